"""`FusedSession`: the session of accelerators, whose fed tokens ride along decode steps (chunked prefill), whose
decode calls run many steps with stops detected on the device, and whose programs are all compiled before the
first feed.

On a GPU or TPU a step over [rows, chunk] positions of a small model costs little more than one over [rows, 1],
while every call, every host round trip and every program shape costs much. So a fed prompt is not prefilled
by calls of its own: `feed` only queues it, and the next `step` runs one program (`kernels.fused`) whose steps
append up to `prefill_chunk` queued tokens to each fed row while the other rows decode, for `decode_chunk` steps
or until every row is done. A step in which few rows feed computes their chunks in lanes of their own and one position
for each decoding row: with many rows or a large model, [rows, chunk] positions are compute that a decode step
does not have to spare. Rows keep whole conversations in their own buffers (no shared prefix slots: they would
add shapes); a row starting a conversation whose first prompt shares at least `min_copied_prefix` tokens with the
first prompt of a conversation another row holds copies those positions from it before the next call, in one
copy over all rows, and is fed only the rest (episodes of one environment share a long system prompt). So the
programs are one fused loop and one copy per cache capacity and one resize per pair of capacities, which
`warm_up` compiles ahead of time. The CPU keeps `Session`, whose row-wise prefills and shared
prefixes avoid the padding a CPU pays for in full.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import time
from collections.abc import Sequence

import jax
import numpy as np

from trace_jax import lora as lora_lib
from trace_jax.models import decoder
from trace_jax.sampling.kernels import (
    FORM_ANY,
    FORM_NONE,
    RECENT_NONE,
    STOP_FORM_TOKENS,
    STOP_FORMS,
    FeedRows,
)
from trace_jax.sampling.session import Completion, Session, position_sum
from trace_jax.sampling.shapes import common_prefix_length


def _like(a: jax.Array, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """Array `a` (with `shape`) as ahead-of-time compilation sees it: shape, dtype, and its sharding where it
    was placed (an array left where JAX put it compiles with its sharding unspecified)."""
    return jax.ShapeDtypeStruct(shape or a.shape, a.dtype, sharding=a.sharding if a.committed else None)


@dataclasses.dataclass
class _Call:
    """A fused call in flight: its outputs (device arrays, not yet read), the turns it samples (by row) and the
    tokens it appends to each row from the row's queue."""

    outputs: tuple
    turns: dict[int, object]
    fed: np.ndarray


class FusedSession(Session):
    """A `Session` (same methods, same tokens up to float rounding) for accelerators: see the module docstring.

    A call runs its `decode_chunk` steps whatever `step`'s `return_early` says (a finished row idles until it
    returns), and a row appends at most `prefill_chunk * feed_chunks` fed tokens a call, going on in the next.
    `step` overlaps the host with the device: it reads the call in flight, dispatches the next one for the rows
    still sampling (and those fed since), and only then returns the finished turns, so the caller's work on them
    (tool calls, the next prompts) runs while the device decodes. Each row's length is kept on the host, so
    nothing else waits for the device.
    """

    def __init__(self, sampler, cache: decoder.KVCache, **stops):
        super().__init__(sampler, cache, **stops)
        self._pending: dict[int, list[int]] = {}  # row -> tokens fed and not yet appended
        self._forms: dict[tuple[str, ...], np.ndarray] = {}  # stop strings -> their token forms
        self._lengths = np.asarray(cache.lengths).astype(np.int64)  # each row's own length, as the host knows it
        self._call: _Call | None = None
        self._heads: dict[int, tuple[int, list[int]]] = {}  # row -> (adapter, its conversation's first prompt)
        # row -> (adapter, the head's tokens its buffer still holds): rows released, or started anew, whose positions
        # stay on the device until the row is fed again
        self._left: dict[int, tuple[int, list[int]]] = {}
        self._copies: dict[int, tuple[int, int]] = {}  # row -> (the row it copies from, positions) before the next call

    @property
    def feed_width(self) -> int:
        """Tokens a row appends in one call at most."""
        return self.sampler.prefill_chunk * self.sampler.feed_chunks

    def start(self, row: int, prompt: Sequence[int], adapter_idx: int = lora_lib.NO_ADAPTER, group=None) -> int:
        """Empties `row` for a new conversation whose first prompt is `prompt`; returns how many of its leading
        tokens the row holds (feed it the rest): the most it shares with the first prompt of a conversation a row
        holds or left (released, its positions not yet overwritten) with the same adapter, as far as that row's
        buffer has it, when at least `min_copied_prefix` (copied before the next call), else 0. `group` is not
        needed here."""
        del group
        source, shared = self._best_head(prompt, adapter_idx)
        self._forget([row])
        self._left.pop(row, None)  # it is fed or copied into next
        self._empty(row)
        self._heads[row] = (adapter_idx, list(prompt))
        minimum = self.sampler.min_copied_prefix
        if minimum is None or shared < minimum:
            return 0
        self._copies[row] = (source, shared)
        self._lengths[row] = shared
        return shared

    def _best_head(self, prompt: Sequence[int], adapter_idx: int) -> tuple[int | None, int]:
        """(row, positions) of the computed head sharing the most leading tokens with `prompt` (one left to feed)
        among the rows with adapter `adapter_idx` that no copy is pending into."""
        held = [(r, head[: self._lengths[r]]) for r, (a, head) in self._heads.items() if a == adapter_idx]
        held += [(r, head) for r, (a, head) in self._left.items() if a == adapter_idx]
        best: tuple[int | None, int] = (None, 0)
        for r, head in held:
            if r not in self._copies:
                shared = min(common_prefix_length([head, prompt]), len(prompt) - 1)
                best = max(best, (r, shared), key=lambda pair: pair[1])
        return best

    def _append(self, rows, parts, adapter_idx, max_new, lengths) -> None:
        """Queues parts[i] for row rows[i]: the next call appends it."""
        del adapter_idx, max_new, lengths
        for r, part in zip(rows.tolist(), parts):
            if part:
                self._pending[r] = list(part)
                self._left.pop(r, None)  # a row fed without `start`: what it left is overwritten

    def _forget(self, rows: Sequence[int]) -> None:
        """`rows` drop what they were to feed and copy; the heads they hold stay as long as their positions do."""
        super()._forget(rows)
        for r in map(int, rows):
            self._pending.pop(r, None)
            self._copies.pop(r, None)
            if r in self._heads:
                adapter, head = self._heads.pop(r)
                self._left[r] = (adapter, head[: self._lengths[r]])

    def _own_lengths(self) -> np.ndarray:
        return self._lengths.copy()

    def _prefix_lengths(self) -> np.ndarray:
        return np.zeros_like(self._lengths)

    def _set_own_length(self, row: int, length: int) -> None:
        super()._set_own_length(row, length)
        self._lengths[row] = length
        if row in self._heads:  # the positions after `length` will hold other tokens
            adapter, head = self._heads[row]
            self._heads[row] = (adapter, head[:length])

    def _empty(self, row: int) -> None:
        super()._empty(row)
        self._lengths[row] = 0

    def _needed(self) -> np.ndarray:
        """Per row: its own positions, for a sampling row those the call in flight and the next one append, and for
        a released row the head it left."""
        fed = np.zeros((self.cache.batch,), np.int64)
        for r, pending in self._pending.items():
            fed[r] = min(len(pending), self.feed_width)
        if self._call is not None:
            fed += self._call.fed
        steps = np.minimum(self._rows.remaining, self.sampler.decode_chunk)
        needed = self._lengths + np.where(self._rows.running, fed + steps, 0)
        for r, (_, head) in self._left.items():  # kept while released rows' heads may be copied (the next
            needed[r] = max(needed[r], len(head))  # conversations of an environment share its system prompt)
        return needed

    def step(self, key: jax.Array, *, return_early: bool = False) -> dict[int, Completion]:
        """Reads the call in flight (its finished turns complete), dispatches the next call if a row samples, and
        returns {row: completion} of the rows that finished since the last step (see the class docstring)."""
        del return_early
        if self._call is not None:
            self._collect()
        if self._rows.running.any():
            self._launch(key)
        done, self._done = self._done, {}
        return done

    def _launch(self, key: jax.Array) -> None:
        """Dispatches a fused call over the sampling rows, each appending the head of its queue."""
        self._fit(self._needed())
        sampler, start = self.sampler, time.perf_counter()
        self._copy_heads()
        feed, fed = self._feed_rows()
        tokens, logp, self._logits, self.cache, count, code, steps, fed_steps = sampler.programs.fused(
            sampler.params,
            sampler.adapters,
            self.cache,
            self._logits,
            key,
            self._row_arrays(),
            feed,
            self._stop_ids,
        )
        for r in np.flatnonzero(fed).tolist():
            del self._pending[r][: fed[r]]
            if not self._pending[r]:
                del self._pending[r]
        turns = {r: self._turns[r] for r in np.flatnonzero(self._rows.running).tolist()}
        self._call = _Call((tokens, logp, count, code, steps, fed_steps), turns, fed)
        self.stats.update(
            decode_s=time.perf_counter() - start,
            prefill_tokens=int(fed.sum()),
            prefill_positions=position_sum(self._lengths, fed),
        )

    def _copy_heads(self) -> None:
        """The started rows take the heads they share from the rows holding them (`start`), in one copy over all
        rows (ids past the batch pad it: copied from nowhere, written nowhere)."""
        if not self._copies:
            return
        batch, put = self.cache.batch, lambda a: self.sampler.put(a, "batch")
        src, dst, lengths = (
            np.full((batch,), batch, np.int32),
            np.full((batch,), batch, np.int32),
            np.zeros((batch,), np.int32),
        )
        for i, (r, (source, shared)) in enumerate(self._copies.items()):
            src[i], dst[i], lengths[i] = source, r, shared
        k, v, all_lengths, self._logits = self.sampler.programs.copy_rows(
            self.cache.k,
            self.cache.v,
            self.cache.lengths,
            self._logits,
            put(src),
            put(dst),
            put(lengths),
            self._no_logits,
        )
        self.cache = self.cache.replace(k=k, v=v, lengths=all_lengths)
        self.stats.update(copied_rows=len(self._copies), copied_tokens=int(lengths.sum()))
        self._copies.clear()

    @functools.cached_property
    def _no_logits(self) -> jax.Array:
        """Zero next-token logits for the copied rows (each is fed a token before it samples); the copy reads them
        without donating them, so one array serves every copy."""
        return self.sampler.put(np.zeros(self._logits.shape, np.float32), "batch")

    def _collect(self) -> None:
        """Waits for the call in flight and takes its tokens into the turns it sampled (a row cancelled, or
        cancelled and fed anew, since it was dispatched keeps none of them)."""
        call, self._call, start = self._call, None, time.perf_counter()
        step_tokens, step_logp, count, code, steps, fed_steps = map(np.asarray, call.outputs)
        rows = [r for r, turn in call.turns.items() if self._turns.get(r) is turn]
        for r in rows:
            self._lengths[r] += call.fed[r] + count[r]
        self._take(rows, step_tokens, step_logp, count, code)
        self.stats.update(
            decode_s=time.perf_counter() - start,
            decode_calls=1,
            decode_steps=int(steps),
            decode_tokens=int(count.sum()),
            lane_feed_steps=int(fed_steps[0]),
            full_feed_steps=int(fed_steps[1]),
        )

    def _feed_rows(self) -> tuple[FeedRows, np.ndarray]:
        """This call's `FeedRows` (each row's next queued tokens, its turn's last tokens and its stop forms), and
        how many tokens each row appends."""
        batch, width = self.cache.batch, self.feed_width
        tokens = np.zeros((batch, width), np.int32)
        length = np.zeros((batch,), np.int32)
        more = np.zeros((batch,), bool)
        recent = np.full((batch, STOP_FORM_TOKENS), RECENT_NONE, np.int32)
        forms = np.full((batch, STOP_FORMS, STOP_FORM_TOKENS), FORM_NONE, np.int32)
        for r, pending in self._pending.items():
            length[r] = min(len(pending), width)
            tokens[r, : length[r]] = pending[: length[r]]
            more[r] = len(pending) > width
        for r, turn in self._turns.items():
            last = turn.ids[-STOP_FORM_TOKENS:]
            if last:
                recent[r, -len(last) :] = last
            forms[r] = self._stop_forms(self._stops(turn))
        put = lambda a: self.sampler.put(a, "batch")
        return FeedRows(*map(put, (tokens, length, more, recent, forms))), length

    def _stop_forms(self, stops: tuple[str, ...]) -> np.ndarray:
        """The token forms of `stops` the device watches for (each string's encoding, when the sampler has a
        `tokenize` and it fits STOP_FORM_TOKENS; the host finds the others in the text after the call)."""
        if stops not in self._forms:
            forms = np.full((STOP_FORMS, STOP_FORM_TOKENS), FORM_NONE, np.int32)
            tokenize = self.sampler.tokenize
            encoded = [tokenize(s) for s in stops] if tokenize is not None else []
            fitting = [ids for ids in encoded if 0 < len(ids) <= STOP_FORM_TOKENS]
            for form, ids in zip(forms, fitting[:STOP_FORMS]):
                form[:] = FORM_ANY
                form[-len(ids) :] = ids
            self._forms[stops] = forms
        return self._forms[stops]

    def warm_up(self) -> None:
        """Compiles every program this session can run, ahead of time: the fused loop and the head copy at each
        cache capacity of `ShapePolicy.capacities`, the resize between each two of them, and the row updates `start`
        makes, the compiles in parallel threads. Nothing compiles after it (the programs also go to the persistent
        compilation cache where it is on)."""
        sampler, cache = self.sampler, self.cache
        self.cache = sampler.start_row(cache, 0)  # the row updates, run once (row 0 is empty before any feed)
        capacities = sampler.shapes.capacities()
        own = lambda capacity: tuple(_like(a, (*a.shape[:2], capacity, a.shape[3])) for a in cache.k)
        arguments = (self._row_arrays(), self._feed_rows()[0], self._stop_ids)
        lowered = [
            sampler.programs.fused.lower(
                sampler.params,
                sampler.adapters,
                jax.tree.map(_like, cache).replace(k=own(capacity), v=own(capacity)),
                self._logits,
                jax.random.key(0),
                *arguments,
            )
            for capacity in capacities
        ]
        lowered += [
            sampler.programs.resize.lower(own(old), own(old), capacity=new)
            for old, new in itertools.permutations(capacities, 2)
        ]
        ids = _like(sampler.put(np.zeros((cache.batch,), np.int32), "batch"))
        lowered += [
            sampler.programs.copy_rows.lower(
                own(capacity), own(capacity), _like(cache.lengths), self._logits, ids, ids, ids, self._logits
            )
            for capacity in capacities
        ]
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(lambda program: program.compile(), lowered))  # XLA compiles outside the GIL
