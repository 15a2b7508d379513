"""The chat client of the pipeline's LLM roles (capability analyst, environment writer, judge).

It talks to any OpenAI-compatible endpoint (a hosted API or a local server such as vLLM) through
the `openai` library, caches every reply on disk so that a rerun repeats no request, and turns
replies into validated JSON, asking again with the error when a reply is malformed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import openai

from trace_jax.files import read_json, write_json_atomic
from trace_jax.settings import (
    is_str,
    non_negative_int,
    non_negative_number,
    nonempty_str,
    positive_int,
    positive_number,
    setting,
)

T = TypeVar("T")

_PLACEHOLDER_KEY = "unused"  # local servers take any key, but the openai client insists on one
_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class LlmSettings:
    """The `llm` block: which endpoint and model, sampling, and how hard to retry."""

    model: str = setting("", "a model name: set --config.{block}.model=...", nonempty_str)
    # "" = $OPENAI_BASE_URL, else the openai default
    base_url: str = setting("", "a URL, or '' for $OPENAI_BASE_URL / the openai default", is_str)
    # the NAME of the env var holding the key ("unused" when it is unset)
    api_key_env: str = setting("OPENAI_API_KEY", "the name of the env var holding the API key", nonempty_str)
    temperature: float = setting(1.0, "a number >= 0", non_negative_number)
    max_tokens: int = setting(4096, "an int >= 1", positive_int)
    timeout_s: float = setting(120.0, "a number of seconds > 0", positive_number)
    # transport retries (connection errors, 408/409/429/5xx), done by the openai library
    max_retries: int = setting(3, "an int >= 0", non_negative_int)
    # complete_json's attempts in all, each told the previous reply's error
    max_json_attempts: int = setting(3, "an int >= 1", positive_int)


class LLMError(RuntimeError):
    """A request that failed: an API error after the openai library's retries, or an empty reply."""


class MalformedReply(LLMError):
    """Replies that still held no valid JSON after `max_json_attempts` attempts."""


def extract_json(text: str) -> Any:
    """The JSON value of a reply: the whole reply, a ```json fenced block, or the first {...} / [...] in prose.
    ValueError when it holds none, also when its JSON nests deeper than the parser's recursion allows."""
    try:
        for candidate in (text, *(m.group(1) for m in _FENCE.finditer(text))):
            try:
                return json.loads(candidate)
            except json.JSONDecodeError:
                pass
        decoder, first_error = json.JSONDecoder(), None
        for start in (i for i, char in enumerate(text) if char in "{["):
            try:
                return decoder.raw_decode(text, start)[0]
            except json.JSONDecodeError as error:
                first_error = first_error or error
    except RecursionError:
        raise ValueError("the reply's JSON is nested too deeply to parse") from None
    raise ValueError("the reply holds no JSON object or array" + (f" ({first_error})" if first_error else ""))


def _retry_prompt(error: ValueError) -> str:
    return f"Your reply could not be used: {error}. Reply again with the corrected JSON only, and no other text."


class ChatClient:
    """Chat completions from an OpenAI-compatible endpoint, each reply cached on disk under its request's hash.

    `stats` counts `requests` (sent to the endpoint; the openai library's transport retries not counted),
    `cache_hits`, `malformed` (replies that failed parsing or validation) and `failed` (complete_json calls
    that gave up). It is safe to share between threads.
    """

    def __init__(self, cfg: LlmSettings, cache_dir: str | pathlib.Path | None):
        self.cfg = cfg
        self.cache_dir = None if cache_dir is None else pathlib.Path(cache_dir)
        self.stats = {"requests": 0, "cache_hits": 0, "malformed": 0, "failed": 0}
        self._lock = threading.Lock()
        self._client = openai.OpenAI(
            base_url=cfg.base_url or os.environ.get("OPENAI_BASE_URL") or None,
            api_key=os.environ.get(cfg.api_key_env) or _PLACEHOLDER_KEY,
            timeout=cfg.timeout_s,
            max_retries=cfg.max_retries,
        )

    def complete(self, messages: list[dict], *, sample: int = 0, temperature: float | None = None) -> str:
        """The first choice's content. `sample` numbers independent samples of one prompt; it is sent as the seed."""
        request = {
            "model": self.cfg.model,
            "messages": messages,
            "temperature": float(self.cfg.temperature if temperature is None else temperature),
            "max_tokens": self.cfg.max_tokens,
            "sample": sample,
        }
        path = self._cache_path(request)
        if path is not None and path.exists():
            self._count("cache_hits")
            return read_json(path)["response"]
        content = self._send(request)
        if path is not None:
            write_json_atomic(path, {"request": request, "response": content})
        return content

    def complete_json(self, messages: list[dict], validate: Callable[[Any], T], *, sample: int = 0) -> T:
        """`validate` (which raises ValueError on a bad value) of the reply's JSON; a malformed or invalid reply
        is answered with its error and asked again, up to `max_json_attempts` attempts in all."""
        for _ in range(self.cfg.max_json_attempts):
            reply = self.complete(messages, sample=sample)
            try:
                return validate(extract_json(reply))
            except ValueError as error:  # json.JSONDecodeError included
                last_error = error
                self._count("malformed")
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": _retry_prompt(error)},
                ]
        self._count("failed")
        raise MalformedReply(
            f"{self.cfg.model}: no valid JSON in {self.cfg.max_json_attempts} attempts; "
            f"the last reply's error: {last_error}"
        )

    def _send(self, request: dict) -> str:
        """One chat completion from the endpoint; API errors (after the library's retries) become LLMError."""
        self._count("requests")
        try:
            response = self._client.chat.completions.create(
                model=request["model"],
                messages=request["messages"],
                temperature=request["temperature"],
                max_tokens=request["max_tokens"],
                seed=request["sample"],
            )
        except openai.APIStatusError as error:
            raise LLMError(f"{self.cfg.model}: HTTP {error.status_code}: {error.message}") from error
        except openai.APIError as error:  # no response: connection error or timeout
            raise LLMError(f"{self.cfg.model}: {error.message}") from error
        choice = response.choices[0] if response.choices else None
        if choice is None or not choice.message.content:
            reason = choice.finish_reason if choice else "no choices"
            raise LLMError(f"{self.cfg.model} returned an empty reply ({reason})")
        return choice.message.content

    def _cache_path(self, request: dict) -> pathlib.Path | None:
        if self.cache_dir is None:
            return None
        key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
        return self.cache_dir / key[:2] / f"{key}.json"

    def _count(self, stat: str) -> None:
        with self._lock:
            self.stats[stat] += 1
