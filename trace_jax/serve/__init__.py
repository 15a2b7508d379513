"""Serving: an OpenAI-compatible HTTP server over the multi-LoRA sampler, with TRACE's router (launch/serve.py)."""
