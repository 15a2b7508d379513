"""Diagnostics of partial learning: the families a capability targets, pass@k from sampled episodes against the
hand-computed values, and held-out evaluations restricted to families (scripted agents, the embedded target)."""

import math

import ml_collections
import pytest

from trace_jax.agent.episodes import recorded_episodes
from trace_jax.evaluation import evaluate
from trace_jax.settings import defaults, from_config
from trace_jax.trace.diagnostics import (
    DiagnosticsSettings,
    diagnostics_table,
    pass_rates,
    sampled_evaluation,
    targeted_families,
)


def test_the_targeted_families_hold_a_share_of_the_capabilitys_lacking_failures():
    lacking = {"return_delivered": 25, "change_address": 13, "refuse": 3, "lookup_by_email": 1}
    assert targeted_families(lacking, 0.1) == ["return_delivered", "change_address"]
    assert targeted_families(lacking, 0.0) == list(lacking) and targeted_families({}, 0.1) == []


def test_pass_rates_are_the_unbiased_pass_at_k_by_family():
    records = [
        {"task_id": f"t{t}", "family": "a" if t < 2 else "b", "success": s}
        for t, wins in enumerate((0, 1, 4))
        for s in [True] * wins + [False] * (4 - wins)
    ]
    rates = pass_rates(records, 4)
    assert rates["tickets"] == 3 and rates["pass@1"] == pytest.approx((0 + 0.25 + 1) / 3)
    assert rates["pass@4"] == pytest.approx(2 / 3)
    assert rates["by_family"]["a"] == {"tickets": 2, "pass@1": pytest.approx(0.125), "pass@4": pytest.approx(0.5)}
    two = pass_rates([{"task_id": "t", "family": "a", "success": s} for s in (True, False, False, False)], 2)
    assert two["pass@2"] == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    after = pass_rates([{**r, "success": r["family"] == "a"} for r in records], 4)  # a learnt, b forgotten
    table = diagnostics_table(
        {
            "tool_calling": {"families": ["a", "b"], "samples": 4, "base": rates, "adapter": after},
            "other": {"families": [], "reason": "none"},
        }
    )
    assert table.splitlines()[2:] == [
        "| tool_calling | all | 3 | 0.417 -> 0.667 | 0.667 -> 0.667 |",
        "|  | a | 2 | 0.125 -> 1.000 | 0.500 -> 1.000 |",
        "|  | b | 1 | 1.000 -> 0.000 | 1.000 -> 0.000 |",
    ]


def test_a_sampled_evaluation_plays_only_the_targeted_families_first_tickets(tmp_path):
    heldout = ml_collections.ConfigDict(
        dict(
            model="unused-by-scripted-agents",
            dtype="float32",
            adapter="",
            seed=0,
            env={"name": "embedded_retail", "seed": 0, "families": ()},
            split="heldout",
            num_tasks=None,
            trials=1,
            log_every_s=0.0,
            rollout=dict(
                batch_size=4,
                max_turns=8,
                max_tokens_per_turn=64,
                max_errors=4,
                temperature=0.0,
                top_p=1.0,
                user_temperature=0.0,
            ),
        )
    )
    settings = DiagnosticsSettings(samples=2, per_family=3)
    run = sampled_evaluation(heldout, settings, ["change_address", "return_delivered"])
    assert run.trials == 2 and run.rollout.temperature == 1.0 and heldout.trials == 1
    evaluate(run, tmp_path, agent="gold")
    records = recorded_episodes(tmp_path / "episodes.jsonl")
    assert sorted({r["family"] for r in records}) == ["change_address", "return_delivered"]
    assert len(records) == 2 * 3 * 2 and all(r["success"] for r in records)
    config = defaults(DiagnosticsSettings)
    config.per_family = 0
    with pytest.raises(ValueError, match="config.diagnostics.per_family = 0 is invalid"):
        from_config(DiagnosticsSettings, config, "diagnostics")
    bad = ml_collections.ConfigDict({**run.to_dict(), "families": [3]})
    with pytest.raises(ValueError, match=r"config.families = \[3\] is invalid"):
        evaluate(bad, tmp_path / "bad", agent="gold")
