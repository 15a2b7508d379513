"""Chat tokenizer: a thin wrapper over a transformers fast tokenizer (no torch needed).

Renders conversations with the model's own chat template. Templates without tool support
(e.g. SmolLM2's) still get tools, tool calls and tool results, spelled in the project's
Hermes/Qwen format from `trace_jax.tool_calls`.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trace_jax.files import read_json

# Tokens that end an assistant turn in common chat formats (ChatML, Llama 3, Gemma, Phi-3).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")


class ChatTokenizer:
    """Encodes, decodes and chat-renders text for one model."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, generation_eos: Iterable[int] = ()):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        ends = {vocab[token] for token in _END_OF_TURN_TOKENS if token in vocab}
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | ends | set(generation_eos))
        if not self.eos_token_ids:
            raise ValueError("tokenizer has no end-of-sequence token")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id: int = pad if pad is not None else min(self.eos_token_ids)
        self.vocab_size: int = len(tokenizer)  # ids it can produce; a model's embedding may have more rows

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> ChatTokenizer:
        """Loads the tokenizer files of an HF model folder, plus eos ids from generation_config.json."""
        path = pathlib.Path(path)
        generation_eos: list[int] = []
        generation_file = path / "generation_config.json"
        if generation_file.is_file():
            eos = read_json(generation_file).get("eos_token_id")
            generation_eos = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(AutoTokenizer.from_pretrained(str(path)), generation_eos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; no BOS by default, since chat templates write their own."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def supports_tools(self, tools: list[dict] | None = None) -> bool:
        """Whether the chat template (the one chosen for `tools`) handles tools itself."""
        return "tools" in self.tokenizer.get_chat_template(tools=tools)

    def render_chat(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> str:
        """The conversation as prompt text, in the model's chat template.

        Templates with tool support receive `tools` and the messages as they are (tool-call
        arguments decoded to dicts). For templates without it, the messages are rewritten first:
        tool instructions are appended to the system message (one is created if absent),
        an assistant's `tool_calls` become `<tool_call>` text after its content, and each run of
        `role: "tool"` messages becomes one user message of `<tool_response>` blocks -- the
        model sees the results as a user turn, the way Qwen's template presents them.
        """
        if self.supports_tools(tools):
            rendered = [_with_dict_arguments(message) for message in messages]
            return self.tokenizer.apply_chat_template(
                rendered, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        return self.tokenizer.apply_chat_template(
            _without_tool_roles(messages, tools), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def apply_chat(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of `render_chat(...)`."""
        return self.encode(self.render_chat(messages, tools, add_generation_prompt))


def _arguments(call: dict) -> tuple[str, Any]:
    """`(name, arguments)` of an OpenAI-style tool call; JSON-string arguments are decoded."""
    function = call.get("function", call)
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # rendered verbatim: the model should see what was actually emitted
    return function["name"], arguments


def _with_dict_arguments(message: dict) -> dict:
    """The message with tool-call arguments as dicts, which tool-aware templates expect."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        name, arguments = _arguments(call)
        calls.append({**call, "type": "function", "function": {"name": name, "arguments": arguments}})
    return {**message, "tool_calls": calls}


def _without_tool_roles(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages using only system/user/assistant with string content (see `render_chat`)."""
    from trace_jax.tool_calls import (
        TOOL_RESPONSE_CLOSE,
        TOOL_RESPONSE_OPEN,
        format_tool_call,
        render_tool_instructions,
    )

    out: list[dict] = []
    previous_role = None
    for message in messages:
        content = message.get("content") or ""
        if message["role"] == "tool":
            block = f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
            if previous_role == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            calls = [format_tool_call(*_arguments(call)) for call in message.get("tool_calls") or ()]
            out.append({"role": message["role"], "content": "\n".join(filter(None, [content, *calls]))})
        previous_role = message["role"]

    instructions = render_tool_instructions(tools) if tools else ""
    if instructions:
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{instructions}" if out[0]["content"] else instructions
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
