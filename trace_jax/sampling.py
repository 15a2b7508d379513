"""Batched generation with a KV cache: jitted prefill and decode, per-row everything.

Each row keeps its own length in the cache, so rows of different lengths share a
batch and a row can continue (the next turn of a conversation) by appending new
tokens without recomputing its prefix. A `Session` feeds and finishes rows at
different times (the rollout engine's continuous batching); `Sampler.generate` is one
feed of all rows. Temperature, top-p and top-k are per-row
arrays (changing them never recompiles); batch, prompt and cache lengths are
rounded up to buckets, and shared prefixes to a multiple of 64 tokens, so the number of
compiled programs stays small.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import lora as lora_lib
from trace_jax.models import decoder
from trace_jax.models.config import ModelConfig
from trace_jax.sharding import ShardingPlan

FINISH_STOP = "stop"  # a stop token or stop string
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_CONTEXT = "context"  # the row reached the model's context limit


@dataclasses.dataclass(frozen=True)
class Completion:
    """One row's output. `token_ids` include the stop token / the tokens through a stop string;
    `text` is their decoding with a matched stop string and what follows it removed."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str | None = None


def power_of_two(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def bucket_size(n: int, minimum: int) -> int:
    """The smallest size of the form 2^k or 3 * 2^(k-1) that is >= max(n, minimum).

    Steps of at most 1.5x keep padding (attention reads the whole cache) low while the
    number of distinct shapes, and so of compiled programs, grows only logarithmically.
    """
    n = max(int(n), minimum, 1)
    power = power_of_two(n)
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power


PREFIX_MULTIPLE = 64
MIN_PIECE = 32  # a row prefill computes a power of two positions from this to the chunk


def prefix_capacity(n: int) -> int:
    """The padded length of a shared prefix of n tokens: the next multiple of `PREFIX_MULTIPLE`.

    A shared prefix (a system prompt) keeps its length for a whole job, so a fine step adds
    few compiled shapes, while every row attends over all of its padding, which a `bucket_size`
    would make up to half the prefix (1062 -> 1536 tokens for the tool-call task's prompt).
    """
    return -(-max(int(n), 1) // PREFIX_MULTIPLE) * PREFIX_MULTIPLE


_BISECTION_STEPS = 32  # shrinks a logit range of ~1e2 to ~1e-8


def truncate_logits(scaled, top_p, top_k):
    """Masks to -inf the tokens outside each row's top-k (k > 0) and top-p nucleus (p < 1).

    A token stays in the nucleus when the probability of the tokens more likely than
    it is below top_p, so the most likely token always stays. Both cut-offs are found
    by bisection on the logit value: exact up to ties closer than ~1e-8, and no sort
    (a full-vocabulary sort is very slow on CPU).
    """
    finite_min = jnp.min(jnp.where(jnp.isfinite(scaled), scaled, jnp.inf), axis=-1)
    x = jnp.maximum(scaled, finite_min[:, None])
    probs = jax.nn.softmax(scaled, axis=-1)
    k = jnp.where(top_k > 0, top_k, scaled.shape[-1])

    def step(_, bounds):
        # Invariants: count(x >= k_lo) > k >= count(x >= k_hi); mass(x > p_lo) >= top_p > mass(x > p_hi).
        k_lo, k_hi, p_lo, p_hi = bounds
        k_mid, p_mid = (k_lo + k_hi) / 2, (p_lo + p_hi) / 2
        too_many = jnp.sum(x >= k_mid[:, None], axis=-1) > k
        too_much = jnp.sum(jnp.where(x > p_mid[:, None], probs, 0.0), axis=-1) >= top_p
        return (
            jnp.where(too_many, k_mid, k_lo),
            jnp.where(too_many, k_hi, k_mid),
            jnp.where(too_much, p_mid, p_lo),
            jnp.where(too_much, p_hi, p_mid),
        )

    lo, hi = finite_min - 1.0, jnp.max(x, axis=-1)
    _, k_hi, p_lo, _ = jax.lax.fori_loop(0, _BISECTION_STEPS, step, (lo, hi, lo, hi))
    keep = (x >= k_hi[:, None]) & (x > p_lo[:, None])
    return jnp.where(keep, scaled, -jnp.inf)


def sample_from_logits(logits, keys, temperature, top_p, top_k):
    """Draws one token per row, row b with its own key `keys[b]`. Returns (tokens [B], logprobs [B]).

    Rows with temperature <= 0 are greedy and report the plain log-softmax of their
    token; other rows report the log-probability under the distribution they were
    drawn from (temperature-scaled, truncated by top-k / top-p, renormalised).
    """
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    needs_truncation = jnp.any(~greedy & ((top_p < 1.0) | (top_k > 0)))
    scaled = jax.lax.cond(needs_truncation, lambda s: truncate_logits(s, top_p, top_k), lambda s: s, scaled)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    tokens = jax.lax.cond(
        jnp.all(greedy),
        lambda: jnp.argmax(logits, axis=-1),
        lambda: jnp.where(greedy, jnp.argmax(logits, axis=-1), jax.vmap(jax.random.categorical)(keys, scaled)),
    )
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _prefill(params, adapters, cache, tokens, num_new, adapter_idx, *, cfg, constrain):
    """Appends each row's first num_new[b] tokens; returns logits after each row's last one."""
    row_lora = lora_lib.for_rows(adapters, adapter_idx)
    hidden, cache = decoder.forward_hidden(
        params, tokens, cfg, row_lora=row_lora, cache=cache, num_new=num_new, constrain=constrain
    )
    last = jnp.take_along_axis(hidden, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)
    return decoder.logits_from_hidden(params, last, cfg)[:, 0], cache


def _take_rows(k, v, lengths, prefix_slot, prefix_len, row_ids, *, window):
    """Rows `row_ids` of a cache (ids >= the batch give empty padding rows): the first `window`
    positions of their own buffers in every layer, their lengths and prefixes. A turn's prefill then
    reads and writes those rows only, and only as far as they reach, not the whole batch at the
    cache's capacity (attention and the row moves cost rows x positions)."""
    row = lambda a: a.at[row_ids].get(mode="fill", fill_value=0)
    own = lambda a: a[:, :, :window].at[row_ids].get(mode="fill", fill_value=0)
    return tuple(map(own, k)), tuple(map(own, v)), row(lengths), row(prefix_slot), row(prefix_len)


def _put_rows(k, v, lengths, logits, row_ids, rows_k, rows_v, rows_lengths, row_logits):
    """Writes rows taken by `_take_rows` (and since prefilled) back into their window, with their
    next-token logits; padding ids are dropped."""
    row = lambda a, b: a.at[row_ids].set(b, mode="drop")
    own = lambda a, b: a.at[row_ids, :, : b.shape[2]].set(b, mode="drop")
    return tuple(map(own, k, rows_k)), tuple(map(own, v, rows_v)), row(lengths, rows_lengths), row(logits, row_logits)


def _copy_rows(k, v, lengths, logits, src, dst, dst_lengths, dst_logits):
    """Rows `dst` take the own buffers of rows `src`, with own lengths `dst_lengths` and next-token logits
    `dst_logits` (an opening's: its length and the logits after it, where `src` may have gone on since); ids
    >= the batch are padding (copied from empty rows, written nowhere)."""
    copy = lambda a: a.at[dst].set(a.at[src].get(mode="fill", fill_value=0), mode="drop")
    return (
        tuple(map(copy, k)),
        tuple(map(copy, v)),
        lengths.at[dst].set(dst_lengths, mode="drop"),
        logits.at[dst].set(dst_logits, mode="drop"),
    )


def row_keys(key: jax.Array, streams: jax.Array, positions: jax.Array) -> jax.Array:
    """Each row's key for the token it samples at `positions` (absolute, in its sequence): `key` folded with the
    row's stream, then the position. A row's draws thus depend on its stream and positions only, not on the
    batch around it or when it was fed, so an episode samples the same wherever it is played."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(key, s), p))(streams, positions)


def _decode(
    params,
    adapters,
    cache,
    logits,
    key,
    sampling,
    stop_ids,
    remaining,
    done,
    adapter_idx,
    return_early,
    *,
    cfg,
    constrain,
    steps,
    max_context,
):
    """Samples up to `steps` tokens for each unfinished row, feeding each back through the cache;
    with `return_early`, returns as soon as a row finishes (so its next turn can be fed). `sampling`:
    per-row temperature, top_p, top_k and stream (`row_keys`).

    Every sampled token (stop tokens included) is written to the cache, so a row can
    later continue after it. Returns tokens and logprobs [B, steps] (-1 / 0 past a
    row's end), the next logits, the cache, and per row: tokens generated and a
    finish code (0 running, 1 stop token, 2 length, 3 context full).
    """
    temperature, top_p, top_k, streams = sampling
    row_lora = lora_lib.for_rows(adapters, adapter_idx)
    batch = logits.shape[0]

    def cond(state):
        step, _, _, _, done, _, _, finish = state
        return (step < steps) & ~jnp.all(done) & ~(return_early & jnp.any(finish > 0))

    def body(state):
        step, cache, logits, count, done, out_tokens, out_logp, finish = state
        keys = row_keys(key, streams, cache.sequence_lengths)
        tokens, logp = sample_from_logits(logits, keys, temperature, top_p, top_k)
        active = ~done
        out_tokens = out_tokens.at[:, step].set(jnp.where(active, tokens, -1))
        out_logp = out_logp.at[:, step].set(jnp.where(active, logp, 0.0))
        count = count + active
        hit_stop = jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
        hit_context = cache.sequence_lengths + 1 >= max_context
        code = jnp.where(hit_stop, 1, jnp.where(count >= remaining, 2, jnp.where(hit_context, 3, 0)))
        finish = jnp.where(active, code, finish)
        hidden, cache = decoder.forward_hidden(
            params,
            tokens[:, None],
            cfg,
            row_lora=row_lora,
            cache=cache,
            num_new=active.astype(jnp.int32),
            constrain=constrain,
        )
        logits = jnp.where(active[:, None], decoder.logits_from_hidden(params, hidden, cfg)[:, 0], logits)
        return step + 1, cache, logits, count, done | (finish > 0), out_tokens, out_logp, finish

    init = (
        jnp.int32(0),
        cache,
        logits,
        jnp.zeros((batch,), jnp.int32),
        done,
        jnp.full((batch, steps), -1, jnp.int32),
        jnp.zeros((batch, steps), jnp.float32),
        jnp.zeros((batch,), jnp.int32),
    )
    _, cache, logits, count, _, out_tokens, out_logp, finish = jax.lax.while_loop(cond, body, init)
    return out_tokens, out_logp, logits, cache, count, finish


_FINISH_NAMES = {1: FINISH_STOP, 2: FINISH_LENGTH, 3: FINISH_CONTEXT}


def _per_row(value, n: int, dtype) -> np.ndarray:
    """Broadcasts a scalar or a length-n sequence to a length-n array."""
    arr = np.asarray(value, dtype)
    if arr.ndim == 0:
        return np.full((n,), arr, dtype)
    if arr.shape != (n,):
        raise ValueError(f"per-row sampling parameter has shape {arr.shape}, expected ({n},)")
    return arr


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix all sequences share (0 for none)."""
    if not sequences:
        return 0
    first, length = sequences[0], min(len(s) for s in sequences)
    for seq in sequences[1:]:
        length = next((i for i in range(length) if seq[i] != first[i]), length)
    return length


def shared_prefix_length(prompts: Sequence[Sequence[int]], min_length: int | None) -> int:
    """How many leading prompt tokens may be run once for all rows (0: do not share).

    Sharing needs >= 2 prompts and at least `min_length` (None: never) common tokens; each
    row keeps at least its last prompt token, whose position predicts the first new token.
    """
    if min_length is None or len(prompts) < 2:
        return 0
    length = min(common_prefix_length(prompts), min(len(p) for p in prompts) - 1)
    return length if length >= max(min_length, 1) else 0


class Sampler:
    """Generates for many rows at once from one base model and a stack of LoRA adapters.

    `generate` returns the completions and a `KVCache` holding every row's tokens so
    far; pass it back with `rows=` to append a next turn to those rows and go on.
    A fresh batch whose prompts share at least `min_shared_prefix` leading tokens
    prefills that prefix once per adapter into a prefix slot of the cache that the rows
    continue from (None: never); `add_prefix` and `start_row` do the same for rows
    started one by one. Other prompt tokens are prefilled in calls of at most
    `prefill_chunk` tokens per row: little padding, and few compiled widths.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        *,
        adapters: lora_lib.Adapters | None = None,
        plan: ShardingPlan | None = None,
        max_context: int | None = None,
        decode_chunk: int = 32,
        min_cache: int = 128,
        detokenize: Callable[[list[int]], str] | None = None,
        min_shared_prefix: int | None = 64,
        prefill_chunk: int = 128,
    ):
        if prefill_chunk != bucket_size(prefill_chunk, 16):
            raise ValueError(f"prefill_chunk {prefill_chunk} must be a bucket size (16, 24, 32, 48, 64, 96, 128, ...)")
        self.cfg = cfg
        self.prefill_chunk = prefill_chunk
        self.plan = plan
        self.max_context = max_context or cfg.max_position_embeddings
        self.decode_chunk = decode_chunk
        self.min_cache = min_cache
        self.detokenize = detokenize
        self.min_shared_prefix = min_shared_prefix
        self._groups: dict[tuple[int, int], list[int]] = {}  # (rows, batch) -> `_row_groups`
        self.params = plan.shard_params(params) if plan else params
        self.adapters = None if adapters is None else (plan.shard_params(adapters) if plan else adapters)
        constrain = plan.constrain if plan else decoder.no_constraint
        self._prefill = jax.jit(functools.partial(_prefill, cfg=cfg, constrain=constrain), donate_argnums=(2,))
        # Taken rows share the cache's prefix slots, so their prefill donates nothing.
        self._prefill_rows = jax.jit(functools.partial(_prefill, cfg=cfg, constrain=constrain))
        self._take_rows = jax.jit(_take_rows, static_argnames="window")
        self._put_rows = jax.jit(_put_rows, donate_argnums=(0, 1, 2, 3))
        self._copy_rows = jax.jit(_copy_rows, donate_argnums=(0, 1, 2, 3))
        self._decode = jax.jit(
            functools.partial(_decode, cfg=cfg, constrain=constrain, steps=decode_chunk, max_context=self.max_context),
            donate_argnums=(2,),
        )

    def set_adapters(self, adapters: lora_lib.Adapters | None) -> None:
        """Swaps in new adapter weights (same shapes: no recompilation)."""
        self.adapters = None if adapters is None else (self.plan.shard_params(adapters) if self.plan else adapters)

    def _put(self, x, name: str):
        x = jnp.asarray(x)
        return jax.device_put(x, self.plan.activation_sharding(name, x.shape)) if self.plan else x

    def _batch_size(self, rows: int) -> int:
        """`rows` rounded up to a power of two and to a multiple of the mesh's batch multiple."""
        multiple = self.plan.batch_multiple if self.plan else 1
        return -(-power_of_two(rows) // multiple) * multiple

    def _capacity(self, needed: int) -> int:
        """The cache length for `needed` positions: a power of two, at most the context limit.

        Every cache length compiles its own decode and row moves (row prefills: every window, the
        same powers of two up to the cache length), each program with hundreds of kernels, and
        XLA:CPU maps each kernel's code into memory apart, so a long job's programs can reach the
        kernel's limit on memory maps (docs/design.md, "Runtime settings"). Powers of two bound the
        programs of any run, for attention over at most twice the positions in use."""
        return min(max(power_of_two(needed), self.min_cache), self.max_context)

    def _rows_width(self, rows: int, batch: int) -> int:
        """How many rows a row prefill computes for `rows` fed rows of a `batch`-row cache: a power of
        four (1, 4, 16, ...) or the batch, whichever is less (few widths: few compiled programs)."""
        return min(self._batch_size(1 << (2 * -(-(max(rows, 1) - 1).bit_length() // 2))), batch)

    def _row_groups(self, rows: int, batch: int) -> list[int]:
        """How many of `rows` fed rows each row-prefill call takes, largest first: the split computing the fewest
        rows (`_rows_width` pads each call's), a call counting as half a row. Six rows are three calls of 4, 1
        and 1 rows rather than one of 16 (a server's requests arrive a few at a time)."""
        if (rows, batch) not in self._groups:
            best = [(0.0, [])]  # best[m]: (cost, group sizes) for m rows
            for m in range(1, rows + 1):
                best.append(
                    min(
                        (
                            (best[m - k][0] + self._rows_width(k, batch) + 0.5, [k, *best[m - k][1]])
                            for k in range(m, 0, -1)
                        ),
                        key=lambda option: option[0],
                    )
                )
            self._groups[rows, batch] = sorted(best[rows][1], reverse=True)
        return self._groups[rows, batch]

    def new_cache(self, batch: int, capacity: int | None = None) -> decoder.KVCache:
        """An empty cache for `batch` rows (rounded up to a bucket)."""
        capacity = min(capacity or self.min_cache, self.max_context)
        cache = decoder.init_cache(self.cfg, self._batch_size(batch), capacity, self.params["embed"].dtype)
        return self._place(cache)

    def _place(self, cache: decoder.KVCache) -> decoder.KVCache:
        layers = lambda arrays, name: tuple(self._put(a, name) for a in arrays)
        return decoder.KVCache(
            layers(cache.k, "cache"),
            layers(cache.v, "cache"),
            self._put(cache.lengths, "batch"),
            layers(cache.prefix_k, "prefix_cache"),
            layers(cache.prefix_v, "prefix_cache"),
            self._put(cache.prefix_slot, "batch"),
            self._put(cache.prefix_len, "batch"),
        )

    def _resize(self, cache: decoder.KVCache, capacity: int) -> decoder.KVCache:
        """`cache` with `capacity` positions in each row's own buffer (padded, or cut: rows must fit)."""
        pad = [(0, 0), (0, 0), (0, max(capacity - cache.max_len, 0)), (0, 0)]
        resized = lambda arrays: tuple(jnp.pad(a[:, :, :capacity], pad) for a in arrays)
        return self._place(cache.replace(k=resized(cache.k), v=resized(cache.v)))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        key: jax.Array,
        max_new_tokens=256,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        adapter_idx=lora_lib.NO_ADAPTER,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        cache: decoder.KVCache | None = None,
        rows: Sequence[int] | None = None,
        stream=None,
    ) -> tuple[list[Completion], decoder.KVCache]:
        """Appends prompts[i] to row rows[i] (a fresh cache and rows 0..n-1 by default) and samples.

        Sampling arguments are scalars or one value per prompt. Every prompt must be
        non-empty: a continuing row appends at least the next turn's tokens. `stream`: each
        prompt's random stream (default its row; see `Session.feed`).
        """
        n = len(prompts)
        if cache is None:
            cache, prompts = self._fresh_cache(
                prompts, _per_row(adapter_idx, n, np.int32), _per_row(max_new_tokens, n, np.int32)
            )
        rows = list(range(n)) if rows is None else [int(r) for r in rows]
        session = Session(self, cache, stop_token_ids=stop_token_ids, stop_strings=stop_strings)
        session.feed(
            rows,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            adapter_idx=adapter_idx,
            stream=stream,
        )
        done: dict[int, Completion] = {}
        while len(done) < n:
            done.update(session.step(key))
        return [done[r] for r in rows], session.cache

    def session(self, batch: int, **stops) -> Session:
        """A `Session` over a fresh cache of `batch` rows (see there; `stops`: stop_token_ids, stop_strings)."""
        return Session(self, self.new_cache(batch), **stops)

    def add_prefix(
        self, cache: decoder.KVCache, prefix: Sequence[int], adapter_idx: int
    ) -> tuple[decoder.KVCache, int]:
        """`cache` with `prefix` prefilled with adapter `adapter_idx` in a new prefix slot, and the slot."""
        slot = cache.num_slots
        return self._add_slots(cache, prefix, np.array([adapter_idx])), slot

    def start_row(self, cache: decoder.KVCache, row: int, slot: int = 0, length: int = 0) -> decoder.KVCache:
        """`cache` with `row` emptied to start a new sequence: after the first `length` positions of
        prefix slot `slot` (as if those tokens had been prefilled in it), or from scratch (length 0)."""
        return cache.replace(
            lengths=cache.lengths.at[row].set(0),
            prefix_slot=cache.prefix_slot.at[row].set(slot),
            prefix_len=cache.prefix_len.at[row].set(length),
        )

    def _fresh_cache(
        self, prompts: Sequence[Sequence[int]], adapter_idx: np.ndarray, max_new: np.ndarray
    ) -> tuple[decoder.KVCache, Sequence[Sequence[int]]]:
        """A cache for a fresh batch and what of each prompt is left to prefill: rows continuing
        the shared prefix (prefilled once per adapter, in prefix slots) when it is long enough,
        else empty rows."""
        lengths = [len(p) for p in prompts]
        shared = shared_prefix_length(prompts, self.min_shared_prefix)
        if not shared or max(lengths) >= self.max_context:  # a row that cannot fit must stay empty
            return self.new_cache(len(prompts)), prompts
        capacity = self._capacity(int(np.max(np.add(lengths, max_new))) - shared)
        groups, group_of_row = np.unique(adapter_idx, return_inverse=True)
        cache = self._add_slots(self.new_cache(len(prompts), capacity), prompts[0][:shared], groups)
        slot = np.zeros((cache.batch,), np.int32)
        slot[: len(prompts)] = group_of_row.reshape(-1)
        length = np.zeros((cache.batch,), np.int32)
        length[: len(prompts)] = shared
        cache = cache.replace(prefix_slot=self._put(slot, "batch"), prefix_len=self._put(length, "batch"))
        return cache, [p[shared:] for p in prompts]

    def _add_slots(self, cache: decoder.KVCache, prefix: Sequence[int], groups: np.ndarray) -> decoder.KVCache:
        """`cache` with one new prefix slot per adapter of `groups`, each holding `prefix` prefilled with it."""
        width = min(prefix_capacity(len(prefix)), self.max_context)
        prefilled = self.new_cache(len(groups), width)
        tokens = np.zeros((prefilled.batch, width), np.int32)
        tokens[: len(groups), : len(prefix)] = prefix
        num_new = np.zeros((prefilled.batch,), np.int32)
        num_new[: len(groups)] = len(prefix)
        group_adapter = np.full((prefilled.batch,), lora_lib.NO_ADAPTER, np.int32)
        group_adapter[: len(groups)] = groups
        _, prefilled = self._prefill(
            self.params,
            self.adapters,
            prefilled,
            self._put(tokens, "batch"),
            self._put(num_new, "batch"),
            self._put(group_adapter, "batch"),
        )
        rows = lambda arrays: tuple(a[: len(groups)] for a in arrays)  # the mesh may have padded the batch
        return self._place(decoder.add_prefix_slots(cache, prefilled.replace(k=rows(prefilled.k), v=rows(prefilled.v))))

    def _find_stop_string(self, ids: list[int], stop_strings: Sequence[str]) -> tuple[int, int] | None:
        """(tokens to keep, text length before the stop string) for the earliest stop string, if any."""
        text = self.detokenize(ids)
        hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
        if not hits:
            return None
        start = min(hits)
        end = min(start + len(s) for s in stop_strings if text.find(s) == start)
        keep = next(k for k in range(1, len(ids) + 1) if len(self.detokenize(ids[:k])) >= end)
        return keep, start


@dataclasses.dataclass(frozen=True)
class _Opening:
    """A first prompt that rows hold at the start of their own buffers (`length` positions), and the
    next-token logits after it: a row opening alike copies a holder instead of prefilling it again."""

    length: int
    logits: np.ndarray


class Session:
    """Rows of one cache that sample independently, for callers that feed rows at different times.

    `feed` appends tokens to some rows and starts them sampling (one prefill over those rows
    only); `step` decodes every sampling row for up to a chunk of tokens and returns the
    completions of the rows that finished, which may be fed again at once. A batch then never
    waits for its slowest row: the rollout engine gives a row its conversation's next turn, or a
    new conversation (`start`), as soon as its turn ends, and `release`s the rows of a finished
    one. The cache's capacity follows the rows: it grows as they lengthen and shrinks when the
    longest are released. `Sampler.generate` is one feed and steps until every row is done.
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
        self._stop_ids = jnp.asarray(sorted(set(stop_token_ids)) or [-1], jnp.int32)
        batch = cache.batch
        self._logits = sampler._put(np.zeros((batch, sampler.cfg.vocab_size), np.float32), "batch")
        self._settings = {
            "temperature": np.zeros((batch,), np.float32),
            "top_p": np.ones((batch,), np.float32),
            "top_k": np.zeros((batch,), np.int32),
            "stream": np.arange(batch, dtype=np.int32),
            "adapter_idx": np.full((batch,), lora_lib.NO_ADAPTER, np.int32),
        }
        self._remaining = np.zeros((batch,), np.int32)
        self._running = np.zeros((batch,), bool)
        self._start_len = np.zeros((batch,), np.int32)  # the row's own length when its turn began
        self._ids: dict[int, list[int]] = {}
        self._logp: dict[int, list[float]] = {}
        self._finish: dict[int, str] = {}
        self._done: dict[int, Completion] = {}  # finished rows not yet returned by `step`
        self._text_end: dict[int, int] = {}  # where a stop string cut a row's text
        self._row_stops: dict[int, tuple[str, ...]] = {}  # rows fed with stop strings of their own
        self._prefixes: dict[tuple, tuple[list[int], int]] = {}  # (adapter, group) -> (tokens, slot)
        self._openings: dict[tuple, _Opening] = {}  # (prefix slot, its length, adapter, tokens) -> held opening
        self._opening_of: dict[int, tuple] = {}  # row -> the key of the opening it holds
        # Where the time goes (for benchmarks): prefill calls, rows and tokens (and the stored prefixes'); decode
        # calls, steps and tokens.
        self.stats = collections.Counter()

    @property
    def running(self) -> bool:
        """Whether any row is sampling or has a completion `step` has not returned yet."""
        return bool(self._running.any() or self._done)

    def start(self, row: int, prompt: Sequence[int], adapter_idx: int = lora_lib.NO_ADAPTER, group: Any = None) -> int:
        """Empties `row` for a new conversation whose first prompt is `prompt`; returns how many of
        its leading tokens the row already holds (feed it the rest). Prompts of one (adapter,
        group) share the stored prefix of the group's first prompt (system prompts repeat: each
        is prefilled once per session) when they share `min_shared_prefix` tokens with it."""
        minimum, sampler = self.sampler.min_shared_prefix, self.sampler
        self._forget([row])
        if minimum is None or len(prompt) <= minimum:
            self.cache = sampler.start_row(self.cache, row)
            return 0
        if (adapter_idx, group) not in self._prefixes:
            tokens = list(prompt[:-1])  # the row must feed at least its last prompt token
            start = time.perf_counter()
            self.cache, slot = sampler.add_prefix(self.cache, tokens, adapter_idx)
            jax.block_until_ready(self.cache.k)
            self.stats.update(prefill_s=time.perf_counter() - start, prefix_prefills=1, prefix_tokens=len(tokens))
            self._prefixes[adapter_idx, group] = (tokens, slot)
        tokens, slot = self._prefixes[adapter_idx, group]
        shared = min(common_prefix_length([tokens, prompt]), len(prompt) - 1)
        if shared < minimum:
            self.cache = sampler.start_row(self.cache, row)
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
        if self._running[rows].any() or any(int(r) in self._done for r in rows):
            raise ValueError(f"rows {rows.tolist()} include a row whose turn has not been returned by step()")
        settings = {
            "temperature": _per_row(temperature, n, np.float32),
            "top_p": _per_row(top_p, n, np.float32),
            "top_k": _per_row(top_k, n, np.int32),
            "adapter_idx": _per_row(adapter_idx, n, np.int32),
            "stream": rows.astype(np.int32) if stream is None else _per_row(stream, n, np.int32),
        }
        max_new = _per_row(max_new_tokens, n, np.int32)
        lengths = np.asarray(self.cache.lengths)
        new_len = np.array([len(p) for p in prompts])
        fits = np.asarray(self.cache.sequence_lengths)[rows] + new_len < sampler.max_context  # prompt + a token
        # Room for the prompts and the first decode chunk; `step` grows the cache as rows go on.
        self._fit(np.where(fits, lengths[rows] + new_len + np.minimum(max_new, sampler.decode_chunk), 0))
        parts = [list(p) if ok else [] for p, ok in zip(prompts, fits)]
        firsts, copies = self._openings_fed(rows, parts, settings["adapter_idx"], lengths)
        for offset in range(0, max(map(len, parts)), sampler.prefill_chunk):
            # longest first, so that each call's rows have pieces of like lengths (each call pads to its longest)
            members = sorted(
                (i for i, p in enumerate(parts) if len(p) > offset and i not in copies), key=lambda i: -len(parts[i])
            )
            for size in sampler._row_groups(len(members), batch):
                group, members = members[:size], members[size:]
                self._prefill_chunk(
                    rows[group],
                    [parts[i][offset : offset + sampler.prefill_chunk] for i in group],
                    settings["adapter_idx"][group],
                )
        for key, i in firsts.items():
            self._hold(key, int(rows[i]), len(parts[i]))
        if copies:
            self._copy_openings(rows, copies)
        for name, values in settings.items():
            self._settings[name][rows] = values
        self._remaining[rows] = max_new
        self._running[rows] = fits & (max_new > 0)
        self._start_len[rows] = lengths[rows] + np.where(fits, new_len, 0)
        for i, (r, ok) in enumerate(zip(rows.tolist(), fits)):
            self._row_stops.pop(r, None)
            if stop_strings is not None:
                self._row_stops[r] = tuple(stop_strings[i])
            self._ids[r], self._logp[r] = [], []
            self._finish[r] = FINISH_LENGTH if ok else FINISH_CONTEXT
            if not self._running[r]:
                self._complete(r)

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
        width = sampler._rows_width(len(dst), batch)
        ids = lambda values: sampler._put(self._row_ids(values, width), "batch")
        lengths = np.zeros((width,), np.int32)
        lengths[: len(dst)] = [o.length for o in openings]
        logits = np.zeros((width, sampler.cfg.vocab_size), np.float32)
        logits[: len(dst)] = [o.logits for o in openings]
        k, v, all_lengths, self._logits = sampler._copy_rows(
            self.cache.k,
            self.cache.v,
            self.cache.lengths,
            self._logits,
            ids(src),
            ids(dst),
            sampler._put(lengths, "batch"),
            sampler._put(logits, "batch"),
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
        capacity = self.sampler._capacity(int(np.max(needed, initial=0)))
        if capacity > self.cache.max_len or (shrink and capacity < self.cache.max_len):
            self.cache = self.sampler._resize(self.cache, capacity)
            self.stats.update(resizes=1)

    def release(self, rows: Sequence[int]) -> None:
        """Empties `rows` (not sampling now) whose conversations are over, and shrinks the cache to
        what the remaining rows need."""
        rows = [int(r) for r in rows]
        if self._running[rows].any() or any(r in self._done for r in rows):
            raise ValueError(f"rows {rows} include a row whose turn has not been returned by step()")
        self._forget(rows)
        for r in rows:
            self.cache = self.sampler.start_row(self.cache, r)
        self._fit(self._needed(), shrink=True)

    def cancel(self, rows: Sequence[int]) -> None:
        """Stops `rows` wherever they are (sampling, or finished and not yet returned by `step`), drops what
        they sampled in this turn and empties them (a server's client that went away)."""
        rows = [int(r) for r in rows]
        for r in rows:
            self._running[r] = False
            self._done.pop(r, None)
            for state in (self._ids, self._logp, self._finish, self._text_end, self._row_stops):
                state.pop(r, None)
        self.release(rows)

    def partial(self, row: int) -> tuple[list[int], list[float]]:
        """The tokens (and logprobs) `row` has sampled so far in its running turn (streaming)."""
        return list(self._ids.get(row, ())), list(self._logp.get(row, ()))

    def keep(self, row: int, length: int) -> bool:
        """Cuts finished `row` to its first `length` positions, so that a next prompt sharing them feeds only the
        rest (a server's conversation reusing its cache); False, and the row unchanged, where `length` falls inside
        the prefix slot the row continues."""
        prefix = int(np.asarray(self.cache.prefix_len)[row])
        own = int(np.asarray(self.cache.lengths)[row])
        if self._running[row] or row in self._done:
            raise ValueError(f"row {row}'s turn has not been returned by step()")
        if length > prefix + own:
            raise ValueError(f"row {row} holds {prefix + own} positions: cannot keep {length}")
        if length < prefix:
            return False
        key = self._opening_of.get(row)
        if key is not None and length - prefix < self._openings[key].length:
            self._forget([row])
        self.cache = self.cache.replace(lengths=self.cache.lengths.at[row].set(length - prefix))
        return True

    def _needed(self) -> np.ndarray:
        """Per row: the own positions it holds, and for a sampling row those of its next decode chunk."""
        chunk = np.where(self._running, np.minimum(self._remaining, self.sampler.decode_chunk), 0)
        return np.asarray(self.cache.lengths) + chunk

    def _prefill_chunk(self, rows: np.ndarray, pieces: list[list[int]], adapter_idx: np.ndarray) -> None:
        """Appends pieces[i] (at most `prefill_chunk` tokens) to row rows[i], in one call over those
        rows only (taken out of the cache, prefilled, put back)."""
        sampler, n, batch = self.sampler, len(rows), self.cache.batch
        width = sampler._rows_width(n, batch)
        row_ids = self._row_ids(rows, width)
        longest = max(map(len, pieces))  # positions: a power of two from MIN_PIECE to the chunk
        tokens = np.zeros((width, min(max(power_of_two(longest), MIN_PIECE), sampler.prefill_chunk)), np.int32)
        for i, piece in enumerate(pieces):
            tokens[i, : len(piece)] = piece
        num_new = np.zeros((width,), np.int32)
        num_new[:n] = [len(piece) for piece in pieces]
        row_adapter = np.full((width,), lora_lib.NO_ADAPTER, np.int32)
        row_adapter[:n] = adapter_idx
        put, start, cache = sampler._put, time.perf_counter(), self.cache
        reach = int(np.max(np.asarray(cache.lengths)[rows] + num_new[:n]))  # own positions filled after the feed
        window = min(sampler._capacity(reach), cache.max_len)
        row_ids = put(row_ids, "batch")
        k, v, row_lengths, prefix_slot, prefix_len = sampler._take_rows(
            cache.k, cache.v, cache.lengths, cache.prefix_slot, cache.prefix_len, row_ids, window=window
        )
        taken = cache.replace(k=k, v=v, lengths=row_lengths, prefix_slot=prefix_slot, prefix_len=prefix_len)
        row_logits, taken = sampler._prefill_rows(
            sampler.params,
            sampler.adapters,
            taken,
            put(tokens, "batch"),
            put(num_new, "batch"),
            put(row_adapter, "batch"),
        )
        k, v, all_lengths, self._logits = sampler._put_rows(
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
        )

    def step(self, key: jax.Array, *, return_early: bool = False) -> dict[int, Completion]:
        """Decodes every sampling row for up to `decode_chunk` tokens (with `return_early`, until the
        first row finishes) and returns {row: completion} of the rows that finished since the last step.
        Each token is drawn with `row_keys(key, stream, position)`: pass the same `key` at every step."""
        if self._running.any():
            self._fit(self._needed())
            sampler, put, start = self.sampler, self.sampler._put, time.perf_counter()
            sampling = tuple(put(self._settings[name], "batch") for name in ("temperature", "top_p", "top_k", "stream"))
            step_tokens, step_logp, self._logits, self.cache, count, code = sampler._decode(
                sampler.params,
                sampler.adapters,
                self.cache,
                self._logits,
                key,
                sampling,
                self._stop_ids,
                put(self._remaining, "batch"),
                put(~self._running, "batch"),
                put(self._settings["adapter_idx"], "batch"),
                jnp.asarray(return_early),
            )
            step_tokens, step_logp, count, code = map(np.asarray, (step_tokens, step_logp, count, code))
            self.stats.update(
                decode_s=time.perf_counter() - start,
                decode_calls=1,
                decode_steps=int((step_tokens >= 0).any(axis=0).sum()),
                decode_tokens=int(count.sum()),
            )
            for r in np.flatnonzero(self._running).tolist():
                self._ids[r].extend(step_tokens[r, : count[r]].tolist())
                self._logp[r].extend(step_logp[r, : count[r]].tolist())
                self._remaining[r] -= count[r]
                if code[r]:
                    self._finish[r] = _FINISH_NAMES[int(code[r])]
                if (self._row_stops.get(r, self.stop_strings) and self._cut_at_stop_string(r)) or code[r]:
                    self._complete(r)
        done, self._done = self._done, {}
        return done

    def _cut_at_stop_string(self, r: int) -> bool:
        """Ends row r's turn at a stop string in its output, if there is one (the cache forgets what follows)."""
        cut = self.sampler._find_stop_string(self._ids[r], self._row_stops.get(r, self.stop_strings))
        if cut is None:
            return False
        keep, self._text_end[r] = cut
        del self._ids[r][keep:], self._logp[r][keep:]
        self._finish[r] = FINISH_STOP
        self.cache = self.cache.replace(lengths=self.cache.lengths.at[r].set(int(self._start_len[r]) + keep))
        return True

    def _complete(self, r: int) -> None:
        self._running[r] = False
        self._row_stops.pop(r, None)
        text = None
        if self.sampler.detokenize is not None:
            text = self.sampler.detokenize(self._ids[r])[: self._text_end.pop(r, None)]
        self._done[r] = Completion(self._ids.pop(r), self._logp.pop(r), self._finish.pop(r), text)
