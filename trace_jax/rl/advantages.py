"""Per-trajectory advantages from rewards within groups (rollouts of one task and seed).

Host-side NumPy: it runs once per batch of trajectories, before the learner step.
Every estimator takes rewards [N] and dense group indices [N] (0 .. G-1) and returns
advantages [N]; `compute_advantages` also drops groups whose rewards are all equal
(they carry no learning signal under any of these estimators).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Estimator = Callable[[np.ndarray, np.ndarray], np.ndarray]
STD_EPS = 1e-6


def _group_mean(rewards: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's group mean and group size."""
    sizes = np.bincount(groups).astype(np.float64)
    means = np.bincount(groups, weights=rewards) / sizes
    return means[groups], sizes[groups]


def group_normalized(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """GRPO (the paper's): (r - mean) / (population std + 1e-6)."""
    mean, _ = _group_mean(rewards, groups)
    var, _ = _group_mean((rewards - mean) ** 2, groups)
    return (rewards - mean) / (np.sqrt(var) + STD_EPS)


def mean_only(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Dr.GRPO: r - mean, no std scaling (avoids up-weighting near-constant groups)."""
    mean, _ = _group_mean(rewards, groups)
    return rewards - mean


def rloo(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """REINFORCE leave-one-out: r_i - mean of the other rows in its group (0 for a group of one)."""
    mean, size = _group_mean(rewards, groups)
    return np.where(size > 1, (rewards - mean) * size / np.maximum(size - 1, 1), 0.0)


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "group_normalized": group_normalized,
    "mean_only": mean_only,
    "rloo": rloo,
}


def compute_advantages(name: str, rewards, group_ids) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Advantages [N] float32, keep [N] bool (False for rows of constant-reward groups, whose
    advantage is set to 0) and stats (groups, dropped_groups, dropped_fraction).

    `group_ids` may be any hashable labels (ints, strings); rows sharing one form a group.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGE_ESTIMATORS)}")
    rewards = np.asarray(rewards, np.float64)
    labels = np.asarray(group_ids)
    if rewards.ndim != 1 or labels.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be [N]; got {rewards.shape} and {labels.shape}")
    if not np.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    unique, groups = np.unique(labels, return_inverse=True)
    groups = groups.reshape(-1)
    num_groups = len(unique)
    group_min = np.full(num_groups, np.inf)
    group_max = np.full(num_groups, -np.inf)
    np.minimum.at(group_min, groups, rewards)
    np.maximum.at(group_max, groups, rewards)
    constant = group_min == group_max
    keep = ~constant[groups]
    advantages = np.where(keep, ADVANTAGE_ESTIMATORS[name](rewards, groups), 0.0)
    dropped = int(constant.sum())
    stats = {
        "groups": float(num_groups),
        "dropped_groups": float(dropped),
        "dropped_fraction": dropped / num_groups if num_groups else 0.0,
    }
    return advantages.astype(np.float32), keep, stats
