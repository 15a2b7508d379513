"""The TRACE pipeline's report: `report.md` with its tables, PNG plots, the oracle routing and the summary.

Plots (matplotlib, written to `plots/`): Delta and Cov per candidate capability with the
selection thresholds; the calibration tries against the gate band; the training reward of
each adapter per step; held-out success per family of the base agent and of TRACE with 95%
intervals.
"""

from __future__ import annotations

import collections
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from trace_jax.agent.episodes import recorded_episodes  # noqa: E402
from trace_jax.files import read_json  # noqa: E402
from trace_jax.lora import NO_ADAPTER  # noqa: E402
from trace_jax.metrics import logged_lines, scalars_by_step  # noqa: E402
from trace_jax.report import format_table, summarize  # noqa: E402
from trace_jax.rl.job import SUMMARY  # noqa: E402
from trace_jax.trace.calibration import GATES, calibration_table  # noqa: E402
from trace_jax.trace.diagnostics import diagnostics_table  # noqa: E402


def _records(folder: str | pathlib.Path) -> list[dict]:
    return recorded_episodes(pathlib.Path(folder) / "episodes.jsonl")


def best_by_family(systems: dict[int, list[dict]]) -> dict[str, int]:
    """Per task family, the system (`NO_ADAPTER`: the base agent; i: adapter i alone) whose episode records hold
    the most successes; a tie goes to the base agent, then to the first adapter."""
    best = {}
    for family in sorted({r["family"] for r in systems[NO_ADAPTER]}):
        wins = {
            index: sum(r["success"] for r in records if r["family"] == family) for index, records in systems.items()
        }
        best[family] = max(wins, key=lambda index: (wins[index], index == NO_ADAPTER, -index))
    return best


def oracle_routes(workdir: pathlib.Path, base_dir: str, names: list[str], routed: dict[str, int]) -> dict:
    """The oracle: per task family, the system (base or one adapter alone) with the most held-out
    successes; its success (each task's episode of its family's system) and the router's accuracy
    against it."""
    systems = {NO_ADAPTER: _records(base_dir), **{i: _records(workdir / "heldout" / n) for i, n in enumerate(names)}}
    by_task = {index: {r["task_id"]: r for r in records} for index, records in systems.items()}
    best = best_by_family(systems)
    tasks = [r for r in systems[NO_ADAPTER] if r["task_id"] in routed]
    choice = {r["task_id"]: best[r["family"]] for r in tasks}
    label = lambda index: "general_service" if index == NO_ADAPTER else names[index]
    return {
        "by_family": {f: label(i) for f, i in best.items()},
        "success": float(np.mean([by_task[choice[r["task_id"]]][r["task_id"]]["success"] for r in tasks])),
        "accuracy": float(np.mean([routed[t] == i for t, i in choice.items()])),
        "episodes": len(tasks),
    }


def _plot_selection(candidates: list[dict], settings: dict, path: pathlib.Path) -> None:
    names = [c["name"] for c in candidates]
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, threshold in ((axes[0], "delta", settings["delta"]), (axes[1], "cov", settings["coverage"])):
        values = np.array([c[f"mean_{key}"] for c in candidates])
        spans = np.array([c[f"{key}_interval"] for c in candidates]).T
        colors = ["tab:green" if c["selected"] else "tab:gray" for c in candidates]
        ax.bar(x, values, color=colors, yerr=np.abs(spans - values), capsize=3)
        ax.axhline(threshold, color="tab:red", linestyle="--", label=f"threshold {threshold}")
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.set_title({"delta": "contrastive gap Delta", "cov": "failure coverage Cov"}[key])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_calibration(results: list[dict], settings: dict, path: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    band = GATES[settings["gates"]]
    ax.axhspan(band["min_mean"], band["max_mean"], color="tab:green", alpha=0.15, label="gate band")
    for result in results:
        walks: dict[str, list[dict]] = {}
        for t in result["tries"]:  # a capability with families walks once per family
            walks.setdefault(result["capability"] + (f"[{t['variant']}]" if "variant" in t else ""), []).append(t)
        for name, tries in walks.items():
            ax.plot([t["difficulty"] for t in tries], [t["mean"] for t in tries], marker="o", label=name)
    ax.set_xlabel("difficulty (in the order tried; below 0 scaffolded)")
    ax.set_ylabel("base agent's mean reward")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _adapter_logs(workdir: pathlib.Path, names: list[str]) -> dict[str, dict[int, dict[str, float]]]:
    """Per adapter, its GRPO job's logged scalars by step."""
    return {name: scalars_by_step(logged_lines(workdir / "adapters" / name)) for name in names}


def _training_curves(logs: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Per adapter, its training reward by GRPO step: "all" episodes, and where its environment mixes variants
    each variant's ("<variant>") and its unhinted episodes' ("<variant> unhinted")."""
    curves = {}
    for name, steps in logs.items():
        series: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
        for step, scalars in steps.items():
            for key, value in scalars.items():
                parts = key.split("/")
                if key == "rollout/reward":
                    series["all"].append((step, value))
                elif len(parts) == 3 and parts[0] == "rollout" and parts[2] in ("reward", "unhinted_reward"):
                    label = parts[1] if parts[2] == "reward" else f"{parts[1]} unhinted"
                    series[label].append((step, value))
        curves[name] = dict(series)
    return curves


def _heldout_curves(logs: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Per adapter, its held-out evaluations by GRPO step: "reward" and, where logged, "gold_logp" (the gold turns'
    likelihood, `training.eval.ties`)."""
    return {
        name: {
            key: [(step, scalars[f"eval/{key}"]) for step, scalars in steps.items() if f"eval/{key}" in scalars]
            for key in ("reward", "gold_logp")
        }
        for name, steps in logs.items()
    }


def _plot_training(
    curves: dict[str, dict[str, list[tuple[int, float]]]],
    heldout: dict[str, dict[str, list[tuple[int, float]]]],
    path: pathlib.Path,
) -> None:
    """One panel per adapter: its training reward, and each variant's (dashed: its unhinted episodes); below, where
    the job evaluated held-out tasks, their greedy reward and (right axis) the gold turns' logprob by step."""
    evaluated = any(series["reward"] for series in heldout.values())
    rows, cols = 1 + evaluated, max(len(curves), 1)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False)
    for ax, (name, series) in zip(axes[0], curves.items()):
        for label, points in sorted(series.items()):
            if points:
                style = dict(color="black", linewidth=2) if label == "all" else {}
                ax.plot(*zip(*points), marker="o", linestyle="--" if "unhinted" in label else "-", label=label, **style)
        ax.set_title(name)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("mean training reward")
        ax.legend(fontsize=7)
    for ax, name in zip(axes[1] if evaluated else (), curves):
        series = heldout.get(name, {})
        if series.get("reward"):
            ax.plot(*zip(*series["reward"]), marker="o", color="black", label="held-out reward (greedy)")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("held-out reward")
        ax.set_ylim(-0.02, 1.02)
        if series.get("gold_logp"):
            twin = ax.twinx()
            twin.plot(*zip(*series["gold_logp"]), marker="s", color="tab:blue", label="gold turns' logprob")
            twin.set_ylabel("gold turns' logprob (nats a task)", color="tab:blue")
        ax.set_title(f"{name}: held-out tasks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _variant_table(curves: dict[str, dict[str, list[tuple[int, float]]]]) -> str:
    """Each adapter's training reward per variant at its first and last step."""
    lines = ["| adapter | episodes | first step | last step |", "|---|---|---:|---:|"]
    for name, series in curves.items():
        for label, points in sorted(series.items(), key=lambda item: (item[0] != "all", item[0])):
            if points:
                lines.append(f"| {name} | {label} | {points[0][1]:.3f} | {points[-1][1]:.3f} |")
    return "\n".join(lines)


def _plot_heldout(rows: dict[str, list[dict]], path: pathlib.Path) -> None:
    families = [r["family"] for r in next(iter(rows.values()))]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(7, len(families) * 1.1), 3.8))
    for k, (system, system_rows) in enumerate(rows.items()):
        by_family = {r["family"]: r for r in system_rows}
        values = np.array([100 * by_family[f]["success"] for f in families])
        errors = np.clip(
            np.array(
                [
                    [
                        100 * (by_family[f]["success"] - by_family[f]["ci_low"]),
                        100 * (by_family[f]["ci_high"] - by_family[f]["success"]),
                    ]
                    for f in families
                ]
            ).T,
            0,
            None,
        )  # rounding may put an end a hair inside the estimate
        ax.bar(np.arange(len(families)) + k * width, values, width, yerr=errors, capsize=3, label=system)
    ax.set_xticks(np.arange(len(families)) + width * (len(rows) - 1) / 2, families, rotation=30, ha="right")
    ax.set_ylabel("held-out success % (95% CI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _side_by_side(rows: dict[str, list[dict]]) -> str:
    """Success per family (rows) for each system (columns), with 95% intervals."""
    systems = list(rows)
    lines = ["| family | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for i, family in enumerate(r["family"] for r in rows[systems[0]]):
        cells = [
            f"{100 * rows[s][i]['success']:.1f}% [{100 * rows[s][i]['ci_low']:.1f}, {100 * rows[s][i]['ci_high']:.1f}]"
            for s in systems
        ]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _adapter_line(name: str, folder: pathlib.Path, steps: dict[int, dict[str, float]]) -> str:
    """The adapter's folder, and with `training.eval.keep_best` the step it was kept from and its held-out reward
    against the base's on the capability environment's held-out tasks (the GRPO job's summary.json), with the gold
    turns' likelihood of both where the job logged it (`training.eval.ties`; `steps`: the job's scalars by step)."""
    summary_path = folder.parent / SUMMARY
    job = read_json(summary_path) if summary_path.is_file() else {}
    if "best_step" not in job:
        return f"- {name}: `{folder}`"
    gold = [steps.get(step, {}).get("eval/gold_logp") for step in (job["best_step"], 0)]
    likelihood = f"; gold turns' logprob {gold[0]:.2f}, base {gold[1]:.2f}" if None not in gold else ""
    return (
        f"- {name}: `{folder}`, step {job['best_step']} of {job['steps']} kept (held-out reward "
        f"{job['final_reward']:.3f}, base {job['base_reward']:.3f}{likelihood})"
    )


def write_report(workdir: pathlib.Path, stages: dict, config: ml_collections.ConfigDict) -> dict:
    """Writes report.md and plots/ from the stages' outputs; returns the pipeline's summary."""
    plots = workdir / "plots"
    plots.mkdir(exist_ok=True)
    analysis = read_json(workdir / "analysis" / "capabilities.json")
    calibrations = [{"capability": name, **result} for name, result in stages["environments"]["result"].items()]
    adapters = stages["training"]["result"]
    routing, final = stages["routing"]["result"], stages["final"]["result"]
    base_records = _records(stages["base"]["result"]["heldout_dir"])
    trace_records = _records(workdir / "heldout" / "trace")
    rows = {"base": summarize(base_records, 1), "TRACE": summarize(trace_records, 1)}
    _plot_selection(analysis["candidates"], analysis["settings"], plots / "selection.png")
    _plot_calibration([c for c in calibrations if c["tries"]], config.calibration.to_dict(), plots / "calibration.png")
    logs = _adapter_logs(workdir, list(adapters))
    curves = _training_curves(logs)
    _plot_training(curves, _heldout_curves(logs), plots / "training.png")
    _plot_heldout(rows, plots / "heldout.png")
    counts = collections.Counter(routing["by_task"].values())
    labels = routing["labels"]
    distribution = {labels[index + 1]: counts.get(index, 0) for index in range(-1, len(labels) - 1)}
    lines = [
        "# TRACE report\n",
        f"Held-out success: base {100 * rows['base'][-1]['success']:.1f}% "
        f"[{100 * rows['base'][-1]['ci_low']:.1f}, {100 * rows['base'][-1]['ci_high']:.1f}], TRACE "
        f"{100 * rows['TRACE'][-1]['success']:.1f}% [{100 * rows['TRACE'][-1]['ci_low']:.1f}, "
        f"{100 * rows['TRACE'][-1]['ci_high']:.1f}] over {len(trace_records)} episodes.\n",
        "## Stages\n",
        "| stage | seconds |",
        "|---|---:|",
        *(f"| {name} | {stage['seconds']:.0f} |" for name, stage in stages.items()),
        "\n## 1. Capability analysis\n",
        f"{analysis['failed']} failed and {analysis['passed']} successful base trajectories; selected "
        f"{analysis['selected'] or 'none'} (details: analysis/analysis.md).\n",
        "![selection](plots/selection.png)\n",
        "## 2. Environments and calibration\n",
        calibration_table(calibrations) if calibrations else "(none)",
        *(f"\n- {c['capability']}: dropped ({c['reason']})" for c in calibrations if not c["calibrated"]),
        "\n![calibration](plots/calibration.png)\n",
        "## 3. Adapters\n",
        *(_adapter_line(name, pathlib.Path(folder), logs[name]) for name, folder in adapters.items()),
        "\nTraining reward per variant (unhinted: the episodes played without the hint):\n",
        _variant_table(curves),
        "\n![training](plots/training.png)\n",
        "## 4. Routing\n",
        "| label | held-out tasks |",
        "|---|---:|",
        *(f"| {label} | {n} |" for label, n in distribution.items()),
    ]
    diagnostics = stages.get("diagnostics", {}).get("result", {})
    if final["oracle"]:
        oracle = final["oracle"]
        lines += [
            f"\nOracle (the best system per family on these held-out tasks, an upper bound for routing: "
            f"{oracle['by_family']}): success "
            f"{100 * oracle['success']:.1f}%; the router agrees with it on {100 * oracle['accuracy']:.1f}% "
            "of tasks."
        ]
    lines += [
        "\n## Held-out success per family\n",
        _side_by_side(rows),
        "\n![held-out](plots/heldout.png)\n",
        "### TRACE\n",
        format_table(rows["TRACE"]),
        "\n## 5. Partial learning: sampled pass@k on the families each capability targets\n",
        diagnostics_table(diagnostics),
    ]
    (workdir / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {
        "base_success": rows["base"][-1]["success"],
        "trace_success": rows["TRACE"][-1]["success"],
        "capabilities": analysis["selected"],
        "trained": list(adapters),
        "episodes": {"base": len(base_records), "trace": len(trace_records)},
        "routing": distribution,
        "oracle": final["oracle"],
        "per_adapter_success": final["success"],
        "diagnostics": {
            n: {k: r[k]["pass@1"] for k in ("base", "adapter")} for n, r in diagnostics.items() if r.get("families")
        },
    }
