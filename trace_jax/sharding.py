"""Device mesh and partition rules: regex on parameter paths -> PartitionSpec.

Axes: "data" (batch), "fsdp" (batch + parameter sharding), "tensor" (heads / MLP
width). A dimension that its mesh axes do not divide is left unsharded, so the same
rules serve any model on any mesh (1 CPU, 8 fake CPUs, a GPU, a TPU pod).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")

# First match wins. Paths are "/"-joined tree keys, e.g. "layers/3/q_proj/kernel".
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"^embed$", P(("tensor", "fsdp"), None)),  # vocab-sharded: the token gather needs no reshuffle
    (r"^lm_head$", P("fsdp", "tensor")),
    (r"^layers/\d+/(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", P("fsdp", "tensor")),
    (r"^layers/\d+/(o_proj|down_proj)/kernel$", P("tensor", "fsdp")),
    (r"^layers/\d+/(q_proj|k_proj|v_proj)/bias$", P("tensor")),
    (r".*", P()),  # norms, adapters (small): replicated
)

# Logical activation names used by the decoder and sampler.
ACTIVATION_RULES: dict[str, P] = {
    "hidden": P(BATCH, None, None),  # [B, T, D]
    "mlp": P(BATCH, None, "tensor"),  # [B, T, F]
    "batch": P(BATCH),  # [B, ...]
    "cache": P(BATCH, "tensor", None, None),  # one layer's [B, KV, S, hd]
    "prefix_cache": P(None, "tensor", None, None),  # one layer's prefix slots [G, KV, P, hd]: read by every row
}


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh; one size may be -1 to take the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis size may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} does not use the {len(devices)} devices exactly")
    return jax.make_mesh(tuple(sizes), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingPlan:
    """A mesh plus the rules that place parameters and constrain activations on it."""

    mesh: Mesh
    param_rules: tuple[tuple[str, P], ...] = PARAM_RULES
    activation_rules: dict[str, P] = dataclasses.field(default_factory=lambda: dict(ACTIVATION_RULES))

    def _fit(self, spec: P, shape: tuple[int, ...]) -> P:
        """Drops the axes of any dimension they do not divide."""
        fitted = []
        for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
            names = (axes,) if isinstance(axes, str) else (axes or ())
            size = int(np.prod([self.mesh.shape[a] for a in names]))
            fitted.append(axes if axes is not None and dim % size == 0 else None)
        return P(*fitted)

    def sharding(self, spec: P, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self._fit(spec, shape))

    def param_sharding(self, path: str, shape: tuple[int, ...]) -> NamedSharding:
        spec = next(s for pattern, s in self.param_rules if re.search(pattern, path))
        return self.sharding(spec, shape)

    def shard_params(self, tree):
        """Places any pytree of arrays (params, adapters) on the mesh by the rules (on a mesh of several processes,
        each holding the same values: each places its devices' shards)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: _place(x, self.param_sharding(_path_str(path), x.shape)), tree
        )

    def activation_sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
        return self.sharding(self.activation_rules[name], shape)

    def constrain(self, x: jax.Array, name: str) -> jax.Array:
        """`with_sharding_constraint` by logical name (usable as the decoder's `constrain`)."""
        return jax.lax.with_sharding_constraint(x, self.activation_sharding(name, x.shape))

    @property
    def batch_multiple(self) -> int:
        """Batch sizes must be a multiple of this for rows to spread over the mesh."""
        return int(np.prod([self.mesh.shape[a] for a in BATCH]))


def _place(x, sharding: NamedSharding) -> jax.Array:
    """`x` on `sharding`; where the mesh spans processes, built from this process's copy of the value."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _path_str(path) -> str:
    """ "layers/q_proj/kernel" from a pytree key path (dict keys and dataclass fields)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
