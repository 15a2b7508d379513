"""The client of the pipeline's LLM roles: any OpenAI-compatible chat endpoint, cached on disk."""

from trace_jax.llm.client import (
    ChatClient,
    LLMError,
    MalformedReply,
    extract_json,
    llm_defaults,
    validate_llm_config,
)

__all__ = ["ChatClient", "LLMError", "MalformedReply", "extract_json", "llm_defaults", "validate_llm_config"]
