"""Several environments as one: the tasks of each in turn (TRACE's "one adapter on all capability environments
mixed" arm trains on it, so every GRPO step draws from every capability).
"""

from __future__ import annotations

from collections.abc import Sequence

from trace_jax.envs.base import Environment, Episode, TaskSpec


class MixedEnvironment:
    """The parts' tasks interleaved (part 0's first task, part 1's first, ..., part 0's second, ...); an episode
    is played by the part its task came from. Task ids must not repeat across parts."""

    def __init__(self, parts: Sequence[Environment]):
        if not parts:
            raise ValueError("a mixed environment needs at least one part")
        self.parts = list(parts)
        self.name = "mixed"
        self._owner: dict[str, Environment] = {}

    def tasks(self, split: str, num: int | None = None) -> list[TaskSpec]:
        """The first `num` tasks of `split` in turn from each part (all of every part's when None)."""
        per_part = None if num is None else -(-num // len(self.parts))
        lists = [part.tasks(split, per_part) for part in self.parts]
        mixed = [tasks[i] for i in range(max(map(len, lists))) for tasks in lists if i < len(tasks)]
        for part, tasks in zip(self.parts, lists):
            for task in tasks:
                if self._owner.setdefault(task.task_id, part) is not part:
                    raise ValueError(f"task id {task.task_id!r} occurs in two parts of the mixed environment")
        return mixed if num is None else mixed[:num]

    def hint_for(self, task: TaskSpec) -> str:
        """The task's hint from the part it came from ("" where that part offers none)."""
        hint_for = getattr(self._part(task), "hint_for", None)
        return hint_for(task) if hint_for else ""

    def episode(self, task: TaskSpec, **options) -> Episode:
        return self._part(task).episode(task, **options)

    def part_index(self, task_id: str) -> int:
        """Which part (its index) the task `task_id` came from."""
        if task_id not in self._owner:
            raise ValueError(f"task {task_id!r} did not come from this environment's tasks()")
        return next(i for i, part in enumerate(self.parts) if part is self._owner[task_id])

    def _part(self, task: TaskSpec) -> Environment:
        if task.task_id not in self._owner:
            raise ValueError(f"task {task.task_id!r} did not come from this environment's tasks()")
        return self._owner[task.task_id]
