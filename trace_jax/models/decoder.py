"""The decoder forward pass: one pure function for Llama, Qwen2 and Qwen3.

Parameters are a plain pytree with one dict per layer (`params["layers"]` is a
list), and each layer has its own KV-cache buffers: a layer reads and updates its
cache in place, with no slicing of stacked arrays (which XLA:CPU copies, and which
cost a quarter of the decode time here). LoRA adapters come in already gathered
per batch row (see `lora.gather_rows`).
"""

from __future__ import annotations

import math
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from trace_jax.models.config import ModelConfig

Params = dict
# Constrains an activation's sharding: (array, logical name) -> array.
Constrain = Callable[[jax.Array, str], jax.Array]


def no_constraint(x: jax.Array, _: str) -> jax.Array:
    """The default `Constrain`: leaves placement to XLA (single device, or no rules)."""
    return x


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for each row, plus how many positions are filled.

    k, v: one [batch, kv_heads, max_len, head_dim] array per layer (head-major, so
    attention reads each head's keys contiguously); lengths: [batch] int32.
    Row b holds a contiguous sequence at positions 0 .. lengths[b] - 1.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache (all rows of length 0)."""
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # distinct buffers (donated)
    return KVCache(zeros(), zeros(), jnp.zeros((batch,), jnp.int32))


def gather_cache_rows(cache: KVCache, source_rows: jax.Array) -> KVCache:
    """A cache whose row b is a copy of `cache` row source_rows[b]: one prefilled shared
    prefix (or one per group) fanned out to every row that continues from it."""
    take = lambda arrays: tuple(jnp.take(a, source_rows, axis=0) for a in arrays)
    return KVCache(take(cache.k), take(cache.v), jnp.take(cache.lengths, source_rows, axis=0))


def copy_cache_row(cache: KVCache, source: KVCache, source_row: jax.Array, row: jax.Array,
                   length: jax.Array) -> KVCache:
    """`cache` whose row `row` holds the first `length` positions of `source` row `source_row`.

    Copies the source's whole capacity (a static shape); positions past `length` are
    ignored, since attention reads a row only up to its length. Needs
    cache.max_len >= source.max_len.
    """
    def put(dst, src):
        block = jax.lax.dynamic_slice_in_dim(src, source_row, 1, axis=0)
        return jax.lax.dynamic_update_slice(dst, block.astype(dst.dtype), (row, 0, 0, 0))

    k = tuple(put(d, s) for d, s in zip(cache.k, source.k))
    v = tuple(put(d, s) for d, s in zip(cache.v, source.v))
    return KVCache(k, v, cache.lengths.at[row].set(length))


def rope_inverse_frequencies(cfg: ModelConfig) -> jax.Array:
    """Rotary inverse frequencies, with Llama 3 long-context scaling when configured."""
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))
    s = cfg.rope_scaling
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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates [B, T, heads, head_dim] by position (HF's rotate-half layout)."""
    angles = positions[:, :, None].astype(jnp.float32) * inv_freq  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32, cast back before the weight (as transformers does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def _linear(x: jax.Array, layer: Params, name: str, row_lora: Params | None) -> jax.Array:
    """x @ W (+ bias) (+ the row's LoRA delta: (x @ A) @ B, with the scale folded into B)."""
    proj = layer[name]
    y = x @ proj["kernel"]
    if "bias" in proj:
        y = y + proj["bias"]
    if row_lora is not None and name in row_lora:
        a, b = row_lora[name]["a"], row_lora[name]["b"]  # [B, in, r], [B, r, out]
        y = y + jnp.einsum("btr,bro->bto", jnp.einsum("bti,bir->btr", x, a), b)
    return y


def _attention(q, k, v, q_pos, k_pos, k_valid):
    """Grouped-query attention. q: [B,T,H,hd]; k, v: [B,KV,S,hd]; masks by absolute position.

    Batch and kv-head dims are merged into one dot batch dim: XLA:CPU runs that far
    faster than a dot with two batch dims.
    """
    batch, t, num_heads, hd = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    groups = num_heads // kv_heads
    q = q.reshape(batch, t, kv_heads, groups, hd).transpose(0, 2, 3, 1, 4).reshape(batch * kv_heads, groups * t, hd)
    k = k.reshape(batch * kv_heads, s, hd)
    v = v.reshape(batch * kv_heads, s, hd)
    scores = jax.lax.dot_general(q, k, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    scores = scores.reshape(batch, kv_heads, groups, t, s) * (hd**-0.5)
    mask = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(batch * kv_heads, groups * t, s)
    out = jax.lax.dot_general(probs, v, (((2,), (1,)), ((0,), (0,))))
    return out.reshape(batch, kv_heads, groups, t, hd).transpose(0, 3, 1, 2, 4).reshape(batch, t, num_heads * hd)


def _write_cache(layer_cache, new, positions, write_mask):
    """Scatters new [B,T,KV,hd] into one layer's cache [B,KV,S,hd] at (row, :, position).

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
    positions: jax.Array | None = None,
    row_lora: Params | None = None,
    cache: KVCache | None = None,
    num_new: jax.Array | None = None,
    constrain: Constrain = no_constraint,
    remat: bool = False,
) -> tuple[jax.Array, KVCache | None]:
    """Final-norm hidden states [B, T, D] and the updated cache.

    Without a cache, row b's tokens sit at `positions` (default 0..T-1) and attend
    causally among themselves. With a cache, row b's first `num_new[b]` tokens are
    appended after its `cache.lengths[b]` cached ones; the rest of the row is padding.
    `row_lora` maps target names to per-row {"a": [L,B,in,r], "b": [L,B,r,out]}.
    """
    batch, t = tokens.shape
    inv_freq = rope_inverse_frequencies(cfg)
    if cache is not None:
        num_new = jnp.full((batch,), t, jnp.int32) if num_new is None else num_new
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        write_mask = jnp.arange(t)[None, :] < num_new[:, None]
        k_pos = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (batch, cache.max_len))
        k_valid = k_pos < (cache.lengths + num_new)[:, None]
    elif positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))

    def layer_fn(x, layer, lora, layer_k, layer_v):
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q = _linear(h, layer, "q_proj", lora).reshape(batch, t, cfg.num_heads, cfg.head_dim)
        k = _linear(h, layer, "k_proj", lora).reshape(batch, t, cfg.num_kv_heads, cfg.head_dim)
        v = _linear(h, layer, "v_proj", lora).reshape(batch, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        if layer_k is None:
            attn = _attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions, positions,
                              jnp.ones((batch, t), bool))
        else:
            layer_k = _write_cache(layer_k, k, positions, write_mask)
            layer_v = _write_cache(layer_v, v, positions, write_mask)
            attn = _attention(q, layer_k, layer_v, positions, k_pos, k_valid)
        x = constrain(x + _linear(attn, layer, "o_proj", lora), "hidden")
        h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
        gated = jax.nn.silu(_linear(h, layer, "gate_proj", lora)) * _linear(h, layer, "up_proj", lora)
        x = constrain(x + _linear(constrain(gated, "mlp"), layer, "down_proj", lora), "hidden")
        return x, layer_k, layer_v

    if remat:
        layer_fn = jax.checkpoint(layer_fn)
    x = constrain(params["embed"][tokens], "hidden")
    new_k, new_v = [], []
    for i, layer in enumerate(params["layers"]):
        lora = None if row_lora is None else jax.tree.map(lambda w: w[i], row_lora)
        x, layer_k, layer_v = layer_fn(x, layer, lora, *((None, None) if cache is None else (cache.k[i], cache.v[i])))
        new_k.append(layer_k)
        new_v.append(layer_v)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if cache is not None:
        cache = KVCache(tuple(new_k), tuple(new_v), cache.lengths + num_new)
    return x, cache


def logits_from_hidden(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Projects hidden states onto the vocabulary (tied or separate head), in fp32."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (hidden @ head).astype(jnp.float32)


def forward(params: Params, tokens: jax.Array, cfg: ModelConfig, **kwargs) -> tuple[jax.Array, KVCache | None]:
    """Logits [B, T, V] for every position and the updated cache (see `forward_hidden`)."""
    hidden, cache = forward_hidden(params, tokens, cfg, **kwargs)
    return logits_from_hidden(params, hidden, cfg), cache
