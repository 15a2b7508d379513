"""Capability environments (TRACE stage 2): seeded tasks of a τ² domain (retail, airline: `domains`) that
each exercise one capability, on synthetic worlds, with τ²'s tools and policy of the domain and a
reward computed by code.

A generator turns (random draw, difficulty) into a `Scenario`: a synthetic world, a
ticket, the calls already made before the agent's first turn (a pre-filled conversation:
authentication and look-ups done, so the agent's work is the capability itself), the
calls the agent still has to make and the facts its reply must state. The agent sees the
pre-filled turns exactly as it would have written them (`<tool_call>` blocks) with τ²'s
real results. Splits draw from disjoint seed streams; every task is a pure function of
(capability, seed, difficulty, variant, split, index).

Levels. Difficulty 0 up to `max_difficulty` are the generator's. Below 0 are scaffolded levels, for an
agent that never succeeds at level 0: each applies one more of the capability's `scaffolds` to the level-0
task (`scaffold`):
  "prefill"     the gold calls before the last write (or before the last call, where none writes) are
                pre-filled as the agent's own turns, so the agent does the last write(s);
  "exact_hint"  a hinted episode's hint spells the remaining calls out with their arguments, and the facts;
  "opened_call" a hinted episode's first agent turn is opened for the agent with the next gold call's tool
                name (`<tool_call>` and the name, `CapabilityEpisode.opening`): the agent writes the rest;
  "written_call" the whole next gold call is written in (`</tool_call>` included): the agent ends the turn
                and goes on from the call's result.
The learner takes the tokens written in as the agent's own (rescored without the hint), so where a hinted episode
scores above its group, the tool (or the whole call) the agent never chose becomes likelier unhinted: at its
deepest level GRPO is advantage-weighted imitation of the gold call, and the curriculum climbs out of it.
`variant` restricts an environment to one kind of the generator's tasks (its `Scenario.variant`: tool_calling's
cancel / return / address / default_address), so a level cannot pass on work the agent already does
(`Capability.families` lists the kinds meant as separate level families). A variant's family has the levels
up to 0: its level 0 is the generator's top difficulty (where every kind is drawn), each task drawn again from
its key until it is of that kind, with the top difficulty's tools.

The reward (the paper's): 1.0 when every gold call was made with its key arguments (lists compared as sets),
no other write was attempted (even one the system rejects: trying a forbidden write is the failure), the DB
equals the gold replay's, the episode ended normally and its text turns state every required fact (τ²'s
COMMUNICATE check); otherwise 0.6 x the share of gold calls made minus 0.1 per wrong write, clipped to [0, 1].
A wrong write so always costs: it earns less than the same episode without it. An episode cut at a limit
(turns, errors, a turn's length) keeps only `cut_share` of that (τ²'s rule: 0).

Hints. A hinted episode (`episode(task, hint=True)`: a share of training and calibration episodes) has the task's
hint appended to its system prompt ("Hint: ..."), nothing else changed: the capability's general guidance, then
each remaining gold call by tool with where each argument's value is on the page (`trace_jax.envs.hints`), or at
an "exact_hint" level the calls themselves; at an "opened_call" or "written_call" level its first turn is opened
too. Evaluation never hints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections import Counter
from collections.abc import Callable

from tau2.data_model.message import AssistantMessage
from tau2.environment.db import DB
from tau2.environment.environment import Environment
from tau2.evaluator.evaluator_communicate import CommunicateEvaluator

from trace_jax.envs.base import NORMAL_ENDS, Call, Gold, Message, Outcome, TaskSpec
from trace_jax.envs.capability.domains import WorldDomain, world_domain
from trace_jax.envs.embedded_retail import SoloTicketEpisode
from trace_jax.envs.hints import replay_sources, task_hint
from trace_jax.envs.tau2_bridge import execute
from trace_jax.tool_calls import format_tool_call

SPLITS = ("train", "heldout")
# The scaffolds (module docstring) in the order levels below 0 add them, and those that change hinted episodes alone
SCAFFOLDS = ("prefill", "exact_hint", "opened_call", "written_call")
HINTED_SCAFFOLDS = frozenset({"exact_hint", "opened_call", "written_call"})
DONE_CREDIT = 0.6  # the reward of all gold calls made, short of success; a share of them earns its share
WRONG_WRITE_COST = 0.1  # taken off per write the task does not call for
CUT_SHARE = 0.0  # the share of its reward an episode cut at a limit keeps, by default: τ²'s rule (it fails)
MAX_VARIANT_DRAWS = 200  # draws of a task's key before a variant is taken to be out of the generator's reach


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
    """A capability environment: its domain, its generator, the tools it offers at each difficulty (τ²'s
    schemas of those names, the same for every task of one difficulty) and the scaffolds of its levels below 0."""

    name: str
    description: str
    generate: Generator
    tools: tuple[tuple[str, ...], ...]  # by difficulty
    hint: str = ""  # general guidance that opens every hint of the capability's tasks
    domain: str = "retail"  # a name in `domains.DOMAINS`
    scaffolds: tuple[str, ...] = SCAFFOLDS  # those that change its tasks, in order: level -k has the first k
    families: tuple[str, ...] = ()  # variants that are separate kinds of work, each calibrated on its own

    def __post_init__(self):
        unknown = [s for s in self.scaffolds if s not in SCAFFOLDS]
        if unknown or len(set(self.scaffolds)) != len(self.scaffolds):
            raise ValueError(
                f"capability {self.name!r}: scaffolds {self.scaffolds} must be distinct names of {', '.join(SCAFFOLDS)}"
            )

    @property
    def max_difficulty(self) -> int:
        return len(self.tools) - 1

    @property
    def min_difficulty(self) -> int:
        """The most scaffolded level."""
        return -len(self.scaffolds)


def _is_write(call: Call, write_tools: frozenset[str]) -> bool:
    return call["name"] in write_tools


def scaffold(scenario: Scenario, scaffolds: tuple[str, ...], write_tools: frozenset[str]) -> Scenario:
    """`scenario` with the task-changing `scaffolds` applied ("exact_hint" changes only the hint): "prefill" moves
    the gold calls before the last write (before the last call, where none writes) into the pre-filled turns."""
    if "prefill" not in scaffolds:
        return scenario
    gold = scenario.gold_calls
    writes = [i for i, c in enumerate(gold) if _is_write(c, write_tools)]
    cut = writes[-1] if writes else max(len(gold) - 1, 0)
    return dataclasses.replace(scenario, prefilled=scenario.prefilled + gold[:cut], gold_calls=gold[cut:])


def _canonical(call: Call) -> str:
    """A call's name and key arguments, lists compared as sets (the order of item ids is no argument)."""
    arguments = {k: sorted(v, key=json.dumps) if isinstance(v, list) else v for k, v in call["arguments"].items()}
    return json.dumps([call["name"], arguments], sort_keys=True)


def call_credit(gold: tuple[Call, ...], made: list[Call], write_tools: frozenset[str]) -> tuple[int, int]:
    """(gold calls made, writes made that no gold call matches), each gold call matched at most once."""
    left = Counter(_canonical(c) for c in gold)
    done = wrong = 0
    for call in made:
        key = _canonical(call)
        if left[key] > 0:
            left[key] -= 1
            done += 1
        elif _is_write(call, write_tools):
            wrong += 1
    return done, wrong


def partial_reward(done: int, gold: int, wrong: int) -> float:
    """The paper's reward short of success: 0.6 x the share of gold calls made - 0.1 per wrong write, in [0, 1]."""
    share = done / gold if gold else 0.0
    return min(1.0, max(0.0, DONE_CREDIT * share - WRONG_WRITE_COST * wrong))


def call_opening(call: Call) -> str:
    """The start of `call` as the agent writes it, up to the end of its tool name (the closing quote left to
    the agent, so the forced tokens are those of the agent's own writing)."""
    text = format_tool_call(call["name"], call["arguments"])
    name = json.dumps(call["name"], ensure_ascii=False)
    return text[: text.index(name) + len(name) - 1]


class CapabilityEpisode(SoloTicketEpisode):
    """One scenario played once on its own copy of the scenario's world. `opening`: the text the agent's first
    turn is opened with (the hinted episodes of an "opened_call" or "written_call" level; "" otherwise), which the
    rollout engine writes in for the agent before it samples the rest of the turn."""

    def __init__(
        self,
        spec: TaskSpec,
        scenario: Scenario,
        prompt: str,
        tools: list[dict],
        cut_share: float,
        domain: WorldDomain,
        opening: str = "",
    ):
        self.task = spec
        self.domain = domain
        self.cut_share = cut_share
        self.tools = tools
        self.user_tools: list[dict] = []
        self.scenario = scenario
        self._prompt = prompt
        self.opening = opening
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
        """The paper's reward (module docstring), with each check as a component."""
        if self.end_reason is None:
            raise RuntimeError(f"episode {self.task.task_id} has not ended")
        gold = self.scenario.gold_calls
        made = [
            {"name": c["name"], "arguments": c["arguments"]}
            for m in self.messages[self._opening :]
            for c in m.get("tool_calls") or ()
        ]
        write_tools = self.domain.state.write_tools
        done, wrong = call_credit(gold, made, write_tools)
        replay = self.domain.environment(self.scenario.db)
        for i, call in enumerate(self.scenario.prefilled + gold):
            execute(replay, {"id": f"gold_{i}", **call})
        db = self._environment.get_db_hash() == replay.get_db_hash()
        texts = [
            AssistantMessage(role="assistant", content=m["content"])
            for m in self.messages[self._opening :]
            if m["role"] == "assistant" and m.get("content") and not m.get("tool_calls")
        ]
        missing = [
            c.info
            for c in CommunicateEvaluator.evaluate_communicate_info(texts, list(self.scenario.facts))
            if not c.met
        ]
        normal = self.end_reason in NORMAL_ENDS
        success = done == len(gold) and not wrong and db and normal and not missing
        reward = 1.0 if success else partial_reward(done, len(gold), wrong)
        if not normal:
            reward *= self.cut_share
        gold_keys = {_canonical(c) for c in gold}
        info = {
            "end_reason": self.end_reason,
            "failed_communicate": missing,
            "missing_calls": [
                f"{c['name']}({c['arguments']})" for c in gold if _canonical(c) not in {_canonical(m) for m in made}
            ],
            "wrong_writes": [
                f"{c['name']}({c['arguments']})"
                for c in made
                if _is_write(c, write_tools) and _canonical(c) not in gold_keys
            ],
        }
        components = {
            "calls": done / len(gold) if gold else 1.0,
            "wrong_writes": float(wrong),
            "DB": float(db),
            "COMMUNICATE": float(normal and not missing),
        }
        return Outcome(reward=reward, success=success, components=components, info=info)


class CapabilityEnvironment:
    """Unlimited seeded tasks of one capability, in disjoint train and held-out seed streams."""

    name = "capability"

    def __init__(
        self,
        capability: Capability,
        seed: int = 0,
        difficulty: float = 0,
        policy: bool = True,
        num_tasks: int = 200,
        cut_share: float = CUT_SHARE,
        variant: str | None = None,
    ):
        """`difficulty` in [capability.min_difficulty, capability.max_difficulty]: a level (below 0 a scaffolded
        one: module docstring), or between two levels a mix of them (each task of the upper one with probability
        difficulty - lower, drawn from the task's key; the tools of both offered: calibration's finer knob);
        `policy` puts τ²'s policy of the domain in the system prompt (as the target has it) or only the solo
        instruction (a short head, for CPU-sized runs); `cut_share` in [0, 1]: the share of its reward an
        episode cut at a limit keeps; `variant`: only tasks of that kind (None: every kind)."""
        low, high = capability.min_difficulty, 0 if variant is not None else capability.max_difficulty
        if not (isinstance(difficulty, (int, float)) and low <= difficulty <= high):
            raise ValueError(f"difficulty = {difficulty!r} is out of range for {capability.name}: {low} to {high}")
        if not (isinstance(cut_share, (int, float)) and 0 <= cut_share <= 1):
            raise ValueError(f"cut_share = {cut_share!r} is invalid; it must be a number in [0, 1]")
        if variant is not None and capability.families and variant not in capability.families:
            raise ValueError(
                f"variant = {variant!r} is invalid for {capability.name}; its families are "
                f"{', '.join(capability.families)}"
            )
        difficulty = int(difficulty) if float(difficulty).is_integer() else float(difficulty)  # 1.0 is level 1
        self.capability, self.seed, self.difficulty, self.num_tasks = capability, seed, difficulty, num_tasks
        self.variant = variant
        self.levels = (math.floor(difficulty), math.ceil(difficulty))
        self.cut_share = cut_share
        self.domain = world_domain(capability.domain)
        self._catalogue = self.domain.catalogue()
        offered = {tool for level in self.levels for tool in capability.tools[self._generator_difficulty(level)]}
        self.tools = [t for t in self.domain.state.tool_schemas if t["function"]["name"] in offered]
        self.system_prompt = self.domain.system_prompt(policy)
        self._scenarios: dict[str, tuple[TaskSpec, Scenario, int]] = {}

    def tasks(self, split: str, num: int | None = None) -> list[TaskSpec]:
        """The first `num` tasks of `split` (`num_tasks` when None)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        return [self._task(split, index)[0] for index in range(self.num_tasks if num is None else num)]

    def scenario(self, spec: TaskSpec) -> Scenario:
        """The scenario behind `spec` (from an earlier `tasks` call)."""
        return self._entry(spec)[1]

    def _entry(self, spec: TaskSpec) -> tuple[TaskSpec, Scenario, int]:
        if spec.task_id not in self._scenarios:
            raise ValueError(f"task {spec.task_id!r} did not come from this environment's tasks()")
        return self._scenarios[spec.task_id]

    def hint_for(self, spec: TaskSpec) -> str:
        """The hint of task `spec` (module docstring): its remaining gold calls with where their arguments come
        from, or at an "exact_hint" level the calls themselves, after the capability's general guidance."""
        _, scenario, level = self._entry(spec)
        per_call = replay_sources(
            self.domain.environment(scenario.db), scenario.ticket, scenario.prefilled, scenario.gold_calls
        )
        exact = "exact_hint" in self._scaffolds(level)
        return task_hint(
            scenario.gold_calls,
            per_call,
            scenario.facts,
            self.domain.state.write_tools,
            exact=exact,
            guidance=self.capability.hint,
        )

    def episode(self, task: TaskSpec, hint: bool = False) -> CapabilityEpisode:
        """A fresh episode of `task`; `hint` appends the task's hint to its system prompt and, at an "opened_call"
        or "written_call" level, opens the agent's first turn with the next gold call's tool name or the call."""
        prompt = f"{self.system_prompt}\n\nHint: {self.hint_for(task)}" if hint else self.system_prompt
        _, scenario, level = self._entry(task)
        scaffolds = self._scaffolds(level) if hint and scenario.gold_calls else ()
        first = scenario.gold_calls[0] if scaffolds else None
        opening = (
            format_tool_call(first["name"], first["arguments"])
            if "written_call" in scaffolds
            else call_opening(first)
            if "opened_call" in scaffolds
            else ""
        )
        return CapabilityEpisode(task, scenario, prompt, self.tools, self.cut_share, self.domain, opening)

    def _generator_difficulty(self, level: int) -> int:
        """The generator's difficulty behind a level: the level itself, 0 below it, the top one for a variant."""
        return self.capability.max_difficulty if self.variant is not None else max(level, 0)

    def _scaffolds(self, level: int) -> tuple[str, ...]:
        return self.capability.scaffolds[: max(-level, 0)]

    def _task(self, split: str, index: int) -> tuple[TaskSpec, Scenario, int]:
        variant = f"/{self.variant}" if self.variant else ""
        key = f"{self.capability.name}/{self.seed}/{self.difficulty}{variant}/{split}/{index}"
        task_id = f"{self.name}/{key}"
        if task_id not in self._scenarios:
            level = self.level(key)
            drawn = self._draw(split, index, key, self._generator_difficulty(level))
            scenario = scaffold(drawn, self._scaffolds(level), self.domain.state.write_tools)
            self._scenarios[task_id] = (TaskSpec(task_id, split, scenario.variant), scenario, level)
        return self._scenarios[task_id]

    def level(self, key: str) -> int:
        """The level of the task with `key`: the difficulty, or in a mix the upper level with probability
        difficulty - lower (a draw of its own from the key, so the generator's draws stay the key's)."""
        lower, upper = self.levels
        return upper if random.Random(f"{key}/level").random() < self.difficulty - lower else lower

    def _draw(self, split: str, index: int, key: str, level: int) -> Scenario:
        """Task `index` of `split`: the generator's scenario for the task's key at difficulty `level`, drawn again
        from the key until it is of this environment's variant."""
        for attempt in range(MAX_VARIANT_DRAWS):
            scenario = self.capability.generate(
                random.Random(key if attempt == 0 else f"{key}/{attempt}"), level, self._catalogue
            )
            if self.variant is None or scenario.variant == self.variant:
                return scenario
        raise ValueError(
            f"{self.capability.name} drew no task of variant {self.variant!r} at difficulty {level} in "
            f"{MAX_VARIANT_DRAWS} draws: the generator does not make it at that difficulty"
        )
