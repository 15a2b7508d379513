"""What the learner step takes: micro-batches of rows, the head they share, and a step's scalars.

`pack_sequences` (trace_jax/rl/batching.py) builds a `LearnerBatch` from sampled sequences; `make_grad_fn`
(trace_jax/rl/learner.py) takes it. A micro-batch is R rows of W tokens; with `loss_positions` each row scores
K chosen entries of tokens[:, 1:] (K <= W - 1) and the per-token arrays are [R, K], else every entry (K = W - 1).
Arrays may be NumPy (host) or JAX (device); both structures are pytrees, so a jitted function takes them whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import chex
import numpy as np

Array = Any  # np.ndarray or jax.Array


@chex.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of learner rows. The losses read loss_mask, GRPO's also advantages and old_logp;
    logprobs alone need only tokens and adapter_idx. `sampler_logp`: the sampler's logprobs where old_logp was
    recomputed (hinted rows, `make_rescore_fn`); `prefix_of_row`: the shared head each row continues (with
    `LearnerBatch.prefix`); `frozen_hidden`: the residual stream entering the first adapted layer, when computed
    once (`learner.frozen_inputs`); `sequence`: each row's index among the packed sequences (-1: padding);
    `hinted`: the rows sampled under a hint (set with old_logp by `make_rescore_fn`)."""

    tokens: Array  # [R, W] int32
    adapter_idx: Array  # [R] int32
    loss_mask: Array | None = None  # [R, K]: 1 where a token is learned (every loss needs it)
    advantages: Array | None = None  # [R]
    old_logp: Array | None = None  # [R, K]
    sampler_logp: Array | None = None  # [R, K]
    loss_positions: Array | None = None  # [R, K] int32
    prefix_of_row: Array | None = None  # [R] int32
    frozen_hidden: Array | None = None  # [R, W - 1, D]
    sequence: Array | None = None  # [R] int32
    hinted: Array | None = None  # [R] bool

    def check(self) -> None:
        """Fails naming the field whose rank or row count is wrong."""
        rows, width = np.shape(self.tokens)
        scored = width - 1 if self.loss_positions is None else np.shape(self.loss_positions)[1]
        shapes = {
            "loss_mask": (rows, scored),
            "adapter_idx": (rows,),
            "advantages": (rows,),
            "old_logp": (rows, scored),
            "sampler_logp": (rows, scored),
            "loss_positions": (rows, scored),
            "prefix_of_row": (rows,),
            "sequence": (rows,),
            "hinted": (rows,),
        }
        for name, shape in shapes.items():
            value = getattr(self, name)
            if value is not None and tuple(np.shape(value)) != shape:
                raise ValueError(f"MicroBatch.{name} has shape {tuple(np.shape(value))}, expected {shape}")
        if self.frozen_hidden is not None:
            chex.assert_shape(self.frozen_hidden, (rows, width - 1, None))

    def take(self, index: Array) -> MicroBatch:
        """The rows `index` selects (a slice or index array) of every per-row array."""
        return MicroBatch(**{k: None if v is None else v[index] for k, v in self.items()})


@chex.dataclass(frozen=True)
class SharedPrefix:
    """The head that rows continue (system prompt, policy, tool schemas), run once per step: G copies of P
    tokens, copy g the first lengths[g] tokens under adapter adapter[g]; `hidden`: their residual stream
    entering the first adapted layer, when computed once (`learner.frozen_inputs`)."""

    tokens: Array  # [G, P] int32
    lengths: Array  # [G] int32
    adapter: Array  # [G] int32
    hidden: Array | None = None  # [G, P, D]


@dataclasses.dataclass(frozen=True)
class LearnerBatch:
    """A learner step's input: its micro-batches (each of its own shape), the shared head, and the share of the
    step's groups dropped for constant reward (a metric passed through)."""

    micro_batches: tuple[MicroBatch, ...]
    prefix: SharedPrefix | None = None
    dropped_fraction: float | None = None

    @classmethod
    def strided(cls, rows: MicroBatch, n: int, **kwargs) -> LearnerBatch:
        """`rows` as n micro-batches, micro-batch m = rows m, m+n, m+2n, ... (strided rather than contiguous,
        so on a batch-sharded mesh each device keeps its own rows in every micro-batch)."""
        size = np.shape(rows.tokens)[0]
        if n < 1 or size % n:
            raise ValueError(f"a batch of {size} rows does not split into {n} micro-batches")
        return cls(tuple(rows.take(slice(m, None, n)) for m in range(n)), **kwargs)
