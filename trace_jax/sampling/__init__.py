"""Batched generation with a KV cache: jitted prefill and decode, per-row everything.

Each row keeps its own length in the cache, so rows of different lengths share a batch and a row can continue
(the next turn of a conversation) by appending new tokens without recomputing its prefix. A `Session` feeds and
finishes rows at different times (the rollout engine's continuous batching); `Sampler.generate` is one feed of
all rows. Temperature, top-p and top-k are per-row arrays (changing them never recompiles); batch, prompt and
cache lengths are rounded up to buckets, and shared prefixes to a multiple of 64 tokens, so the number of
compiled programs stays small.

  draws.py    drawing a token: temperature, top-k / top-p, each row's random key
  shapes.py   the shapes programs are compiled for, and how fed rows are grouped (`ShapePolicy`)
  kernels.py  the device programs: prefill, row moves, the decode loop (`Programs`: jitted for one model)
  session.py  `Session`: rows fed and sampled independently; `Completion`
  fused.py    `FusedSession`: fed tokens folded into decode steps, programs compiled ahead (accelerators)
  sampler.py  `Sampler`: the model, its adapters and programs, the session policy; `generate`
"""

from trace_jax.sampling.draws import row_keys, sample_from_logits, truncate_logits
from trace_jax.sampling.fused import FusedSession
from trace_jax.sampling.sampler import POLICIES, Sampler
from trace_jax.sampling.session import FINISH_CONTEXT, FINISH_LENGTH, FINISH_STOP, Completion, Session
from trace_jax.sampling.shapes import (
    bucket_size,
    common_prefix_length,
    power_of_two,
    prefix_capacity,
    shared_prefix_length,
)

__all__ = [
    "FINISH_CONTEXT",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "POLICIES",
    "Completion",
    "FusedSession",
    "Sampler",
    "Session",
    "bucket_size",
    "common_prefix_length",
    "power_of_two",
    "prefix_capacity",
    "row_keys",
    "sample_from_logits",
    "shared_prefix_length",
    "truncate_logits",
]
