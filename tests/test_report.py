"""pass^k and success intervals against brute force and published values; the per-family table; paired
comparisons against scipy's exact binomial test."""

import itertools

import pytest
from scipy.stats import binomtest

from trace_jax.report import format_table, mcnemar_p_value, paired, pass_hat_k, summarize, wilson_interval


@pytest.mark.parametrize("successes, trials, k", [(0, 4, 1), (3, 4, 2), (4, 4, 4), (2, 5, 3), (5, 8, 2)])
def test_pass_hat_k_is_the_chance_that_k_drawn_trials_all_succeed(successes, trials, k):
    outcomes = [True] * successes + [False] * (trials - successes)
    draws = list(itertools.combinations(outcomes, k))
    assert pass_hat_k(successes, trials, k) == pytest.approx(sum(all(d) for d in draws) / len(draws))


def test_pass_hat_k_rejects_k_beyond_trials():
    with pytest.raises(ValueError, match="k <= trials"):
        pass_hat_k(1, 2, 3)


@pytest.mark.parametrize(
    "successes, n, low, high", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (81, 263, 0.2553, 0.3662)]
)  # Wilson 1927; Newcombe 1998
def test_wilson_interval_matches_published_values(successes, n, low, high):
    got = wilson_interval(successes, n)
    assert got == pytest.approx((low, high), abs=5e-4)


def test_summary_rows_per_family_and_overall():
    episodes = [
        {"task_id": t, "family": f, "reward": r, "success": r == 1.0}
        for t, f, r in [
            ("a", "x", 1.0),
            ("a", "x", 0.0),
            ("b", "x", 1.0),
            ("b", "x", 1.0),
            ("c", "y", 0.0),
            ("c", "y", 0.0),
        ]
    ]
    rows = summarize(episodes, k=2)
    assert [r["family"] for r in rows] == ["x", "y", "all"]
    x, y, overall = rows
    assert (x["episodes"], x["tasks"], x["success"], x["pass1"], x["pass_k"]) == (4, 2, 0.75, 0.75, 0.5)
    assert (y["success"], y["pass_k"]) == (0.0, 0.0)
    assert overall["mean_reward"] == pytest.approx(0.5) and overall["pass_k"] == pytest.approx(1 / 3)
    table = format_table(rows)
    assert table.count("\n") == 4 and "| x | 4 | 2 | 0.750 | 75.0% [" in table


@pytest.mark.parametrize("only_a, only_b", [(0, 0), (8, 0), (0, 8), (3, 3), (5, 2), (1, 6), (12, 4), (30, 41)])
def test_the_exact_mcnemar_test_is_the_two_sided_binomial_test_on_the_discordant_tasks(only_a, only_b):
    expected = binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    assert mcnemar_p_value(only_a, only_b) == pytest.approx(expected, rel=1e-9)


def test_a_paired_comparison_counts_the_tasks_one_side_alone_solved_and_needs_the_same_tasks():
    episode = lambda task, success: {"task_id": task, "success": success}
    a = [episode("t1", True), episode("t2", True), episode("t3", False), episode("t4", True)]
    b = [episode("t4", True), episode("t3", True), episode("t2", False), episode("t1", False)]  # another order
    assert paired(a, b) == {"tasks": 4, "only_a": 2, "only_b": 1, "p_value": 1.0}
    with pytest.raises(ValueError, match="same tasks"):
        paired(a, b[:3])
    with pytest.raises(ValueError, match="one episode per task"):
        paired(a + [episode("t1", False)], b)
