"""Evaluation summaries: pass^k, success rates with 95% Wilson intervals, per-family tables, and paired
comparisons of two systems on the same tasks (exact McNemar test).

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


def pass_at_k(successes: int, n: int, k: int) -> float:
    """One task's unbiased pass@k (some of k drawn trials succeeds): 1 - C(n - successes, k) / C(n, k)."""
    return 1.0 - math.comb(n - successes, k) / math.comb(n, k)


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval for a success rate (sound at 0% and 100%, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_p_value(only_a: int, only_b: int) -> float:
    """The exact two-sided McNemar test: the chance, were both systems equally good, of a split of the
    discordant tasks (solved by one system only) at least as uneven as `only_a` against `only_b`."""
    n = only_a + only_b
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired(a: Sequence[dict], b: Sequence[dict]) -> dict:
    """Two systems' episodes on the same tasks, one each (held-out evaluations): the tasks only `a` solves,
    those only `b` solves, and the exact McNemar p-value. Sharper than two intervals, which ignore that both
    met the same tasks."""
    success_a, success_b = ({e["task_id"]: bool(e["success"]) for e in episodes} for episodes in (a, b))
    if len(success_a) != len(a) or len(success_b) != len(b) or success_a.keys() != success_b.keys():
        raise ValueError("a paired comparison needs one episode per task of the same tasks on both sides")
    only_a = sum(success_a[t] and not success_b[t] for t in success_a)
    only_b = sum(success_b[t] and not success_a[t] for t in success_a)
    return {"tasks": len(success_a), "only_a": only_a, "only_b": only_b, "p_value": mcnemar_p_value(only_a, only_b)}


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
    return {
        "family": name,
        "episodes": len(episodes),
        "tasks": len(per_task),
        "mean_reward": sum(e["reward"] for e in episodes) / len(episodes),
        "success": successes / len(episodes),
        "ci_low": low,
        "ci_high": high,
        "pass1": pass_at(1),
        "k": k,
        "pass_k": pass_at(k),
    }


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table of `summarize` rows (Markdown-compatible)."""
    header = "| family | episodes | tasks | mean reward | success [95% CI] | pass^1 | pass^k |"
    lines = [header, "|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['episodes']} | {r['tasks']} | {r['mean_reward']:.3f} | "
            f"{100 * r['success']:.1f}% [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}] | "
            f"{r['pass1']:.3f} | {r['pass_k']:.3f} (k={r['k']}) |"
        )
    return "\n".join(lines)
