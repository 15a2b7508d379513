"""Comparison helpers shared by the learner tests."""

import jax
import numpy as np


def tree_rel(a, b) -> float:
    """|a - b| / |b| over whole pytrees (global L2 norms, in float64)."""
    a, b = (np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)]) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
