"""Learner batches for tests, from the flat dicts the tests build: every per-row array under its `MicroBatch`
field name, a shared prefix as prefix_tokens / prefix_lengths / prefix_adapter, and dropped_fraction."""

from __future__ import annotations

import dataclasses

from trace_jax.rl.learner_batch import LearnerBatch, MicroBatch, SharedPrefix

PREFIX = {"prefix_tokens": "tokens", "prefix_lengths": "lengths", "prefix_adapter": "adapter"}
ROWS = {f.name for f in dataclasses.fields(MicroBatch)}


def as_batch(flat: dict, micro_batches: int = 1) -> LearnerBatch:
    """`flat` as a `LearnerBatch` of `micro_batches` strided micro-batches."""
    unknown = set(flat) - ROWS - set(PREFIX) - {"dropped_fraction"}
    assert not unknown, f"not a learner batch entry: {sorted(unknown)}"
    rows = MicroBatch(**{k: v for k, v in flat.items() if k in ROWS})
    prefix = SharedPrefix(**{name: flat[key] for key, name in PREFIX.items()}) if "prefix_tokens" in flat else None
    return LearnerBatch.strided(rows, micro_batches, prefix=prefix, dropped_fraction=flat.get("dropped_fraction"))
