"""The environment protocol the rollout engine drives: tasks, episodes, steps and outcomes.

Messages are OpenAI-style dicts, the same ones `ChatTokenizer.apply_chat` renders:
`{"role": "system" | "user" | "assistant" | "tool", "content": str}`; an assistant
message may carry `"tool_calls": [{"id", "name", "arguments"}]` and a tool message
carries the `"tool_call_id"` and `"name"` it answers.

One episode is one task played once. The engine calls `reset` for the agent's first
messages, then alternates: the agent's parsed turn goes to `step`; tool results come
back as observations; a text turn either ends the episode (solo tasks: the text is the
final reply) or asks the user for an answer (`StepResult.awaiting_user`). The user
simulator is a model row the engine runs from `user_simulator_messages()`; its reply
goes to `user_turn`. `evaluate` scores the finished episode; `end` records an end the
engine imposes (max turns, context full, too many errors), which scores 0 like any
abnormal end.

A turn holding any `<tool_call>` block is a tool turn. `step` receives either a text
message (no "tool_calls") or a message with one or more well-formed calls; malformed
blocks never reach the environment: the engine answers each with an error observation.
A tool that fails (unknown name, bad arguments, a domain error) is answered by the
environment with a tool message whose content starts with "Error:".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

Message = dict[str, Any]

# Why an episode ended. The first two are normal ends and the only ones that are scored.
END_AGENT_STOP = "agent_stop"
END_USER_STOP = "user_stop"
END_MAX_TURNS = "max_turns"
END_CONTEXT = "context_full"
END_MAX_ERRORS = "too_many_errors"
END_TURN_TOO_LONG = "turn_too_long"  # a turn reached max_tokens_per_turn without ending
NORMAL_ENDS = frozenset({END_AGENT_STOP, END_USER_STOP})


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A task as the engine sees it: ids for records, a family (or domain) for per-family tables."""

    task_id: str
    split: str
    family: str


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What follows an agent or user turn.

    `observations` go to the agent next (tool results, or the user's message);
    `awaiting_user` asks the engine to run the user simulator and call `user_turn`;
    `end_reason` is set once the episode is over (one of the END_* values).
    """

    observations: tuple[Message, ...] = ()
    awaiting_user: bool = False
    end_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.end_reason is not None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A scored episode: the official reward, success (reward 1), reward components by
    name (for example {"DB": 1.0, "COMMUNICATE": 0.0}) and free-form details."""

    reward: float
    success: bool
    components: dict[str, float]
    info: dict[str, Any]


Call = dict  # a tool call as tasks state it: {"name": str, "arguments": dict}


def call(name: str, **arguments) -> Call:
    """The tool call `name(**arguments)`."""
    return {"name": name, "arguments": arguments}


@dataclasses.dataclass(frozen=True)
class Gold:
    """What a perfect agent does: the task's gold tool calls ({"name", "arguments"}) in
    order, then one text message stating `facts` (the strings the task requires said)."""

    tool_calls: tuple[Call, ...]
    facts: tuple[str, ...]


class Episode(Protocol):
    """One task played once (see the module docstring for the call order)."""

    task: TaskSpec
    tools: list[dict]  # OpenAI JSON-schema tools offered to the agent
    user_tools: list[dict]  # tools of the user simulator (τ² telecom's dual control); empty elsewhere

    def reset(self) -> list[Message]:
        """The agent's first messages: system prompt (policy and tools), then the ticket or greeting."""

    def step(self, message: Message) -> StepResult:
        """The agent's turn: text, or tool calls (executed in order), or a parse error to report."""

    def user_simulator_messages(self) -> list[Message] | None:
        """The user simulator's opening messages, or None when the task has no user (solo)."""

    def user_turn(self, text: str) -> StepResult:
        """The user simulator's reply to the agent's last text turn."""

    def end(self, reason: str) -> None:
        """Records an end imposed by the engine (END_MAX_TURNS, END_CONTEXT, ...)."""

    def gold(self) -> Gold:
        """The task's gold actions and required facts (for the scripted gold agent)."""

    def evaluate(self) -> Outcome:
        """Scores the finished episode; only normal ends can score above 0."""


class Environment(Protocol):
    """A source of tasks and of episodes playing them."""

    name: str

    def tasks(self, split: str, num: int | None = None) -> list[TaskSpec]:
        """The split's tasks (the first `num` of them, or all)."""

    def episode(self, task: TaskSpec) -> Episode:
        """A fresh episode of `task`, with its own copy of any state (DB) it changes."""
