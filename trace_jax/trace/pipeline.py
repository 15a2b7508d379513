"""TRACE as one resumable job: base evaluation -> analysis -> environments -> training -> routing -> final
evaluation -> report.

Every stage writes to the workdir and is recorded in `stages.json` with its wall time once done;
a rerun skips finished stages, and the stage a kill interrupted resumes from what its jobs wrote
(evaluations from their episodes, GRPO from its checkpoints, analysis and calibration from their
files). A stage's wall time sums every process that worked on it (`stage_clock.json`). As several processes
of one JAX run, every process plays its share of the evaluations, calibrations and training; the analysis and
the report run on process 0 (docs/multihost.md). Layout:

  base_analysis/      the base agent on the target's analysis split (the analyst's trajectories)
  heldout/base/       the base agent on the held-out split, in the same batch (or `target.base_run`, checked
                      to be that run)
  analysis/           stage 1 (`trace_jax.trace.analysis`)
  environments/<c>/   stage 2: calibration of the selected capabilities' environments, by coverage, until
                      `environments.max_trained` pass; written/ holds the LLM-written module, its attempts
                      and exported tasks (`trace_jax.trace.env_writer`)
  adapters/<c>/       stage 3: the GRPO job per calibrated capability; its PEFT adapter in adapter/
  stages.json         also stage 4's routing: each held-out task's adapter, the router's weights, settings
                      and calibration offsets
  heldout/<c>/        each adapter alone on every held-out task (for the oracle routing)
  heldout/trace/      the routed final evaluation, every task under its own adapter in one batch (the episodes
                      of heldout/<c>/ and heldout/base/ taken, not played again)
  report.md, plots/, summary.json
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import threading
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging

from trace_jax import distributed
from trace_jax.agent.episodes import Routes, check_base_run, recorded_episodes
from trace_jax.agent.rollout import RolloutConfig
from trace_jax.envs import check_environment, make_environment
from trace_jax.envs.base import Environment, Gold, TaskSpec
from trace_jax.envs.capability import CAPABILITIES
from trace_jax.envs.capability.domains import DOMAINS
from trace_jax.envs.capability.environment import SCAFFOLDS
from trace_jax.envs.capability.sandbox import ValidationReport
from trace_jax.evaluation import evaluate, evaluate_together
from trace_jax.evaluation import validate_config as validate_evaluation_config
from trace_jax.files import read_json, write_json_atomic
from trace_jax.isolation import isolation_problem
from trace_jax.llm.client import ChatClient, LlmSettings
from trace_jax.lora import NO_ADAPTER
from trace_jax.models.model import load_model
from trace_jax.rl import trainer as grpo
from trace_jax.settings import (
    dotted,
    from_config,
    is_bool,
    is_str,
    non_negative_int,
    nonempty_str,
    positive_int,
    setting,
)
from trace_jax.trace.analysis import AnalysisSettings, analyze, make_analyst
from trace_jax.trace.analyst import CapabilityCard
from trace_jax.trace.calibration import (
    CalibrationSettings,
    calibrate_builtin,
    calibrate_capability,
    calibration_feedback,
    environment_config,
    walk_bounds,
)
from trace_jax.trace.diagnostics import DiagnosticsSettings, run_diagnostics
from trace_jax.trace.env_writer import EnvWriterSettings, write_environment
from trace_jax.trace.routing import CALIBRATIONS, RouteOption, Router
from trace_jax.trace.trace_report import oracle_routes, write_report
from trace_jax.trace.trajectories import compact, from_record, load_trajectories
from trace_jax.workdirs import claimed

STAGES = ("base", "analysis", "environments", "training", "routing", "final", "diagnostics", "report")
EXAMPLE_CHARS = 600  # a routing example's length
CLOCK_EVERY_S = 30.0  # how often a running stage's wall time is saved: a kill loses at most this much of it
SOURCES = ("builtin", "auto", "llm")  # environments.source: built-in generators only, built-in else written, written


@dataclasses.dataclass(frozen=True)
class TargetSettings:
    """The `target` block's tasks (its `env` and `rollout` are the evaluation job's: `heldout_evaluation`)."""

    analysis_split: str = setting("train", "a split of the target environment", nonempty_str)
    analysis_tasks: int = setting(140, "a positive int", positive_int)
    heldout_split: str = setting("heldout", "a split of the target environment", nonempty_str)
    heldout_tasks: int = setting(200, "a positive int", positive_int)
    base_run: str = setting("", '"" or the workdir of the base held-out evaluation', is_str)


@dataclasses.dataclass(frozen=True)
class RoutingSettings:
    """The `routing` block: the router's input and how its label scores are calibrated (`trace.routing`)."""

    max_messages: int = setting(10, "a positive int", positive_int)
    batch_size: int = setting(8, "a positive int", positive_int)
    calibration: str = setting("batch", " or ".join(f'"{c}"' for c in CALIBRATIONS), lambda v: v in CALIBRATIONS)


@dataclasses.dataclass(frozen=True)
class FinalSettings:
    """The `final` block."""

    per_adapter: bool = setting(True, "True (each adapter alone too: the oracle) or False", is_bool)


@dataclasses.dataclass(frozen=True)
class EnvironmentsSettings:
    """The `environments` block: where capability environments come from, and how many are trained."""

    source: str = setting("builtin", " or ".join(f'"{s}"' for s in SOURCES), lambda v: v in SOURCES)
    max_trained: int = setting(2, "an int >= 0 (0: all selected)", non_negative_int)


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """The blocks every pipeline config holds, read by `from_config`."""

    target: TargetSettings
    analysis: AnalysisSettings
    calibration: CalibrationSettings
    routing: RoutingSettings
    final: FinalSettings
    diagnostics: DiagnosticsSettings
    environments: EnvironmentsSettings


@dataclasses.dataclass(frozen=True)
class PipelineSettings(_Blocks):
    """A pipeline config's typed blocks, which the stages' libraries take; `env_writer` is None when environments
    are only built in, `llm` None unless the analyst or the writer is the LLM (`source = "auto"` checks it when it
    writes)."""

    env_writer: EnvWriterSettings | None = None
    llm: LlmSettings | None = None


def validate_config(config: ml_collections.ConfigDict, key: str = "") -> PipelineSettings:
    """The config's typed blocks (of the block at `key` of a config that holds one, as the experiment's `trace`);
    fails at start naming the first wrong key, in any stage's block."""
    at = functools.partial(dotted, key)
    blocks = from_config(_Blocks, config, key)
    # The evaluations' env, rollout and tensor are the pipeline's target.env, target.rollout, training.mesh.tensor.
    check_environment(config.target.env, at("target.env"))
    from_config(RolloutConfig, config.target.rollout, at("target.rollout"))
    tensor, devices = config.training.mesh.tensor, jax.local_device_count()
    if not positive_int(tensor) or devices % tensor:
        raise ValueError(
            f"config.{at('training.mesh.tensor')} = {tensor!r} is invalid; it must be a positive int that divides "
            f"this process's {devices} devices"
        )
    validate_evaluation_config(heldout_evaluation(config), key)
    # the training job's config is the `training` block, with an env made here
    env = environment_config("tool_calling", 0, blocks.calibration)
    grpo.validate_config(training_config(config, {"env": env}), at("training"))
    if blocks.calibration.hint_share != config.training.rollout.hint_share:
        raise ValueError(
            f"config.{at('calibration.hint_share')} = {blocks.calibration.hint_share} is invalid: calibration "
            f"must hint the share of each group that training does, config.{at('training.rollout.hint_share')} = "
            f"{config.training.rollout.hint_share}"
        )
    source, analyst = blocks.environments.source, blocks.analysis.analyst
    writes = source == "llm" or (source == "auto" and analyst == "llm")
    if writes and jax.process_count() > 1:  # the writer's sandbox and the calibrations it asks for run in one process
        raise ValueError(
            f"config.{at('environments.source')} = {source!r} with the {analyst} analyst may have the LLM write "
            'environments, which a run of several processes does not do: set it to "builtin" or run as one process'
        )
    if writes and isolation_problem():  # refused at start, never run unisolated
        raise ValueError(
            f"config.{at('environments.source')} = {source!r} with the {analyst} analyst may have the LLM write "
            f'environments, whose code this machine cannot isolate: {isolation_problem()} Or set it to "builtin".'
        )
    return PipelineSettings(
        **{f.name: getattr(blocks, f.name) for f in dataclasses.fields(blocks)},
        env_writer=None if source == "builtin" else from_config(EnvWriterSettings, config.env_writer, at("env_writer")),
        # "auto": checked once it writes
        llm=from_config(LlmSettings, config.llm, at("llm")) if "llm" in (analyst, source) else None,
    )


def _evaluation_config(
    config: ml_collections.ConfigDict, split: str, num_tasks: int, adapter: str = ""
) -> ml_collections.ConfigDict:
    """An evaluation job's config for the base agent (with `adapter`) on the target (greedy, the target's limits),
    its sampler sharded as training's (`training.mesh.tensor`)."""
    sharded = {"tensor": config.training.mesh.tensor} if config.training.mesh.tensor > 1 else {}
    return ml_collections.ConfigDict(
        dict(
            model=config.model,
            dtype=config.dtype,
            adapter=adapter,
            seed=config.seed,
            env=config.target.env.to_dict(),
            split=split,
            num_tasks=num_tasks,
            trials=1,
            rollout=config.target.rollout.to_dict(),
            log_every_s=config.log_every_s,
            **sharded,
        )
    )


def heldout_evaluation(config: ml_collections.ConfigDict, adapter: str = "") -> ml_collections.ConfigDict:
    """The evaluation job's config of the base agent (with `adapter`, a PEFT folder) on the target's held-out
    tasks."""
    return _evaluation_config(config, config.target.heldout_split, config.target.heldout_tasks, adapter)


def analysis_evaluation(
    config: ml_collections.ConfigDict, adapter: str = "", num_tasks: int | None = None
) -> ml_collections.ConfigDict:
    """The evaluation job's config of the base agent (with `adapter`) on the first `num_tasks` (default: all) of
    the target's analysis tasks."""
    target = config.target
    return _evaluation_config(config, target.analysis_split, num_tasks or target.analysis_tasks, adapter)


def training_config(config: ml_collections.ConfigDict, calibrated: dict) -> ml_collections.ConfigDict:
    """The GRPO job's config for one capability's calibrated environment (`calibrated["env"]`, the
    calibration's result; equal iterations for every capability)."""
    return grpo_config(config, {**calibrated["env"], "split": "train"}, hints=True)


def grpo_config(config: ml_collections.ConfigDict, env: dict, hints: bool) -> ml_collections.ConfigDict:
    """The GRPO job's config from the pipeline's `training` block, model and seed, on `env` (`hints`: keep the
    block's hinted share, for environments that offer hints). The seed is `training.seed` where the block sets
    one, else the pipeline's: a second training seed then leaves the base agent's, calibration's and the
    diagnostics' draws, and so their episodes, as they were."""
    training = ml_collections.ConfigDict(config.training.to_dict())
    seed = config.seed if training.get("seed") is None else training.seed
    training.update(model=config.model, dtype=config.dtype, seed=seed, log_every_s=config.log_every_s)
    training.env = env
    if not hints:
        training.rollout.hint_share = 0.0
    return training


def target_domain(env: ml_collections.ConfigDict) -> str:
    """The τ² domain of the target environment `env`, which its capability environments are built in."""
    return env.domain if env.name == "tau2" else "retail"  # the embedded environment is retail's


def calibration_evaluation(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The evaluation job's config that calibration plays: the base agent, episodes cut as training cuts them."""
    base = _evaluation_config(config, "train", config.calibration.seeds)
    base.rollout.update({k: config.training.rollout[k] for k in ("max_turns", "max_tokens_per_turn", "max_errors")})
    return base


class StageClock:
    """A stage's wall time summed over every process that worked on it: while the stage runs, a thread saves
    the running total to `path` every `every_s` (beside other stages' totals: a stage added before an unfinished
    one runs first, and the unfinished one's time must survive it), and the process that resumes the stage
    starts from it."""

    def __init__(self, path: pathlib.Path, stage: str, every_s: float = CLOCK_EVERY_S):
        self.path, self.stage, self.every_s = path, stage, every_s
        self._saved = read_json(path) if path.exists() else {}
        self.before = float(self._saved.get(stage, 0.0))
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._save_every, daemon=True)

    def seconds(self) -> float:
        return self.before + time.monotonic() - self._start

    def __enter__(self) -> StageClock:
        if distributed.is_main():  # the processes of one run share its wall time
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _save_every(self) -> None:
        while not self._stop.wait(self.every_s):
            write_json_atomic(self.path, {**self._saved, self.stage: round(self.seconds(), 1)})


class Stages:
    """The stages of a resumable job in `workdir`, in order: `stages.json` keeps each finished one's result and
    wall time (summed over every process that worked on it: `StageClock`), and `run` skips a finished one."""

    def __init__(self, workdir: pathlib.Path, names: tuple[str, ...]):
        self.workdir, self.names = workdir, names
        self.path = workdir / "stages.json"
        self.done: dict = read_json(self.path) if self.path.exists() else {}

    def run(self, name: str, run: Callable[[], dict]) -> dict:
        """Runs stage `name` unless it is done; returns its result."""
        number = f"{self.names.index(name) + 1}/{len(self.names)}"
        if name in self.done:
            logging.info("stage %s %s: done before (%.0f s)", number, name, self.done[name]["seconds"])
            return self.done[name]["result"]
        with StageClock(self.workdir / "stage_clock.json", name) as clock:
            if clock.before:
                logging.info("stage %s %s: resuming (%.0f s before)", number, name, clock.before)
            else:
                logging.info("stage %s %s: starting", number, name)
            result = run()
        self.done[name] = {"seconds": round(clock.seconds(), 1), "result": result}
        if distributed.is_main():
            write_json_atomic(self.path, self.done)
        logging.info("stage %s %s: done in %.0f s", number, name, self.done[name]["seconds"])
        return result


def heldout_runs(workdir: pathlib.Path, base_dir: str | pathlib.Path | None = None) -> list[pathlib.Path]:
    """The held-out evaluations of the run in `workdir` so far (the base agent's in `base_dir` where it was not
    played here, TRACE's, each adapter's alone): a later held-out evaluation takes from them the episodes of the
    same policy on the same task instead of playing them again (a routed task under its adapter, or none)."""
    found = sorted(p for p in (workdir / "heldout").glob("*") if p.is_dir())
    return list(dict.fromkeys([*([pathlib.Path(base_dir)] if base_dir else []), *found]))


def evaluate_alone(config: ml_collections.ConfigDict, workdir: pathlib.Path, adapters: dict[str, str]) -> dict:
    """Each adapter (name -> PEFT folder) alone on every held-out task, into workdir/heldout/<name> (the oracle's
    and the best single adapter's input; what TRACE's routed run played under it is reused); name -> success."""
    success = {}
    for name, folder in adapters.items():
        success[name] = evaluate(
            heldout_evaluation(config, folder), workdir / "heldout" / name, reuse=heldout_runs(workdir)
        )["success"]
    return success


def route_tasks(
    model: str,
    dtype: str,
    routing: RoutingSettings,
    target: Environment,
    tasks: list[TaskSpec],
    options: list[RouteOption],
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Stage 4's router (the base `model`, `routing`'s settings) over `options`: each task's adapter index
    (NO_ADAPTER: the base model), the label weights and the calibration's offsets, from the task's opening
    messages."""
    router = Router(
        load_model(model, dtype),
        options,
        max_messages=routing.max_messages,
        batch_size=routing.batch_size,
        calibration=routing.calibration,
        log_every_s=30.0,
    )
    return router.route([target.episode(t).reset() for t in tasks])


def _dropped(reason: str) -> dict:
    """The environments stage's result for a capability it could not calibrate, and why."""
    return {"calibrated": False, "difficulty": None, "env": None, "tries": [], "reason": reason}


def calibrate_in_order(selected: list[str], max_trained: int, calibrate: Callable[[str], dict]) -> dict:
    """Each capability's calibration, in selection (coverage) order, until `max_trained` passed (0: all): a
    capability dropped by calibration gives its place to the next one."""
    results = {}
    for name in selected:
        if max_trained and sum(r["calibrated"] for r in results.values()) == max_trained:
            break
        results[name] = calibrate(name)
    return results


class Pipeline:
    """One TRACE run in `workdir` (see the module docstring)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path):
        self.settings = validate_config(config)
        self.config, self.workdir = config, pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._stages = Stages(self.workdir, STAGES)
        self.stages = self._stages.done
        self.target = make_environment(config.target.env)
        base_run = self.settings.target.base_run
        if base_run:  # now, not after the analysis split's episodes
            check_base_run(pathlib.Path(base_run), heldout_evaluation(config), "target.base_run")

    def run(self) -> dict:
        """Runs (or resumes) every stage; returns the summary also written to summary.json."""
        start = time.monotonic()
        summary = self.run_stage("report")
        summary["seconds"] = round(sum(s["seconds"] for s in self.stages.values()), 1)
        summary["this_run_seconds"] = round(time.monotonic() - start, 1)
        if distributed.is_main():
            write_json_atomic(self.workdir / "summary.json", summary)
        return summary

    def run_stage(self, name: str) -> dict:
        """Runs (or resumes) the stages up to `name`, in order, each skipped once done; returns `name`'s result
        (colabs/03_trace_stages.ipynb walks the stages one at a time this way)."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}: one of {', '.join(STAGES)}")
        done = lambda stage: self.stages[stage]["result"]
        steps = {
            "base": self._base,
            "analysis": lambda: distributed.on_main(self._analysis),
            "environments": lambda: self._environments(done("analysis")["selected"]),
            "training": lambda: self._training(done("environments")),
            "routing": lambda: self._routing(done("training")),
            "final": lambda: self._final(done("training"), done("routing")),
            "diagnostics": lambda: self._diagnostics(done("training")),
            "report": lambda: distributed.on_main(lambda: write_report(self.workdir, self.stages, self.config)),
        }
        with claimed(self.workdir, "trace", self.config.to_dict(), main=distributed.is_main()):
            for stage in STAGES[: STAGES.index(name) + 1]:
                result = self._stages.run(stage, steps[stage])
        return result

    def _base(self) -> dict:
        """The base agent on the analysis split and, unless `target.base_run` names that run, on the held-out
        split, both in one batch."""
        target = self.settings.target
        runs = [(analysis_evaluation(self.config), self.workdir / "base_analysis")]
        heldout_dir = pathlib.Path(target.base_run) if target.base_run else self.workdir / "heldout" / "base"
        if not target.base_run:
            runs.append((heldout_evaluation(self.config), heldout_dir))
        analysis, *played = evaluate_together(runs)
        heldout = played[0] if played else read_json(heldout_dir / "summary.json")
        return {
            "analysis_success": analysis["success"],
            "heldout_success": heldout["success"],
            "heldout_dir": str(heldout_dir),
        }

    def _analysis(self) -> dict:
        records = recorded_episodes(self.workdir / "base_analysis" / "episodes.jsonl")
        trajectories = load_trajectories(records, self.target)
        result = analyze(
            trajectories,
            make_analyst(self.settings.analysis, self.settings.llm, self.target, self.workdir),
            self.settings.analysis,
            self.workdir,
        )
        return {"selected": result["selected"], "failed": result["failed"], "passed": result["passed"]}

    def _environments(self, selected: list[str]) -> dict:
        """Calibrates the selected capabilities' environments, built-in or written by the LLM as
        `environments.source` says (episodes cut as training cuts them), until `environments.max_trained` pass."""
        base = calibration_evaluation(self.config)
        source = self.settings.environments.source
        domain = target_domain(self.config.target.env)

        def calibrate(name: str) -> dict:
            folder = self.workdir / "environments" / name
            if domain not in DOMAINS:
                return _dropped(
                    f"capability environments are built in τ²'s {' or '.join(DOMAINS)} domain, not {domain}"
                )
            builtin = domain == "retail" and name in CAPABILITIES  # the built-in generators are retail's
            if source == "llm" or (source == "auto" and not builtin):
                return self._written(name, folder, base, domain)
            if builtin:
                return {**calibrate_builtin(name, base, self.settings.calibration, folder), "folder": str(folder)}
            return _dropped(
                f"no built-in {domain} generator for this capability (environments.source = 'auto' writes one)"
            )

        return calibrate_in_order(selected, self.settings.environments.max_trained, calibrate)

    def _written(self, name: str, folder: pathlib.Path, base: ml_collections.ConfigDict, domain: str) -> dict:
        """The LLM-written environment of capability `name` in τ²'s `domain` (from its analysis card and
        evidence), calibrated:
        a module that passes validation but not calibration is asked for again with the calibration's verdict."""
        card = self._cards()[name]
        evidence = [e["evidence"] for e in card.get("examples", [])]
        llm = self.settings.llm or from_config(LlmSettings, self.config.llm, "llm")  # "auto" writes: checked now
        client = ChatClient(llm, self.workdir / "environments" / "llm_cache")
        written = folder / "written"

        def calibrated(attempt: int, report: ValidationReport, scenarios: pathlib.Path) -> dict:
            at = written / f"calibration_{attempt}"
            bounds = walk_bounds(SCAFFOLDS, len(report.gold_success) - 1, self.settings.calibration.hint_share)
            return {
                **calibrate_capability(name, bounds, base, self.settings.calibration, at, scenarios=str(scenarios)),
                "scenarios": str(scenarios),
                "folder": str(at),
            }

        def judge(attempt: int, report: ValidationReport, scenarios: pathlib.Path) -> str | None:
            result = calibrated(attempt, report, scenarios)
            return None if result["calibrated"] else calibration_feedback(result, self.settings.calibration)

        synthesis = write_environment(
            CapabilityCard(name, card["description"], card["lacking"]),
            evidence,
            client,
            written,
            self.settings.env_writer,
            judge=judge,
            domain=domain,
        )
        if not synthesis.accepted:
            return _dropped(f"no LLM-written module passed validation and calibration in {synthesis.attempts} attempts")
        return calibrated(synthesis.attempts, synthesis.reports[-1], pathlib.Path(synthesis.scenarios))

    def _training(self, environments: dict) -> dict:
        """One GRPO adapter per calibrated environment, in selection order; name -> adapter folder."""
        adapters = {}
        for name, result in environments.items():
            if result["calibrated"]:
                folder = self.workdir / "adapters" / name
                grpo.train(training_config(self.config, result), folder)
                adapters[name] = str(folder / "adapter")
        return adapters

    def _routing(self, adapters: dict) -> dict:
        """Each held-out task's adapter index (among `adapters`, in order), from the router."""
        tasks = self.target.tasks(self.settings.target.heldout_split, self.settings.target.heldout_tasks)
        if not adapters:
            return {"by_task": {t.task_id: NO_ADAPTER for t in tasks}, "labels": ["general_service"], "weights": {}}
        cards = self._cards()
        options = [RouteOption(name, cards[name]["description"], self._example(name)) for name in adapters]
        indices, weights, offsets = route_tasks(
            self.config.model, self.config.dtype, self.settings.routing, self.target, tasks, options
        )
        return {
            "by_task": {t.task_id: i for t, i in zip(tasks, indices)},
            "labels": ["general_service", *adapters],
            "weights": {t.task_id: [round(float(w), 4) for w in row] for t, row in zip(tasks, weights)},
            "examples": {o.name: o.example for o in options},
            # what a server needs to route one conversation as this stage did (trace_jax/serve/models.py)
            "router": {
                "max_messages": self.settings.routing.max_messages,
                "calibration": self.settings.routing.calibration,
                "offsets": [float(o) for o in offsets],
            },
        }

    def _cards(self) -> dict[str, dict]:
        """The analysis's candidate capabilities by name (description, what lacking looks like, evidence)."""
        candidates = read_json(self.workdir / "analysis" / "capabilities.json")["candidates"]
        return {c["name"]: c for c in candidates}

    def _example(self, name: str) -> str:
        """One successful episode of the capability's environment from its calibration, compacted (tool
        calls as name(args), contents cut short)."""
        environment = self.stages["environments"]["result"][name]
        records = recorded_episodes(pathlib.Path(environment["episodes_dir"]) / "episodes.jsonl")
        success = next((r for r in records if r["success"]), None)
        if success is None:
            return "(no successful episode in calibration)"
        turns = compact(from_record(success, Gold((), ()), tools=[]), message_chars=120)["messages"]
        return " | ".join(f"{m['role']}: {m.get('tool_calls') or m['content']}" for m in turns)[:EXAMPLE_CHARS]

    def _diagnostics(self, adapters: dict) -> dict:
        """Each adapter's sampled pass@k on the held-out tickets of the families its capability targets, against
        the base agent's (`trace_jax.trace.diagnostics`)."""
        lacking = {c["name"]: c.get("lacking_families", {}) for c in self._cards().values()}
        return run_diagnostics(
            heldout_evaluation(self.config), self.settings.diagnostics, lacking, adapters, self.workdir / "diagnostics"
        )

    def _final(self, adapters: dict, routing: dict) -> dict:
        """The routed held-out evaluation and, with `final.per_adapter`, each adapter alone (the oracle's input),
        played first: the routed run then takes every episode from them and the base agent's."""
        alone = evaluate_alone(self.config, self.workdir, adapters) if self.settings.final.per_adapter else {}
        folders = tuple(adapters.values())
        routes = Routes(folders, routing["by_task"]) if folders else None
        reuse = heldout_runs(self.workdir, self.stages["base"]["result"]["heldout_dir"])
        runs = {
            "trace": evaluate(
                heldout_evaluation(self.config), self.workdir / "heldout" / "trace", routes=routes, reuse=reuse
            )["success"],
            **alone,
        }
        oracle = (
            oracle_routes(
                self.workdir, self.stages["base"]["result"]["heldout_dir"], list(adapters), routing["by_task"]
            )
            if self.settings.final.per_adapter and adapters
            else None
        )
        return {"success": runs, "oracle": oracle}
