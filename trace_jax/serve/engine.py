"""Continuous batching for the server: concurrent requests share one `Session`, row by row.

Each row has its own adapter, sampling settings and stop strings. A row whose request ended takes the
next waiting one at once; a finished row keeps its tokens in the cache ("parked") until its row is
needed, and a request whose prompt extends a parked row's tokens with the same adapter (the next turn of
a conversation) continues that row: only the new tokens are prefilled. The engine runs in a thread of
its own, where every JAX call happens; requests come from any thread and get their tokens back through
a callback as they are sampled.

One bad request cannot take the others down: `submit` refuses settings out of the sampler's range and a full
queue at once; a request whose admission fails is failed alone (the others admitted with it are fed again
one by one); a failed decode step, which no request can be blamed for, fails the running requests, and the
engine starts a new session and goes on with the waiting ones.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import threading
import time
import zlib
from collections.abc import Callable, Sequence

import jax
from absl import logging

from trace_jax import lora, runtime
from trace_jax.sampling import Sampler, Session, common_prefix_length

MIN_REUSE = 16  # a parked row is continued when it holds at least this many of a prompt's leading tokens
INT32_MAX = (1 << 31) - 1  # the sampler's per-row settings are int32
_UNSEEDED = 1 << 30  # random streams of requests without a seed start here; seeded ones stay below


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One prompt's generation: `n` choices of up to `max_tokens` tokens each, with adapter `adapter`
    (lora.NO_ADAPTER: the base model). `seed` fixes every choice's random stream, so a seeded request samples
    the same tokens whatever else the batch holds."""

    prompt: tuple[int, ...]
    max_tokens: int
    adapter: int = lora.NO_ADAPTER
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    stream: bool = False  # report tokens as they are sampled, not only each choice's end


@dataclasses.dataclass(frozen=True)
class ChoiceUpdate:
    """Choice `index` of a request: its tokens so far and, once it ended, its finish reason and text (the
    `Sampler`'s detokenization, a matched stop string cut off); `cached_tokens`: prompt tokens it did not
    prefill (a continued row's, a shared system prompt's). `error`: the request failed (reported once)."""

    index: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish_reason: str | None = None
    text: str | None = None
    cached_tokens: int = 0
    error: str | None = None


Callback = Callable[[ChoiceUpdate], None]


class EngineBusy(RuntimeError):
    """The engine's queue is full: the request may be sent again later."""


def check_request(request: GenerationRequest, batch: int, max_context: int) -> None:
    """Raises ValueError naming what of `request` the engine could never run."""
    problems = [
        (not 1 <= request.n <= batch, f"n = {request.n}: this server plays 1 to {batch} choices per request"),
        (
            not request.prompt or len(request.prompt) >= max_context,
            f"the prompt has {len(request.prompt)} tokens; this model's context holds {max_context} (prompt and "
            "completion)",
        ),
        (not 1 <= request.max_tokens <= INT32_MAX, f"max_tokens = {request.max_tokens} is not in [1, {INT32_MAX}]"),
        (
            not (math.isfinite(request.temperature) and request.temperature >= 0),
            f"temperature = {request.temperature} is not a number >= 0",
        ),
        (not 0 < request.top_p <= 1, f"top_p = {request.top_p} is not in (0, 1]"),
        (not 0 <= request.top_k <= INT32_MAX, f"top_k = {request.top_k} is not in [0, {INT32_MAX}]"),
        (not all(isinstance(s, str) and s for s in request.stop), "stop strings must be non-empty strings"),
    ]
    for failed, message in problems:
        if failed:
            raise ValueError(message)


@dataclasses.dataclass
class _Active:
    request: GenerationRequest
    callback: Callback
    sent: dict[int, int] = dataclasses.field(default_factory=dict)  # choice -> tokens reported
    cached: dict[int, int] = dataclasses.field(default_factory=dict)  # choice -> prompt tokens not prefilled
    left: int = 0  # choices still running


def choice_stream(seed: int, index: int) -> int:
    """The random stream of a seeded request's choice `index` (below the unseeded ones)."""
    return zlib.crc32(f"{seed}/{index}".encode()) % _UNSEEDED


class ServingEngine:
    """Plays `GenerationRequest`s on `sampler` in a batch of `batch` rows (see the module docstring).

    `submit` returns a request id and calls `callback` from the engine's thread with each `ChoiceUpdate`;
    `cancel` drops a request wherever it is. `seed` is the key every row's draws fold their stream into.
    """

    def __init__(
        self,
        sampler: Sampler,
        stop_token_ids: Sequence[int],
        *,
        batch: int = 16,
        seed: int = 0,
        max_waiting: int = 256,
    ):
        """`max_waiting`: requests queued beyond the running ones, past which `submit` raises EngineBusy."""
        if sampler.detokenize is None:
            raise ValueError("the serving engine needs a Sampler built with detokenize=")
        self.sampler, self.batch, self.max_waiting = sampler, batch, max_waiting
        self._stop_token_ids = tuple(stop_token_ids)
        self._key = jax.random.key(seed)
        self._session = self._new_session()
        self._free = list(range(self._session.cache.batch))
        self._parked: collections.OrderedDict[int, tuple[int, list[int]]] = collections.OrderedDict()
        self._rows: dict[int, tuple[int, int]] = {}  # running row -> (request id, choice)
        self._tokens: dict[int, list[int]] = {}  # running row -> its tokens before this turn
        self._waiting: collections.deque[int] = collections.deque()
        self._active: dict[int, _Active] = {}
        # Only these two are shared with other threads (under `_wake`); the rest is the engine thread's own.
        self._incoming: list[tuple[int, _Active]] = []
        self._cancelled: set[int] = set()
        self._waiting_count = 0  # len(_waiting), for other threads (under `_wake`)
        self._ids = itertools.count()
        self._unseeded = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._upkeep = runtime.Upkeep()  # its loop's freed heap and memory maps
        self.stats = collections.Counter()  # requests, choices, prompt/cached/generated tokens
        self._thread = threading.Thread(target=self._loop, name="serving-engine", daemon=True)
        self._thread.start()

    def _new_session(self) -> Session:
        return self.sampler.session(self.batch, stop_token_ids=self._stop_token_ids)

    def submit(self, request: GenerationRequest, callback: Callback) -> int:
        """Queues `request`; returns its id. Fails at once on what could never run (ValueError) and when the
        queue holds `max_waiting` requests (EngineBusy)."""
        check_request(request, self.batch, self.sampler.max_context)
        with self._wake:
            if self._closed:
                raise RuntimeError("the serving engine is closed")
            if len(self._incoming) + self._waiting_count >= self.max_waiting:
                raise EngineBusy(f"the server has {self.max_waiting} requests waiting; try again shortly")
            request_id = next(self._ids)
            self._incoming.append((request_id, _Active(request, callback, left=request.n)))
            self._wake.notify()
        return request_id

    def cancel(self, request_id: int) -> None:
        """Stops request `request_id` (a client went away): its rows are freed at the engine's next step."""
        with self._wake:
            self._cancelled.add(request_id)
            self._wake.notify()

    def snapshot(self) -> dict:
        """Counters since start (requests, choices, cancelled, prompt/cached/generated tokens; the sampler's
        prefill and decode calls, tokens and seconds) and the rows now running, parked and free, and the requests
        waiting."""
        return {
            **self.stats,
            "running_rows": len(self._rows),
            "parked_rows": len(self._parked),
            "free_rows": len(self._free),
            "waiting": len(self._waiting) + len(self._incoming),
            "sampler": dict(self._session.stats),
        }

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._closed or self._cancelled or self._incoming or self._waiting or self._rows):
                    self._wake.wait()
                cancelled, self._cancelled = self._cancelled, set()
                incoming, self._incoming = self._incoming, []
            for request_id, active in incoming:
                self._active[request_id] = active
                self._waiting.append(request_id)
            if self._closed:
                self._fail(list(self._active), "the server is shutting down")
                return
            try:
                self._upkeep()  # a server meets new shapes for as long as it runs
                self._drop(cancelled)
                self._admit()
                if self._session.running:
                    finished = self._session.step(self._key, return_early=True)
                    self._report_progress()
                    for row, completion in finished.items():
                        self._finish(row, completion)
            except Exception as error:  # noqa: BLE001 - the running requests hear of it; the server goes on
                logging.exception("the serving engine's step failed")
                self._fail(self._running_requests(), f"generation failed: {type(error).__name__}: {error}")
                self._restart()
            with self._wake:
                self._waiting_count = len(self._waiting)

    def _restart(self) -> None:
        """A new session with every row free (the running requests were failed); until one can be made, the
        waiting requests are failed, one attempt a second."""
        for state in (self._rows, self._tokens, self._parked):
            state.clear()
        while True:
            try:
                self._session = self._new_session()
                break
            except Exception as error:  # noqa: BLE001 - keep serving errors rather than hanging requests
                logging.exception("the serving engine cannot start a session")
                with self._wake:
                    incoming, self._incoming = self._incoming, []
                self._active.update(incoming)
                self._fail(list(self._active), f"the server cannot generate now: {type(error).__name__}: {error}")
                time.sleep(1.0)
        self._free = list(range(self._session.cache.batch))

    def _running_requests(self) -> list[int]:
        return sorted({request_id for request_id, _ in self._rows.values()})

    def _drop(self, request_ids: set[int]) -> None:
        """Forgets cancelled requests: their waiting place, their running rows (emptied)."""
        rows = [row for row, (rid, _) in self._rows.items() if rid in request_ids]
        if rows:
            self._session.cancel(rows)
            for row in rows:
                del self._rows[row], self._tokens[row]
            self._free.extend(rows)
        for request_id in request_ids:
            if self._active.pop(request_id, None) is not None:
                self.stats.update(cancelled=1)
        self._waiting = collections.deque(r for r in self._waiting if r in self._active)

    def _admit(self) -> None:
        """Feeds waiting requests, first come first served, while rows are free or parked (one prefill). If
        feeding them together fails on a request's settings, each is fed alone and those that fail again are
        failed."""
        feeds: list[tuple[int, list[int], GenerationRequest, int]] = []  # row, tokens to feed, request, stream
        admitted: list[int] = []
        while self._waiting:
            active = self._active[self._waiting[0]]
            request = active.request
            if request.n > len(self._free) + len(self._parked):
                break
            request_id = self._waiting.popleft()
            admitted.append(request_id)
            for choice in range(request.n):
                row, held, cached = self._row_for(request, first=choice == 0)
                active.cached[choice] = cached
                self._rows[row] = (request_id, choice)
                self._tokens[row] = list(request.prompt)
                stream = (
                    choice_stream(request.seed, choice)
                    if request.seed is not None
                    else (_UNSEEDED + next(self._unseeded) % _UNSEEDED)
                )
                feeds.append((row, list(request.prompt[held:]), request, stream))
            self.stats.update(
                requests=1,
                choices=request.n,
                prompt_tokens=len(request.prompt) * request.n,
                cached_tokens=sum(active.cached.values()),
            )
        if not feeds:
            return
        try:
            self._feed(feeds)
        except (ValueError, TypeError, OverflowError):  # a request's settings, found before the session changed
            own = {rid: [feed for feed in feeds if self._rows[feed[0]][0] == rid] for rid in admitted}
            for request_id in admitted:
                try:
                    self._feed(own[request_id])
                except (ValueError, TypeError, OverflowError) as error:
                    logging.exception("a request could not be admitted")
                    self._fail([request_id], f"the request could not be started: {type(error).__name__}: {error}")

    def _feed(self, feeds: list[tuple[int, list[int], GenerationRequest, int]]) -> None:
        rows, parts, requests, streams = zip(*feeds)
        room = [min(r.max_tokens, self.sampler.max_context - len(r.prompt)) for r in requests]
        self._session.feed(
            list(rows),
            list(parts),
            max_new_tokens=room,
            temperature=[r.temperature for r in requests],
            top_p=[r.top_p for r in requests],
            top_k=[r.top_k for r in requests],
            adapter_idx=[r.adapter for r in requests],
            stream=list(streams),
            stop_strings=[r.stop for r in requests],
        )

    def _row_for(self, request: GenerationRequest, first: bool) -> tuple[int, int, int]:
        """A row for a choice of `request`, how many of its prompt tokens the row holds already, and how many of
        those were there before (not prefilled now): for the first choice, the parked row (same adapter) holding
        the most of them when that is >= MIN_REUSE; else a free row, or the least recently parked one, started
        afresh (after a shared system prompt, where it has one; prefilled now if it is the first)."""
        prompt = list(request.prompt)
        if first:
            best = max(
                (
                    (common_prefix_length([tokens, prompt]), row)
                    for row, (adapter, tokens) in self._parked.items()
                    if adapter == request.adapter
                ),
                default=(0, -1),
            )
            held, row = min(best[0], len(prompt) - 1), best[1]
            if held >= MIN_REUSE and self._session.keep(row, held):
                del self._parked[row]
                return row, held, held
        row = self._free.pop() if self._free else self._parked.popitem(last=False)[0]
        prefills = self._session.stats["prefix_prefills"]
        held = self._session.start(row, prompt, request.adapter)
        return row, held, held if self._session.stats["prefix_prefills"] == prefills else 0

    def _report_progress(self) -> None:
        """Each streaming choice's tokens so far, where it sampled new ones."""
        for row, (request_id, choice) in self._rows.items():
            active = self._active[request_id]
            if not active.request.stream:
                continue
            ids, logprobs = self._session.partial(row)
            if len(ids) > active.sent.get(choice, 0):
                active.sent[choice] = len(ids)
                active.callback(ChoiceUpdate(choice, tuple(ids), tuple(logprobs)))

    def _finish(self, row: int, completion) -> None:
        """Reports a choice's end, parks its row (its tokens stay in the cache) and ends a request whose
        choices have all ended."""
        request_id, choice = self._rows.pop(row)
        tokens = self._tokens.pop(row) + list(completion.token_ids)
        active = self._active[request_id]
        self._parked[row] = (active.request.adapter, tokens)
        self.stats.update(generated_tokens=len(completion.token_ids))
        active.callback(
            ChoiceUpdate(
                choice,
                tuple(completion.token_ids),
                tuple(completion.logprobs),
                completion.finish_reason,
                completion.text,
                active.cached[choice],
            )
        )
        active.left -= 1
        if not active.left:
            del self._active[request_id]

    def _fail(self, request_ids: list[int], message: str) -> None:
        """Ends requests `request_ids` with `message`: their running rows are freed, their waiting places
        dropped."""
        failed = set(request_ids)
        rows = [row for row, (request_id, _) in self._rows.items() if request_id in failed]
        for row in rows:
            del self._rows[row], self._tokens[row]
        self._free.extend(rows)
        for request_id in request_ids:
            active = self._active.pop(request_id, None)
            if active is not None:
                active.callback(ChoiceUpdate(0, error=message))
        self._waiting = collections.deque(r for r in self._waiting if r not in failed)
