"""The paper's comparison as one resumable job: TRACE against its baselines at equal training-rollout budgets.

Stages, recorded in <workdir>/stages.json as the pipeline records its own (a rerun skips what is done; a
killed stage resumes from what its jobs wrote):

  trace        the TRACE pipeline's run (`trace_run`, or run here in <workdir>/trace), with every adapter alone
               on the held-out tasks (the oracles' and the best single adapter's input) where it lacks them
  oracle       oracle routing chosen on train tasks: the base agent and each adapter alone on the first
               `oracle.num_tasks` of TRACE's analysis tasks, per family the system with the most successes
  grpo_target  GRPO on the target's `grpo_target.split` with the budget, then held-out
  grpo_target_hinted  the same with TRACE's hints in TRACE's share of each group (the target's tickets offer
               hints too, `trace_jax.envs.hints`), so that a difference is not hints against none
  mixed        GRPO on every calibrated capability environment mixed (one adapter), the budget, then held-out
  gepa         GEPA per capability with an equal share of the budget, the texts joined into the target's
               system prompt, then held-out (`trace_jax.baselines.gepa`)
  subsets      TRACE with only its first 1, 2, ... selected capabilities (by coverage, as selected): the
               router over those adapters alone, then held-out (the paper's 1 / 2 / 4 capabilities)
  scaling      TRACE, GRPO on the target and GEPA at each of `trace.training.train.snapshot_fractions` of their
               budget, read along their runs (`trace_jax.baselines.scaling`), then held-out

The budget, in training episodes, is TRACE's own (the episodes its GRPO jobs played, summed over the
capabilities) unless `budget` sets it. Every arm is evaluated by the evaluation job on the same held-out
tasks (greedy); results.json and report.md hold success per arm, overall and per family, with 95% intervals,
the rollouts each arm used and its wall time, and the scaling curve (a table in report.md, plots/scaling.png);
<workdir>/tensorboard holds the same successes as scalars against training rollouts (`heldout/<arm>`,
`scaling/<arm>`), beside the TensorBoard logs its GRPO jobs write in their folders.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import time

import ml_collections
from absl import logging

from trace_jax import distributed, lora
from trace_jax.agent.episodes import Routes, recorded_episodes
from trace_jax.agent.rollout import RolloutConfig
from trace_jax.baselines.gepa import GepaSettings, gepa_arm
from trace_jax.baselines.scaling import plot_scaling, scaling_points, scaling_table
from trace_jax.envs import make_environment
from trace_jax.evaluation import evaluate
from trace_jax.files import read_json, write_json_atomic
from trace_jax.llm import LlmSettings
from trace_jax.metrics import MetricsWriter, logged_lines
from trace_jax.report import paired, summarize
from trace_jax.rl import job
from trace_jax.rl import trainer as grpo
from trace_jax.settings import from_config, is_str, none_or, nonempty_str, positive_int, setting
from trace_jax.trace.pipeline import (
    Pipeline,
    PipelineSettings,
    Stages,
    analysis_evaluation,
    evaluate_alone,
    grpo_config,
    heldout_evaluation,
    heldout_runs,
    route_tasks,
)
from trace_jax.trace.pipeline import validate_config as validate_pipeline_config
from trace_jax.trace.routing import RouteOption
from trace_jax.trace.trace_report import best_by_family, oracle_routes
from trace_jax.workdirs import claimed

ARMS = ("oracle", "grpo_target", "grpo_target_hinted", "mixed", "gepa", "subsets")
CAPABILITY_ARMS = ("oracle", "mixed", "gepa", "subsets")  # arms on TRACE's capability environments or adapters
STAGES = ("trace", *ARMS, "scaling")
BUDGET_TOLERANCE = 0.05  # the baselines' budgets are within 5% of TRACE's (else a warning)


@dataclasses.dataclass(frozen=True)
class GrpoTargetSettings:
    """The `grpo_target` block."""

    split: str = setting("train", "the target's training split", nonempty_str)


@dataclasses.dataclass(frozen=True)
class OracleSettings:
    """The `oracle` block: the analysis tasks oracle routing is chosen on."""

    num_tasks: int | None = setting(
        None, "None (all of TRACE's analysis tasks) or a positive int", none_or(positive_int)
    )


@dataclasses.dataclass(frozen=True)
class ExperimentSettings:
    """A comparison config's own blocks, typed (the pipeline's under `trace` are `PipelineSettings`)."""

    grpo_target: GrpoTargetSettings
    oracle: OracleSettings
    gepa: GepaSettings
    trace_run: str = setting("", '"" (run the pipeline here) or a TRACE run\'s workdir', is_str)
    budget: int | None = setting(None, "None (TRACE's own rollouts) or a positive int", none_or(positive_int))
    arms: tuple[str, ...] = setting(ARMS, f"a subset of {ARMS}", lambda v: isinstance(v, tuple) and set(v) <= set(ARMS))
    results_file: str = setting(
        "", '"" (none) or a path the compact comparison (`comparison_record`) is also written to', is_str
    )


def validate_config(config: ml_collections.ConfigDict) -> tuple[ExperimentSettings, PipelineSettings]:
    """The config's typed blocks and its pipeline's; fails at start naming the first wrong key (the pipeline's
    under `trace.`)."""
    settings, trace = from_config(ExperimentSettings, config, ""), validate_pipeline_config(config.trace, "trace")
    if settings.gepa.reflection == "llm" and trace.llm is None:  # GEPA reflects through the pipeline's endpoint
        trace = dataclasses.replace(trace, llm=from_config(LlmSettings, config.trace.llm, "trace.llm"))
    return settings, trace


class Experiment:
    """One comparison in `workdir` (see the module docstring)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path):
        self.settings, self.trace_settings = validate_config(config)
        self.config, self.workdir = config, pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        trace_run = self.settings.trace_run
        self.trace_dir = pathlib.Path(trace_run) if trace_run else self.workdir / "trace"
        self.stages = Stages(self.workdir, STAGES)

    def run(self) -> dict:
        """Runs (or resumes) every arm; writes results.json and report.md; returns the summary."""
        with claimed(self.workdir, "experiment", self.config.to_dict(), main=distributed.is_main()):
            return self._run()

    def _run(self) -> dict:
        start = time.monotonic()
        trace = self.stages.run("trace", self._trace)
        budget = self.settings.budget or trace["trace_rollouts"]
        if not budget:
            raise ValueError("TRACE trained no adapter, so it gives no budget: set config.budget")
        target = {**self.config.trace.target.env.to_dict(), "split": self.settings.grpo_target.split}
        mixed = {"name": "mixed", "parts": list(trace["environments"].values()), "split": "train"}
        runs = {
            "oracle": lambda: self._oracle(trace),
            "grpo_target": lambda: self._grpo("grpo_target", target, budget, hints=False, snapshots=True),
            # the same hints in the same share as TRACE's training: a win is then not hints against none
            "grpo_target_hinted": lambda: self._grpo("grpo_target_hinted", target, budget, hints=True, snapshots=False),
            "mixed": lambda: self._grpo("mixed", mixed, budget, hints=True, snapshots=False),
            "gepa": lambda: self._gepa(trace, budget),
            "subsets": lambda: self._subsets(trace),
        }
        skipped = () if trace["environments"] else CAPABILITY_ARMS
        for arm in [arm for arm in self.settings.arms if arm in skipped]:
            logging.warning("arm %s skipped: TRACE calibrated no capability environment", arm)
        arms = [arm for arm in ARMS if arm in self.settings.arms and arm not in skipped]
        stages = [*arms, "scaling"]
        self._write(trace, budget, stages)  # a long experiment's table so far, kept current after every arm
        for arm in arms:
            self.stages.run(arm, runs[arm])
            self._write(trace, budget, stages)
        fractions = sorted(self.config.trace.training.train.snapshot_fractions)
        self.stages.run(
            "scaling",
            lambda: scaling_points(
                fractions,
                heldout_evaluation(self.config.trace),
                self.workdir,
                trace,
                {arm: self.stages.done[arm]["result"] for arm in ("grpo_target", "gepa") if arm in self.stages.done},
                heldout_runs(self.trace_dir, trace["base_dir"]),
            ),
        )
        results = self._write(trace, budget, stages)
        return {
            "success": {row["arm"]: row["success"] for row in results["arms"]},
            "budget": results["budget"],
            "seconds": round(sum(s["seconds"] for s in self.stages.done.values()), 1),
            "this_run_seconds": round(time.monotonic() - start, 1),
        }

    def _write(self, trace: dict, budget: int, stages: list[str]) -> dict:
        """results.json, report.md and the scaling plot as far as the experiment has come (`stages`: those it
        runs after TRACE); returns the results."""
        results = self._results(trace, budget, [name for name in stages if name not in self.stages.done])
        if distributed.is_main():
            write_json_atomic(self.workdir / "results.json", results)
            if self.settings.results_file:
                write_json_atomic(pathlib.Path(self.settings.results_file), comparison_record(results))
            (self.workdir / "report.md").write_text(report(results), encoding="utf-8")
            if results["scaling"]:
                plot_scaling(results["scaling"], self.workdir / "plots" / "scaling.png")
            _log_scalars(self.workdir, results)
        logging.info(
            "report.md: %d arms%s",
            len(results["arms"]),
            f"; still to run: {', '.join(results['pending'])}" if results["pending"] else "",
        )
        return results

    def _trace(self) -> dict:
        """The TRACE run (resumed or run here) and what the arms take from it: its training episodes (the budget),
        the calibrated environments, the analysis's descriptions, and each adapter alone on the held-out tasks."""
        pipeline = Pipeline(self.config.trace, self.trace_dir)
        summary = pipeline.run()
        adapters = pipeline.stages["training"]["result"]
        missing = {n: f for n, f in adapters.items() if not (self.trace_dir / "heldout" / n / "summary.json").exists()}
        evaluate_alone(self.config.trace, self.trace_dir, missing)
        environments = pipeline.stages["environments"]["result"]
        cards = read_json(self.trace_dir / "analysis" / "capabilities.json")["candidates"]
        jobs = {n: read_json(self.trace_dir / "adapters" / n / job.SUMMARY) for n in adapters}
        rollouts = {n: done["rollouts"] for n, done in jobs.items()}
        return {
            "trace_rollouts": sum(rollouts.values()),
            "rollouts_by_capability": rollouts,
            "adapters": adapters,
            "steps_by_capability": {n: done["steps"] for n, done in jobs.items()},
            "episodes_dir": str(self.trace_dir / "heldout" / "trace"),
            "examples": pipeline.stages["routing"]["result"].get("examples", {}),
            "trace_seconds": summary["seconds"],
            "base_seconds": pipeline.stages["base"]["seconds"],
            "base_dir": pipeline.stages["base"]["result"]["heldout_dir"],
            "routing": pipeline.stages["routing"]["result"]["by_task"],
            "environments": {n: environments[n]["env"] for n in adapters},
            "descriptions": {c["name"]: c["description"] for c in cards if c["name"] in adapters},
        }

    def _oracle(self, trace: dict) -> dict:
        """Oracle routing chosen on train tasks, not on the held-out ones it is scored on: the base agent (its
        episodes taken from TRACE's analysis run) and each adapter alone on the first `oracle.num_tasks` analysis
        tasks; per family, the system with the most successes there."""
        config, folder = self.config.trace, self.workdir / "oracle"
        systems = {lora.NO_ADAPTER: ("general_service", ""), **dict(enumerate(trace["adapters"].items()))}
        records, played = {}, 0
        for index, (name, adapter) in systems.items():
            summary = evaluate(
                analysis_evaluation(config, adapter, self.settings.oracle.num_tasks),
                folder / name,
                reuse=[self.trace_dir / "base_analysis"],
            )
            played += summary["num_episodes"] - summary["reused_episodes"]
            records[index] = _episodes(folder / name)
        return {
            "by_family": {f: systems[i][0] for f, i in best_by_family(records).items()},
            "tasks": len(records[lora.NO_ADAPTER]),
            "episodes_played": played,
        }

    def _grpo(self, arm: str, env: dict, budget: int, hints: bool, snapshots: bool) -> dict:
        """GRPO with TRACE's training settings on `env` for `budget` episodes, then its adapter on the held-out
        tasks (`hints`: keep TRACE's hinted share, where every environment offers a hint; `snapshots`: keep
        TRACE's adapter snapshots along the run, for the scaling curve). Where TRACE keeps each adapter's best
        step (`training.eval.keep_best`), so does this arm, by as many tasks of `env`'s split that its training
        never draws (never the held-out tickets every arm is reported on)."""
        trace, folder = self.config.trace, self.workdir / arm
        training = grpo_config(trace, env, hints)
        training.train.update(steps=None, rollout_budget=budget)
        if not snapshots:
            training.train.snapshot_fractions = ()
        if training.eval.get("keep_best", False):  # its best step as TRACE's: by tasks of its own training split
            training.eval.update(split=env["split"], base_run="")
        else:
            training.eval.num_tasks = 0  # held out below, as every arm is
        summary = grpo.train(training, folder)
        heldout = heldout_evaluation(trace, str(folder / "adapter"))
        return {
            "rollouts": summary["rollouts"],
            "steps": summary["steps"],
            "adapter": heldout.adapter,
            "heldout": evaluate(heldout, folder / "heldout")["success"],
            "episodes_dir": str(folder / "heldout"),
        }

    def _gepa(self, trace: dict, budget: int) -> dict:
        """GEPA per calibrated capability (seeded with its description, episodes cut as TRACE's training cuts
        them), then the joined texts on the held-out tasks."""
        limits = self.config.trace.training.rollout
        rollout = RolloutConfig(
            batch_size=limits.batch_size,
            max_turns=limits.max_turns,
            max_tokens_per_turn=limits.max_tokens_per_turn,
            max_errors=limits.max_errors,
            temperature=self.settings.gepa.temperature,
        )
        capabilities = {n: (env, trace["descriptions"][n]) for n, env in trace["environments"].items()}
        folder = self.workdir / "gepa"
        result = gepa_arm(
            capabilities,
            heldout_evaluation(self.config.trace),
            rollout,
            self.settings.gepa,
            self.trace_settings.llm,
            budget,
            folder,
        )
        return {
            "rollouts": result["metric_calls"],
            "episodes_played": result["episodes_played"],
            "texts": result["texts"],
            "heldout": result["heldout"]["success"],
            "episodes_dir": str(folder / "heldout"),
            "result": str(folder / "result.json"),
        }

    def _subsets(self, trace: dict) -> dict:
        """TRACE routed among its first k adapters only, for each k below their number; k -> the rollouts those
        adapters' training used and the held-out episodes' folder."""
        names, config, settings = list(trace["adapters"]), self.config.trace, self.trace_settings
        target = make_environment(config.target.env)
        tasks = target.tasks(settings.target.heldout_split, settings.target.heldout_tasks)
        reuse = heldout_runs(self.trace_dir, trace["base_dir"])  # each adapter's alone, the base agent's
        runs = {}
        for k in range(1, len(names)):
            options = [RouteOption(n, trace["descriptions"][n], trace["examples"][n]) for n in names[:k]]
            indices, _, _ = route_tasks(config.model, config.dtype, settings.routing, target, tasks, options)
            routes = Routes(
                tuple(trace["adapters"][n] for n in names[:k]), {t.task_id: i for t, i in zip(tasks, indices)}
            )
            folder = self.workdir / "subsets" / f"top_{k}"
            evaluate(heldout_evaluation(config), folder, routes=routes, reuse=reuse)
            runs[str(k)] = {
                "rollouts": sum(trace["rollouts_by_capability"][n] for n in names[:k]),
                "episodes_dir": str(folder),
            }
        return runs

    def _results(self, trace: dict, budget: int, pending: list[str]) -> dict:
        """One row per arm done: held-out success overall (95% interval) and per family, rollouts, wall time;
        each arm paired with TRACE on the same tasks; the scaling curve once done; the stages still `pending`."""
        base, routed_trace = _episodes(pathlib.Path(trace["base_dir"])), _episodes(self.trace_dir / "heldout" / "trace")
        row = lambda arm, records, rollouts, seconds: {
            **_row(arm, records, rollouts, seconds),
            "vs_trace": paired(routed_trace, records),
        }
        rows = [
            row("base", base, 0, trace["base_seconds"]),
            _row("TRACE", routed_trace, trace["trace_rollouts"], trace["trace_seconds"]),
        ]
        adapters = list(trace["adapters"])
        if adapters:
            singles = {n: _episodes(self.trace_dir / "heldout" / n) for n in adapters}
            by_task = {
                name: {r["task_id"]: r for r in records}
                for name, records in {"general_service": base, **singles}.items()
            }
            # each held-out task's episode of its family's system (a family the choice never met: the base agent's)
            routed = lambda by_family: [
                by_task[by_family.get(r["family"], "general_service")][r["task_id"]] for r in base
            ]
            if "oracle" in self.stages.done:
                done, split = self.stages.done["oracle"], self.trace_settings.target.analysis_split
                rows.append(
                    row(
                        f"TRACE, oracle routing (chosen on {done['result']['tasks']} {split} tasks)",
                        routed(done["result"]["by_family"]),
                        trace["trace_rollouts"],
                        trace["trace_seconds"] + done["seconds"],
                    )
                )
            upper = oracle_routes(self.trace_dir, trace["base_dir"], adapters, trace["routing"])["by_family"]
            rows.append(
                row(
                    "per family the best system on held-out (upper bound)",
                    routed(upper),
                    trace["trace_rollouts"],
                    trace["trace_seconds"],
                )
            )
            best = max(adapters, key=lambda n: sum(r["success"] for r in singles[n]))
            rows.append(
                row(
                    f"best single adapter ({best})",
                    singles[best],
                    trace["rollouts_by_capability"][best],
                    trace["trace_seconds"],
                )
            )
        names = {
            "grpo_target": "GRPO on the target",
            "grpo_target_hinted": "GRPO on the target, hinted as TRACE",
            "mixed": "one adapter, environments mixed",
            "gepa": "GEPA",
        }
        for arm in names:
            if arm in self.stages.done:
                done = self.stages.done[arm]
                rows.append(
                    row(
                        names[arm],
                        _episodes(pathlib.Path(done["result"]["episodes_dir"])),
                        done["result"]["rollouts"],
                        done["seconds"],
                    )
                )
                if abs(rows[-1]["rollouts"] - budget) > BUDGET_TOLERANCE * budget:
                    logging.warning(
                        "%s used %d rollouts against the budget of %d", names[arm], rows[-1]["rollouts"], budget
                    )
        for k, run in self.stages.done.get("subsets", {}).get("result", {}).items():
            rows.append(
                row(
                    f"TRACE, top {k} of {len(adapters)} capabilities",
                    _episodes(pathlib.Path(run["episodes_dir"])),
                    run["rollouts"],
                    self.stages.done["subsets"]["seconds"],
                )
            )
        return {
            "budget": budget,
            "trace_rollouts": trace["trace_rollouts"],
            "arms": rows,
            "scaling": self._curves(),
            "pending": pending,
        }

    def _curves(self) -> dict[str, list[dict]]:
        """The scaling stage's points as rows: held-out success with its 95% interval at each point's rollouts
        (points share folders, the base agent's in every curve: each is read once)."""
        read = functools.cache(lambda folder: _episodes(pathlib.Path(folder)))
        return {
            arm: [{**_row(arm, read(p["episodes_dir"]), p["rollouts"], 0.0), "fraction": p["fraction"]} for p in points]
            for arm, points in self.stages.done.get("scaling", {}).get("result", {}).items()
        }


def _episodes(folder: pathlib.Path) -> list[dict]:
    return recorded_episodes(folder / "episodes.jsonl")


def _row(arm: str, records: list[dict], rollouts: int, seconds: float) -> dict:
    """An arm's line of the comparison from its held-out episode records."""
    if not records:
        raise ValueError(f"the arm {arm!r} has no held-out episodes")
    *families, overall = summarize(records, 1)
    return {
        "arm": arm,
        "success": overall["success"],
        "ci_low": overall["ci_low"],
        "ci_high": overall["ci_high"],
        "episodes": overall["episodes"],
        "rollouts": int(rollouts),
        "seconds": round(float(seconds), 1),
        "families": {row["family"]: row["success"] for row in families},
        "family_counts": {
            row["family"]: [round(row["success"] * row["episodes"]), row["episodes"]] for row in families
        },
    }


def comparison_record(results: dict) -> dict:
    """The comparison in the compact form results are committed in (`results_file`): per arm its held-out
    successes, episodes, training episodes, wall time and per family [successes, episodes]; per arm paired with
    TRACE the tasks only TRACE solves, those only the arm solves and the exact McNemar p."""
    arms = {
        row["arm"]: {
            "successes": round(row["success"] * row["episodes"]),
            "episodes": row["episodes"],
            "success": row["success"],
            "ci": [row["ci_low"], row["ci_high"]],
            "training_episodes": row["rollouts"],
            "wall_s": row["seconds"],
            "families": row["family_counts"],
        }
        for row in results["arms"]
    }
    pairs = {
        row["arm"]: {
            "only_trace": row["vs_trace"]["only_a"],
            "only_arm": row["vs_trace"]["only_b"],
            "p": row["vs_trace"]["p_value"],
        }
        for row in results["arms"]
        if "vs_trace" in row
    }
    return {"budget": results["budget"], "arms": arms, "vs_trace": pairs, "pending": results["pending"]}


def scalar_name(kind: str, arm: str) -> str:
    """An arm's TensorBoard tag, `kind/arm` with every run of other characters than letters and digits as one
    '_' (TensorBoard would rewrite them)."""
    return f"{kind}/{re.sub(r'[^a-z0-9]+', '_', arm.lower()).strip('_')}"


def _log_scalars(workdir: pathlib.Path, results: dict) -> None:
    """The results' held-out successes as TensorBoard scalars against training rollouts: one point per arm and
    each scaling curve. The table is rewritten after every arm, so only points not logged before are added."""
    points = {}
    for row in results["arms"]:
        points.setdefault(row["rollouts"], {})[scalar_name("heldout", row["arm"])] = row["success"]
    for arm, curve in results["scaling"].items():
        for point in curve:  # two shares that round to one step give one point
            points.setdefault(point["rollouts"], {})[scalar_name("scaling", arm)] = point["success"]
    logged = {(line["step"], name) for line in logged_lines(workdir) for name in line if name != "step"}
    new = {step: {n: v for n, v in scalars.items() if (step, n) not in logged} for step, scalars in points.items()}
    new = {step: scalars for step, scalars in sorted(new.items()) if scalars}
    if new:
        writer = MetricsWriter(workdir)
        for step, scalars in new.items():
            writer.write(step, scalars)
        writer.close()


def report(results: dict) -> str:
    """The comparison's tables: success per arm with its 95% interval, rollouts and wall time; per family; each
    arm paired with TRACE (McNemar); the scaling curve."""
    lines = [
        f"# TRACE against its baselines (budget: {results['budget']} training episodes per arm)",
        "",
        *([f"Still to run: {', '.join(results['pending'])}.", ""] if results["pending"] else []),
        "| arm | held-out success [95% CI] | episodes | training rollouts | wall time |",
        "|---|---|---:|---:|---:|",
    ]
    for row in results["arms"]:
        lines.append(
            f"| {row['arm']} | {100 * row['success']:.1f}% [{100 * row['ci_low']:.1f}, "
            f"{100 * row['ci_high']:.1f}] | {row['episodes']} | {row['rollouts']} | "
            f"{row['seconds'] / 60:.1f} min |"
        )
    families = sorted({f for row in results["arms"] for f in row["families"]})
    lines += [
        "",
        "## Held-out success per family",
        "",
        "| arm | " + " | ".join(families) + " |",
        "|---|" + "---:|" * len(families),
    ]
    for row in results["arms"]:
        cells = [f"{100 * row['families'][f]:.0f}%" if f in row["families"] else "-" for f in families]
        lines.append(f"| {row['arm']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Paired with TRACE on the same held-out tasks",
        "",
        "| arm | tasks only TRACE solves | tasks only the arm solves | exact McNemar p |",
        "|---|---:|---:|---:|",
    ]
    for row in results["arms"]:
        if "vs_trace" in row:
            pair = row["vs_trace"]
            lines.append(f"| {row['arm']} | {pair['only_a']} | {pair['only_b']} | {pair['p_value']:.3g} |")
    if results["scaling"]:
        lines += [
            "",
            "## Scaling: held-out success at shares of the budget (plots/scaling.png)",
            "",
            *scaling_table(results["scaling"]),
        ]
    return "\n".join(lines) + "\n"
