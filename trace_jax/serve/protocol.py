"""The OpenAI API's requests and responses as the server reads and writes them.

Requests are checked field by field; anything the server cannot honour is an `ApiError` naming the field
(OpenAI's error body and a 4xx status), never an exception inside the server. Replies follow OpenAI's
shapes: a chat turn's `<tool_call>` blocks (the project's format, `trace_jax.tool_calls`) become
`tool_calls`; a turn holding a malformed block is returned whole as content, as the model wrote it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from trace_jax.serve.engine import INT32_MAX
from trace_jax.tool_calls import TOOL_CALL_OPEN, parse_assistant_output

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_STOPS = 4
MAX_STOP_CHARS = 256  # a stop string is matched against every new piece of text: keep it short


class ApiError(Exception):
    """A request the server refuses: HTTP `status` and OpenAI's error body."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def parse_json(raw: bytes) -> dict:
    """The request's JSON object."""
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise ApiError(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError("the request body is JSON nested too deeply to read") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A request's generation settings (OpenAI's names, `top_k` as vLLM accepts it)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    n: int
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: bool


def _number(body: dict, name: str, default, low: float, high: float, *, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ApiError(f"{name} must be {kind} in [{low}, {high}]; got {value!r}", param=name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool) and value is not None:
        raise ApiError(f"{name} must be true or false; got {value!r}", param=name)
    return bool(value)


def _stops(stop: Any) -> tuple[str, ...]:
    """A request's stop strings: none, a string, or a list of at most MAX_STOPS non-empty ones."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise ApiError(
            f"stop must be a string of 1 to {MAX_STOP_CHARS} characters or a list of at most {MAX_STOPS} of "
            f"them; got {str(stop)[:200]!r}",
            param="stop",
        )
    return tuple(stops)


def sampling(body: dict, *, default_max_tokens: int, max_n: int, vocab: int, chat: bool) -> Sampling:
    """The generation settings of a chat (`chat`) or text completion request, each in the range the sampler
    takes (`top_k` at most the vocabulary's `vocab` tokens, `n` at most `max_n` choices)."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    stops = _stops(body.get("stop"))
    if chat:
        logprobs = _flag(body, "logprobs")
        if body.get("top_logprobs"):
            raise ApiError(
                "top_logprobs is not supported: the sampler reports the sampled token's logprob only",
                param="top_logprobs",
            )
    else:
        logprobs = _number(body, "logprobs", None, 0, 0, integer=True) == 0
    for name_, allowed in (
        ("best_of", (None, 1)),
        ("echo", (None, False)),
        ("suffix", (None,)),
        ("logit_bias", (None, {})),
    ):
        if body.get(name_) not in allowed:
            raise ApiError(f"{name_} is not supported by this server", param=name_)
    if chat and body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError("response_format: only text is supported by this server", param="response_format")
    options = body.get("stream_options") or {}
    return Sampling(
        max_tokens=_number(body, name, default_max_tokens, 1, INT32_MAX, integer=True),
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 1e-9, 1.0)),
        top_k=_number(body, "top_k", 0, 0, vocab, integer=True),
        stop=stops,
        n=_number(body, "n", 1, 1, max_n, integer=True),
        seed=_number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True),
        stream=_flag(body, "stream"),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        logprobs=logprobs,
    )


def _text(content: Any, param: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(f"{param} must be a string or a list of text parts (this server reads text only)", param=param)


def chat_messages(body: dict) -> list[dict]:
    """The conversation in the form the chat template reads ("developer" read as "system")."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(f"{param} must be an object whose role is one of {', '.join(ROLES)}", param=param)
        role = "system" if message["role"] == "developer" else message["role"]
        item = {"role": role, "content": _text(message.get("content"), f"{param}.content")}
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = _tool_calls(message["tool_calls"], f"{param}.tool_calls")
        elif role == "tool" and message.get("tool_call_id") is not None:
            item["tool_call_id"] = str(message["tool_call_id"])
        out.append(item)
    return out


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise ApiError(f"{param} must be a list", param=param)
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", "{}"), (str, dict))
        ):
            raise ApiError(
                f"{param}[{j}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                param=f"{param}[{j}]",
            )
    return calls


def chat_tools(body: dict) -> list[dict] | None:
    """The request's tool schemas (checked), or None where it has none or `tool_choice` is "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError("tool_choice: this server supports 'auto' and 'none'", param="tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError("tools must be a list", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise ApiError(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param=param)
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise ApiError(
                f"{param}.function.name must be 1-64 letters, digits, '_' or '-'; got {name!r}",
                param=f"{param}.function.name",
            )
        if name in names:
            raise ApiError(f"{param}: a second tool named {name!r}", param=f"{param}.function.name")
        names.add(name)
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ApiError(
                f"{param}.function.parameters must be a JSON schema of type 'object'",
                param=f"{param}.function.parameters",
            )
        if not isinstance(function.get("description", ""), str):
            raise ApiError(f"{param}.function.description must be a string", param=f"{param}.function.description")
    return tools if tools and choice != "none" else None


def completion_prompts(body: dict, encode: Callable[[str], list[int]], max_prompts: int) -> list[list[int]]:
    """A text completion request's prompts as token ids: a string, a list of ids, or a list of at most
    `max_prompts` of either."""
    prompt = body.get("prompt")
    is_ids = lambda p: isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
    if isinstance(prompt, str) or is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or is_ids(p) for p in prompt):
        raise ApiError("prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt")
    if len(prompt) > max_prompts:
        raise ApiError(f"prompt: this server takes at most {max_prompts} prompts per request", param="prompt")
    return [encode(p) if isinstance(p, str) else list(p) for p in prompt]


def assistant_reply(text: str, tools: list[dict] | None) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of an assistant turn in OpenAI's form; with a malformed or schema-invalid block, the
    whole text as content (the client sees what the model wrote) and no calls."""
    if not tools:
        return text, None
    parsed = parse_assistant_output(text, tools)
    if parsed.errors or not parsed.tool_calls:
        return text, None
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in parsed.tool_calls
    ]
    return parsed.content or None, calls


def _held_back(text: str, holds: tuple[str, ...]) -> int:
    """How many of `text`'s last characters could begin one of `holds`."""
    return max((k for h in holds for k in range(min(len(h) - 1, len(text)), 0, -1) if text.endswith(h[:k])), default=0)


class TextDeltas:
    """A streamed choice's text as deltas that are never taken back: what could still turn into a stop string,
    or into a tool-call block where tools are on, waits, as does an unfinished UTF-8 character; once a block
    opens, the rest waits for the choice's end (`finish`)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...], tools: list[dict] | None):
        self.decode, self.tools = decode, tools
        self.holds = stop + ((TOOL_CALL_OPEN,) if tools else ())
        self.sent, self._blocked = "", False

    def update(self, token_ids) -> str:
        if self._blocked:
            return ""
        text = self.decode(list(token_ids))
        if self.tools and TOOL_CALL_OPEN in text:
            self._blocked, text = True, text[: text.index(TOOL_CALL_OPEN)]
        else:
            text = text[: len(text) - _held_back(text, self.holds)]
        return self._advance(text.rstrip("\ufffd"))

    def finish(self, text: str) -> tuple[str, list[dict] | None]:
        """The content still to send and the tool calls of the finished choice whose full text is `text`."""
        content, calls = assistant_reply(text, self.tools)
        if not calls:
            return self._advance(text), None
        sent = self.sent.strip()
        return (content or "")[len(sent) :] if (content or "").startswith(sent) else "", calls

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""  # the decoding of earlier tokens changed: what follows waits for the end
        delta, self.sent = text[len(self.sent) :], text
        return delta


def completion_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def envelope(response_id: str, model: str, chat: bool, chunk: bool = False) -> dict:
    """The fields every response or chunk of one request shares."""
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "system_fingerprint": None}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(token_ids, logprobs, decode: Callable[[list[int]], str]) -> dict:
    """OpenAI's chat `logprobs` of the sampled tokens (no alternatives: see `sampling`)."""
    content = []
    for token, logprob in zip(token_ids, logprobs):
        text = decode([token])
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def text_logprobs(token_ids, logprobs, decode: Callable[[list[int]], str]) -> dict:
    """The legacy completion `logprobs` of the sampled tokens."""
    tokens = [decode([t]) for t in token_ids]
    offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}
