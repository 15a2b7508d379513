"""Evaluation summaries: pass^k, success rates with 95% Wilson intervals, per-family tables.

pass^k follows τ²-bench: per task, C(successes, k) / C(trials, k) (the chance that k
trials drawn without replacement all succeed), averaged over tasks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

Z_95 = 1.959963984540054  # two-sided 95% normal quantile


def pass_hat_k(successes: int, trials: int, k: int) -> float:
    """One task's pass^k: C(successes, k) / C(trials, k); needs k <= trials."""
    if not 1 <= k <= trials:
        raise ValueError(f"pass^k needs 1 <= k <= trials, got k={k}, trials={trials}")
    return math.comb(successes, k) / math.comb(trials, k)


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval for a success rate (sound at 0% and 100%, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(episodes: Sequence[dict], k: int) -> list[dict]:
    """One row per family, then "all": episodes, tasks, mean reward, success rate with its
    95% interval, pass^1 and pass^k (k capped at the fewest trials any task had).

    `episodes` are `Trajectory.record()` dicts (task_id, family, reward, success).
    """
    by_family: dict[str, list[dict]] = defaultdict(list)
    for episode in episodes:
        by_family[episode["family"]].append(episode)
    rows = [_row(family, by_family[family], k) for family in sorted(by_family)]
    return rows + [_row("all", list(episodes), k)] if episodes else rows


def _row(name: str, episodes: list[dict], k: int) -> dict:
    per_task: dict[str, list[bool]] = defaultdict(list)
    for episode in episodes:
        per_task[episode["task_id"]].append(bool(episode["success"]))
    k = min(k, min(len(v) for v in per_task.values()))
    successes = sum(bool(e["success"]) for e in episodes)
    low, high = wilson_interval(successes, len(episodes))
    pass_at = lambda j: sum(pass_hat_k(sum(v), len(v), j) for v in per_task.values()) / len(per_task)
    return {"family": name, "episodes": len(episodes), "tasks": len(per_task),
            "mean_reward": sum(e["reward"] for e in episodes) / len(episodes),
            "success": successes / len(episodes), "ci_low": low, "ci_high": high,
            "pass1": pass_at(1), "k": k, "pass_k": pass_at(k)}


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table of `summarize` rows (Markdown-compatible)."""
    header = "| family | episodes | tasks | mean reward | success [95% CI] | pass^1 | pass^k |"
    lines = [header, "|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['episodes']} | {r['tasks']} | {r['mean_reward']:.3f} | "
                     f"{100 * r['success']:.1f}% [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}] | "
                     f"{r['pass1']:.3f} | {r['pass_k']:.3f} (k={r['k']}) |")
    return "\n".join(lines)
