"""The HTTP side of the server (Starlette, an ASGI app run by uvicorn): OpenAI's `/v1/models`,
`/v1/chat/completions` and `/v1/completions`, answered from the `ServingEngine`, streamed as server-sent
events where asked. A refused request gets OpenAI's error body and the server goes on; a client that goes
away frees its rows.

Before anything of a request is read: its API key (with `api_key` set: `Authorization: Bearer <key>`, else
401), its Content-Type (JSON only, so that a web page cannot post a form to a server on the loopback address)
and its size (`max_body_bytes`, else 413). Every setting is range-checked and the prompt's length checked
before the router or the engine sees it; a full queue is a 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as Path

from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.sampling import FINISH_STOP
from trace_jax.serve import protocol
from trace_jax.serve.engine import ChoiceUpdate, EngineBusy, GenerationRequest, ServingEngine
from trace_jax.serve.models import Catalog, Route
from trace_jax.serve.protocol import ApiError, Sampling, TextDeltas

_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


@dataclasses.dataclass
class Server:
    """What the routes answer from: the engine, the served names, the tokenizer and the defaults."""

    engine: ServingEngine
    catalog: Catalog
    tokenizer: ChatTokenizer
    default_max_tokens: int = 512
    api_key: str = ""  # "" serves anyone who can reach the port
    max_body_bytes: int = 8 * 2**20

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(
                "Incorrect API key provided: send it as 'Authorization: Bearer <key>'.",
                status=401,
                code="invalid_api_key",
            )

    async def _body(self, request: Request) -> dict:
        """The request's JSON object, once its key, Content-Type and size are checked."""
        self._authorize(request)
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise ApiError("the request's Content-Type must be application/json", status=415)
        too_big = ApiError(f"the request body is over this server's {self.max_body_bytes} bytes", status=413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise too_big
        return protocol.parse_json(bytes(raw))

    def _sampling(self, body: dict, chat: bool) -> Sampling:
        vocab = self.tokenizer.vocab_size
        return protocol.sampling(
            body, default_max_tokens=self.default_max_tokens, max_n=self.engine.batch, vocab=vocab, chat=chat
        )

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "trace-jax"} for name in self.catalog.names()]
        return JSONResponse({"object": "list", "data": data})

    async def stats(self, request: Request) -> Response:
        """The engine's counters and rows (not OpenAI's API: for load tests and monitoring)."""
        self._authorize(request)
        return JSONResponse(self.engine.snapshot())

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        settings = self._sampling(body, chat=True)
        messages, tools = protocol.chat_messages(body), protocol.chat_tools(body)
        try:
            prompt = self.tokenizer.apply_chat(messages, tools=tools)
        except Exception as error:  # noqa: BLE001 - a conversation the chat template refuses
            raise ApiError(f"the chat template cannot render these messages: {error}", param="messages") from None
        self._check_prompts([prompt], "messages")  # before the router reads the conversation
        adapter, route = await asyncio.to_thread(self.catalog.resolve, body.get("model"), messages)
        return await self._answer(
            request, [prompt], settings, adapter, chat=True, model=body["model"], tools=tools, route=route
        )

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        settings = self._sampling(body, chat=False)
        adapter, _ = self.catalog.resolve(body.get("model"))
        prompts = protocol.completion_prompts(body, self.tokenizer.encode, max_prompts=self.engine.batch)
        self._check_prompts(prompts, "prompt")
        return await self._answer(
            request, prompts, settings, adapter, chat=False, model=body["model"], tools=None, route=None
        )

    def _check_prompts(self, prompts: list[list[int]], param: str) -> None:
        limit, vocab = self.engine.sampler.max_context, self.tokenizer.vocab_size
        for prompt in prompts:
            if not prompt or not all(0 <= t < vocab for t in prompt):
                raise ApiError(f"a prompt must be at least one token, each an id in [0, {vocab})", param=param)
            if len(prompt) >= limit:
                raise ApiError(
                    f"the prompt has {len(prompt)} tokens; this model's context holds {limit} (prompt and completion)",
                    param=param,
                    code="context_length_exceeded",
                )

    async def _answer(
        self,
        request: Request,
        prompts: list[list[int]],
        settings: Sampling,
        adapter: int,
        *,
        chat: bool,
        model: str,
        tools: list[dict] | None,
        route: Route | None,
    ) -> Response:
        run = _Run(self, prompts, settings, adapter)
        head = protocol.envelope(protocol.completion_id(chat), model, chat, chunk=settings.stream)
        headers = {"x-trace-adapter": route.name} if route else {}
        if settings.stream:
            events = _sse(run, head, chat, tools, route)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            finals = await run.finals(request)
        except ClientGone:
            return Response(status_code=499)
        body = {
            **head,
            "choices": [self._choice(finals[i], chat, tools, settings) for i in range(len(finals))],
            "usage": run.usage(finals),
        }
        if route:
            body["route"] = route.body()
        return JSONResponse(body, headers=headers)

    def _choice(self, final: ChoiceUpdate, chat: bool, tools: list[dict] | None, settings: Sampling) -> dict:
        ids, logprobs = self.shown(final.token_ids, final.logprobs)
        if chat:
            content, calls = protocol.assistant_reply(final.text, tools)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            return {
                "index": final.index,
                "message": message,
                "finish_reason": finish_reason(final, calls),
                "logprobs": protocol.chat_logprobs(ids, logprobs, self.decode) if settings.logprobs else None,
            }
        return {
            "index": final.index,
            "text": final.text,
            "finish_reason": finish_reason(final, None),
            "logprobs": protocol.text_logprobs(ids, logprobs, self.decode) if settings.logprobs else None,
        }

    def shown(self, token_ids, logprobs) -> tuple[list[int], list[float]]:
        """The tokens a reply shows (its end-of-turn token is not text) and their logprobs."""
        ends = self.tokenizer.eos_token_ids
        kept = [(t, p) for t, p in zip(token_ids, logprobs) if t not in ends]
        return [t for t, _ in kept], [p for _, p in kept]


def finish_reason(final: ChoiceUpdate, calls: list[dict] | None) -> str:
    """OpenAI's finish reason: tool_calls, stop (an end token or stop string), or length (a limit reached)."""
    if calls:
        return "tool_calls"
    return "stop" if final.finish_reason == FINISH_STOP else "length"


class _Run:
    """One HTTP request's prompts in the engine (`n` choices each, numbered prompt by prompt): their progress
    arrives on an asyncio queue from the engine's thread."""

    def __init__(self, server: Server, prompts: list[list[int]], settings: Sampling, adapter: int):
        loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        self.server = server
        self.engine, self.prompts, self.settings = server.engine, prompts, settings
        self.total = len(prompts) * settings.n
        self.ids = []
        for number, prompt in enumerate(prompts):
            put: Callable[[ChoiceUpdate], None] = lambda progress, first=number * settings.n: loop.call_soon_threadsafe(
                self.queue.put_nowait, (first, progress)
            )
            request = GenerationRequest(
                tuple(prompt),
                settings.max_tokens,
                adapter,
                settings.temperature,
                settings.top_p,
                settings.top_k,
                settings.stop,
                settings.n,
                settings.seed,
                settings.stream,
            )
            try:
                self.ids.append(self.engine.submit(request, put))
            except EngineBusy as error:
                self.cancel()
                raise ApiError(str(error), status=429, kind="rate_limit_error", headers={"Retry-After": "1"}) from None
            except ValueError as error:
                self.cancel()
                raise ApiError(str(error)) from None

    async def next(self) -> tuple[int, ChoiceUpdate]:
        """The next progress of any choice: (choice number, progress); a failed request raises a server error."""
        first, progress = await self.queue.get()
        if progress.error:
            self.cancel()
            raise ApiError(progress.error, status=500, kind="server_error")
        return first + progress.index, progress

    async def finals(self, request: Request) -> list[ChoiceUpdate]:
        """Every choice's end, in order; ClientGone (its rows freed) if the client leaves first."""
        finals: dict[int, ChoiceUpdate] = {}
        while len(finals) < self.total:
            try:
                number, progress = await asyncio.wait_for(self.next(), _POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    self.cancel()
                    raise ClientGone from None
                continue
            if progress.finish_reason is not None:
                finals[number] = dataclasses.replace(progress, index=number)
        return [finals[i] for i in range(self.total)]

    def cancel(self) -> None:
        for request_id in self.ids:
            self.engine.cancel(request_id)

    def usage(self, finals: list[ChoiceUpdate]) -> dict:
        n = self.settings.n
        return protocol.usage(
            sum(len(p) for p in self.prompts) * n,
            sum(len(f.token_ids) for f in finals),
            sum(f.cached_tokens for f in finals),
        )


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse(run: _Run, head: dict, chat: bool, tools: list[dict] | None, route: Route | None) -> AsyncIterator[str]:
    """The streamed response: a chunk per choice per engine step with new text, each choice's last chunk with its
    finish reason (and tool calls), a usage chunk where asked, then [DONE]. Leaving early cancels the request."""
    server, settings = run.server, run.settings
    deltas = [TextDeltas(server.decode, settings.stop, tools) for _ in range(run.total)]
    shown_tokens = [0] * run.total
    extra = {"route": route.body()} if route else {}

    def chunk(number: int, text: str, progress: ChoiceUpdate, finish: str | None = None, calls=None) -> dict:
        ids, logprobs = server.shown(progress.token_ids, progress.logprobs)
        new_ids, new_logprobs = ids[shown_tokens[number] :], logprobs[shown_tokens[number] :]
        shown_tokens[number] = len(ids)
        if chat:
            delta = {
                "content": text,
                **({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]} if calls else {}),
            }
            logs = protocol.chat_logprobs(new_ids, new_logprobs, server.decode) if settings.logprobs else None
            choice = {"index": number, "delta": delta, "logprobs": logs, "finish_reason": finish}
        else:
            logs = protocol.text_logprobs(new_ids, new_logprobs, server.decode) if settings.logprobs else None
            choice = {"index": number, "text": text, "logprobs": logs, "finish_reason": finish}
        return {**head, "choices": [choice], **extra}

    finals: dict[int, ChoiceUpdate] = {}
    try:
        if chat:
            for number in range(run.total):
                yield _event(
                    {
                        **head,
                        "choices": [
                            {
                                "index": number,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        **extra,
                    }
                )
        while len(finals) < run.total:
            try:
                number, progress = await run.next()
            except ApiError as error:
                yield _event(error.body())
                break
            if progress.finish_reason is None:
                text = deltas[number].update(progress.token_ids)
                if text or settings.logprobs:
                    yield _event(chunk(number, text, progress))
                continue
            finals[number] = progress
            text, calls = deltas[number].finish(progress.text)
            yield _event(chunk(number, text, progress, finish_reason(progress, calls), calls))
        if settings.include_usage and len(finals) == run.total:
            yield _event({**head, "choices": [], "usage": run.usage([finals[i] for i in range(run.total)])})
        yield "data: [DONE]\n\n"
    finally:
        if len(finals) < run.total:
            run.cancel()


async def _api_error(request: Request, error: ApiError) -> Response:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error(request: Request, error: HTTPException) -> Response:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        ApiError(f"{request.method} {request.url.path}: {error.detail}", status=error.status_code, kind=kind).body(),
        status_code=error.status_code,
    )


async def _server_error(request: Request, error: Exception) -> Response:
    return JSONResponse(
        ApiError(
            f"the server failed on this request: {type(error).__name__}: {error}", status=500, kind="server_error"
        ).body(),
        status_code=500,
    )


def build_app(server: Server) -> Starlette:
    """The ASGI app of `server`'s routes."""
    routes = [
        Path("/v1/models", server.models, methods=["GET"]),
        Path("/stats", server.stats, methods=["GET"]),
        Path("/v1/chat/completions", server.chat, methods=["POST"]),
        Path("/v1/completions", server.completions, methods=["POST"]),
    ]
    return Starlette(
        routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
    )
