"""The comparison's scaling curve (the paper's rollout-scaling figure): held-out success of TRACE, GRPO on the
target and GEPA at shares of their training budget, each read along its one run instead of a run per budget.

At share f: TRACE routes every task as its run did, to each capability adapter's snapshot at f of that GRPO
job's steps (no adapter while that is step 0); GRPO on the target takes its job's snapshot at f of its steps;
GEPA takes, per capability, the best candidate it had found within f of the metric calls it made. A point that
is the untrained agent or the finished arm reuses those episodes; every other point is evaluated on the
held-out tasks (greedy, resumable, in <workdir>/scaling/<arm>/...).
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Sequence

import matplotlib
import ml_collections
import numpy as np
from absl import logging

from trace_jax import lora
from trace_jax.agent.episodes import Routes
from trace_jax.baselines.gepa import best_within, guided_evaluation
from trace_jax.evaluation import evaluate
from trace_jax.files import read_json
from trace_jax.rl.trainer import snapshot_step

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

TRACE, GRPO_TARGET, GEPA = "TRACE", "GRPO on the target", "GEPA"


def snapshot_folder(adapter: str | pathlib.Path, step: int, steps: int) -> pathlib.Path | None:
    """A GRPO job's adapter after `step` of its `steps` (`adapter`: the job's final one, <job>/adapter); None at
    step 0, the untrained agent."""
    adapter = pathlib.Path(adapter)
    if step == 0:
        return None
    return adapter if step == steps else adapter.parent / "snapshots" / f"step_{step}"


def trace_routes(
    fraction: float, adapters: dict[str, str], steps: dict[str, int], by_task: dict[str, int]
) -> Routes | None:
    """TRACE's routing (`by_task`: each task's index in `adapters`) with every adapter at `fraction` of its
    job's steps; the tasks of an adapter still at step 0 get none. None when no adapter has trained yet."""
    names = list(adapters)
    folders = {n: snapshot_folder(adapters[n], snapshot_step(fraction, steps[n]), steps[n]) for n in names}
    kept = [n for n in names if folders[n] is not None]
    if not kept:
        return None
    index = {n: i for i, n in enumerate(kept)}
    return Routes(
        tuple(str(folders[n]) for n in kept),
        {
            task: lora.NO_ADAPTER if i == lora.NO_ADAPTER else index.get(names[i], lora.NO_ADAPTER)
            for task, i in by_task.items()
        },
    )


def _evaluated(
    heldout: ml_collections.ConfigDict,
    folder: pathlib.Path,
    routes: Routes | None = None,
    reuse: Sequence[pathlib.Path] = (),
) -> str:
    """`heldout` (with `routes`, taking what `reuse` holds of the same policies) evaluated into `folder` once its
    adapters are known to exist; the folder."""
    missing = [
        pathlib.Path(f)
        for f in (routes.adapters if routes else [heldout.adapter] if heldout.adapter else [])
        if not (pathlib.Path(f) / "adapter_config.json").is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"no adapter snapshot at {missing[0]}: the run was made without train.snapshot_fractions at this share"
        )
    evaluate(heldout, folder, routes=routes, reuse=reuse)
    return str(folder)


def scaling_points(
    fractions: list[float],
    heldout: ml_collections.ConfigDict,
    workdir: pathlib.Path,
    trace: dict,
    arms: dict[str, dict],
    trace_heldout: Sequence[pathlib.Path] = (),
) -> dict[str, list[dict]]:
    """Per scaled arm, its curve: {"fraction", "rollouts", "episodes_dir"} for the untrained agent, each of
    `fractions` and the finished arm. `trace`: the experiment's TRACE stage result; `arms`: the finished
    grpo_target and gepa stages' results (an arm not run has no curve); `trace_heldout`: the TRACE run's held-out
    evaluations, whose base-agent episodes TRACE's points reuse for tasks no trained adapter serves yet. A TRACE
    run made without snapshots at these shares gets no curve (a warning says so)."""
    curves: dict[str, list[dict]] = {}
    base_dir = trace["base_dir"]
    if trace["adapters"]:
        try:
            points = [_trace_point(f, heldout, workdir, base_dir, trace, trace_heldout) for f in fractions]
            curves[TRACE] = _with_ends(points, base_dir, trace["trace_rollouts"], trace["episodes_dir"])
        except FileNotFoundError as error:
            logging.warning("no TRACE scaling curve: %s", error)
    for name, arm, point in ((GRPO_TARGET, "grpo_target", _grpo_point), (GEPA, "gepa", _gepa_point)):
        if arm in arms:
            points = [point(f, heldout, workdir, base_dir, arms[arm]) for f in fractions]
            curves[name] = _with_ends(points, base_dir, arms[arm]["rollouts"], arms[arm]["episodes_dir"])
    return curves


def _with_ends(points: list[dict], base_dir: str, rollouts: int, episodes_dir: str) -> list[dict]:
    return [
        {"fraction": 0.0, "rollouts": 0, "episodes_dir": base_dir},
        *points,
        {"fraction": 1.0, "rollouts": rollouts, "episodes_dir": episodes_dir},
    ]


def _trace_point(
    fraction: float, heldout, workdir: pathlib.Path, base_dir: str, trace: dict, reuse: Sequence[pathlib.Path]
) -> dict:
    steps, rollouts = trace["steps_by_capability"], trace["rollouts_by_capability"]
    at = {n: snapshot_step(fraction, steps[n]) for n in steps}
    used = sum(at[n] * rollouts[n] // steps[n] for n in steps)
    routes = trace_routes(fraction, trace["adapters"], steps, trace["routing"])
    if routes is None:
        episodes = base_dir
    elif all(at[n] == steps[n] for n in steps):
        episodes = trace["episodes_dir"]
    else:
        folder = workdir / "scaling" / "trace" / ("steps_" + "_".join(str(at[n]) for n in trace["adapters"]))
        episodes = _evaluated(heldout, folder, routes, reuse)
    return {"fraction": fraction, "rollouts": used, "episodes_dir": episodes}


def _grpo_point(fraction: float, heldout, workdir: pathlib.Path, base_dir: str, arm: dict) -> dict:
    step = snapshot_step(fraction, arm["steps"])
    adapter = snapshot_folder(arm["adapter"], step, arm["steps"])
    if adapter is None or step == arm["steps"]:
        episodes = base_dir if adapter is None else arm["episodes_dir"]
    else:
        evaluation = ml_collections.ConfigDict(heldout.to_dict())
        evaluation.adapter = str(adapter)
        episodes = _evaluated(evaluation, workdir / "scaling" / "grpo_target" / f"step_{step}")
    return {"fraction": fraction, "rollouts": step * arm["rollouts"] // arm["steps"], "episodes_dir": episodes}


def _gepa_point(fraction: float, heldout, workdir: pathlib.Path, base_dir: str, arm: dict) -> dict:
    runs = read_json(pathlib.Path(arm["result"]))["capabilities"]
    calls = {n: int(fraction * run["metric_calls"]) for n, run in runs.items()}
    texts = {n: best_within(run, calls[n]) for n, run in runs.items()}
    if texts == arm["texts"]:
        episodes = arm["episodes_dir"]
    else:
        evaluation = guided_evaluation(heldout, texts)
        digest = hashlib.sha256(evaluation.env.guidance.encode()).hexdigest()[:12]
        episodes = _evaluated(evaluation, workdir / "scaling" / "gepa" / digest)
    return {"fraction": fraction, "rollouts": sum(calls.values()), "episodes_dir": episodes}


def scaling_table(curves: dict[str, list[dict]]) -> list[str]:
    """Markdown: one row per arm, its held-out success [95% CI] and training rollouts at each share."""
    fractions = sorted({p["fraction"] for points in curves.values() for p in points})
    lines = [
        "| arm | " + " | ".join(f"{f:g} of the budget" for f in fractions) + " |",
        "|---|" + "---:|" * len(fractions),
    ]
    for arm, points in curves.items():
        at = {p["fraction"]: p for p in points}
        cells = [
            f"{100 * at[f]['success']:.1f}% [{100 * at[f]['ci_low']:.1f}, {100 * at[f]['ci_high']:.1f}], "
            f"{at[f]['rollouts']} rollouts"
            if f in at
            else "-"
            for f in fractions
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def plot_scaling(curves: dict[str, list[dict]], path: pathlib.Path) -> None:
    """Held-out success (95% CI) against training rollouts, one line per arm."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, points in curves.items():
        x = [p["rollouts"] for p in points]
        y = np.array([100 * p["success"] for p in points])
        errors = np.clip(
            [
                [100 * p["success"] - 100 * p["ci_low"] for p in points],
                [100 * p["ci_high"] - 100 * p["success"] for p in points],
            ],
            0,
            None,
        )
        ax.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=arm)
    ax.set_xlabel("training rollouts (episodes; GEPA: metric calls)")
    ax.set_ylabel("held-out success % (95% CI)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
