"""The base agent's scored trajectories as TRACE's analysis reads them (stage 1's input).

An evaluation job's episode records (`episodes.jsonl`) are joined with each task's gold
(calls and facts, from the environment) and the agent's turns are parsed back into the
calls it made and the results it got. `compact` gives the short form an analyst is shown,
as the authors' code builds it: id, reward and components, end reason, the failure
reasons with their diagnostics, messages cut short and tool calls written `name(args)`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence

from trace_jax.envs.base import NORMAL_ENDS, Environment, Gold, Message
from trace_jax.tool_calls import parse_assistant_output


@dataclasses.dataclass(frozen=True)
class AgentCall:
    """One well-formed call the agent made, the result it got and the agent turn it came in (from 0)."""

    name: str
    arguments: dict
    result: str
    turn: int

    @property
    def failed(self) -> bool:
        return self.result.startswith("Error")

    def __str__(self) -> str:
        return call_text(self.name, self.arguments)


@dataclasses.dataclass(frozen=True)
class ScoredTrajectory:
    """One scored episode of the base agent with its task's gold, parsed for labelling."""

    id: str
    family: str
    success: bool
    reward: float
    components: dict[str, float]
    end_reason: str
    info: dict
    messages: tuple[Message, ...]
    ticket: str  # the first user message
    calls: tuple[AgentCall, ...]
    format_errors: tuple[str, ...]  # malformed or schema-invalid call blocks, as the agent was told
    replies: tuple[str, ...]  # the agent's text turns
    gold: Gold


def call_text(name: str, arguments: dict) -> str:
    """A call as analysts read it: `name(key=value, ...)` with JSON values."""
    return f"{name}({', '.join(f'{k}={json.dumps(v)}' for k, v in arguments.items())})"


def _agent_turns(messages: Sequence[Message], tools: list[dict]):
    """(calls with results, format errors, text replies) of the agent, reparsed as the engine parsed them."""
    calls, errors, replies = [], [], []
    turn = -1
    pending: list = []  # parsed calls of the last tool turn still waiting for their results
    for message in messages:
        if message["role"] == "assistant":
            turn += 1
            parsed = parse_assistant_output(message["content"], tools)
            errors += parsed.errors
            pending = list(parsed.tool_calls)
            if not parsed.tool_calls and not parsed.errors:
                replies.append(message["content"])
        elif message["role"] == "tool" and message.get("name") != "error" and pending:
            call = pending.pop(0)
            calls.append(AgentCall(call.name, call.arguments, str(message["content"]), turn))
    return tuple(calls), tuple(errors), tuple(replies)


def from_record(record: dict, gold: Gold, tools: list[dict]) -> ScoredTrajectory:
    """A trajectory from one evaluation record, its task's gold and the tool schemas the agent was offered."""
    messages = tuple(record["messages"])
    calls, errors, replies = _agent_turns(messages, tools)
    trial = record.get("trial", 0)
    return ScoredTrajectory(
        id=record["task_id"] + (f"@{trial}" if trial else ""),
        family=record["family"],
        success=bool(record["success"]),
        reward=float(record["reward"]),
        components=dict(record["components"]),
        end_reason=record["end_reason"],
        info=dict(record.get("info") or {}),
        messages=messages,
        ticket=next((m["content"] for m in messages if m["role"] == "user"), ""),
        calls=calls,
        format_errors=errors,
        replies=replies,
        gold=gold,
    )


def load_trajectories(records: Iterable[dict], env: Environment) -> list[ScoredTrajectory]:
    """Every record as a trajectory, with the gold and tools of its task in `env` (the environment the
    records were played in: a task id it does not have is an error that names the id)."""
    records = list(records)
    played = {}  # split -> its task ids
    for r in records:
        played.setdefault(r["split"], set()).add(r["task_id"])
    specs = {}
    for split, ids in sorted(played.items()):
        tasks = env.tasks(split)
        if len(ids) > len(tasks):  # an evaluation of more tasks than the default played the split's first ones
            tasks = env.tasks(split, len(ids))
        specs.update((spec.task_id, spec) for spec in tasks)
    trajectories = []
    for record in records:
        spec = specs.get(record["task_id"])
        if spec is None:
            raise ValueError(
                f"task {record['task_id']!r} is not among the {record['split']!r} tasks of environment "
                f"{env.name!r}: were the episodes played in another environment configuration?"
            )
        episode = env.episode(spec)
        trajectories.append(from_record(record, episode.gold(), episode.tools))
    return trajectories


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


def failure_reasons(trajectory: ScoredTrajectory) -> list[str]:
    """Each reward component below 1 with the evaluator's diagnostic, and an abnormal end."""
    info, reasons = trajectory.info, []
    if trajectory.end_reason not in NORMAL_ENDS:
        reasons.append(f"episode ended abnormally ({trajectory.end_reason}), which scores 0")
    if trajectory.components.get("DB", 1.0) < 1.0:
        reasons.append("DB: the final database differs from the gold replay's")
    for action in (info.get("failed_actions") or []) + (info.get("missing_calls") or []):  # τ²'s, capability envs'
        reasons.append(f"ACTION: gold call not made: {action}")
    for write in info.get("stray_writes") or ():
        reasons.append(f"ACTION: a write the task did not ask for: {write}")
    if info.get("failed_communicate"):
        reasons.append(f"COMMUNICATE: the reply did not state {info['failed_communicate']}")
    for name, value in trajectory.components.items():
        if value < 1.0 and name not in ("DB", "COMMUNICATE", "ACTION"):
            reasons.append(f"{name}: {value:g}")
    return reasons


def compact(trajectory: ScoredTrajectory, message_chars: int = 300) -> dict:
    """The analyst's view of one trajectory (system prompt left out: every trajectory shares it)."""
    shown = []
    for message in trajectory.messages:
        if message["role"] == "system":
            continue
        if message["role"] == "assistant":
            parsed = parse_assistant_output(message["content"])
            if parsed.tool_calls or parsed.errors:
                text = "; ".join(
                    [call_text(c.name, c.arguments) for c in parsed.tool_calls]
                    + ["<malformed tool call>"] * len(parsed.errors)
                )
                shown.append({"role": "assistant", "tool_calls": _cut(text, message_chars)})
                continue
        shown.append({"role": message["role"], "content": _cut(str(message["content"]), message_chars)})
    return {
        "id": trajectory.id,
        "family": trajectory.family,
        "reward": trajectory.reward,
        "components": trajectory.components,
        "end_reason": trajectory.end_reason,
        "failure_reasons": failure_reasons(trajectory),
        "messages": shown,
    }
