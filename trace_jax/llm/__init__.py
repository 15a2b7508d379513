"""The client of the pipeline's LLM roles: any OpenAI-compatible chat endpoint, cached on disk."""

from trace_jax.llm.client import (
    ChatClient,
    LLMError,
    LlmSettings,
    MalformedReply,
    extract_json,
)

__all__ = ["ChatClient", "LLMError", "LlmSettings", "MalformedReply", "extract_json"]
