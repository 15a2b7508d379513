"""Capability environments (TRACE stage 2): seeded tasks of a τ² domain (retail, airline: `domains`) that
each exercise one capability, on synthetic worlds, with τ²'s tools and policy of the domain and a
multi-level reward computed by code.

A generator turns (random draw, difficulty) into a `Scenario`: a synthetic world, a
ticket, the calls already made before the agent's first turn (a pre-filled conversation:
authentication and look-ups done, so the agent's work is the capability itself), the
calls the agent still has to make and the facts its reply must state. The agent sees the
pre-filled turns exactly as it would have written them (`<tool_call>` blocks) with τ²'s
real results. Splits draw from disjoint seed streams; every task is a pure function of
(capability, seed, difficulty, split, index).

The reward has levels, so GRPO groups have variance while the agent is weak:
  0.2  at least one well-formed call to an offered tool;
  0.5  every gold tool called by name;
  0.8  every gold call made with exactly the gold arguments, no other write attempted (even
       one the system rejects: trying a forbidden write is the failure), and the DB equals
       the gold replay's;
  1.0  all that, and the episode ended normally (the agent's final reply) with every
       required fact stated in a text turn (τ²'s COMMUNICATE check).
An episode cut at a limit (turns, errors, a turn's length) keeps only `cut_share` of its call
level: τ² fails such an episode, and when the calls paid in full however the episode ended, GRPO
taught the embedded agent to keep calling tools after the right write instead of replying
(docs/trace_pipeline.md). A share of 1 keeps the calls' levels where most episodes are cut (the
tiny CI agent, the quick config's 3-turn episodes); only 1.0 needs the ending either way.

A built-in capability carries a `hint`: a sentence or two of guidance. A hinted episode
(`episode(task, hint=True)`) has it appended to its system prompt ("Hint: ..."), nothing
else changed; the GRPO job plays a share of its training episodes so (`rollout.hint_share`)
and learns from them as if unhinted (`trace_jax.rl.environment_rollouts`). Evaluation never hints.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

from tau2.data_model.message import AssistantMessage
from tau2.environment.db import DB
from tau2.environment.environment import Environment
from tau2.evaluator.evaluator_communicate import CommunicateEvaluator

from trace_jax.agent.tool_calls import format_tool_call
from trace_jax.envs.base import NORMAL_ENDS, Call, Gold, Message, Outcome, TaskSpec
from trace_jax.envs.capability.domains import WorldDomain, world_domain
from trace_jax.envs.embedded_retail import SoloTicketEpisode
from trace_jax.envs.tau2_bridge import execute

SPLITS = ("train", "heldout")
LEVELS = {"format": 0.2, "tool": 0.5, "arguments": 0.8, "COMMUNICATE": 1.0}  # see the module docstring
CUT_SHARE = 0.0  # the share of its level an episode cut at a limit keeps, by default: τ²'s rule (it fails)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One task of a capability: its world and ticket, what was done before the agent's turn, what it must do."""

    variant: str  # the task's family in per-family tables
    db: DB  # of the capability's domain: RetailDB, FlightDB
    ticket: str
    prefilled: tuple[Call, ...]  # calls made before the agent's first turn, in order
    gold_calls: tuple[Call, ...]  # the calls the agent still has to make
    facts: tuple[str, ...] = ()  # strings its final reply must contain


# (random draw, difficulty, the domain's catalogue: τ²'s products or flights) -> Scenario
Generator = Callable[[random.Random, int, dict], Scenario]


@dataclasses.dataclass(frozen=True)
class Capability:
    """A capability environment: its domain, its generator and the tools it offers at each difficulty
    (τ²'s schemas of those names, the same for every task of one difficulty)."""

    name: str
    description: str
    generate: Generator
    tools: tuple[tuple[str, ...], ...]  # by difficulty
    hint: str = ""  # guidance a hinted training episode appends to its system prompt ("": none offered)
    domain: str = "retail"  # a name in `domains.DOMAINS`

    @property
    def max_difficulty(self) -> int:
        return len(self.tools) - 1


class CapabilityEpisode(SoloTicketEpisode):
    """One scenario played once on its own copy of the scenario's world."""

    def __init__(self, spec: TaskSpec, scenario: Scenario, prompt: str, tools: list[dict], cut_share: float,
                 domain: WorldDomain):
        self.task = spec
        self.domain = domain
        self.cut_share = cut_share
        self.tools = tools
        self.user_tools: list[dict] = []
        self.scenario = scenario
        self._prompt = prompt
        self._environment: Environment | None = None
        self._opening = 0  # messages before the agent's first turn
        self.messages: list[Message] = []
        self.end_reason: str | None = None

    def reset(self) -> list[Message]:
        """The system prompt, the ticket and the pre-filled turns: each call as the agent writes one, then τ²'s
        result."""
        self._environment = self.domain.environment(self.scenario.db)
        self.end_reason = None
        self.messages = [{"role": "system", "content": self._prompt}, {"role": "user", "content": self.scenario.ticket}]
        shown = list(self.messages)
        for i, call in enumerate(self.scenario.prefilled):
            call = {"id": f"prefilled_{i}", **call}
            result = execute(self._environment, call)
            self.messages += [{"role": "assistant", "content": "", "tool_calls": [call]}, result]
            shown += [{"role": "assistant", "content": format_tool_call(call["name"], call["arguments"])}, result]
        self._opening = len(self.messages)
        return shown

    def _tool_environment(self) -> Environment:
        return self._environment

    def gold(self) -> Gold:
        return Gold(tool_calls=self.scenario.gold_calls, facts=self.scenario.facts)

    def evaluate(self) -> Outcome:
        """The multi-level reward of the module docstring, with each level's check as a component."""
        if self.end_reason is None:
            raise RuntimeError(f"episode {self.task.task_id} has not ended")
        gold = self.scenario.gold_calls
        agent_calls = [{"name": c["name"], "arguments": c["arguments"]}
                       for m in self.messages[self._opening:] for c in m.get("tool_calls") or ()]
        write_tools = self.domain.state.write_tools
        stray = [c for c in agent_calls if c["name"] in write_tools and c not in gold]
        replay = self.domain.environment(self.scenario.db)
        for i, call in enumerate(self.scenario.prefilled + gold):
            execute(replay, {"id": f"gold_{i}", **call})
        texts = [AssistantMessage(role="assistant", content=m["content"]) for m in self.messages[self._opening:]
                 if m["role"] == "assistant" and m.get("content") and not m.get("tool_calls")]
        missing = [c.info for c in CommunicateEvaluator.evaluate_communicate_info(texts, list(self.scenario.facts))
                   if not c.met]
        checks = {"format": bool(agent_calls),
                  "tool": {c["name"] for c in gold} <= {c["name"] for c in agent_calls},
                  "arguments": (all(c in agent_calls for c in gold) and not stray
                                and self._environment.get_db_hash() == replay.get_db_hash()),
                  "COMMUNICATE": self.end_reason in NORMAL_ENDS and not missing}
        reward = 0.0
        for level, value in LEVELS.items():  # levels build on each other
            if not checks[level]:
                break
            reward = value
        if self.end_reason not in NORMAL_ENDS:
            reward *= self.cut_share
        info = {"end_reason": self.end_reason, "failed_communicate": missing,
                "missing_calls": [f"{c['name']}({c['arguments']})" for c in gold if c not in agent_calls],
                "stray_writes": [f"{c['name']}({c['arguments']})" for c in stray]}
        return Outcome(reward=reward, success=reward >= 1.0, components={k: float(v) for k, v in checks.items()},
                       info=info)


class CapabilityEnvironment:
    """Unlimited seeded tasks of one capability, in disjoint train and held-out seed streams."""

    name = "capability"

    def __init__(self, capability: Capability, seed: int = 0, difficulty: float = 0, policy: bool = True,
                 num_tasks: int = 200, cut_share: float = CUT_SHARE):
        """`difficulty` in [0, capability.max_difficulty]: a level, or between two levels a mix of them (each
        task of the upper one with probability difficulty - lower, drawn from the task's key; the tools of
        both offered: calibration's finer knob); `policy` puts τ²'s policy of the domain in the system prompt
        (as the target has it) or only the solo instruction (a short head, for CPU-sized runs); `cut_share` in
        [0, 1]: the share of its level an episode cut at a limit keeps (module docstring)."""
        if not (isinstance(difficulty, (int, float)) and 0 <= difficulty <= capability.max_difficulty):
            raise ValueError(f"difficulty = {difficulty!r} is out of range for {capability.name}: "
                             f"0 to {capability.max_difficulty}")
        if not (isinstance(cut_share, (int, float)) and 0 <= cut_share <= 1):
            raise ValueError(f"cut_share = {cut_share!r} is invalid; it must be a number in [0, 1]")
        difficulty = int(difficulty) if float(difficulty).is_integer() else float(difficulty)  # 1.0 is level 1
        self.capability, self.seed, self.difficulty, self.num_tasks = capability, seed, difficulty, num_tasks
        self.levels = (math.floor(difficulty), math.ceil(difficulty))
        self.cut_share = cut_share
        self.domain = world_domain(capability.domain)
        self._catalogue = self.domain.catalogue()
        offered = set(capability.tools[self.levels[0]]) | set(capability.tools[self.levels[1]])
        self.tools = [t for t in self.domain.state.tool_schemas if t["function"]["name"] in offered]
        self.system_prompt = self.domain.system_prompt(policy)
        self._scenarios: dict[str, tuple[TaskSpec, Scenario]] = {}

    def tasks(self, split: str, num: int | None = None) -> list[TaskSpec]:
        """The first `num` tasks of `split` (`num_tasks` when None)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        return [self._task(split, index)[0] for index in range(self.num_tasks if num is None else num)]

    def scenario(self, spec: TaskSpec) -> Scenario:
        """The scenario behind `spec` (from an earlier `tasks` call)."""
        if spec.task_id not in self._scenarios:
            raise ValueError(f"task {spec.task_id!r} did not come from this environment's tasks()")
        return self._scenarios[spec.task_id][1]

    @property
    def hint(self) -> str:
        """The capability's hint ("" when it offers none): see the module docstring."""
        return self.capability.hint

    def episode(self, task: TaskSpec, hint: bool = False) -> CapabilityEpisode:
        """A fresh episode of `task`; `hint` appends the capability's hint to its system prompt."""
        if hint and not self.hint:
            raise ValueError(f"the capability {self.capability.name!r} offers no hint")
        prompt = f"{self.system_prompt}\n\nHint: {self.hint}" if hint else self.system_prompt
        return CapabilityEpisode(task, self.scenario(task), prompt, self.tools, self.cut_share, self.domain)

    def _task(self, split: str, index: int) -> tuple[TaskSpec, Scenario]:
        key = f"{self.capability.name}/{self.seed}/{self.difficulty}/{split}/{index}"
        task_id = f"{self.name}/{key}"
        if task_id not in self._scenarios:
            scenario = self._draw(split, index, key)
            self._scenarios[task_id] = (TaskSpec(task_id, split, scenario.variant), scenario)
        return self._scenarios[task_id]

    def level(self, key: str) -> int:
        """The level of the task with `key`: the difficulty, or in a mix the upper level with probability
        difficulty - lower (a draw of its own from the key, so the generator's draws stay the key's)."""
        lower, upper = self.levels
        return upper if random.Random(f"{key}/level").random() < self.difficulty - lower else lower

    def _draw(self, split: str, index: int, key: str) -> Scenario:
        """Task `index` of `split`: the generator's scenario for the task's key at the task's level."""
        return self.capability.generate(random.Random(key), self.level(key), self._catalogue)
