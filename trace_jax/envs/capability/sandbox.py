"""Validation and export of an LLM-written capability module (see `authoring`), isolated as untrusted code.

The module's source is never imported by the caller. `validate_module` runs it in a process isolated by
`trace_jax.isolation` (no network, no view of the home folder or the repository, nothing writable but an
in-memory working folder, one process, everything killed at the end), which loads τ²'s catalogue of the
domain, limits its own address space and CPU time (`resource.setrlimit`, the module's budget on top of the
process's start-up), then loads the module. That process builds the module's `Capability` and, for seeds
0..N-1 at every difficulty, generates the scenario (twice: it must be deterministic), checks it, and plays the
gold solution and an agent that does nothing through `CapabilityEpisode` (the standard reward); seed i at
difficulty d is train task i of `CapabilityEnvironment(capability, seed=0, difficulty=d)`. A module passes
when the gold solution scores 1.0 on >= `min_gold_success` of the seeds at each difficulty, doing nothing
scores at most `max_empty_reward` on average, and no seed raises (a gold call that is malformed or that τ²
answers with an error, a scenario that breaks the API or changes between equal rngs all count as raising).

The caller does not trust that process's verdict: the module shares its process and could write any report.
A module that says it passed has its train and held-out tasks exported to JSON there (catalogue entries:
products or flights, stored once), and a second isolated process, which loads no written code, replays the
gold solution and the empty agent on the exported scenarios and checks every exported one; the verdict is
computed by the caller from that replay, and a report it cannot read is a failed validation. The exported
file is what training uses: `ExportedEnvironment` serves it where `CapabilityEnvironment` is used, without
importing the module's code. Failure reports hold no temporary paths or timings, so a conversation that
quotes them is the same in a rerun (and the LLM client's cache answers it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import random
import resource
import shutil
import signal
import sys
import tempfile
import traceback
import types
from collections.abc import Callable

from trace_jax.envs.base import END_MAX_TURNS, Outcome, TaskSpec
from trace_jax.envs.capability.authoring import (
    AuthoringError,
    capability_from_module,
    check_scenario,
)
from trace_jax.envs.capability.domains import WorldDomain, world_domain
from trace_jax.envs.capability.environment import (
    CUT_SHARE,
    SPLITS,
    Capability,
    CapabilityEnvironment,
    CapabilityEpisode,
    Scenario,
)
from trace_jax.envs.scripted import GoldAgent, NoopAgent
from trace_jax.files import read_json, write_json_atomic
from trace_jax.isolation import WORKDIR, Confinement, IsolatedRun, run_isolated
from trace_jax.tool_calls import parse_assistant_output

MODULE_FILE = "module.py"  # the module's name in the child's folder (and in its tracebacks)
SHOWN = 3  # distinct exceptions and gold failures quoted in a report
TRACE_CHARS = 1200  # a quoted traceback's tail
MAX_REPORT_CHARS = 20_000  # a report read back from an isolated run (the module may have written it)


@dataclasses.dataclass(frozen=True)
class Checks:
    """What a module must pass: `seeds` seeds at every difficulty, and the thresholds on them."""

    seeds: int = 100
    min_gold_success: float = 0.95  # share of seeds, at each difficulty, where the gold solution scores 1.0
    max_empty_reward: float = 0.1  # mean reward of the agent that does nothing, at each difficulty


@dataclasses.dataclass(frozen=True)
class Limits:
    """An isolated run's limits: wall clock for the whole run; CPU time and memory on top of its start-up; the
    in-memory working folder (the export included)."""

    timeout_s: float = 600.0
    cpu_s: float = 300.0
    memory_mb: int = 2048
    disk_mb: int = 1024


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    """A module's validation: its rates per difficulty, the first problems, and whether it passed."""

    passed: bool
    checks: Checks
    error: str = ""  # what stopped the whole run (no code, import, API, limits, crash); "" when none did
    name: str = ""  # the module's NAME once it loaded
    gold_success: tuple[float, ...] = ()  # by difficulty
    empty_reward: tuple[float, ...] = ()  # by difficulty
    exceptions: int = 0  # plays (seed, difficulty) that raised
    first_exceptions: tuple[str, ...] = ()  # the first distinct ones, each with the plays that raised it
    gold_failures: tuple[str, ...] = ()  # the first plays where the gold solution scored below 1.0
    exported: int = 0  # scenarios written by the export

    @classmethod
    def failed(cls, error: str, checks: Checks, name: str = "") -> ValidationReport:
        """A report of a run that something stopped before any verdict on the seeds."""
        return cls(passed=False, checks=checks, error=error, name=name)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ValidationReport:
        tuples = {k: tuple(v) for k, v in data.items() if isinstance(v, list)}
        return cls(**{**data, **tuples, "checks": Checks(**data["checks"])})

    def failure_report(self) -> str:
        """What failed, in words meant for the module's author ("" when the module passed)."""
        if self.passed:
            return ""
        if self.error:
            return self.error
        checks, levels = self.checks, ", ".join(str(d) for d in range(len(self.gold_success)))
        lines = [f"The module was played on {checks.seeds} seeds at each of its difficulties ({levels})."]
        if self.exceptions:
            lines.append(
                f"{self.exceptions} plays raised an exception or broke the authoring API (none may); the "
                "first problems:"
            )
            lines += self.first_exceptions
        if min(self.gold_success) < checks.min_gold_success:
            shares = ", ".join(f"{s:.0%}" for s in self.gold_success)
            lines.append(
                f"The gold solution scored 1.0 on {shares} of the seeds at difficulties {levels} (it must on "
                f">= {checks.min_gold_success:.0%} at each; a seed that raised counts as a failure)"
                + ("; the first failures:" if self.gold_failures else ".")
            )
            lines += self.gold_failures
        if max(self.empty_reward) > checks.max_empty_reward:
            means = ", ".join(f"{r:.2f}" for r in self.empty_reward)
            lines.append(
                f"An agent that does nothing scored {means} on average at difficulties {levels} (it must "
                f"score <= {checks.max_empty_reward} at each)."
            )
        return "\n".join(lines)


def _passed(report: ValidationReport) -> bool:
    checks = report.checks
    return (
        not report.error
        and not report.exceptions
        and bool(report.gold_success)
        and min(report.gold_success) >= checks.min_gold_success
        and max(report.empty_reward) <= checks.max_empty_reward
    )


# --- the caller's side ---


def validate_module(
    source: str,
    *,
    name: str | None = None,
    domain: str = "retail",
    checks: Checks = Checks(),
    limits: Limits = Limits(),
    export: pathlib.Path | None = None,
    export_tasks: int = 200,
) -> ValidationReport:
    """Validates `source` isolated from the machine (see the module docstring); given `export`, a module that
    passes has `export_tasks` train and held-out tasks per difficulty written there. The module's DOMAIN must be
    `domain` and, with `name`, its NAME must be it. Whatever the module does (loops, allocates, crashes, forges
    its report), this returns a report; it raises IsolationUnavailable where the machine cannot isolate it."""
    world_domain(domain)  # an unknown domain fails here, naming the valid ones
    tasks = max(checks.seeds, export_tasks if export is not None else 0)
    spec = {
        "name": name,
        "domain": domain,
        "checks": dataclasses.asdict(checks),
        "cpu_s": limits.cpu_s,
        "memory_mb": limits.memory_mb,
        "export_tasks": tasks,
    }
    with tempfile.TemporaryDirectory(prefix="trace_jax_sandbox_") as tmp:
        folder = pathlib.Path(tmp)
        (folder / MODULE_FILE).write_text(source, encoding="utf-8")
        (folder / SPEC).write_text(json.dumps({**spec, "mode": "module"}), encoding="utf-8")
        run = _isolated(folder, (MODULE_FILE, SPEC), (REPORT, SCENARIOS), limits)
        claimed = _report(folder / REPORT, run, checks, limits)
        if not claimed.passed:
            return claimed
        if not (folder / SCENARIOS).is_file():
            return ValidationReport.failed("The module's run reported a pass but exported no scenarios.", checks)
        (folder / SPEC).write_text(json.dumps({**spec, "mode": "replay"}), encoding="utf-8")
        run = _isolated(folder, (SPEC, SCENARIOS), (REPLAY,), limits)
        replay = _report(folder / REPLAY, run, checks, limits, replaying=True)
        report = dataclasses.replace(
            claimed,
            **{f: getattr(replay, f) for f in _REPLAYED},
            exported=0 if export is None else replay.exported,
        )
        report = dataclasses.replace(report, passed=_passed(report) and replay.passed)
        if report.passed and export is not None:
            export = pathlib.Path(export)
            staged = export.with_name(export.name + ".partial")
            shutil.copyfile(folder / SCENARIOS, staged)
            os.replace(staged, export)
        return report


SPEC, REPORT, SCENARIOS, REPLAY = "spec.json", "report.json", "scenarios.json", "replay.json"
# what the caller takes from the replay of the exported scenarios, never from the module's own report
_REPLAYED = ("error", "name", "gold_success", "empty_reward", "exceptions", "first_exceptions", "gold_failures")


def _isolated(folder: pathlib.Path, inputs: tuple[str, ...], outputs: tuple[str, ...], limits: Limits) -> IsolatedRun:
    """`python -m` this module on the spec in `folder`, isolated as untrusted code."""
    package = pathlib.Path(__file__).resolve().parents[2]  # trace_jax/
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": WORKDIR,
        "TMPDIR": f"{WORKDIR}/tmp",
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(package.parent),
        "PYTHONHASHSEED": "0",  # set order is the same in every run
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # τ²'s LLM library would fetch it over the network
    }
    return run_isolated(
        [sys.executable, "-m", __name__, SPEC],
        folder,
        inputs=inputs,
        outputs=outputs,
        readable=(sys.base_prefix, sys.prefix, str(package)),
        env=env,
        confinement=Confinement(timeout_s=limits.timeout_s, disk_mb=limits.disk_mb),
        stderr_chars=TRACE_CHARS,
    )


def _report(
    path: pathlib.Path, run: IsolatedRun, checks: Checks, limits: Limits, replaying: bool = False
) -> ValidationReport:
    """The report an isolated run wrote at `path`, read as untrusted data: anything but a well-formed report
    is a failed validation saying why."""
    stage = "Replaying the module's exported scenarios" if replaying else "The module's run"
    if run.returncode is None:
        return ValidationReport.failed(
            f"{stage} went past the wall-clock limit of {limits.timeout_s:g} s and was stopped: make "
            "generate quick and free of endless loops.",
            checks,
        )
    if not path.exists():
        return ValidationReport.failed(
            _death(run, limits) if not replaying else f"{stage} failed: {_death(run, limits)}", checks
        )
    try:
        report = ValidationReport.from_json(read_json(path))
        if report.checks != checks or not isinstance(report.passed, bool):
            raise ValueError("a report for other checks")
        if len(json.dumps(report.to_json())) > MAX_REPORT_CHARS:  # it is quoted to the module's author
            raise ValueError(f"over {MAX_REPORT_CHARS} characters")
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as error:
        return ValidationReport.failed(f"{stage} left a report that is not a validation report ({error}).", checks)
    return report


def _death(run: IsolatedRun, limits: Limits) -> str:
    """Why an isolated run that wrote no report died, in words for the module's author."""
    if run.signal in (signal.SIGXCPU, signal.SIGKILL):
        return (
            f"The module ran past the CPU-time limit of {limits.cpu_s:g} s and was stopped (signal "
            f"{signal.Signals(run.signal).name}): make generate quick and free of endless loops."
        )
    if "MemoryError" in run.stderr:
        return f"The module ran past the memory limit of {limits.memory_mb} MB (MemoryError) and was stopped."
    return (
        f"The sandbox process ended (exit code {run.returncode}) without a report; its last output:\n"
        f"{run.stderr.strip()}"
    )


# --- scenarios as JSON (catalogue entries stored once per file) ---


def _pack(scenario: Scenario, domain: WorldDomain, entries: dict[str, dict]) -> dict:
    """The scenario as JSON; its DB's catalogue entries (products, flights) go to `entries` under a hash of
    their content."""
    db = scenario.db.model_dump(mode="json")
    refs = {}
    for key, entry in db[domain.catalogue_field].items():
        ref = hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:16]
        entries.setdefault(ref, entry)
        refs[key] = ref
    return {
        "variant": scenario.variant,
        "ticket": scenario.ticket,
        "prefilled": list(scenario.prefilled),
        "gold_calls": list(scenario.gold_calls),
        "facts": list(scenario.facts),
        "db": {**db, domain.catalogue_field: refs},
    }


def _unpack(data: dict, domain: WorldDomain, entries: dict[str, dict]) -> Scenario:
    field = domain.catalogue_field
    db = {**data["db"], field: {key: entries[ref] for key, ref in data["db"][field].items()}}
    return Scenario(
        variant=data["variant"],
        db=domain.db_type.model_validate(db),
        ticket=data["ticket"],
        prefilled=tuple(data["prefilled"]),
        gold_calls=tuple(data["gold_calls"]),
        facts=tuple(data["facts"]),
    )


def _exported_only(rng: random.Random, difficulty: int, catalogue: dict) -> Scenario:
    raise RuntimeError("an exported environment serves the scenarios of its file; it generates none")


class ExportedEnvironment(CapabilityEnvironment):
    """A written capability's tasks from the file its validated module exported: the same tasks, episodes and
    reward as `CapabilityEnvironment(its capability, seed=0)`, without importing the module's code (in a mix of
    two levels, task i is the exported task i of its level)."""

    def __init__(
        self,
        path: str | pathlib.Path,
        difficulty: float = 0,
        policy: bool = True,
        num_tasks: int | None = None,
        cut_share: float = CUT_SHARE,
    ):
        """`num_tasks`: how many tasks `tasks(split)` gives by default (None: every exported one)."""
        self.path = pathlib.Path(path)
        data = read_json(self.path)
        capability = Capability(
            name=data["name"],
            description=data["description"],
            generate=_exported_only,
            tools=tuple(tuple(t) for t in data["tools"]),
            domain=data["domain"],
        )
        super().__init__(
            capability,
            seed=0,
            difficulty=difficulty,
            policy=policy,
            num_tasks=data["tasks"] if num_tasks is None else num_tasks,
            cut_share=cut_share,
        )
        self._entries = data["catalogue"]
        self._pools = {split: data["scenarios"][split] for split in SPLITS}  # by level

    def _draw(self, split: str, index: int, key: str, level: int) -> Scenario:
        pool = self._pools[split][level]
        if index >= len(pool):
            raise ValueError(
                f"{self.path} holds {len(pool)} {split} tasks of difficulty {level}; "
                f"task {index} was asked for: export more (config.env_writer.export_tasks)"
            )
        return _unpack(pool[index], self.domain, self._entries)


# --- the child's side ---


def _short(error: BaseException) -> str:
    """An exception as the author should read it: the API's own errors by message, others by the traceback's
    frames in the module (or, where it has none, the last two) and the exception."""
    if isinstance(error, AuthoringError):
        return f"AuthoringError: {error}"
    trace = traceback.TracebackException.from_exception(error)
    frames = [f for f in trace.stack if f.filename == MODULE_FILE] or list(trace.stack)[-2:]
    text = "".join(
        [
            "Traceback (most recent call last):\n",
            *traceback.StackSummary.from_list(frames).format(),
            *trace.format_exception_only(),
        ]
    ).strip()
    return text if len(text) <= TRACE_CHARS else "..." + text[-TRACE_CHARS:]


def _scenario(capability: Capability, catalogue: dict, difficulty: int, split: str, index: int) -> Scenario:
    """Task `index` of `split` as `CapabilityEnvironment(capability, seed=0)` draws it, checked, generated twice
    (it must not change) and passed through its JSON form (as the export serves it)."""
    key = f"{capability.name}/0/{difficulty}/{split}/{index}"
    first, again = (capability.generate(random.Random(key), difficulty, catalogue) for _ in range(2))
    check_scenario(first, difficulty, capability.tools[difficulty], capability.domain)
    domain = world_domain(capability.domain)
    entries: dict[str, dict] = {}
    data = _pack(first, domain, entries)
    if _pack(again, domain, {}) != data:
        raise AuthoringError(
            "generate gave two different scenarios for equal rngs: draw every random value from "
            "rng and choose from sorted lists"
        )
    return _unpack(data, domain, entries)


def _play(env: CapabilityEnvironment, spec: TaskSpec, scenario: Scenario, agent: GoldAgent | NoopAgent) -> Outcome:
    """One episode of a scripted agent, its turns parsed as the rollout engine parses them; a gold call that is
    malformed or that τ² answers with an error raises AuthoringError."""
    episode = CapabilityEpisode(spec, scenario, env.system_prompt, env.tools, env.cut_share, env.domain)
    episode.reset()
    for _ in range(len(scenario.gold_calls) + 2):
        parsed = parse_assistant_output(agent.reply(episode), env.tools)
        if parsed.errors:
            raise AuthoringError(f"a gold call is not a valid call of the offered tools: {parsed.errors[0]}")
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]
        message = {"role": "assistant", "content": parsed.content, **({"tool_calls": calls} if calls else {})}
        result = episode.step(message)
        failed = [o["content"] for o in result.observations if str(o["content"]).startswith("Error")]
        if failed:
            raise AuthoringError(
                f"the gold call {calls[0]['name']}({json.dumps(calls[0]['arguments'])}) fails in "
                f"τ²: {failed[0]}; every gold call must succeed on the scenario's db"
            )
        if episode.end_reason is not None:
            break
    else:
        episode.end(END_MAX_TURNS)
    return episode.evaluate()


def _gold_failure(seed: int, difficulty: int, scenario: Scenario, outcome: Outcome) -> str:
    info = outcome.info
    problems = [f"{k}: {info[k]}" for k in ("missing_calls", "stray_writes", "failed_communicate") if info.get(k)]
    return f"seed {seed}, difficulty {difficulty} (variant {scenario.variant!r}): reward {outcome.reward}; " + (
        "; ".join(problems) or f"components {outcome.components}"
    )


def _grouped(problems: dict[str, list[str]]) -> list[str]:
    """The first SHOWN distinct problems, each after the plays that raised it."""
    return [
        f"{len(plays)} plays ({', '.join(plays[:SHOWN])}{', ...' if len(plays) > SHOWN else ''}): {text}"
        for text, plays in list(problems.items())[:SHOWN]
    ]


def _validate(
    capability: Capability, checks: Checks, scenario_at: Callable[[int, str, int], Scenario]
) -> ValidationReport:
    """The capability's report on the seeds (see the module docstring); `scenario_at(difficulty, split, index)`
    gives a checked scenario (generated by the module, or read from its export)."""
    problems: dict[str, list[str]] = {}  # an exception's text -> the plays that raised it
    gold_failures, gold_success, empty_reward = [], [], []
    for difficulty in range(capability.max_difficulty + 1):
        env = CapabilityEnvironment(capability, difficulty=difficulty, policy=False)
        gold, empty = [], []
        for seed in range(checks.seeds):
            try:
                scenario = scenario_at(difficulty, "train", seed)
                spec = TaskSpec(f"validation/{difficulty}/{seed}", "train", scenario.variant)
                outcome = _play(env, spec, scenario, GoldAgent())
                empty.append(_play(env, spec, scenario, NoopAgent()).reward)
            except MemoryError:
                raise
            except BaseException as error:  # noqa: BLE001 - the module's code may raise anything, SystemExit too
                problems.setdefault(_short(error), []).append(f"seed {seed} at difficulty {difficulty}")
                continue
            gold.append(outcome.reward >= 1.0)
            if outcome.reward < 1.0:
                gold_failures.append(_gold_failure(seed, difficulty, scenario, outcome))
        gold_success.append(sum(gold) / checks.seeds)
        empty_reward.append(sum(empty) / max(1, len(empty)))
    report = ValidationReport(
        passed=False,
        checks=checks,
        name=capability.name,
        gold_success=tuple(gold_success),
        empty_reward=tuple(empty_reward),
        exceptions=sum(map(len, problems.values())),
        first_exceptions=tuple(_grouped(problems)),
        gold_failures=tuple(gold_failures[:SHOWN]),
    )
    return dataclasses.replace(report, passed=_passed(report))


def _export(capability: Capability, catalogue: dict, tasks: int, path: pathlib.Path) -> int:
    """Writes `tasks` train and held-out scenarios per difficulty to `path`; returns how many."""
    domain = world_domain(capability.domain)
    entries: dict[str, dict] = {}
    scenarios = {
        split: [
            [
                _pack(_scenario(capability, catalogue, difficulty, split, index), domain, entries)
                for index in range(tasks)
            ]
            for difficulty in range(capability.max_difficulty + 1)
        ]
        for split in SPLITS
    }
    write_json_atomic(
        path,
        {
            "name": capability.name,
            "description": capability.description,
            "domain": capability.domain,
            "tools": [list(t) for t in capability.tools],
            "tasks": tasks,
            "catalogue": entries,
            "scenarios": scenarios,
        },
    )
    return tasks * len(SPLITS) * (capability.max_difficulty + 1)


def _limit(cpu_s: float, memory_mb: int) -> None:
    """Caps this process's CPU time and address space at what it has used so far plus the module's budget."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(used.ru_utime + used.ru_stime + cpu_s)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))  # SIGXCPU at the soft limit, SIGKILL at the hard one
    try:
        status = pathlib.Path("/proc/self/status").read_text(encoding="utf-8")
        vm_size = 1024 * int(next(line for line in status.splitlines() if line.startswith("VmSize:")).split()[1])
    except OSError:  # isolated without a /proc: the interpreter and τ² take well under this
        vm_size = 4 * 2**30
    memory = vm_size + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _load() -> types.ModuleType:
    """The module from `MODULE_FILE` in the working folder, under that relative name (tracebacks show it)."""
    module = types.ModuleType("written_capability")
    module.__file__ = MODULE_FILE
    sys.modules[module.__name__] = module  # as an import registers it (dataclasses look their module up)
    exec(compile(pathlib.Path(MODULE_FILE).read_text(encoding="utf-8"), MODULE_FILE, "exec"), module.__dict__)  # noqa: S102 - isolated
    return module


def _run_module(spec: dict) -> ValidationReport:
    """The module's isolated run: limits, load, validation and, for a module that passes, the export."""
    catalogue = world_domain(spec["domain"]).catalogue()  # loaded before the limits: they budget the module alone
    checks = Checks(**spec["checks"])
    _limit(spec["cpu_s"], spec["memory_mb"])
    memory_error = f"The module ran past the memory limit of {spec['memory_mb']} MB (MemoryError) and was stopped."
    try:
        module = _load()
        try:
            capability = capability_from_module(module, spec["name"], spec["domain"])
        except AuthoringError as error:
            return ValidationReport.failed(f"The module breaks the authoring API: {error}", checks)
        report = _validate(
            capability, checks, lambda difficulty, split, i: _scenario(capability, catalogue, difficulty, split, i)
        )
    except MemoryError:
        return ValidationReport.failed(memory_error, checks)
    except BaseException as error:  # noqa: BLE001 - the module's code may raise anything, SystemExit too
        return ValidationReport.failed(
            f"The module failed to load or to build its capability:\n{_short(error)}", checks
        )
    if not report.passed:
        return report
    try:
        exported = _export(capability, catalogue, spec["export_tasks"], pathlib.Path(SCENARIOS))
    except MemoryError:
        return ValidationReport.failed(memory_error, checks, report.name)
    except BaseException as error:  # noqa: BLE001 - as above
        return ValidationReport.failed(f"Generating the tasks to export failed:\n{_short(error)}", checks, report.name)
    return dataclasses.replace(report, exported=exported)


def _replay(spec: dict) -> ValidationReport:
    """The replay's isolated run, which loads no written code: the exported file read as `ExportedEnvironment`
    serves it, its capability put through the authoring API's checks, every exported scenario checked, and the
    seeds played by the gold and the empty agent on the exported scenarios."""
    checks = Checks(**spec["checks"])
    _limit(spec["cpu_s"], spec["memory_mb"])
    fail = lambda problem: ValidationReport.failed(f"The module's exported scenarios {problem}", checks)
    try:
        env = ExportedEnvironment(SCENARIOS)
        data = read_json(pathlib.Path(SCENARIOS))
        declared = types.SimpleNamespace(
            NAME=data["name"],
            DOMAIN=data["domain"],
            DESCRIPTION=data["description"],
            TOOLS=env.capability.tools,
            generate=_exported_only,
        )
        capability = capability_from_module(declared, spec["name"], spec["domain"])
        tasks, levels = data["tasks"], capability.max_difficulty + 1
        if tasks != spec["export_tasks"] or any(
            len(env._pools[split]) != levels or any(len(pool) != tasks for pool in env._pools[split])
            for split in SPLITS
        ):
            return fail(f"are not {spec['export_tasks']} tasks per split and each of the {levels} difficulties.")
        exported = {}
        for split in SPLITS:
            for difficulty in range(levels):
                for index in range(tasks):
                    scenario = env._draw(split, index, "", difficulty)
                    check_scenario(scenario, difficulty, capability.tools[difficulty], capability.domain)
                    exported[difficulty, split, index] = scenario
    except MemoryError:
        return fail(f"take more than the memory limit of {spec['memory_mb']} MB.")
    except Exception as error:  # noqa: BLE001 - the file is untrusted data: any failure to read it is its fault
        return fail(f"are not a valid export: {type(error).__name__}: {str(error)[:TRACE_CHARS]}")
    report = _validate(capability, checks, lambda difficulty, split, i: exported[difficulty, split, i])
    return dataclasses.replace(report, exported=tasks * len(SPLITS) * levels)


if __name__ == "__main__":
    _spec = read_json(pathlib.Path(SPEC))
    if _spec["mode"] == "replay":
        write_json_atomic(pathlib.Path(REPLAY), _replay(_spec).to_json())
    else:
        write_json_atomic(pathlib.Path(REPORT), _run_module(_spec).to_json())
