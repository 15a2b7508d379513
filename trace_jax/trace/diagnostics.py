"""Diagnostics that see partial learning: before and after each adapter, sampled pass@k on the target's held-out
tickets of the families its capability is meant to fix.

Greedy held-out success moves only once an adapter solves a ticket outright; an agent that has begun to learn a
missing write solves some of k samples first. The families a capability targets are those holding at least
`min_share` of the failed analysis trajectories labelled as lacking it (`analysis.lacking_families`). Each is
played `samples` times at `temperature` on its first `per_family` held-out tickets, by the base agent and by the
adapter alone (the evaluation job: resumable, episodes kept under `diagnostics/<capability>/`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections import defaultdict

import ml_collections
import numpy as np

from trace_jax.agent.episodes import recorded_episodes
from trace_jax.evaluation import evaluate
from trace_jax.report import pass_at_k
from trace_jax.settings import none_or, number, positive_int, setting


@dataclasses.dataclass(frozen=True)
class DiagnosticsSettings:
    """The `diagnostics` block: k = `samples` samples at `temperature` on the first `per_family` held-out tickets
    of each family holding at least `min_share` of a capability's lacking failures (samples 0: no diagnostics)."""

    samples: int = setting(8, "an int >= 0 (0: no diagnostics)", lambda v: isinstance(v, int) and v >= 0)
    per_family: int | None = setting(8, "None (all) or a positive int", none_or(positive_int))
    temperature: float = setting(1.0, "a number > 0 (samples must differ)", lambda v: number(v) and v > 0)
    min_share: float = setting(0.1, "a number in [0, 1]", lambda v: number(v) and 0 <= v <= 1)


def targeted_families(lacking: dict[str, int], min_share: float) -> list[str]:
    """The families holding at least `min_share` of a capability's failed trajectories that lack it."""
    total = sum(lacking.values())
    return [family for family, n in lacking.items() if total and n / total >= min_share]


def sampled_evaluation(
    heldout: ml_collections.ConfigDict, settings: DiagnosticsSettings, families: list[str]
) -> ml_collections.ConfigDict:
    """The held-out evaluation `heldout` (an evaluation job's config) on `families`, sampled `settings.samples`
    times a ticket at `settings.temperature`."""
    run = ml_collections.ConfigDict(heldout.to_dict())
    run.update(families=tuple(families), per_family=settings.per_family, trials=settings.samples)
    run.rollout.temperature = settings.temperature
    return run


def pass_rates(records: list[dict], k: int) -> dict:
    """pass@1 and pass@k over the tickets of `records` (each played k times), overall and by family."""
    per_task: dict[str, list[bool]] = defaultdict(list)
    family_of = {}
    for record in records:
        per_task[record["task_id"]].append(bool(record["success"]))
        family_of[record["task_id"]] = record["family"]

    def rates(tasks: list[str]) -> dict:
        return {
            "tickets": len(tasks),
            **{
                f"pass@{j}": float(np.mean([pass_at_k(sum(per_task[t]), len(per_task[t]), j) for t in tasks]))
                for j in (1, k)
            },
        }

    families = sorted(set(family_of.values()))
    return {
        **rates(list(per_task)),
        "by_family": {f: rates([t for t in per_task if family_of[t] == f]) for f in families},
    }


def run_diagnostics(
    heldout: ml_collections.ConfigDict,
    settings: DiagnosticsSettings,
    lacking: dict[str, dict[str, int]],
    adapters: dict[str, str],
    folder: pathlib.Path,
) -> dict:
    """Per adapter (capability -> PEFT folder): its targeted families and the base agent's and the adapter's
    pass rates there (`heldout`: the pipeline's held-out evaluation of the base agent; `lacking`: per capability,
    its lacking failures by family)."""
    if not settings.samples:
        return {}
    results = {}
    for name, adapter in adapters.items():
        families = targeted_families(lacking.get(name, {}), settings.min_share)
        if not families:
            results[name] = {"families": [], "reason": "no failed analysis trajectory lacks it"}
            continue
        base_dirs = sorted(p for p in folder.glob("*/base") if p.is_dir())  # the same tickets under no adapter
        played = {}
        for system, path in (("base", ""), ("adapter", adapter)):
            run = sampled_evaluation(heldout, settings, families)
            run.adapter = path
            workdir = folder / name / system
            evaluate(run, workdir, reuse=base_dirs if system == "base" else ())
            played[system] = pass_rates(recorded_episodes(workdir / "episodes.jsonl"), settings.samples)
        results[name] = {"families": families, "samples": settings.samples, **played}
    return results


def diagnostics_table(results: dict) -> str:
    """Per adapter: a row over its targeted families, then one per family (an adapter that starts to learn one
    missing write can lose as much on another family), each with tickets, pass@1 and pass@k before -> after."""
    rows = [(name, r) for name, r in results.items() if r.get("families")]
    if not rows:
        return "(none)"
    k = rows[0][1]["samples"]
    lines = [
        f"| capability | targeted family | tickets | pass@1 base -> adapter | pass@{k} base -> adapter |",
        "|---|---|---:|---|---|",
    ]

    def row(name: str, family: str, base: dict, adapter: dict) -> str:
        return (
            f"| {name} | {family} | {base['tickets']} | {base['pass@1']:.3f} -> {adapter['pass@1']:.3f} | "
            f"{base[f'pass@{k}']:.3f} -> {adapter[f'pass@{k}']:.3f} |"
        )

    for name, r in rows:
        lines.append(row(name, "all", r["base"], r["adapter"]))
        played = [f for f in r["families"] if f in r["base"]["by_family"] and f in r["adapter"]["by_family"]]
        lines += [row("", f, r["base"]["by_family"][f], r["adapter"]["by_family"][f]) for f in played]
    return "\n".join(lines)
