"""The adapter a GRPO run keeps with `eval.keep_best`: the evaluated step's with the highest held-out reward.

Early stopping on the job's own held-out tasks (a capability environment's held-out split, or training-split
tasks that training never draws: `environment_rollouts`), never on the tickets an experiment reports. Step 0 (the
starting adapter, which leaves the base model as it is) takes part, so a run whose training only hurt its
held-out reward exports an adapter that changes nothing. Ties keep the earlier step (less training for the same
reward), or with a tie-break measure (`eval.ties = "gold_logp"`: how likely the policy finds the held-out tasks'
gold turns, `gold_likelihood`) the step where it is higher: a greedy held-out reward on a few tasks stays the
base's while a missing skill is learned by degrees, and on ties the earlier step would keep the base agent. A step
logged without the measure (a run started before it was logged) loses a tie against one with it.

The best step's adapter lives in <workdir>/best/ (PEFT), exported when a step becomes the best and before that
step's evaluation is logged: a run killed in between evaluates the step again on resume and exports it again, so
best/ always holds the best of the logged evaluations.
"""

from __future__ import annotations

import math
import pathlib
import shutil
from collections.abc import Callable, Mapping

from trace_jax import distributed

BEST_DIR = "best"


class BestAdapter:
    """The best evaluated step so far of the run in `workdir`, taken from its logged evaluations of the steps
    before `resume_step`."""

    def __init__(
        self,
        workdir: pathlib.Path,
        logged: Mapping[int, Mapping[str, float]],
        resume_step: int,
        tie_break: str | None = None,
    ):
        """`logged`: the run's scalars by step (`metrics.scalars_by_step`; in a run of several processes process
        0's log given to all, so that every process keeps the same step). `tie_break`: the logged metric
        ("eval/...") whose higher value wins a tie of the held-out reward; None keeps the earlier step."""
        self.folder = workdir / BEST_DIR
        self.tie_break = tie_break
        self.step: int | None = None
        self.metrics: dict[str, float] = {}
        for step, scalars in sorted(logged.items()):
            if step < resume_step and "eval/reward" in scalars:
                self._consider(step, {k: v for k, v in scalars.items() if k.startswith("eval/")})

    @property
    def reward(self) -> float:
        return self.metrics.get("eval/reward", -math.inf)

    def _better(self, metrics: dict[str, float]) -> bool:
        reward = metrics["eval/reward"]
        if not math.isclose(reward, self.reward, rel_tol=0.0, abs_tol=1e-9):
            return reward > self.reward
        if self.tie_break is None:
            return False
        return metrics.get(self.tie_break, -math.inf) > self.metrics.get(self.tie_break, -math.inf)

    def _consider(self, step: int, metrics: dict[str, float]) -> bool:
        if self._better(metrics):
            self.step, self.metrics = step, dict(metrics)
            return True
        return False

    def offer(self, step: int, metrics: dict[str, float], export: Callable[[pathlib.Path], object]) -> None:
        """Takes `step`'s held-out `metrics`; if the step is the best so far, `export(folder)` writes its adapter."""
        if self._consider(step, metrics):
            export(self.folder)

    def copy_to(self, out: pathlib.Path) -> None:
        """Puts the best step's adapter files in `out` (process 0 writes)."""
        if self.step is None:
            raise RuntimeError("no step was evaluated, so there is no best adapter")
        distributed.on_main(lambda: shutil.copytree(self.folder, out, dirs_exist_ok=True))
