"""`Session`: the rows of one KV cache, fed and sampled independently (continuous batching), and the
`Completion` each turn ends with."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import lora as lora_lib
from trace_jax.models import decoder
from trace_jax.sampling.kernels import DecodeRows
from trace_jax.sampling.shapes import MIN_PIECE, common_prefix_length, power_of_two

if TYPE_CHECKING:
    from trace_jax.sampling.sampler import Sampler

FINISH_STOP = "stop"  # a stop token or stop string
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_CONTEXT = "context"  # the row reached the model's context limit
_FINISH_NAMES = {1: FINISH_STOP, 2: FINISH_LENGTH, 3: FINISH_CONTEXT}


@dataclasses.dataclass(frozen=True)
class Completion:
    """One row's output. `token_ids` include the stop token / the tokens through a stop string;
    `text` is their decoding with a matched stop string and what follows it removed."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str | None = None


def per_row(value, n: int, dtype) -> np.ndarray:
    """Broadcasts a scalar or a length-n sequence to a length-n array."""
    arr = np.asarray(value, dtype)
    if arr.ndim == 0:
        return np.full((n,), arr, dtype)
    if arr.shape != (n,):
        raise ValueError(f"per-row sampling parameter has shape {arr.shape}, expected ({n},)")
    return arr


def position_sum(starts, counts) -> int:
    """The sum over i of positions starts[i] .. starts[i] + counts[i] - 1 (the tokens a prefill appends to row i,
    whose next position is starts[i]): what a prefill adds to `Session.stats["prefill_positions"]`."""
    starts, counts = np.asarray(starts, np.int64), np.asarray(counts, np.int64)
    return int(np.sum(starts * counts + counts * (counts - 1) // 2))


@dataclasses.dataclass(frozen=True)
class _Opening:
    """A first prompt that rows hold at the start of their own buffers (`length` positions), and the
    next-token logits after it: a row opening alike copies a holder instead of prefilling it again."""

    length: int
    logits: np.ndarray


@dataclasses.dataclass
class _Turn:
    """A row's turn from its feed until `step` returns it: what it has sampled, why it ends, and where."""

    start_len: int  # the row's own length when the turn began (a stop string cuts the cache back to it + kept)
    finish: str  # the finish reason if nothing else ends it first
    stops: tuple[str, ...] | None = None  # its own stop strings (None: the session's)
    ids: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    text_end: int | None = None  # where a stop string cut its text


@dataclasses.dataclass
class _RowArrays:
    """What the decode program reads per row, one array each over the cache's rows."""

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    stream: np.ndarray
    adapter_idx: np.ndarray
    remaining: np.ndarray  # tokens a sampling row may still draw this turn
    running: np.ndarray  # bool: the row is sampling

    @classmethod
    def empty(cls, batch: int) -> _RowArrays:
        return cls(
            temperature=np.zeros((batch,), np.float32),
            top_p=np.ones((batch,), np.float32),
            top_k=np.zeros((batch,), np.int32),
            stream=np.arange(batch, dtype=np.int32),
            adapter_idx=np.full((batch,), lora_lib.NO_ADAPTER, np.int32),
            remaining=np.zeros((batch,), np.int32),
            running=np.zeros((batch,), bool),
        )


class Session:
    """Rows of one cache that sample independently, for callers that feed rows at different times.

    `feed` appends tokens to some rows and starts them sampling (one prefill over those rows
    only); `step` decodes every sampling row for up to a chunk of tokens and returns the
    completions of the rows that finished, which may be fed again at once. A batch then never
    waits for its slowest row: the rollout engine gives a row its conversation's next turn, or a
    new conversation (`start`), as soon as its turn ends, and `release`s the rows of a finished
    one. The cache's capacity follows the rows: it grows as they lengthen and shrinks when the
    longest are released. `Sampler.generate` is one feed and steps until every row is done.

    This is the sampler's "adaptive" policy, shapes fitted to each call (the CPU's); `FusedSession` is the
    accelerators'.
    """

    def __init__(
        self,
        sampler: Sampler,
        cache: decoder.KVCache,
        *,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
    ):
        if stop_strings and sampler.detokenize is None:
            raise ValueError("stop_strings need a Sampler built with detokenize=")
        self.sampler, self.cache = sampler, cache
        self.stop_strings = tuple(stop_strings)
        self._stop_ids = jax.device_put(np.asarray(sorted(set(stop_token_ids)) or [-1], np.int32))
        batch = cache.batch
        self._logits = sampler.put(np.zeros((batch, sampler.cfg.vocab_size), np.float32), "batch")
        self._rows = _RowArrays.empty(batch)
        self._turns: dict[int, _Turn] = {}  # rows sampling a turn
        self._done: dict[int, Completion] = {}  # finished rows not yet returned by `step`
        self._prefixes: dict[tuple, tuple[list[int], int]] = {}  # (adapter, group) -> (tokens, slot)
        self._openings: dict[tuple, _Opening] = {}  # (prefix slot, its length, adapter, tokens) -> held opening
        self._opening_of: dict[int, tuple] = {}  # row -> the key of the opening it holds
        # Where the time goes (for benchmarks): prefill calls, rows and tokens (and the stored prefixes'), and the
        # sum of the prefilled tokens' positions in their conversations (an attention's cost grows with its
        # position); decode calls, steps and tokens.
        self.stats = collections.Counter()

    @property
    def running(self) -> bool:
        """Whether any row is sampling or has a completion `step` has not returned yet."""
        return bool(self._rows.running.any() or self._done)

    def start(self, row: int, prompt: Sequence[int], adapter_idx: int = lora_lib.NO_ADAPTER, group: Any = None) -> int:
        """Empties `row` for a new conversation whose first prompt is `prompt`; returns how many of
        its leading tokens the row already holds (feed it the rest). Prompts of one (adapter,
        group) share the stored prefix of the group's first prompt (system prompts repeat: each
        is prefilled once per session) when they share `min_shared_prefix` tokens with it."""
        minimum, sampler = self.sampler.min_shared_prefix, self.sampler
        self._forget([row])
        if minimum is None or len(prompt) <= minimum:
            self._empty(row)
            return 0
        if (adapter_idx, group) not in self._prefixes:
            tokens = list(prompt[:-1])  # the row must feed at least its last prompt token
            start = time.perf_counter()
            self.cache, slot = sampler.add_prefix(self.cache, tokens, adapter_idx)
            jax.block_until_ready(self.cache.k)
            self.stats.update(
                prefill_s=time.perf_counter() - start,
                prefix_prefills=1,
                prefix_tokens=len(tokens),
                prefill_positions=position_sum(0, len(tokens)),
            )
            self._prefixes[adapter_idx, group] = (tokens, slot)
        tokens, slot = self._prefixes[adapter_idx, group]
        shared = min(common_prefix_length([tokens, prompt]), len(prompt) - 1)
        if shared < minimum:
            self._empty(row)
            return 0
        self.cache = sampler.start_row(self.cache, row, slot, shared)
        return shared

    def feed(
        self,
        rows: Sequence[int],
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens=256,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        adapter_idx=lora_lib.NO_ADAPTER,
        stream=None,
        stop_strings: Sequence[Sequence[str]] | None = None,
    ) -> None:
        """Appends prompts[i] to row rows[i] (not sampling now) and starts it sampling up to
        max_new_tokens[i] tokens. Settings are scalars or one value per prompt; every prompt
        needs a token (a continuing row appends at least the next turn's). `stream`: the random
        stream each row draws from (`row_keys`; default the row's index), e.g. one per episode.
        `stop_strings`: each prompt's own stop strings for this turn (default the session's)."""
        n, batch, sampler = len(prompts), self.cache.batch, self.sampler
        rows = np.asarray(rows, np.int64).reshape(-1)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if stop_strings is not None and (len(stop_strings) != n or isinstance(stop_strings, str)):
            raise ValueError(f"stop_strings must hold one sequence of strings per prompt ({n})")
        if stop_strings is not None and any(stop_strings) and sampler.detokenize is None:
            raise ValueError("stop_strings need a Sampler built with detokenize=")
        if len(rows) != n or len(set(rows.tolist())) != n or rows.max(initial=0) >= batch or rows.min(initial=0) < 0:
            raise ValueError(f"rows {rows.tolist()} must be {n} distinct rows of the cache's {batch}")
        if self._rows.running[rows].any() or any(int(r) in self._done for r in rows):
            raise ValueError(f"rows {rows.tolist()} include a row whose turn has not been returned by step()")
        settings = {
            "temperature": per_row(temperature, n, np.float32),
            "top_p": per_row(top_p, n, np.float32),
            "top_k": per_row(top_k, n, np.int32),
            "adapter_idx": per_row(adapter_idx, n, np.int32),
            "stream": rows.astype(np.int32) if stream is None else per_row(stream, n, np.int32),
        }
        max_new = per_row(max_new_tokens, n, np.int32)
        lengths, prefixes = self._own_lengths(), self._prefix_lengths()
        new_len = np.array([len(p) for p in prompts])
        fits = prefixes[rows] + lengths[rows] + new_len < sampler.max_context  # prompt + a token
        parts = [list(p) if ok else [] for p, ok in zip(prompts, fits)]
        self._append(rows, parts, settings["adapter_idx"], max_new, lengths)
        for name, values in settings.items():
            getattr(self._rows, name)[rows] = values
        self._rows.remaining[rows] = max_new
        self._rows.running[rows] = fits & (max_new > 0)
        start_len = lengths[rows] + np.where(fits, new_len, 0)
        for i, (r, ok) in enumerate(zip(rows.tolist(), fits)):
            self._turns[r] = _Turn(
                start_len=int(start_len[i]),
                finish=FINISH_LENGTH if ok else FINISH_CONTEXT,
                stops=None if stop_strings is None else tuple(stop_strings[i]),
            )
            if not self._rows.running[r]:
                self._complete(r)

    def _append(
        self,
        rows: np.ndarray,
        parts: list[list[int]],
        adapter_idx: np.ndarray,
        max_new: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Prefills parts[i] (empty: a row that does not fit) into row rows[i] now, in calls over the fed rows only,
        copying an opening a row already holds instead (`lengths`: the rows' own lengths before the feed)."""
        sampler, batch = self.sampler, self.cache.batch
        # Room for the prompts and the first decode chunk; `step` grows the cache as rows go on.
        sizes = np.array([len(p) for p in parts])
        self._fit(np.where(sizes > 0, lengths[rows] + sizes + np.minimum(max_new, sampler.decode_chunk), 0))
        firsts, copies = self._openings_fed(rows, parts, adapter_idx, lengths)
        for offset in range(0, max(sizes), sampler.prefill_chunk):
            # longest first, so that each call's rows have pieces of like lengths (each call pads to its longest)
            members = sorted(
                (i for i, p in enumerate(parts) if len(p) > offset and i not in copies), key=lambda i: -len(parts[i])
            )
            for size in sampler.shapes.row_groups(len(members), batch):
                group, members = members[:size], members[size:]
                self._prefill_chunk(
                    rows[group], [parts[i][offset : offset + sampler.prefill_chunk] for i in group], adapter_idx[group]
                )
        for key, i in firsts.items():
            self._hold(key, int(rows[i]), len(parts[i]))
        if copies:
            self._copy_openings(rows, copies)

    def _openings_fed(
        self, rows: np.ndarray, parts: list[list[int]], adapter_idx: np.ndarray, lengths: np.ndarray
    ) -> tuple[dict[tuple, int], dict[int, tuple]]:
        """The fed rows that start empty (`lengths`: the rows' own lengths), by opening (prefix slot, its
        length, adapter, tokens): ({key: i} for the first of an opening no row holds, prefilled; {i: key} for
        the others, copied from a row holding it). A GRPO group's or a calibration's episodes of one task open
        alike, at once or as rows free up, so each opening is prefilled once while a row holds it."""
        slots, held = np.asarray(self.cache.prefix_slot), np.asarray(self.cache.prefix_len)
        firsts: dict[tuple, int] = {}
        copies: dict[int, tuple] = {}
        for i, r in enumerate(rows.tolist()):
            if parts[i] and lengths[r] == 0:
                key = (int(slots[r]), int(held[r]), int(adapter_idx[i]), tuple(parts[i]))
                if key in self._openings or key in firsts:
                    copies[i] = key
                else:
                    firsts[key] = i
        return firsts, copies

    def _hold(self, key: tuple, row: int, length: int) -> None:
        """Records that `row` holds opening `key` (`length` own positions) with its next-token logits now."""
        if key not in self._openings:  # one row at a time: one compiled slice whatever the row
            self._openings[key] = _Opening(length, np.asarray(self._logits[row]))
        self._opening_of[row] = key

    def _forget(self, rows: Sequence[int]) -> None:
        """`rows` no longer hold their openings (restarted, released or cut)."""
        for r in rows:
            key = self._opening_of.pop(int(r), None)
            if key is not None and key not in self._opening_of.values():
                del self._openings[key]

    def _copy_openings(self, rows: np.ndarray, copies: dict[int, tuple]) -> None:
        """Fed rows `rows[i]` take opening copies[i] from a row holding it, in one call."""
        sampler, batch, start = self.sampler, self.cache.batch, time.perf_counter()
        openings = [self._openings[key] for key in copies.values()]
        src = [min(r for r, held in self._opening_of.items() if held == key) for key in copies.values()]
        dst = rows[list(copies)]
        width = sampler.shapes.rows_width(len(dst), batch)
        ids = lambda values: sampler.put(self._row_ids(values, width), "batch")
        lengths = np.zeros((width,), np.int32)
        lengths[: len(dst)] = [o.length for o in openings]
        logits = np.zeros((width, sampler.cfg.vocab_size), np.float32)
        logits[: len(dst)] = [o.logits for o in openings]
        k, v, all_lengths, self._logits = sampler.programs.copy_rows(
            self.cache.k,
            self.cache.v,
            self.cache.lengths,
            self._logits,
            ids(src),
            ids(dst),
            sampler.put(lengths, "batch"),
            sampler.put(logits, "batch"),
        )
        self.cache = self.cache.replace(k=k, v=v, lengths=all_lengths)
        self._logits.block_until_ready()
        for key, r in zip(copies.values(), dst.tolist()):
            self._hold(key, r, self._openings[key].length)
        self.stats.update(prefill_s=time.perf_counter() - start, copied_rows=len(dst), copied_tokens=int(lengths.sum()))

    def _row_ids(self, rows: np.ndarray, width: int) -> np.ndarray:
        """`rows` padded to `width` ids with the batch size, an id the row moves read as an empty row
        and write nowhere."""
        return np.pad(np.asarray(rows, np.int32), (0, width - len(rows)), constant_values=self.cache.batch)

    def _fit(self, needed: np.ndarray, shrink: bool = False) -> None:
        """Resizes the cache to the capacity bucket of the most positions a row needs: grows it when
        a row needs more room, and with `shrink` cuts it when no row needs what it has (decode and
        prefill read every position of it, so a cache sized for long-gone rows slows every step)."""
        capacity = self.sampler.shapes.capacity(int(np.max(needed, initial=0)))
        if capacity > self.cache.max_len or (shrink and capacity < self.cache.max_len):
            self.cache = self.sampler.resize(self.cache, capacity)
            self.stats.update(resizes=1)

    def release(self, rows: Sequence[int]) -> None:
        """Empties `rows` (not sampling now) whose conversations are over, and shrinks the cache to
        what the remaining rows need."""
        rows = [int(r) for r in rows]
        if self._rows.running[rows].any() or any(r in self._done for r in rows):
            raise ValueError(f"rows {rows} include a row whose turn has not been returned by step()")
        self._forget(rows)
        for r in rows:
            self._empty(r)
        self._fit(self._needed(), shrink=True)

    def cancel(self, rows: Sequence[int]) -> None:
        """Stops `rows` wherever they are (sampling, or finished and not yet returned by `step`), drops what
        they sampled in this turn and empties them (a server's client that went away)."""
        rows = [int(r) for r in rows]
        for r in rows:
            self._rows.running[r] = False
            self._done.pop(r, None)
            self._turns.pop(r, None)
        self.release(rows)

    def partial(self, row: int) -> tuple[list[int], list[float]]:
        """The tokens (and logprobs) `row` has sampled so far in its running turn (streaming)."""
        turn = self._turns.get(row)
        return ([], []) if turn is None else (list(turn.ids), list(turn.logp))

    def keep(self, row: int, length: int) -> bool:
        """Cuts finished `row` to its first `length` positions, so that a next prompt sharing them feeds only the
        rest (a server's conversation reusing its cache); False, and the row unchanged, where `length` falls inside
        the prefix slot the row continues."""
        prefix, own = int(self._prefix_lengths()[row]), int(self._own_lengths()[row])
        if self._rows.running[row] or row in self._done:
            raise ValueError(f"row {row}'s turn has not been returned by step()")
        if length > prefix + own:
            raise ValueError(f"row {row} holds {prefix + own} positions: cannot keep {length}")
        if length < prefix:
            return False
        key = self._opening_of.get(row)
        if key is not None and length - prefix < self._openings[key].length:
            self._forget([row])
        self._set_own_length(row, length - prefix)
        return True

    def _own_lengths(self) -> np.ndarray:
        """Each row's own positions filled (after its prefix)."""
        return np.asarray(self.cache.lengths)

    def _prefix_lengths(self) -> np.ndarray:
        """How many positions of its prefix slot each row continues."""
        return np.asarray(self.cache.prefix_len)

    def _set_own_length(self, row: int, length: int) -> None:
        """Cuts `row` back to `length` own positions (what follows is forgotten)."""
        self.cache = self.cache.replace(lengths=self.cache.lengths.at[row].set(length))

    def _empty(self, row: int) -> None:
        """Empties `row`, with no prefix."""
        self.cache = self.sampler.start_row(self.cache, row)

    def _needed(self) -> np.ndarray:
        """Per row: the own positions it holds, and for a sampling row those of its next decode chunk."""
        chunk = np.where(self._rows.running, np.minimum(self._rows.remaining, self.sampler.decode_chunk), 0)
        return self._own_lengths() + chunk

    def _prefill_chunk(self, rows: np.ndarray, pieces: list[list[int]], adapter_idx: np.ndarray) -> None:
        """Appends pieces[i] (at most `prefill_chunk` tokens) to row rows[i], in one call over those
        rows only (taken out of the cache, prefilled, put back)."""
        sampler, n, batch = self.sampler, len(rows), self.cache.batch
        width = sampler.shapes.rows_width(n, batch)
        row_ids = self._row_ids(rows, width)
        longest = max(map(len, pieces))  # positions: a power of two from MIN_PIECE to the chunk
        tokens = np.zeros((width, min(max(power_of_two(longest), MIN_PIECE), sampler.prefill_chunk)), np.int32)
        for i, piece in enumerate(pieces):
            tokens[i, : len(piece)] = piece
        num_new = np.zeros((width,), np.int32)
        num_new[:n] = [len(piece) for piece in pieces]
        row_adapter = np.full((width,), lora_lib.NO_ADAPTER, np.int32)
        row_adapter[:n] = adapter_idx
        put, start, cache = sampler.put, time.perf_counter(), self.cache
        own = self._own_lengths()[rows]
        reach = int(np.max(own + num_new[:n]))  # own positions filled after the feed
        window = min(sampler.shapes.capacity(reach), cache.max_len)
        row_ids = put(row_ids, "batch")
        k, v, row_lengths, prefix_slot, prefix_len = sampler.programs.take_rows(
            cache.k, cache.v, cache.lengths, cache.prefix_slot, cache.prefix_len, row_ids, window=window
        )
        taken = cache.replace(k=k, v=v, lengths=row_lengths, prefix_slot=prefix_slot, prefix_len=prefix_len)
        row_logits, taken = sampler.programs.prefill_rows(
            sampler.params,
            sampler.adapters,
            taken,
            put(tokens, "batch"),
            put(num_new, "batch"),
            put(row_adapter, "batch"),
        )
        k, v, all_lengths, self._logits = sampler.programs.put_rows(
            cache.k, cache.v, cache.lengths, self._logits, row_ids, taken.k, taken.v, taken.lengths, row_logits
        )
        self.cache = cache.replace(k=k, v=v, lengths=all_lengths)
        self._logits.block_until_ready()
        self.stats.update(
            prefill_s=time.perf_counter() - start,
            prefill_calls=1,
            prefill_rows=n,
            prefill_tokens=int(num_new.sum()),
            prefill_padded_tokens=tokens.size,
            prefill_positions=position_sum(self._prefix_lengths()[rows] + own, num_new[:n]),
        )

    def step(self, key: jax.Array, *, return_early: bool = False) -> dict[int, Completion]:
        """Decodes every sampling row for up to `decode_chunk` tokens (with `return_early`, until the
        first row finishes) and returns {row: completion} of the rows that finished since the last step.
        Each token is drawn with `row_keys(key, stream, position)`: pass the same `key` at every step."""
        if self._rows.running.any():
            self._fit(self._needed())
            start = time.perf_counter()
            step_tokens, step_logp, count, code, steps = map(np.asarray, self._decode(key, return_early))
            self.stats.update(
                decode_s=time.perf_counter() - start,
                decode_calls=1,
                decode_steps=int(steps),
                decode_tokens=int(count.sum()),
            )
            self._take(np.flatnonzero(self._rows.running).tolist(), step_tokens, step_logp, count, code)
        done, self._done = self._done, {}
        return done

    def _row_arrays(self) -> DecodeRows:
        """The sampling rows' settings, on the device."""
        put, arrays = self.sampler.put, self._rows
        return DecodeRows(
            *(put(a, "batch") for a in (arrays.temperature, arrays.top_p, arrays.top_k, arrays.stream)),
            adapter_idx=put(arrays.adapter_idx, "batch"),
            remaining=put(arrays.remaining, "batch"),
            done=put(~arrays.running, "batch"),
        )

    def _decode(self, key: jax.Array, return_early: bool) -> tuple:
        """One decode call: tokens and logprobs [B, steps], per row how many it drew and its finish code, and the
        steps it ran."""
        sampler = self.sampler
        step_tokens, step_logp, self._logits, self.cache, count, code = sampler.programs.decode(
            sampler.params,
            sampler.adapters,
            self.cache,
            self._logits,
            key,
            self._row_arrays(),
            self._stop_ids,
            jnp.asarray(return_early),
        )
        step_tokens = np.asarray(step_tokens)
        return step_tokens, step_logp, count, code, (step_tokens >= 0).any(axis=0).sum()

    def _take(
        self, rows: list[int], step_tokens: np.ndarray, step_logp: np.ndarray, count: np.ndarray, code: np.ndarray
    ) -> None:
        """Appends the new tokens of each of the sampling `rows` to its turn and completes the rows that finished."""
        for r in rows:
            turn = self._turns[r]
            turn.ids.extend(step_tokens[r, : count[r]].tolist())
            turn.logp.extend(step_logp[r, : count[r]].tolist())
            self._rows.remaining[r] -= count[r]
            if code[r]:
                turn.finish = _FINISH_NAMES[int(code[r])]
            if (self._stops(turn) and self._cut_at_stop_string(r)) or code[r]:
                self._complete(r)

    def _cut_at_stop_string(self, r: int) -> bool:
        """Ends row r's turn at a stop string in its output, if there is one (the cache forgets what follows)."""
        turn = self._turns[r]
        cut = self.sampler.find_stop_string(turn.ids, self._stops(turn))
        if cut is None:
            return False
        keep, turn.text_end = cut
        del turn.ids[keep:], turn.logp[keep:]
        turn.finish = FINISH_STOP
        self._set_own_length(r, turn.start_len + keep)
        return True

    def _stops(self, turn: _Turn) -> tuple[str, ...]:
        """The stop strings `turn` ends at: its own, or the session's."""
        return self.stop_strings if turn.stops is None else turn.stops

    def _complete(self, r: int) -> None:
        self._rows.running[r] = False
        turn = self._turns.pop(r)
        text = None if self.sampler.detokenize is None else self.sampler.detokenize(turn.ids)[: turn.text_end]
        self._done[r] = Completion(turn.ids, turn.logp, turn.finish, text)
