"""Stage 2's calibration gates: statistics and pass@k against hand-computed values, the difficulty
walk, and a real calibration through the evaluation job (scripted agents, real environments)."""

import dataclasses
import json
import math
import pathlib
import shutil
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from trace_jax.settings import from_config
from trace_jax.trace.calibration import (
    CalibrationSettings,
    calibrate,
    calibrate_builtin,
    calibrate_capability,
    calibration_feedback,
    calibration_table,
    gate_failures,
    group_stats,
    informative_groups,
    level_stats,
    walk_bounds,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


def _block(settings: CalibrationSettings, **changes) -> CalibrationSettings:
    """The settings a `calibration` config block of `settings` with `changes` builds."""
    return from_config(CalibrationSettings, {**dataclasses.asdict(settings), **changes}, "calibration")


def test_group_stats_and_pass_at_k_are_the_hand_computed_values():
    rewards = np.array([[1.0, 0.0, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    stats = group_stats(rewards, rewards == 1.0)
    assert stats["mean"] == pytest.approx(4 / 12) and stats["std"] == pytest.approx(np.std(rewards))
    assert (stats["informative"], stats["all_zero"], stats["all_success"]) == (pytest.approx(1 / 3),) * 2 + (0.0,)
    assert stats["pass@1"] == pytest.approx((1 / 4) / 3)  # one success in four, in one group of three
    assert stats["pass@2"] == pytest.approx((1 - math.comb(3, 2) / math.comb(4, 2)) / 3)
    assert stats["pass@4"] == pytest.approx(1 / 3) and "pass@8" not in stats
    assert stats["std"] == pytest.approx(0.312, abs=1e-3)  # mean 1/3 and std pass; a third of groups informative
    assert gate_failures(stats, CalibrationSettings()) == ["informative groups 0.33 < 0.6"]
    split = group_stats(rewards, rewards == 1.0, hinted=1)  # the first sample of each group hinted
    assert (split["hinted_success"], split["unhinted_success"]) == (pytest.approx(1 / 3), 0.0)


def test_a_group_is_informative_only_across_success_or_a_spread_of_half_the_reward():
    rewards = np.array(
        [
            [0.0, 0.2, 0.2, 0.2],  # 0 against 0.2: a spread GRPO would learn a wrong write from
            [0.0, 0.3, 0.4, 0.0],  # under 0.5 apart, no success
            [0.0, 0.5, 0.0, 0.0],  # 0.5 apart
            [0.6, 1.0, 0.6, 0.6],  # across success
            [1.0, 1.0, 1.0, 1.0],
        ]
    )
    assert informative_groups(rewards, rewards == 1.0).tolist() == [False, False, True, True, False]
    assert group_stats(rewards, rewards == 1.0)["informative"] == pytest.approx(2 / 5)


def test_gates_apply_per_variant_and_the_released_codes_are_one_value_away():
    """Two kinds of task averaging into the band: one always solved, one never; the level fails on both kinds,
    though the mix alone would pass every gate."""
    rewards = np.concatenate([np.ones((4, 8)), np.zeros((4, 8))])
    rewards[[0, 4], 0] = [0.0, 1.0]  # one informative group of each kind
    variants = ["cancel"] * 4 + ["return"] * 4
    config = CalibrationSettings()
    stats = level_stats(rewards, rewards == 1.0, variants)
    assert 0.3 <= stats["mean"] <= 0.6 and set(stats["variants"]) == {"cancel", "return"}
    failures = gate_failures(stats, config)
    assert any(f.startswith("cancel: mean reward 0.969 outside [0.3, 0.6]") for f in failures)
    assert any(f.startswith("return: mean reward 0.031 outside [0.3, 0.6]") for f in failures)
    assert "variants" not in level_stats(rewards, rewards == 1.0, ["cancel"] * 8)  # one kind: gated as a whole
    loose = CalibrationSettings(gates="released_code")
    one_kind = np.array([[1.0, 0.0, 0.0, 0.0]] * 4 + [[1.0, 1.0, 1.0, 0.0]] * 2 + [[0.0] * 4] * 2)
    stats = group_stats(one_kind, one_kind == 1.0)
    assert gate_failures(stats, config) == []  # the paper has no gate on all-zero groups
    assert gate_failures(stats, loose) == ["all-zero groups 0.25 > 0.2"]


def _measure(means: dict[float, float]):
    """Rewards of mean about `means[d]`, 0 or 1 at random, all of one variant."""

    def measure(difficulty):
        p = means[difficulty]
        rewards = (np.random.default_rng(int(difficulty * 100) % 2**32).random((20, 8)) < p).astype(float)
        return rewards, rewards == 1.0, ["only"] * 20

    return measure


def test_the_difficulty_walks_to_the_gates_or_the_environment_is_dropped():
    config = CalibrationSettings()
    bounds = (0, 2)
    walked = calibrate(_measure({0: 0.95, 1: 0.45, 2: 0.1}), config, bounds)
    assert walked["calibrated"] and walked["difficulty"] == 1 and [t["difficulty"] for t in walked["tries"]] == [0, 1]
    config = dataclasses.replace(config, start_difficulty=2)
    down = calibrate(_measure({0: 0.95, 1: 0.45, 2: 0.1}), config, bounds)
    assert down["difficulty"] == 1 and [t["difficulty"] for t in down["tries"]] == [2, 1]
    config = dataclasses.replace(config, start_difficulty=0)
    # too easy, then too hard: the mix halfway between, then (with min_step 0.25) halfway again, never a loop
    mixed = calibrate(_measure({0: 0.9, 1: 0.1, 0.5: 0.45}), config, (0, 1))
    assert mixed["calibrated"] and [t["difficulty"] for t in mixed["tries"]] == [0, 1, 0.5]
    flips = calibrate(_measure({0: 0.9, 1: 0.1, 0.5: 0.15}), config, (0, 1))
    assert not flips["calibrated"] and [t["difficulty"] for t in flips["tries"]] == [0, 1, 0.5]
    assert flips["reason"].startswith("too hard: mean reward 0.1") and "outside [0.3, 0.6]" in flips["reason"]
    config = dataclasses.replace(config, min_step=0.25)
    finer = calibrate(_measure({0: 0.9, 1: 0.1, 0.5: 0.15, 0.25: 0.5}), config, (0, 1))
    assert finer["difficulty"] == 0.25 and [t["difficulty"] for t in finer["tries"]] == [0, 1, 0.5, 0.25]
    config = dataclasses.replace(
        config, min_step=1, start_difficulty=2
    )  # whole levels only; down from 2: 0 too easy stops it
    whole = calibrate(_measure({2: 0.1, 1: 0.1, 0: 0.9}), config, bounds)
    assert not whole["calibrated"] and [t["difficulty"] for t in whole["tries"]] == [2, 1, 0]
    config = dataclasses.replace(config, min_step=0.5)  # the same walk may mix 0 and 1
    assert [
        t["difficulty"] for t in calibrate(_measure({2: 0.1, 1: 0.1, 0: 0.9, 0.5: 0.2}), config, bounds)["tries"]
    ] == [2, 1, 0, 0.5]


def test_too_hard_at_level_0_walks_into_the_scaffolded_levels_and_drops_only_at_the_most_scaffolded():
    config = CalibrationSettings()
    scaffolded = calibrate(_measure({0: 0.02, -1: 0.1, -2: 0.45}), config, (-2, 2))
    assert scaffolded["calibrated"] and [t["difficulty"] for t in scaffolded["tries"]] == [0, -1, -2]
    dropped = calibrate(_measure({0: 0.02, -1: 0.1, -2: 0.15}), config, (-2, 2))
    assert not dropped["calibrated"] and [t["difficulty"] for t in dropped["tries"]] == [0, -1, -2]
    assert dropped["reason"].startswith("too hard even at its most scaffolded level (-2): mean reward 0.09")
    overshoot = calibrate(_measure({0: 0.02, -1: 0.9, -0.5: 0.4}), config, (-2, 2))  # back up between two levels
    assert overshoot["difficulty"] == -0.5 and [t["difficulty"] for t in overshoot["tries"]] == [0, -1, -0.5]
    easy = calibrate(_measure({0: 0.95, 1: 0.9}), config, (-1, 1))
    assert easy["reason"].startswith("too easy even at its top level (1)")
    assert walk_bounds(("prefill", "exact_hint"), 2, 0.5) == (-2, 2)
    assert walk_bounds(("prefill", "exact_hint"), 2, 0.0) == (-1, 2)  # an exact hint needs hinted samples
    assert walk_bounds(("exact_hint", "opened_call"), 1, 0.0) == (0, 1)  # so does an opened call
    assert walk_bounds(("prefill", "exact_hint", "opened_call", "written_call"), 1, 0.25) == (-4, 1)


def _measure_variants(solved: dict[float, dict[str, int]]):
    """10 groups of 8 of each variant `v`, `solved[d][v]` of each group's episodes scoring 1 and the rest 0."""

    def measure(difficulty):
        kinds = sorted(solved[difficulty])
        rewards = np.concatenate([np.tile(np.arange(8) < solved[difficulty][v], (10, 1)) for v in kinds]) * 1.0
        return rewards, rewards == 1.0, [v for v in kinds for _ in range(10)]

    return measure


def test_a_level_of_several_variants_moves_the_way_its_failing_variants_point():
    """The mix's mean inside the band does not stop a walk one variant fails: it moves the way that variant
    points; variants pointing opposite ways end it, saying so."""
    config = CalibrationSettings()
    levels = {0: {"allowed": 1, "refused": 4}, -1: {"allowed": 4, "refused": 4}}
    down = calibrate(_measure_variants(levels), config, (-2, 0))
    assert down["tries"][0]["mean"] == 0.3125  # the mix alone is inside the band [0.3, 0.6]
    assert down["calibrated"] and [t["difficulty"] for t in down["tries"]] == [0, -1]
    levels = {0: {"allowed": 1, "refused": 1}, -1: {"allowed": 7, "refused": 1}}
    split = calibrate(_measure_variants(levels), config, (-2, 0))
    assert not split["calibrated"] and [t["difficulty"] for t in split["tries"]] == [0, -1]
    assert split["reason"].startswith("its variants pull opposite ways: allowed: mean reward 0.875 outside")
    assert "refused: mean reward 0.125" in split["reason"] and split["reason"].endswith("at difficulty -1")


def test_a_try_no_episode_solves_sends_the_walk_to_the_most_scaffolded_level_then_up():
    config = CalibrationSettings()
    levels = {0: 0.0, -1: 0.0, -2: 0.0, -3: 0.45}
    jumped = calibrate(_measure(levels), config, (-3, 2))
    assert jumped["difficulty"] == -3 and [t["difficulty"] for t in jumped["tries"]] == [0, -3]
    stepwise = calibrate(_measure(levels), dataclasses.replace(config, jump_unsolved=False), (-3, 2))
    assert stepwise["difficulty"] == -3 and [t["difficulty"] for t in stepwise["tries"]] == [0, -1, -2, -3]
    # too easy at the bottom: up again, one level at a time; an unsolved level above it does not jump twice
    up = calibrate(_measure({0: 0.0, -3: 0.9, -2: 0.45}), config, (-3, 2))
    assert up["difficulty"] == -2 and [t["difficulty"] for t in up["tries"]] == [0, -3, -2]
    between = calibrate(_measure({0: 0.0, -3: 0.9, -2: 0.0, -2.5: 0.5}), config, (-3, 2))
    assert between["difficulty"] == -2.5 and [t["difficulty"] for t in between["tries"]] == [0, -3, -2, -2.5]
    # a try with some success steps down one level as before; unsolved at the bottom drops it, saying so
    assert [t["difficulty"] for t in calibrate(_measure({0: 0.05, -1: 0.45}), config, (-3, 2))["tries"]] == [0, -1]
    dropped = calibrate(_measure({0: 0.0, -3: 0.0}), config, (-3, 2))
    assert not dropped["calibrated"] and [t["difficulty"] for t in dropped["tries"]] == [0, -3]
    assert dropped["reason"].startswith("too hard even at its most scaffolded level (-3)")


def test_a_real_calibration_runs_the_evaluation_job_and_drops_what_it_cannot_calibrate(tmp_path):
    base = ml_collections.ConfigDict(
        dict(
            model="unused-by-scripted-agents",
            dtype="float32",
            adapter="",
            seed=0,
            env={"name": "embedded_retail"},
            split="heldout",
            num_tasks=1,
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
    config = CalibrationSettings(seeds=3, samples=2, jump_unsolved=False)  # one level at a time (jumps: below)
    gold = calibrate_capability("multi_step", (-2, 2), base, config, tmp_path / "gold", agent="gold")
    assert not gold["calibrated"] and [t["difficulty"] for t in gold["tries"]] == [0, 1, 2]  # too easy everywhere
    assert all(t["mean"] == 1.0 and t["episodes"] == 6 for t in gold["tries"]) and gold["env"] is None
    records = [json.loads(line) for line in (tmp_path / "gold" / "difficulty_2" / "episodes.jsonl").open()]
    assert len(records) == 6 and {r["trial"] for r in records} == {0, 1}
    assert [r["hint"] for r in records if r["task_id"] == records[0]["task_id"]] == [True, False]  # half hinted
    assert records[0]["task_id"].startswith("capability/multi_step/0/2/train/")
    noop = calibrate_capability("multi_step", (-2, 2), base, config, tmp_path / "noop", agent="noop")
    assert [t["difficulty"] for t in noop["tries"]] == [0, -1, -2] and noop["tries"][-1]["mean"] == 0.0
    assert noop["reason"].startswith("too hard even at its most scaffolded level (-2)")
    assert calibrate_capability("multi_step", (-2, 2), base, config, tmp_path / "noop", agent="gold") == noop
    jumping = dataclasses.replace(config, jump_unsolved=True)  # no episode solved at 0: straight to -2
    jumped = calibrate_capability("multi_step", (-2, 2), base, jumping, tmp_path / "jump", agent="noop")
    assert jumped["tries"] == [noop["tries"][0], noop["tries"][2]] and jumped["reason"] == noop["reason"]
    walks = tmp_path / "walks" / "multi_step"  # launch.calibrate's layout: <workdir>/<capability>/difficulty_<d>
    shutil.copytree(tmp_path / "gold", walks)
    groups = json.loads((walks / "difficulty_0" / "groups.json").read_text())
    groups["rewards"][0][0] = 0.25  # a mark only a taken try carries
    (walks / "difficulty_0" / "groups.json").write_text(json.dumps(groups))
    config = dataclasses.replace(config, resume_from=str(walks.parent))
    taken = calibrate_capability("multi_step", (-2, 2), base, config, tmp_path / "taken", agent="gold")
    assert taken["tries"][0]["mean"] < 1.0 and (tmp_path / "taken" / "difficulty_0" / "episodes.jsonl").exists()
    played = calibrate_capability("multi_step", (-2, 2), base, config, tmp_path / "played", agent="noop")
    assert played["tries"] == noop["tries"]  # the gold agent's tries are not the noop agent's: played afresh
    config = dataclasses.replace(config, resume_from="")
    deeper = calibrate_capability("multi_step", (-3, 2), base, config, tmp_path / "noop", agent="noop")
    assert [t["difficulty"] for t in deeper["tries"]] == [0, -1, -2, -3]  # a new scaffold: the walk goes on
    assert deeper["tries"][:3] == noop["tries"] and deeper["reason"].startswith(
        "too hard even at its most scaffolded level (-3)"
    )
    for played in [tmp_path / "gold" / "calibration.json", *(tmp_path / "gold").rglob("episodes.jsonl")]:
        played.unlink()  # what a checkout keeps of a committed walk: each try's groups.json
    assert calibrate_capability("multi_step", (-2, 2), base, config, tmp_path / "gold", agent="noop") == gold
    families = calibrate_builtin("tool_calling", base, config, tmp_path / "families", agent="gold")
    assert families["families"] == {v: None for v in ("cancel", "return", "address", "default_address")}
    assert [(t["variant"], t["difficulty"]) for t in families["tries"]] == [
        (v, 0) for v in ("cancel", "return", "address", "default_address")
    ]  # each too easy at its top level, 0
    assert families["reason"].startswith("cancel: too easy even at its top level (0)")
    tasks = {
        json.loads(line)["family"]
        for line in (tmp_path / "families" / "return" / "difficulty_0" / "episodes.jsonl").open()
    }
    assert tasks == {"return"}
    with pytest.raises(ValueError, match="config.calibration.families = .* is invalid; it must be a tuple of built"):
        _block(config, families=["tool_calling/return", "multi_step/none"])
    config = _block(config, families=["tool_calling/address", "tool_calling/return"])
    narrowed = calibrate_builtin("tool_calling", base, config, tmp_path / "families", agent="noop")
    assert narrowed["families"] == {"return": None, "address": None}  # the capability's order, not the config's
    assert narrowed["tries"] == [t for t in families["tries"] if t["variant"] in ("return", "address")]  # replayed
    config = dataclasses.replace(config, families=())
    table = calibration_table([gold, noop, families])
    assert table.count("\n") == 1 + 10 and "| multi_step | 2 | 6 | 1.000 |" in table
    assert "| tool_calling[return] | 0 | 6 | 1.000 |" in table
    with pytest.raises(ValueError, match="config.calibration.samples = 1 is invalid"):
        _block(config, samples=1)
    with pytest.raises(ValueError, match="config.calibration.cut_share = -0.5 is invalid"):
        _block(config, cut_share=-0.5)
    with pytest.raises(ValueError, match='config.calibration.gates = .strict. is invalid; it must be "paper" or'):
        _block(config, gates="strict")


def test_the_calibration_job_names_an_unknown_capability():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.calibrate",
            "--config=configs/trace_tiny.py",
            f"--workdir={REPO / 'unused'}",
            "--capabilities=tool_calling,telepathy",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and "no built-in environment for ['telepathy']" in out.stderr
    assert not (REPO / "unused").exists()


def test_the_calibration_feedback_tells_the_writer_which_way_to_move():
    config = CalibrationSettings()
    tries = [
        {
            "difficulty": 0,
            "mean": 0.05,
            "std": 0.1,
            "informative": 0.2,
            "success": 0.0,
            "failures": ["mean reward 0.050 outside [0.3, 0.6]"],
        }
    ]
    hard = calibration_feedback({"tries": tries}, config)
    assert "difficulty 0: mean reward 0.050" in hard and "too hard" in hard and "make them easier" in hard
    easy = calibration_feedback({"tries": [{**tries[0], "mean": 0.9}]}, config)
    assert "too easy" in easy and "make them harder" in easy
