"""TRACE's stages: capability selection, capability environments, adapters per capability, routing."""
