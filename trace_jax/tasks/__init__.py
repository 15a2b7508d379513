"""Verifiable training tasks: seeded prompt generators with programmatic rewards."""
