"""The per-row LoRA pieces the decoder applies: which projections an adapter covers (`LoraSpec`), a stack of
adapters (`Adapters`), each batch row's mix over the stack (`for_rows`) and the LoRA term itself (`row_delta`).

N adapters are stacked on a leading axis: weights[target] = {"a": [N, L, in, r], "b": [N, L, r, out]} and scale
[N] (alpha / rank). Each batch row picks one by index; `NO_ADAPTER` (-1) means the bare base model, which is also
the reference policy for KL terms. Making, stacking, merging and saving adapters is `trace_jax.lora`'s.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

NO_ADAPTER = -1
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which projections get an adapter, its rank and alpha (scale = alpha / rank), and from which
    layer on: the layers below `first_layer` keep zero weights (A = B = 0, so their gradients
    are zero too and they never change), which lets the learner run them forward only."""

    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    first_layer: int = 0

    def __post_init__(self):
        targets = tuple(t if t.endswith("_proj") else f"{t}_proj" for t in self.targets)
        unknown = sorted(set(targets) - set(ALL_TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; choose from {list(ALL_TARGETS)} (or q, k, v, ...)")
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}")
        if self.first_layer < 0:
            raise ValueError(f"LoRA first_layer must be >= 0, got {self.first_layer}")
        object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@flax.struct.dataclass
class Adapters:
    """A stack of N adapters: `weights` are trained, `scale` [N] is fixed."""

    weights: dict
    scale: jax.Array

    @property
    def num_adapters(self) -> int:
        return int(self.scale.shape[0])


def for_rows(adapters: Adapters | None, adapter_idx: jax.Array) -> dict | None:
    """The adapters as the decoder applies them to a batch whose row b uses adapter_idx[b].

    {"mix": [B, N], "weights": {target: {"a": [L, N, in, r], "b": [L, N, r, out]}}} (layer-major,
    so each layer's slice is contiguous): mix[b, n] is adapter n's scale on row b's own adapter
    and 0 elsewhere (all 0 for NO_ADAPTER), and every projection adds ((x @ A) * mix) @ B, one
    LoRA of rank N * r shared by all rows. Unlike a copy of each row's A and B, this reads every
    adapter once per step (a batch-32 decode step read 32 copies of the same adapter), and with
    N = 1 it costs no more than per-row weights.
    """
    if adapters is None:
        return None
    own = adapter_idx[:, None] == jnp.arange(adapters.num_adapters)[None, :]
    return {
        "mix": jnp.where(own, adapters.scale[None, :], 0.0),
        "weights": jax.tree.map(lambda w: jnp.moveaxis(w, 1, 0), adapters.weights),
    }


@jax.custom_vjp
def row_delta(x: jax.Array, a: jax.Array, b: jax.Array, mix: jax.Array) -> jax.Array:
    """Every row's LoRA output [B, T, out]: ((x @ A) * mix) @ B over the N stacked adapters, for
    x [B, T, in], a [N, in, r], b [N, r, out] and mix [B, N] (see `for_rows`).

    The backward pass is written out so that each gradient matmul reads x and the output
    gradient in their stored [tokens, features] layout; from autodiff's matmuls XLA:CPU
    transposed those activations, a copy per layer (docs/design.md).
    """
    return _row_delta_fwd(x, a, b, mix)[0]


def _row_delta_fwd(x, a, b, mix):
    xa = jnp.einsum("bti,nir->btnr", x, a)
    y = jnp.einsum("btnr,nro->bto", xa * mix[:, None, :, None].astype(x.dtype), b)
    return y, (x, a, b, mix, xa)


def _row_delta_bwd(residuals, dy):
    x, a, b, mix, xa = residuals
    row_mix = mix[:, None, :, None].astype(x.dtype)
    dh = jnp.einsum("bto,nro->btnr", dy, b)  # gradient of xa * mix
    dxa = dh * row_mix
    db = jnp.einsum("btnr,bto->nro", xa * row_mix, dy)
    da = jnp.swapaxes(jnp.einsum("btnr,bti->nri", dxa, x), 1, 2)  # [N, r, in] keeps x's layout; transposed after
    dx = jnp.einsum("btnr,nir->bti", dxa, a)
    dmix = jnp.einsum("btnr,btnr->bn", dh, xa).astype(mix.dtype)
    return dx, da, db, dmix


row_delta.defvjp(_row_delta_fwd, _row_delta_bwd)
