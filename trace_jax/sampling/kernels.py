"""The sampler's device programs, as pure functions of the weights, the KV cache and per-row arrays: prefill
(appending each row's new tokens), the row moves a `Session` feeds rows through (take rows out of the cache, put
them back, copy one row's buffers to another), the decode loop, the fused loop that feeds and decodes rows in
the same steps (`FusedSession`), and the cache resize. `Programs` holds them jitted for one model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from trace_jax import lora as lora_lib
from trace_jax.models import decoder
from trace_jax.models.config import ModelConfig
from trace_jax.sampling.draws import row_keys, sample_from_logits


def prefill(params, adapters, cache, tokens, num_new, adapter_idx, *, cfg, constrain):
    """Appends each row's first num_new[b] tokens; returns logits after each row's last one."""
    row_lora = lora_lib.for_rows(adapters, adapter_idx)
    hidden, cache = decoder.forward_hidden(
        params, tokens, cfg, row_lora=row_lora, cache=cache, num_new=num_new, constrain=constrain
    )
    last = jnp.take_along_axis(hidden, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)
    return decoder.logits_from_hidden(params, last, cfg)[:, 0], cache


def take_rows(k, v, lengths, prefix_slot, prefix_len, row_ids, *, window):
    """Rows `row_ids` of a cache (ids >= the batch give empty padding rows): the first `window`
    positions of their own buffers in every layer, their lengths and prefixes. A turn's prefill then
    reads and writes those rows only, and only as far as they reach, not the whole batch at the
    cache's capacity (attention and the row moves cost rows x positions)."""
    row = lambda a: a.at[row_ids].get(mode="fill", fill_value=0)
    own = lambda a: a[:, :, :window].at[row_ids].get(mode="fill", fill_value=0)
    return tuple(map(own, k)), tuple(map(own, v)), row(lengths), row(prefix_slot), row(prefix_len)


def put_rows(k, v, lengths, logits, row_ids, rows_k, rows_v, rows_lengths, row_logits):
    """Writes rows taken by `take_rows` (and since prefilled) back into their window, with their
    next-token logits; padding ids are dropped."""
    row = lambda a, b: a.at[row_ids].set(b, mode="drop")
    own = lambda a, b: a.at[row_ids, :, : b.shape[2]].set(b, mode="drop")
    return tuple(map(own, k, rows_k)), tuple(map(own, v, rows_v)), row(lengths, rows_lengths), row(logits, row_logits)


def resize(k, v, *, capacity):
    """Every layer's own buffers with `capacity` positions: padded with zeros, or cut (rows must fit)."""
    fit = lambda a: jnp.pad(a[:, :, :capacity], [(0, 0), (0, 0), (0, max(capacity - a.shape[2], 0)), (0, 0)])
    return tuple(map(fit, k)), tuple(map(fit, v))


def copy_rows(k, v, lengths, logits, src, dst, dst_lengths, dst_logits):
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


def _finish_code(hit_stop, count, remaining, sequence_lengths, max_context):
    """Per row, after it drew a token: 1 at a stop, 2 at its `remaining` tokens, 3 at the context limit, else 0
    (running); the first that holds."""
    hit_context = sequence_lengths + 1 >= max_context
    return jnp.where(hit_stop, 1, jnp.where(count >= remaining, 2, jnp.where(hit_context, 3, 0)))


class DecodeRows(NamedTuple):
    """What the decode loop reads per row, one [B] array each: the sampling settings, the random stream
    (`row_keys`), the adapter, how many tokens the row may still draw, and whether it is idle (done)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    stream: jax.Array
    adapter_idx: jax.Array
    remaining: jax.Array
    done: jax.Array


def decode(
    params,
    adapters,
    cache,
    logits,
    key,
    rows: DecodeRows,
    stop_ids,
    return_early,
    *,
    cfg,
    constrain,
    steps,
    max_context,
):
    """Samples up to `steps` tokens for each row not `rows.done`, feeding each back through the cache;
    with `return_early`, returns as soon as a row finishes (so its next turn can be fed).

    Every sampled token (stop tokens included) is written to the cache, so a row can
    later continue after it. Returns tokens and logprobs [B, steps] (-1 / 0 past a
    row's end), the next logits, the cache, and per row: tokens generated and a
    finish code (0 running, 1 stop token, 2 length, 3 context full).
    """
    temperature, top_p, top_k, streams, adapter_idx, remaining, done = rows
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
        code = _finish_code(hit_stop, count, remaining, cache.sequence_lengths, max_context)
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


# Stop strings the fused loop detects on the device, per row: up to STOP_FORMS token forms of up to STOP_FORM_TOKENS
# tokens each (a stop string's encoding); the host detects every stop string in the text all the same.
STOP_FORMS = 4
STOP_FORM_TOKENS = 8
FORM_ANY = -1  # a form's position that matches any token (forms are right-aligned)
FORM_NONE = -2  # fills an unused form: it matches no token
RECENT_NONE = -3  # a recent-token slot before the turn's first token


class FeedRows(NamedTuple):
    """What the fused loop feeds and watches per row: `tokens` [B, W] to append before sampling (`length` [B] of
    them; `more` [B]: the row has further tokens to feed in a later call, so it idles once these are in), the
    turn's last sampled tokens `recent` [B, L] (RECENT_NONE before its first) and its stop strings' token forms
    `forms` [B, STOP_FORMS, L] (right-aligned, FORM_ANY before a form's first token, FORM_NONE where unused)."""

    tokens: jax.Array
    length: jax.Array
    more: jax.Array
    recent: jax.Array
    forms: jax.Array


def fused(
    params,
    adapters,
    cache,
    logits,
    key,
    rows: DecodeRows,
    feed: FeedRows,
    stop_ids,
    *,
    cfg,
    constrain,
    steps,
    chunk,
    max_context,
    batch_multiple,
):
    """Up to `steps` steps over every row not `rows.done`: a row with tokens to feed appends up to `chunk` of them
    per step (its prompt rides along the decoding rows' steps: chunked prefill), then samples as in `decode`, its
    first token from the logits after its last fed one. A step without fed tokens computes [B, 1] positions. A
    step in which at most `feed_lanes(B, batch_multiple)` rows feed takes those rows out of the cache and computes
    [lanes, chunk] positions for them and [B, 1] for the decoding rows (two passes over the weights, which
    accelerators read fast, for a fraction of the positions); a step in which more rows feed computes [B, chunk].
    Rows end at a stop token, at a stop string's token form (`feed.forms`), at their `remaining` tokens or at the
    context limit, and idle until the call returns, which it does after `steps` steps or when every row is done.
    Returns what `decode` does (tokens written from each row's first column), the steps it ran, and how many of
    them fed rows in lanes and in full."""
    temperature, top_p, top_k, streams, adapter_idx, remaining, done = rows
    row_lora = lora_lib.for_rows(adapters, adapter_idx)
    batch, width = feed.tokens.shape
    offsets = jnp.arange(chunk)
    lanes = feed_lanes(batch, batch_multiple)

    def forward(tokens, num_new, cache, lora=row_lora):
        hidden, cache = decoder.forward_hidden(
            params, tokens, cfg, row_lora=lora, cache=cache, num_new=num_new, constrain=constrain
        )
        last = jnp.take_along_axis(hidden, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)
        return last, cache

    def in_lanes(cache, tokens, fed_tokens, num_fed, feeding, active):
        """The feeding rows (all within `lanes`) append their tokens, taken out of the cache, while the decoding rows
        append their sampled one; the fed rows then go back (`put_rows`), replacing what the decoding pass left in
        them."""
        ids = jnp.argsort(~feeding, stable=True)[:lanes]
        ids = jnp.where(feeding[ids], ids, batch)  # past the batch: padding, read as empty and written nowhere
        k, v, lengths, prefix_slot, prefix_len = take_rows(
            cache.k, cache.v, cache.lengths, cache.prefix_slot, cache.prefix_len, ids, window=cache.max_len
        )
        taken = cache.replace(k=k, v=v, lengths=lengths, prefix_slot=prefix_slot, prefix_len=prefix_len)
        lane = lambda a, fill=0: a.at[ids].get(mode="fill", fill_value=fill)
        lane_lora = lora_lib.for_rows(adapters, lane(adapter_idx, lora_lib.NO_ADAPTER))
        fed_last, taken = forward(lane(fed_tokens), lane(num_fed), taken, lane_lora)
        last, cache = forward(tokens[:, None], active.astype(jnp.int32), cache)  # the lanes' rows idle here
        k, v, lengths, last = put_rows(
            cache.k, cache.v, cache.lengths, last, ids, taken.k, taken.v, taken.lengths, fed_last
        )
        return last, cache.replace(k=k, v=v, lengths=lengths)

    def cond(state):
        step, _, _, _, _, done, *_ = state
        return (step < steps) & ~jnp.all(done)

    def body(state):
        step, cache, logits, fed, count, done, recent, out_tokens, out_logp, finish, fed_steps = state
        feeding = ~done & (fed < feed.length)
        active = ~done & ~feeding
        keys = row_keys(key, streams, cache.sequence_lengths)
        tokens, logp = sample_from_logits(logits, keys, temperature, top_p, top_k)
        column = jnp.where(active, count, steps)  # out of range: dropped
        out_tokens = out_tokens.at[jnp.arange(batch), column].set(tokens, mode="drop")
        out_logp = out_logp.at[jnp.arange(batch), column].set(logp, mode="drop")
        count = count + active
        recent = jnp.where(active[:, None], jnp.concatenate([recent[:, 1:], tokens[:, None]], axis=1), recent)
        form_hit = jnp.all((feed.forms == FORM_ANY) | (feed.forms == recent[:, None, :]), axis=-1).any(axis=-1)
        hit_stop = jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1) | form_hit
        code = _finish_code(hit_stop, count, remaining, cache.sequence_lengths, max_context)
        finish = jnp.where(active, code, finish)
        fed_now = jnp.where(feeding, jnp.minimum(feed.length - fed, chunk), 0)
        at = jnp.minimum(fed[:, None] + offsets[None, :], width - 1)
        fed_tokens = jnp.take_along_axis(feed.tokens, at, axis=1)

        def decoding_only(cache):
            return forward(tokens[:, None], active.astype(jnp.int32), cache)

        def lanes_and_decoding(cache):
            return in_lanes(cache, tokens, fed_tokens, fed_now, feeding, active)

        def in_full(cache):
            sampled = jnp.where(offsets[None, :] == 0, tokens[:, None], 0)
            return forward(jnp.where(feeding[:, None], fed_tokens, sampled), fed_now + active, cache)

        feeding_rows = jnp.sum(feeding)
        branch = jnp.where(feeding_rows == 0, 0, jnp.where(feeding_rows <= lanes, 1, 2))
        if lanes:
            last, cache = jax.lax.switch(branch, (decoding_only, lanes_and_decoding, in_full), cache)
        else:
            last, cache = jax.lax.cond(branch > 0, in_full, decoding_only, cache)
        moved = active | feeding
        logits = jnp.where(moved[:, None], decoder.logits_from_hidden(params, last, cfg)[:, 0], logits)
        fed = fed + fed_now
        done = done | (finish > 0) | (feeding & (fed >= feed.length) & feed.more)
        fed_steps = fed_steps.at[branch].add(1)
        return step + 1, cache, logits, fed, count, done, recent, out_tokens, out_logp, finish, fed_steps

    init = (
        jnp.int32(0),
        cache,
        logits,
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch,), jnp.int32),
        done,
        feed.recent,
        jnp.full((batch, steps), -1, jnp.int32),
        jnp.zeros((batch, steps), jnp.float32),
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((3,), jnp.int32),
    )
    ran, cache, logits, _, count, _, _, out_tokens, out_logp, finish, fed_steps = jax.lax.while_loop(cond, body, init)
    # placed as the logits come in (rows over the batch axes), so that the next call's program is this one
    return out_tokens, out_logp, constrain(logits, "batch"), cache, count, finish, ran, fed_steps[1:]


FEED_LANE_SHARE = 4  # a fused step feeds in lanes when at most this share of its rows feed


def feed_lanes(batch: int, batch_multiple: int) -> int:
    """How many rows a fused step feeds apart from the decoding rows: a quarter of the batch, rounded down to a
    multiple of the mesh's batch axes (so the lanes shard as rows do) and at least one such multiple; 0 (no lanes)
    where that is the whole batch."""
    lanes = max(batch // FEED_LANE_SHARE // batch_multiple * batch_multiple, batch_multiple)
    return lanes if lanes < batch else 0


@dataclasses.dataclass
class Programs:
    """The kernels jitted for one model and mesh (`constrain`): `prefill` donates the cache it appends to (a fresh
    batch's, a prefix slot's); `prefill_rows` prefills rows taken out of a cache, which share its prefix slots
    and so donate nothing; the row moves donate the cache they write; `decode` and `fused` run `steps` steps a
    call (`fused` feeding `chunk` tokens a step) and donate the cache; `resize` makes new buffers (of another shape)."""

    prefill: Callable
    prefill_rows: Callable
    take_rows: Callable
    put_rows: Callable
    copy_rows: Callable
    decode: Callable
    fused: Callable
    resize: Callable

    @classmethod
    def compile(
        cls, cfg: ModelConfig, constrain: Callable, steps: int, chunk: int, max_context: int, batch_multiple: int
    ) -> Programs:
        """The kernels for these arguments: a sampler's own `Programs`, holding the jitted functions that every
        sampler of the same model in the process shares (`_jitted`)."""
        return cls(**_jitted(cfg, constrain, steps, chunk, max_context, batch_multiple))


@functools.lru_cache(maxsize=8)
def _jitted(
    cfg: ModelConfig, constrain: Callable, steps: int, chunk: int, max_context: int, batch_multiple: int
) -> dict[str, Callable]:
    """The kernels jitted once a process for these arguments: a job's samplers (its evaluations, calibration
    tries, GRPO's) run the same jitted functions and so the same compiled programs (jitting the kernels anew
    compiles some programs again and holds both copies)."""
    fill = functools.partial(prefill, cfg=cfg, constrain=constrain)
    loop = dict(cfg=cfg, constrain=constrain, steps=steps, max_context=max_context)
    return dict(
        prefill=jax.jit(fill, donate_argnums=(2,)),
        prefill_rows=jax.jit(fill),
        take_rows=jax.jit(take_rows, static_argnames="window"),
        put_rows=jax.jit(put_rows, donate_argnums=(0, 1, 2, 3)),
        copy_rows=jax.jit(copy_rows, donate_argnums=(0, 1, 2, 3)),
        decode=jax.jit(functools.partial(decode, **loop), donate_argnums=(2,)),
        fused=jax.jit(
            functools.partial(fused, chunk=chunk, batch_multiple=batch_multiple, **loop), donate_argnums=(2,)
        ),
        resize=jax.jit(resize, static_argnames="capacity"),
    )
