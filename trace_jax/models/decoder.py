"""The decoder forward pass: one pure function for Llama, Qwen2, Qwen3 and Gemma 3.

Parameters are a plain pytree with one dict per layer (`params["layers"]` is a
list), and each layer has its own KV-cache buffers: a layer reads and updates its
cache in place, with no slicing of stacked arrays (which XLA:CPU copies, and which
cost a quarter of the decode time here). Each row's LoRA adapter is picked by a
per-row mix over the stacked adapters (see `adapters.for_rows`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.models.adapters import row_delta
from trace_jax.models.config import ModelConfig

Params = dict
# Constrains an activation's sharding: (array, logical name) -> array.
Constrain = Callable[[jax.Array, str], jax.Array]


def no_constraint(x: jax.Array, _: str) -> jax.Array:
    """The default `Constrain`: leaves placement to XLA (single device, or no rules)."""
    return x


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for each row, plus the shared prefixes rows continue from.

    k, v: one [batch, kv_heads, max_len, head_dim] array per layer (head-major, so
    attention reads each head's keys contiguously): each row's own positions;
    lengths: [batch] int32, how many of them are filled.
    prefix_k, prefix_v: one [slots, kv_heads, prefix_len, head_dim] array per layer: shared
    prefixes (system prompts) stored once; row b continues the first prefix_len[b] positions
    of slot prefix_slot[b] (prefix_len 0: no prefix), so its own position j is absolute
    position prefix_len[b] + j. Attention reads a slot once for all its rows ("cascade"
    attention) instead of once per row from per-row copies.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    prefix_k: tuple[jax.Array, ...]
    prefix_v: tuple[jax.Array, ...]
    prefix_slot: jax.Array
    prefix_len: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def num_slots(self) -> int:
        return self.prefix_k[0].shape[0]

    @property
    def sequence_lengths(self) -> jax.Array:
        """Each row's whole length: its prefix and its own positions."""
        return self.prefix_len + self.lengths


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache (all rows of length 0) with no prefix slots."""

    def zeros(shape):
        return tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # distinct buffers (donated)

    own = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    none = (0, cfg.num_kv_heads, 0, cfg.head_dim)
    rows = lambda: jnp.zeros((batch,), jnp.int32)
    return KVCache(zeros(own), zeros(own), rows(), zeros(none), zeros(none), rows(), rows())


def add_prefix_slots(cache: KVCache, prefixes: KVCache) -> KVCache:
    """`cache` with the rows of `prefixes` (prefilled, with no prefix of their own) appended as
    prefix slots (numbered after the existing ones); the slot length is the longest of both."""
    length = max(cache.prefix_k[0].shape[2], prefixes.max_len)
    pad = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, length - a.shape[2]), (0, 0)])
    join = lambda old, new: tuple(jnp.concatenate([pad(o), pad(n)]) for o, n in zip(old, new))
    return cache.replace(prefix_k=join(cache.prefix_k, prefixes.k), prefix_v=join(cache.prefix_v, prefixes.v))


def rope_inverse_frequencies(cfg: ModelConfig, local: bool = False) -> jax.Array:
    """Rotary inverse frequencies, with Llama 3 long-context scaling when configured (`local`: a Gemma 3
    sliding-window layer's, from its own base and unscaled)."""
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))
    s = None if local else cfg.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, num_positions: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotary angles of positions 0..num_positions-1, [num_positions, head_dim / 2].

    NumPy constants, computed when the program is traced, so each layer only looks its
    positions up: computed in the program, XLA fused the cos/sin into every layer's q and k
    kernels and evaluated them once per element (4% of a learner step here).
    """
    with jax.ensure_compile_time_eval():
        inv_freq = np.asarray(rope_inverse_frequencies(cfg, local), np.float32)
    angles = np.arange(num_positions, dtype=np.float32)[:, None] * inv_freq
    return np.cos(angles), np.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates [B, T, heads, head_dim] by its positions' cos and sin, [B, T, 1, head_dim / 2]
    (HF's rotate-half layout)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False) -> jax.Array:
    """RMSNorm in fp32, cast back before the weight (as transformers does); with `offset` (Gemma), scaled by
    (1 + weight) in fp32 and cast back after."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def _linear(x: jax.Array, layer: Params, name: str, lora: tuple | None) -> jax.Array:
    """x @ W (+ bias) (+ each row's LoRA delta: ((x @ A) * the row's mix) @ B, over the N stacked adapters)."""
    proj = layer[name]
    y = x @ proj["kernel"]
    if "bias" in proj:
        y = y + proj["bias"]
    if lora is not None and name in lora[1]:
        mix, weights = lora  # [B, N]; {"a": [N, in, r], "b": [N, r, out]} of this layer
        y = y + row_delta(x, weights[name]["a"], weights[name]["b"], mix)
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _softmax_combine(combine: Callable, scores: jax.Array, values: tuple) -> jax.Array:
    """combine(softmax(scores), values), for a `combine` that gives each score row's output as
    a probability-weighted sum of value vectors (out[..., t, :] = sum_s p[..., t, s] * V_s).

    The backward uses flash attention's identity sum_s(dp * p) = sum(dout * out) over the
    head dim: autodiff's softmax backward reduced over the keys inside the dp matmul, a
    fusion XLA:CPU ran at a fraction of the matmul rate (5% of a learner step here).
    """
    return _softmax_combine_fwd(combine, scores, values)[0]


def _softmax_combine_fwd(combine, scores, values):
    probs = jax.nn.softmax(scores, axis=-1)
    out = combine(probs, values)
    return out, (probs, values, out)


def _softmax_combine_bwd(combine, residuals, d_out):
    probs, values, out = residuals
    _, combine_vjp = jax.vjp(combine, probs, values)  # combine is linear: its forward is not rerun
    d_probs, d_values = combine_vjp(d_out)
    row_dot = jnp.sum(d_out * out, axis=-1, keepdims=True)
    return probs * (d_probs - row_dot), d_values


_softmax_combine.defvjp(_softmax_combine_fwd, _softmax_combine_bwd)


def _attention(q, k, v, q_pos, k_pos, k_valid, prefix=None, scale=None, window=None):
    """Grouped-query attention. q: [B,T,H,hd]; k, v: [B,KV,S,hd]; masks by absolute position. `scale`: of the
    scores (default hd ** -0.5). `window` (a local layer's, or None): a query attends to the keys of its last
    `window` positions only, itself included.

    `prefix` (pk, pv [G,KV,P,hd], valid [B, G*P]) adds keys every row may attend to where
    `valid`: the shared prefix slots, all before the rows' own positions. Their scores are
    one matmul of all rows' queries against the G slots (read once, not once per row) and
    share one softmax with the row's own keys. Batch and kv-head dims are merged into one
    dot batch dim: XLA:CPU runs that far faster than a dot with two batch dims.
    """
    batch, t, num_heads, hd = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    groups = num_heads // kv_heads
    q = q.reshape(batch, t, kv_heads, groups, hd).transpose(0, 2, 3, 1, 4)  # [B, KV, g, T, hd]
    rows = lambda x: x.reshape(batch * kv_heads, -1, x.shape[-1])
    heads = lambda x: x.swapaxes(0, 1).reshape(kv_heads, -1, x.shape[-1])  # [KV, B*..., last]
    dot = lambda a, b, contract: jax.lax.dot_general(
        a, b, (((2,), (contract,)), ((0,), (0,))), preferred_element_type=jnp.float32
    )
    scale = hd**-0.5 if scale is None else scale
    scores = dot(rows(q), rows(k), 2).reshape(batch, kv_heads, groups, t, s) * scale
    mask = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)

    def own(probs, v):  # [B, KV, g, T, S] x [B, KV, S, hd] -> [B, KV, g, T, hd]
        return dot(rows(probs.astype(v.dtype)), rows(v), 1).reshape(batch, kv_heads, groups, t, hd)

    if prefix is None:
        out = _softmax_combine(lambda probs, values: own(probs, values[0]), scores, (v,))
    else:
        pk, pv, valid = prefix
        slots = pk.shape[0] * pk.shape[2]
        p_scores = dot(heads(q), heads(pk), 2).reshape(kv_heads, batch, groups, t, slots).swapaxes(0, 1) * scale
        p_mask = jnp.broadcast_to(valid[:, None, :], (batch, t, slots))  # [B, T, slots]
        if window is not None:  # a slot's positions are absolute: a prefix starts at 0
            p_pos = jnp.arange(slots) % pk.shape[2]
            p_mask &= p_pos[None, None, :] > q_pos[:, :, None] - window
        p_scores = jnp.where(p_mask[:, None, None], p_scores, jnp.finfo(jnp.float32).min)

        def own_and_prefix(probs, values):
            p_out = dot(heads(probs[..., :slots].astype(values[1].dtype)), heads(values[1]), 1)
            return own(probs[..., slots:], values[0]) + p_out.reshape(kv_heads, batch, groups, t, hd).swapaxes(0, 1)

        out = _softmax_combine(own_and_prefix, jnp.concatenate([p_scores, scores], axis=-1), (v, pv))
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, t, num_heads * hd)


def _prefix_valid(cache: KVCache) -> jax.Array:
    """[B, slots * prefix_len]: which prefix positions each row continues (its slot, up to its length)."""
    slots, length = cache.num_slots, cache.prefix_k[0].shape[2]
    slot = jnp.arange(slots * length) // length
    position = jnp.arange(slots * length) % length
    return (slot[None, :] == cache.prefix_slot[:, None]) & (position[None, :] < cache.prefix_len[:, None])


def _write_cache(layer_cache, new, positions, write_mask):
    """Scatters new [B,T,KV,hd] into one layer's cache [B,KV,S,hd] at (row, :, position in the row's buffer).

    Masked entries get an out-of-range position and are dropped.
    """
    batch, t = positions.shape
    pos = jnp.where(write_mask, positions, layer_cache.shape[2])
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, t))
    return layer_cache.at[rows, :, pos].set(new.astype(layer_cache.dtype), mode="drop")


def forward_hidden(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    *,
    row_lora: Params | None = None,
    cache: KVCache | None = None,
    num_new: jax.Array | None = None,
    constrain: Constrain = no_constraint,
    remat: bool = False,
    start_layer: int = 0,
    stop_layer: int | None = None,
    hidden: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Final-norm hidden states [B, T, D] and the updated cache.

    A partial pass runs layers start_layer .. stop_layer - 1 only: it starts from `hidden`
    (the residual stream entering start_layer, [B, T, D]; `tokens` then gives only the
    shape) and, with stop_layer < num_layers, returns the residual stream leaving the last
    layer it ran, without the final norm. Such a pass writes its layers' cache entries but
    leaves `cache.lengths` alone, so the pass through the remaining layers continues at the
    same positions (the pass that ends at the last layer advances them).

    Without a cache, each row's tokens sit at positions 0..T-1 and attend causally among
    themselves. With a cache, row b's first `num_new[b]` tokens are
    appended after its prefix and its `cache.lengths[b]` cached ones; the rest of the row
    is padding.
    `row_lora` is `adapters.for_rows(adapters, adapter_idx)`: {"mix": [B, N], "weights": {target:
    {"a": [L, N, in, r], "b": [L, N, r, out]}}}.
    """
    batch, t = tokens.shape
    if cache is not None:
        num_new = jnp.full((batch,), t, jnp.int32) if num_new is None else num_new
        buffer_pos = jnp.arange(cache.max_len, dtype=jnp.int32)  # in each row's own buffer
        write_pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        positions = cache.prefix_len[:, None] + write_pos  # absolute: after the row's prefix
        write_mask = jnp.arange(t)[None, :] < num_new[:, None]
        k_pos = cache.prefix_len[:, None] + buffer_pos[None, :]
        k_valid = buffer_pos[None, :] < (cache.lengths + num_new)[:, None]
        prefix_valid = _prefix_valid(cache) if cache.num_slots else None
        num_positions = cache.prefix_k[0].shape[2] + cache.max_len
    else:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
        num_positions = t
    lookup = lambda local: tuple(  # [B, T, 1, hd/2]
        jnp.asarray(table)[positions][:, :, None, :] for table in rope_tables(cfg, num_positions, local)
    )
    rope = lookup(False) + (lookup(True) if cfg.has_local_layers else ())
    if cache is None:
        write_pos = write_mask = k_pos = k_valid = prefix_valid = None
    # What every layer reads besides its own weights and cache: arguments of the jitted layer below, not closures.
    ctx = (rope, positions, write_pos, write_mask, k_pos, k_valid, prefix_valid)
    norm = functools.partial(rms_norm, eps=cfg.rms_norm_eps, offset=cfg.norm_offset)
    act = functools.partial(jax.nn.gelu, approximate=True) if cfg.activation == "gelu_tanh" else jax.nn.silu

    def layer_fn(x, layer, lora, layer_k, layer_v, prefix_k, prefix_v, local, ctx):
        """One layer; `local` (a bool scalar, or None for a model without local layers): a sliding-window layer."""
        rope, positions, write_pos, write_mask, k_pos, k_valid, prefix_valid = ctx
        cos, sin = rope[:2]
        window = None
        if local is not None:  # Gemma 3: a local layer's own rope base and window (global: one no position passes)
            cos, sin = jnp.where(local, rope[2], cos), jnp.where(local, rope[3], sin)
            window = jnp.where(local, cfg.sliding_window, jnp.iinfo(jnp.int32).max // 2)
        h = norm(x, layer["attn_norm"])
        q = _linear(h, layer, "q_proj", lora).reshape(batch, t, cfg.num_heads, cfg.head_dim)
        k = _linear(h, layer, "k_proj", lora).reshape(batch, t, cfg.num_kv_heads, cfg.head_dim)
        v = _linear(h, layer, "v_proj", lora).reshape(batch, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = norm(q, layer["q_norm"])
            k = norm(k, layer["k_norm"])
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        scale = cfg.attention_scale
        if layer_k is None:
            keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            attn = _attention(
                q, keys, values, positions, positions, jnp.ones((batch, t), bool), scale=scale, window=window
            )
        else:
            layer_k = _write_cache(layer_k, k, write_pos, write_mask)
            layer_v = _write_cache(layer_v, v, write_pos, write_mask)
            attn = _attention(
                q,
                layer_k,
                layer_v,
                positions,
                k_pos,
                k_valid,
                None if prefix_valid is None else (prefix_k, prefix_v, prefix_valid),
                scale=scale,
                window=window,
            )
        out = _linear(attn, layer, "o_proj", lora)
        x = constrain(x + (norm(out, layer["post_attn_norm"]) if cfg.sandwich_norms else out), "hidden")
        h = norm(x, layer["mlp_norm"])
        gated = act(_linear(h, layer, "gate_proj", lora)) * _linear(h, layer, "up_proj", lora)
        out = _linear(constrain(gated, "mlp"), layer, "down_proj", lora)
        x = constrain(x + (norm(out, layer["post_mlp_norm"]) if cfg.sandwich_norms else out), "hidden")
        return x, layer_k, layer_v

    stop_layer = cfg.num_layers if stop_layer is None else stop_layer
    if not 0 <= start_layer < stop_layer <= cfg.num_layers:
        raise ValueError(f"layers {start_layer}..{stop_layer} are not a range of the model's {cfg.num_layers}")
    if (hidden is None) != (start_layer == 0):
        raise ValueError("a pass starting after layer 0 takes `hidden` (and only such a pass does)")
    ids = range(start_layer, stop_layer)
    if hidden is None:
        hidden = params["embed"][tokens]
        if cfg.embed_scale != 1.0:
            hidden = hidden * jnp.asarray(cfg.embed_scale, hidden.dtype)
    x = constrain(hidden, "hidden")
    locals_ = [jnp.asarray(cfg.local_layers[i]) for i in ids] if cfg.has_local_layers else [None] * len(ids)
    layers = params["layers"][start_layer:stop_layer]
    if row_lora is not None:
        row_lora = {
            "mix": row_lora["mix"],
            "weights": jax.tree.map(lambda w: w[start_layer:stop_layer], row_lora["weights"]),
        }
    caches = (
        None
        if cache is None
        else [tuple(c[i] for i in ids) for c in (cache.k, cache.v, cache.prefix_k, cache.prefix_v)]
    )
    if remat:
        x, new_k, new_v = _scan_layers(functools.partial(layer_fn, ctx=ctx), x, layers, row_lora, caches, locals_)
    else:
        new_k, new_v = [], []
        # Each layer is a call of one jitted function: JAX traces and lowers a layer once per program instead
        # of once per layer, and XLA inlines the calls, so the compiled program is the same and builds faster.
        call = jax.jit(layer_fn)
        for i, layer in enumerate(layers):
            lora = (
                None if row_lora is None else (row_lora["mix"], jax.tree.map(lambda w, i=i: w[i], row_lora["weights"]))
            )
            layer_cache = (None,) * 4 if caches is None else tuple(c[i] for c in caches)
            x, layer_k, layer_v = call(x, layer, lora, *layer_cache, locals_[i], ctx)
            new_k.append(layer_k)
            new_v.append(layer_v)
    done = stop_layer == cfg.num_layers
    if done:
        x = norm(x, params["final_norm"])
    if cache is not None:
        k, v = list(cache.k), list(cache.v)
        k[start_layer:stop_layer], v[start_layer:stop_layer] = new_k, new_v
        cache = cache.replace(k=tuple(k), v=tuple(v), lengths=cache.lengths + num_new if done else cache.lengths)
    return x, cache


def _scan_layers(
    layer_fn: Callable,
    x: jax.Array,
    layers: list,
    row_lora: Params | None,
    caches: list[tuple] | None,
    locals_: list[jax.Array | None],
):
    """The layers under `lax.scan`, each rematerialised: the backward pass then holds one layer's
    temporaries at a time (unrolled, XLA:CPU keeps attention-sized buffers of every layer alive through the
    backward pass, too many for a long agent head). Costs a stacked copy of the layer weights per call."""
    stacked = jax.tree.map(lambda *w: jnp.stack(w), *layers)
    lora_weights = None if row_lora is None else row_lora["weights"]
    stacked_caches = (None,) * 4 if caches is None else tuple(jnp.stack(c) for c in caches)
    stacked_locals = None if locals_[0] is None else jnp.stack(locals_)

    def body(x, per_layer):
        layer, weights, layer_k, layer_v, prefix_k, prefix_v, local = per_layer
        lora = None if row_lora is None else (row_lora["mix"], weights)
        x, layer_k, layer_v = jax.checkpoint(layer_fn)(x, layer, lora, layer_k, layer_v, prefix_k, prefix_v, local)
        return x, (layer_k, layer_v)

    x, (new_k, new_v) = jax.lax.scan(body, x, (stacked, lora_weights, *stacked_caches, stacked_locals))
    if caches is None:
        return x, [None] * len(layers), [None] * len(layers)
    return x, list(new_k), list(new_v)


def logits_from_hidden(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Projects hidden states onto the vocabulary (tied or separate head), in fp32."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (hidden @ head).astype(jnp.float32)


def forward(params: Params, tokens: jax.Array, cfg: ModelConfig, **kwargs) -> tuple[jax.Array, KVCache | None]:
    """Logits [B, T, V] for every position and the updated cache (see `forward_hidden`)."""
    hidden, cache = forward_hidden(params, tokens, cfg, **kwargs)
    return logits_from_hidden(params, hidden, cfg), cache
