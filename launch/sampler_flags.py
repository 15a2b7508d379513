"""The `--sampler_policy` flag the sampling jobs share (`trace_jax.sampling.Sampler`'s policy)."""

from __future__ import annotations

from absl import flags

from trace_jax.sampling import POLICIES

SAMPLER_POLICY = flags.DEFINE_enum(
    "sampler_policy",
    None,
    list(POLICIES),
    "How the sampler schedules rows: 'adaptive' (shapes fitted to each call, the CPU's) or 'fused' (fed tokens in "
    "decode steps, programs compiled at start, accelerators'); default by backend.",
)
