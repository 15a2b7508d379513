"""Re-sampling constant groups, as the TRACE authors' GRPO does: a group whose rewards are all equal has no
gradient, so it is dropped and replaced by a group of the next training task, up to `resamples` times a step,
until at least `min_informative` of the step's groups vary. Every episode played counts toward the run's
budget, the dropped ones included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from trace_jax.rl.batching import StepRollouts

# (offset of the first task after the step's own, number of tasks, attempt) -> their groups' rollouts
Draw = Callable[[int, int, int], StepRollouts]


def constant_groups(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Per group (in order of first appearance), whether its rewards are all equal."""
    order = list(dict.fromkeys(np.asarray(group_ids).tolist()))
    return np.array([np.ptp(np.asarray(rewards)[np.asarray(group_ids) == g]) == 0 for g in order], bool)


def replace_groups(rollouts: StepRollouts, drop: np.ndarray, extra: StepRollouts) -> StepRollouts:
    """`rollouts` without the groups `drop` marks (per group, in order) and with `extra`'s groups after them
    (renumbered); records of every episode played are kept, the dropped ones' too."""
    order = list(dict.fromkeys(rollouts.group_ids.tolist()))
    kept_groups = {g for g, d in zip(order, drop) if not d}
    keep = np.array([g in kept_groups for g in rollouts.group_ids.tolist()], bool)
    offset = int(rollouts.group_ids.max()) + 1
    return dataclasses.replace(
        rollouts,
        sequences=[s for s, k in zip(rollouts.sequences, keep) if k] + list(extra.sequences),
        rewards=np.concatenate([rollouts.rewards[keep], extra.rewards]),
        group_ids=np.concatenate([rollouts.group_ids[keep], np.asarray(extra.group_ids) + offset]),
        records=list(rollouts.records) + list(extra.records),
    )


def sample_informative(draw: Draw, tasks: int, resamples: int, min_informative: float) -> tuple[StepRollouts, int, int]:
    """The step's rollouts of `tasks` tasks with up to `resamples` rounds of replacing its constant groups by new
    tasks' while fewer than `min_informative` of its groups vary; returns them, the tasks used and the episodes
    played. Metrics are the first draw's (the policy on the step's own tasks), with "rollout/episodes",
    "rollout/resampled_groups" and "rollout/informative_groups" (the share in the batch learned from)."""
    rollouts = first = draw(0, tasks, 0)
    used, played, replaced = tasks, len(first.rewards), 0
    for attempt in range(1, resamples + 1):
        constant = constant_groups(rollouts.rewards, rollouts.group_ids)
        if 1.0 - constant.mean() >= min_informative:
            break
        extra = draw(used - tasks, int(constant.sum()), attempt)
        rollouts = replace_groups(rollouts, constant, extra)
        used, played, replaced = used + int(constant.sum()), played + len(extra.rewards), replaced + int(constant.sum())
    informative = 1.0 - constant_groups(rollouts.rewards, rollouts.group_ids).mean()
    metrics = {
        **first.metrics,
        "rollout/episodes": float(played),
        "rollout/resampled_groups": float(replaced),
        "rollout/informative_groups": float(informative),
    }
    return dataclasses.replace(rollouts, metrics=metrics), used, played
