"""τ²-bench's airline, retail, mock and telecom domains as `Environment`s, played as τ²'s orchestrator plays them.

An episode starts like τ²'s orchestrator: a fresh environment on a copy of the domain DB,
the task's initial state applied (`Environment.set_state`), then the agent's greeting (or
the task's message history). The agent's system prompt is τ²'s `LLMAgent` prompt; the
user simulator's opening messages are τ²'s `UserSimulator` prompt and history, with roles
flipped as τ² flips them (the user model speaks as "assistant"). Turns are half duplex: an
agent text turn goes to the user, a tool turn runs its calls in order through τ²'s tools;
the user ends the episode with τ²'s stop markers (`UserSimulator.is_stop`). Scoring is τ²'s
own evaluator (`tau2_bridge.score`).

Telecom is dual control: the user has tools too. A user turn holding `<tool_call>` blocks
(the project's format) runs them on the user side; its `StepResult` then carries the
results for the user simulator (`awaiting_user` with observations) and the user speaks again.
"""

from __future__ import annotations

import copy
import importlib
import re
from typing import Any

from tau2.agent.base import is_valid_agent_history_message
from tau2.agent.llm_agent import LLMAgent
from tau2.data_model.message import SystemMessage, ToolMessage, UserMessage
from tau2.data_model.tasks import Task
from tau2.environment.environment import Environment
from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE
from tau2.user.base import is_valid_user_history_message
from tau2.user.user_simulator import UserSimulator

from trace_jax.envs.base import (
    END_USER_STOP,
    Gold,
    Message,
    Outcome,
    StepResult,
    TaskSpec,
)
from trace_jax.envs.tau2_bridge import (
    TERMINATIONS,
    DomainState,
    Judge,
    domain_state,
    execute,
    score,
)
from trace_jax.tool_calls import TOOL_CALL_OPEN, parse_assistant_output

GREETING = DEFAULT_FIRST_AGENT_MESSAGE.content  # "Hi! How can I help you today?"
_FAMILY = re.compile(r"^\[(\w+)\]")  # telecom ids start with their issue type, e.g. "[mms_issue]..."


def from_tau2_messages(messages: list[Any]) -> list[Message]:
    """τ² messages (system, user, assistant, tool) as our OpenAI-style dicts; a tool message is named
    after the call it answers."""
    out: list[Message] = []
    names: dict[str, str] = {}
    for message in messages:
        if isinstance(message, ToolMessage):
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": message.id,
                    "name": names.get(message.id, ""),
                    "content": message.content or "",
                }
            )
            continue
        out.append({"role": message.role, "content": message.content or ""})
        if not isinstance(message, SystemMessage) and message.tool_calls:
            out[-1]["tool_calls"] = [
                {"id": c.id, "name": c.name, "arguments": copy.deepcopy(c.arguments)} for c in message.tool_calls
            ]
            names.update((c.id, c.name) for c in message.tool_calls)
    return out


def task_family(domain: str, task: Task) -> str:
    """The task's family: the domain, refined by the issue type where the task id names one (telecom)."""
    match = _FAMILY.match(task.id)
    return f"{domain}/{match.group(1)}" if match else domain


class Tau2Episode:
    """One τ² task played once, on its own fresh environment."""

    def __init__(self, spec: TaskSpec, task: Task, state: DomainState, system_prompt: str, judge: Judge | None):
        self.task = spec
        self.tau2_task = task
        self.tools = state.tool_schemas
        self.user_tools = state.user_tool_schemas  # telecom's user-side tools; empty elsewhere
        self._state = state
        self._system_prompt = system_prompt
        self._judge = judge
        self._environment: Environment | None = None
        self._history: list[Any] = []
        self.messages: list[Message] = []  # the whole trajectory as τ² scores it, our system prompt first
        self.end_reason: str | None = None
        self._awaiting_user = False

    @property
    def environment(self) -> Environment | None:
        """τ²'s Environment this episode plays on (None before `reset`)."""
        return self._environment

    def reset(self) -> list[Message]:
        """A fresh environment in the task's initial state; the agent's system prompt, then the greeting
        (or the task's message history, as the agent sees it)."""
        initial = self.tau2_task.initial_state
        self._history = copy.deepcopy(initial.message_history or []) if initial is not None else []
        self._environment = self._state.fresh_environment()
        self._environment.set_state(
            initialization_data=initial.initialization_data if initial else None,
            initialization_actions=initial.initialization_actions if initial else None,
            message_history=self._history,
        )
        self._environment.sync_tools()
        opening = self._history or [DEFAULT_FIRST_AGENT_MESSAGE]
        last = opening[-1]
        if last.role not in ("assistant", "user") or last.is_tool_call():
            raise ValueError(f"task {self.tau2_task.id}: a message history must end with a text message")
        self.end_reason = None
        self._awaiting_user = last.role == "assistant"
        system = {"role": "system", "content": self._system_prompt}
        self.messages = [system] + from_tau2_messages(opening)
        return [system] + from_tau2_messages([m for m in opening if is_valid_agent_history_message(m)])

    def step(self, message: Message) -> StepResult:
        """The agent's turn: tool calls run in order (their results come back); text goes to the user.
        τ²'s agent (`LLMAgent`) has no stop token: only the user ends a conversation normally."""
        self._check_turn(user=False)
        self.messages.append(message)
        if message.get("tool_calls"):
            observations = tuple(execute(self._environment, call) for call in message["tool_calls"])
            self.messages.extend(observations)
            self._environment.sync_tools()  # as τ²'s orchestrator does after each step (text changes nothing)
            return StepResult(observations=observations)
        self._awaiting_user = True
        return StepResult(awaiting_user=True)

    def user_simulator_messages(self) -> list[Message]:
        """τ²'s user-simulator prompt (guidelines and the task's scenario) and the conversation so far,
        from the user model's side: the agent's words as "user", the user's as "assistant"."""
        if self._environment is None:
            raise RuntimeError(f"episode {self.task.task_id}: call reset() first")
        history = [m for m in self._history or [DEFAULT_FIRST_AGENT_MESSAGE] if is_valid_user_history_message(m)]
        simulator = UserSimulator(
            tools=self._environment.get_user_tools() if self.user_tools else None,
            instructions=str(self.tau2_task.user_scenario),
        )
        state = simulator.get_init_state(message_history=history)
        return from_tau2_messages(state.system_messages + state.flip_roles())

    def user_turn(self, text: str) -> StepResult:
        """The user's reply: a stop marker ends the episode, user-side tool calls run (telecom), other
        text goes to the agent."""
        self._check_turn(user=True)
        if self.user_tools and TOOL_CALL_OPEN in text:
            return self._user_tool_turn(text)
        message = {"role": "user", "content": text}
        self.messages.append(message)
        if UserSimulator.is_stop(UserMessage(role="user", content=text)):
            self.end_reason = END_USER_STOP
            return StepResult(end_reason=END_USER_STOP)
        self._awaiting_user = False
        return StepResult(observations=(message,))

    def _user_tool_turn(self, text: str) -> StepResult:
        """Runs the user's well-formed calls on the user side; results (and one error per malformed
        block) go back to the user, who speaks again."""
        parsed = parse_assistant_output(text, self.user_tools)
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]
        results: tuple[Message, ...] = ()
        if calls:
            self.messages.append({"role": "user", "content": parsed.content, "tool_calls": calls})
            results = tuple(execute(self._environment, call, requestor="user") for call in calls)
            self.messages.extend(results)
            self._environment.sync_tools()
        errors = tuple({"role": "tool", "name": "error", "content": f"Error: {e}"} for e in parsed.errors)
        return StepResult(observations=results + errors, awaiting_user=True)

    def end(self, reason: str) -> None:
        """Records an end the engine imposes; a normal end already reached is kept."""
        if reason not in TERMINATIONS:
            raise ValueError(f"unknown end reason {reason!r}; valid ones are {', '.join(TERMINATIONS)}")
        if self.end_reason is None:
            self.end_reason = reason

    def gold(self) -> Gold:
        """τ²'s gold actions in order (each with its "requestor": "assistant" or "user") and the task's
        communicate_info as the facts to state."""
        criteria = self.tau2_task.evaluation_criteria
        if criteria is None:
            return Gold(tool_calls=(), facts=())
        calls = tuple(
            {"name": a.name, "arguments": copy.deepcopy(a.arguments), "requestor": a.requestor}
            for a in criteria.actions or ()
        )
        return Gold(tool_calls=calls, facts=tuple(criteria.communicate_info or ()))

    def evaluate(self) -> Outcome:
        """τ²'s official reward for the finished episode (see `tau2_bridge.score`)."""
        if self.end_reason is None:
            raise RuntimeError(f"episode {self.task.task_id} has not ended")
        return score(self.tau2_task, self._state, self.messages, self.end_reason, judge=self._judge)

    def _check_turn(self, user: bool) -> None:
        if self._environment is None:
            raise RuntimeError(f"episode {self.task.task_id}: call reset() first")
        if self.end_reason is not None:
            raise RuntimeError(f"episode {self.task.task_id} has ended ({self.end_reason})")
        if user != self._awaiting_user:
            raise RuntimeError(
                f"episode {self.task.task_id}: it is the {'user' if self._awaiting_user else 'agent'}'s turn"
            )


class Tau2Environment:
    """A τ² domain's tasks, each played in a fresh episode: the pool is τ²'s split `task_split`
    ("base": the official task set), and `tasks(split)` gives the pool's tasks in τ²'s split `split`."""

    def __init__(self, domain: str, task_split: str = "base", judge: Judge | None = None):
        """`judge` scores NL assertions where a task's reward basis needs them (see `tau2_bridge.score`)."""
        self.state = domain_state(domain)
        self.domain = domain
        self.name = f"tau2/{domain}"
        module = importlib.import_module(f"tau2.domains.{domain}.environment")
        self._splits: dict[str, list[str]] = module.get_tasks_split()
        self._check_split(task_split)
        pool = set(self._splits[task_split])
        self._tasks = {f"{domain}/{t.id}": t for t in module.get_tasks(None) if t.id in pool}
        self._judge = judge
        # τ²'s agent prompt: its instruction and the policy (tools go to the model separately, as schemas)
        self.system_prompt = LLMAgent(tools=[], domain_policy=self.state.policy).system_prompt

    def tasks(self, split: str, num: int | None = None) -> list[TaskSpec]:
        """The tasks of τ²'s split `split` (e.g. "train", "test", "base"), the first `num` of them or all."""
        self._check_split(split)
        members = set(self._splits[split])
        specs = [
            TaskSpec(task_id, split, task_family(self.domain, task))
            for task_id, task in self._tasks.items()
            if task.id in members
        ]
        return specs if num is None else specs[:num]

    def tau2_task(self, spec: TaskSpec) -> Task:
        """τ²'s Task behind `spec`."""
        if spec.task_id not in self._tasks:
            raise ValueError(f"task {spec.task_id!r} is not a task of {self.name}")
        return self._tasks[spec.task_id]

    def episode(self, task: TaskSpec) -> Tau2Episode:
        """A fresh episode of `task` (call `reset` to start it)."""
        return Tau2Episode(task, self.tau2_task(task), self.state, self.system_prompt, self._judge)

    def _check_split(self, split: str) -> None:
        if split not in self._splits:
            raise ValueError(
                f"unknown split {split!r} of τ² domain {self.domain}; valid splits are {', '.join(self._splits)}"
            )
