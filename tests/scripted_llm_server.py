"""A real OpenAI-compatible chat server on 127.0.0.1 that answers from a script, for driving the LLM client
(and the roles built on it) without network access."""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
from collections.abc import Callable
from typing import Any, Self


@dataclasses.dataclass(frozen=True)
class Fail:
    """A script entry answering an HTTP error with an OpenAI-style error body."""

    status: int
    message: str


Entry = str | Fail  # a str is the assistant's content
Script = list[Entry] | Callable[[dict], Entry]

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")


def chat_completion(request: dict, content: str, number: int) -> dict:
    """A ChatCompletion body replying `content` to `request` (token counts are word counts)."""
    prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in request.get("messages", []))
    completion_tokens = len(content.split())
    return {
        "id": f"chatcmpl-scripted-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model", ""),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def error_body(message: str, status: int) -> dict:
    return {"error": {"message": message, "type": "scripted_error", "param": None, "code": str(status)}}


class ScriptedLLMServer:
    """`POST /v1/chat/completions` answered from `script`: a list consumed in order (HTTP 500 once it runs out)
    or a callable `request -> entry`. `requests` and `headers` record each request's JSON body and headers."""

    def __init__(self, script: Script):
        self._script = script if callable(script) else list(script)
        self.requests: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="scripted-llm-server", daemon=True
        )  # a short poll: a quick shutdown

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def answer(self, request: dict, headers: dict[str, str]) -> tuple[int, dict]:
        """Records a request and returns (HTTP status, JSON body) for it from the script."""
        with self._lock:
            self.requests.append(request)
            self.headers.append(headers)
            number = len(self.requests)
            entry = self._next_entry(request)
        if isinstance(entry, Fail):
            return entry.status, error_body(entry.message, entry.status)
        return 200, chat_completion(request, entry, number)

    def _next_entry(self, request: dict) -> Entry:
        if callable(self._script):
            return self._script(request)
        if not self._script:
            return Fail(500, f"the script is exhausted: request {len(self.requests)} has no scripted reply")
        return self._script.pop(0)


def _handler_class(server: ScriptedLLMServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path.split("?")[0] not in CHAT_PATHS:
                self._reply(404, error_body(f"no route {self.path}", 404))
                return
            try:
                request = json.loads(body)
            except json.JSONDecodeError as error:
                self._reply(400, error_body(f"the request is not JSON: {error}", 400))
                return
            self._reply(*server.answer(request, {k.lower(): v for k, v in self.headers.items()}))

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # silence the per-request log on stderr
            pass

    return Handler
