"""The embedded retail environment: unlimited seeded solo tickets over τ²'s real retail DB and tools.

Each task is a written customer ticket (τ²'s "solo" style: no user simulator) from one of
the families in `embedded_retail_families`, with gold tool calls and facts to state. Tool
calls run on a fresh copy of τ²'s retail DB through τ²'s own tools; the agent's first
text turn is its final reply and ends the episode. Scoring is τ²'s own evaluator with
the reward basis of τ²'s retail tasks, DB and COMMUNICATE (see `RetailEpisode.evaluate`).

Splits are disjoint in customers: a stable hash of the user id puts each customer, and
so every order of theirs, in "train" or "heldout" (one in five held out); every entity a
task looks up or acts on belongs to its split. Families take turns, so any `num` is
balanced across them, and a task is a pure function of (seed, split, family, its turn).

The agent sees τ²'s own schemas of the seven tools the families need (the same set for
every task, so write tools of other families stay on offer as distractors) and the full
retail policy (system prompt 1.65k tokens with SmolLM2's tokenizer; first prompt with the
tools and the ticket about 3.4k, against 5.2k with all fifteen tools), which leaves a 135M
model's 8k context room for tool results (up to about 650 tokens for one order's details).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Sequence

from tau2.data_model.tasks import Action, Description, EvaluationCriteria, RewardType, Task, UserScenario
from tau2.environment.environment import Environment

from trace_jax.envs.base import END_AGENT_STOP, Gold, Message, Outcome, StepResult, TaskSpec
from trace_jax.envs.embedded_retail_families import FAMILIES, SPLITS, Draft, Pool
from trace_jax.envs.hints import replay_sources, task_hint
from trace_jax.envs.tau2_bridge import DomainState, domain_state, execute, score

TOOL_NAMES = (
    "find_user_id_by_email",
    "find_user_id_by_name_zip",
    "get_user_details",
    "get_order_details",
    "cancel_pending_order",
    "modify_pending_order_address",
    "return_delivered_order_items",
)

SOLO_INSTRUCTION = (
    "You are a customer service agent of an online retail store, working on one written customer ticket. "
    "You cannot talk with the customer: the ticket is their whole request and their explicit confirmation "
    "of the actions it asks for. Follow the policy below: authenticate the customer first, check an order "
    "before acting on it, and refuse what the policy forbids. Make one tool call per turn. When you are done, "
    "write one final message to the customer with the outcome and the information they asked for; "
    "that message ends the conversation."
)


@dataclasses.dataclass(frozen=True)
class RetailTask:
    """A generated task: its spec, the family variant, the ticket, the gold, τ²'s Task and the entities used."""

    spec: TaskSpec
    variant: str
    ticket: str
    gold: Gold
    tau2_task: Task
    entities: frozenset[str]


def system_prompt(policy: str, instruction: str = SOLO_INSTRUCTION) -> str:
    """A solo agent instruction (the retail one by default) followed by the domain's policy."""
    return f"{instruction}\n\n<policy>\n{policy}\n</policy>"


def _tau2_task(task_id: str, family: str, draft: Draft) -> Task:
    """The draft as τ²'s Task, scored on DB and COMMUNICATE like τ²'s retail tasks."""
    actions = [
        Action(action_id=f"{i}_{call['name']}", name=call["name"], arguments=copy.deepcopy(call["arguments"]))
        for i, call in enumerate(draft.calls)
    ]
    criteria = EvaluationCriteria(
        actions=actions, communicate_info=list(draft.facts), reward_basis=[RewardType.DB, RewardType.COMMUNICATE]
    )
    return Task(
        id=task_id,
        description=Description(purpose=f"embedded retail: {family} ({draft.variant})"),
        user_scenario=UserScenario(instructions=draft.ticket),
        ticket=draft.ticket,
        evaluation_criteria=criteria,
    )


class SoloTicketEpisode:
    """A written ticket played once: the agent's tool calls run in a τ² environment, its first text
    turn is the final reply and ends the episode (subclasses give the environment)."""

    task: TaskSpec
    messages: list[Message]
    end_reason: str | None

    def _tool_environment(self) -> Environment:
        raise NotImplementedError

    def step(self, message: Message) -> StepResult:
        """Runs the turn's tool calls in order; a text turn is the final reply and ends the episode."""
        if self.end_reason is not None:
            raise RuntimeError(f"episode {self.task.task_id} has ended ({self.end_reason})")
        self.messages.append(message)
        if message.get("tool_calls"):
            environment = self._tool_environment()
            observations = tuple(execute(environment, call) for call in message["tool_calls"])
            self.messages.extend(observations)
            return StepResult(observations=observations)
        self.end_reason = END_AGENT_STOP
        return StepResult(end_reason=END_AGENT_STOP)

    def user_simulator_messages(self) -> list[Message] | None:
        """Solo tickets have no user simulator."""
        return None

    def user_turn(self, text: str) -> StepResult:
        raise RuntimeError("solo tickets have no user to answer")

    def end(self, reason: str) -> None:
        """Records an imposed end, unless the episode already ended (a normal stop is never overwritten)."""
        if self.end_reason is None:
            self.end_reason = reason


class RetailEpisode(SoloTicketEpisode):
    """One solo ticket played once on its own fresh copy of the retail DB."""

    def __init__(self, task: RetailTask, state: DomainState, prompt: str, tools: list[dict]):
        self.task = task.spec
        self.tools = tools
        self.user_tools: list[dict] = []  # solo tickets: no user
        self._retail_task = task
        self._state = state
        self._prompt = prompt
        self._environment: Environment | None = None
        self.messages: list[Message] = []
        self.end_reason: str | None = None

    def reset(self) -> list[Message]:
        """The system prompt and the ticket; the DB copy is made at the first tool call."""
        self._environment = None
        self.end_reason = None
        self.messages = [
            {"role": "system", "content": self._prompt},
            {"role": "user", "content": self._retail_task.ticket},
        ]
        return list(self.messages)

    def _tool_environment(self) -> Environment:
        if self._environment is None:
            self._environment = self._state.fresh_environment()
        return self._environment

    def gold(self) -> Gold:
        return self._retail_task.gold

    def evaluate(self) -> Outcome:
        """τ²'s evaluator on the episode as a normal-mode trajectory (system, ticket as the user's
        message, agent turns, tool results).

        τ²'s retail environment refuses solo_mode=True, so the trajectory is scored as normal
        mode. That is honest: DB and COMMUNICATE are computed exactly as for τ²'s own retail
        tasks (DB: agent's write calls replayed on a fresh DB against the gold replay;
        COMMUNICATE: each fact in an assistant text), and the only user message is the ticket.
        """
        if self.end_reason is None:
            raise RuntimeError(f"episode {self.task.task_id} has not ended")
        return score(self._retail_task.tau2_task, self._state, self.messages, self.end_reason)


class EmbeddedRetail:
    """Seeded, unlimited solo retail tickets in families of graded difficulty, with disjoint splits."""

    name = "embedded_retail"

    def __init__(
        self, seed: int = 0, families: Sequence[str] | None = None, num_tasks: int = 200, all_tools: bool = False
    ):
        """`families` (default: all, easiest first) take turns in task order; `num_tasks` is the
        size of `tasks(split)` when no `num` is given; `all_tools` offers all fifteen retail tools."""
        families = list(FAMILIES) if families is None else list(families)
        unknown = [f for f in families if f not in FAMILIES]
        if unknown or not families:
            raise ValueError(f"unknown or no families {unknown}; valid families: {', '.join(FAMILIES)}")
        self.seed = seed
        self.families = families
        self.num_tasks = num_tasks
        self.state = domain_state("retail")
        schemas = self.state.tool_schemas
        self.tools = schemas if all_tools else [t for t in schemas if t["function"]["name"] in TOOL_NAMES]
        self.system_prompt = system_prompt(self.state.policy)
        self._pools = {split: Pool(self.state.db, split) for split in SPLITS}
        self._tasks: dict[str, RetailTask] = {}

    def tasks(self, split: str, num: int | None = None) -> list[TaskSpec]:
        """The first `num` tasks of `split` (any number; `num_tasks` when None)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        return [self._task(split, index).spec for index in range(self.num_tasks if num is None else num)]

    def retail_task(self, spec: TaskSpec) -> RetailTask:
        """The generated task behind `spec` (from an earlier `tasks` call)."""
        if spec.task_id not in self._tasks:
            raise ValueError(f"task {spec.task_id!r} did not come from this environment's tasks()")
        return self._tasks[spec.task_id]

    def hint_for(self, spec: TaskSpec) -> str:
        """The ticket's hint (`trace_jax.envs.hints`): each gold call by tool, with where each argument's value is
        (the ticket, or the result of an earlier call), for the hinted share of a GRPO run's episodes."""
        task = self.retail_task(spec)
        sources = replay_sources(self.state.fresh_environment(), task.ticket, (), task.gold.tool_calls)
        return task_hint(task.gold.tool_calls, sources, task.gold.facts, self.state.write_tools)

    def episode(self, task: TaskSpec, hint: bool = False) -> RetailEpisode:
        """A fresh episode of `task`; `hint` appends the ticket's hint to its system prompt."""
        prompt = f"{self.system_prompt}\n\nHint: {self.hint_for(task)}" if hint else self.system_prompt
        return RetailEpisode(self.retail_task(task), self.state, prompt, self.tools)

    def _task(self, split: str, index: int) -> RetailTask:
        """Task `index` of `split`: family by turns, drawn from a Random seeded by (seed, split, family, turn)."""
        family = self.families[index % len(self.families)]
        turn = index // len(self.families)
        task_id = f"{self.name}/{split}/{family}/{self.seed}/{turn}"
        if task_id not in self._tasks:
            draft = FAMILIES[family](self._pools[split], random.Random(f"{self.seed}/{split}/{family}/{turn}"))
            self._tasks[task_id] = RetailTask(
                TaskSpec(task_id, split, family),
                draft.variant,
                draft.ticket,
                Gold(tool_calls=draft.calls, facts=draft.facts),
                _tau2_task(task_id, family, draft),
                draft.entities,
            )
        return self._tasks[task_id]
