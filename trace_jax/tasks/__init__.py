"""Verifiable training tasks: seeded prompt generators with programmatic rewards.

A task set is a module with `SPLITS`, `make_tasks(split, num, seed)` (tasks carrying
`task_id`, `messages` and `tools`) and `reward(task, completion_text) -> (score, diagnostics)`.
"""

from trace_jax.tasks import tool_call_task

TASK_SETS = {"tool_call": tool_call_task}
