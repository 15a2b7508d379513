"""A curriculum that follows the agent: when the training reward of a capability environment's level stays above
the calibration's upper gate for `patience` steps in a row, the environment moves one level harder (from a
scaffolded level toward 0 and past it, up to its top level). Calibration picks a level once, before training;
the agent then outgrows it, and a level it always solves gives GRPO constant groups. A climb can overshoot: the
next level may be one where even the hinted episodes fail (a written call learned is not yet a call opened), and
its groups are constant at 0. So a part whose reward then stays below the lower gate for `patience` steps goes
back a level, never below the level it started from.

A training environment is one capability environment or a mix of them (a capability's families): each part
climbs on its own, from the rewards of its own tasks. The state (each part's level and streak) is a small
JSON-ready dict the GRPO job keeps in its checkpoint, so a resumed run climbs on as if never stopped.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from trace_jax.settings import Invalid, non_negative_int, setting, share


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
    """The `curriculum` block: `patience` steps in a row above `upper` (mean training reward of a part's episodes)
    move a part up a level, as many below `lower` move it back down to no lower than its starting level;
    `patience` 0 turns the curriculum off. The defaults are the paper's gate on a level's mean reward (0.3-0.6)."""

    patience: int = setting(0, "an int >= 0 (0: off)", non_negative_int, optional=True)
    upper: float = setting(0.6, "a number in [0, 1]", share, optional=True)
    lower: float = setting(0.3, "a number in [0, 1]", share, optional=True)

    def __post_init__(self):
        if self.lower >= self.upper:
            raise Invalid("lower", f"below upper = {self.upper} (a reward between them holds a part's level)")


def start_state(levels: list[float]) -> dict:
    """The state of parts starting at `levels`: each part's level, its floor (the starting level), and its streaks
    of steps above the upper gate (positive) or below the lower one (negative)."""
    return {"levels": list(levels), "floors": list(levels), "streaks": [0] * len(levels)}


def climb(
    state: dict, rewards: list[float | None], tops: list[int], config: CurriculumConfig
) -> tuple[dict, list[int]]:
    """The state after a step whose parts' mean training rewards were `rewards` (None: no episode of that part
    this step, which keeps its streak), and the parts that moved, up or down; a part at its top level (`tops`)
    does not climb, one at its floor does not fall."""
    levels, streaks, moved = list(state["levels"]), list(state["streaks"]), []
    floors = list(state.get("floors", levels))
    for i, reward in enumerate(rewards):
        if reward is None:
            continue
        if reward > config.upper:
            streaks[i] = max(streaks[i], 0) + 1
        elif reward < config.lower:
            streaks[i] = min(streaks[i], 0) - 1
        else:
            streaks[i] = 0
        if not config.patience or abs(streaks[i]) < config.patience:
            continue
        step = 1 if streaks[i] > 0 else -1
        level = min(max(levels[i] + step, floors[i]), tops[i])
        if level != levels[i]:
            levels[i], streaks[i] = level, 0
            moved.append(i)
    return {"levels": levels, "floors": floors, "streaks": streaks}, moved


def env_parts(env: ml_collections.ConfigDict) -> list[dict]:
    """The capability environment configs a training environment is made of (itself, or a mix's parts)."""
    parts = (
        [p.to_dict() if hasattr(p, "to_dict") else dict(p) for p in env.parts]
        if env.name == "mixed"
        else [env.to_dict()]
    )
    if any(p.get("name") != "capability" for p in parts):
        raise ValueError(
            "config.curriculum.patience > 0 needs a capability environment (or a mix of them) in "
            f"config.env, not {env.name!r}"
        )
    return parts


def with_levels(env: ml_collections.ConfigDict, levels: list[float]) -> ml_collections.ConfigDict:
    """`env` (one capability environment or a mix of them) with its parts at `levels`."""
    parts = [{**part, "difficulty": level} for part, level in zip(env_parts(env), levels)]
    if env.name == "mixed":
        return ml_collections.ConfigDict({**env.to_dict(), "parts": parts})
    return ml_collections.ConfigDict({**env.to_dict(), **parts[0]})
