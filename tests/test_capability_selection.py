"""Stage 1's selection rule on labelling runs in the authors' interchange format, and its CLI."""

import json
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest
from multiprocess import failure_report

from trace_jax.trace.selection import InvalidRun, LabellingRun, intervals, load_runs, resample, scores, select

REPO = pathlib.Path(__file__).resolve().parents[1]
FAILED = [f"f{i}" for i in range(20)]
PASSED = [f"p{i}" for i in range(10)]


def _run(labels: dict[str, dict[str, str]], attempt: int = 0) -> dict:
    """The interchange JSON of per-trajectory labels {capability: {task id: NA|PRESENT|LACKING}}."""
    cells = {}
    for name, by_task in labels.items():
        cells[name] = {
            f"{label.lower()}_{outcome}": [t for t in ids if by_task[t] == label]
            for outcome, ids in (("failed", FAILED), ("passed", PASSED))
            for label in ("LACKING", "PRESENT", "NA")
        }
    return {"attempt": attempt, "totals": {"total_failed": len(FAILED), "total_passed": len(PASSED)}, "labels": cells}


def _paper(by_task: dict[str, str]) -> dict[str, float]:
    """The paper's definitions, counted trajectory by trajectory."""

    def rate(ids):
        needed = [t for t in ids if by_task[t] != "NA"]
        return sum(by_task[t] == "LACKING" for t in needed) / len(needed) if needed else 0.0

    er_minus, er_plus = rate(FAILED), rate(PASSED)
    return {
        "er_plus": er_plus,
        "er_minus": er_minus,
        "delta": er_minus - er_plus,
        "cov": sum(by_task[t] == "LACKING" for t in FAILED) / len(FAILED),
    }


def test_scores_are_the_papers_rates_counted_per_trajectory():
    rng = random.Random(0)
    for trial in range(50):
        weights = [rng.random() for _ in range(3)]
        by_task = {t: rng.choices(["NA", "PRESENT", "LACKING"], weights)[0] for t in FAILED + PASSED}
        got = scores(LabellingRun.from_json(_run({"c": by_task})), "c")
        assert got == pytest.approx(_paper(by_task), abs=1e-12), trial
    none_needed = {t: "NA" for t in FAILED + PASSED}  # zero denominators count as 0
    assert scores(LabellingRun.from_json(_run({"c": none_needed})), "c") == {
        "er_plus": 0.0,
        "er_minus": 0.0,
        "delta": 0.0,
        "cov": 0.0,
    }


def _labels(lacking_failed: int, present_failed: int, lacking_passed: int) -> dict[str, str]:
    """Labels with the given counts (the rest NA)."""
    by_task = {t: "NA" for t in FAILED + PASSED}
    for t in FAILED[:lacking_failed]:
        by_task[t] = "LACKING"
    for t in FAILED[lacking_failed : lacking_failed + present_failed]:
        by_task[t] = "PRESENT"
    for i, t in enumerate(PASSED):
        by_task[t] = "LACKING" if i < lacking_passed else "PRESENT"
    return by_task


def test_a_capability_is_selected_when_it_passes_in_k_of_n_runs_ranked_by_coverage():
    passing, failing = _labels(8, 2, 1), _labels(8, 2, 9)  # Delta 0.7 / -0.1, Cov 0.4
    small_gap = _labels(5, 5, 4)  # Delta 0.5 - 0.4 = 0.1: fails every run
    wide = _labels(12, 0, 0)  # Cov 0.6, Delta 1.0 in every run
    runs = [
        LabellingRun.from_json(
            _run(
                {
                    "eight": passing if i < 8 else failing,
                    "seven": passing if i < 7 else failing,
                    "small_gap": small_gap,
                    "wide": wide,
                },
                i,
            )
        )
        for i in range(10)
    ]
    rows = select(runs, delta=0.2, coverage=0.1, min_runs=8)
    assert [(r["name"], r["runs_passed"], r["selected"]) for r in rows] == [
        ("wide", 10, True),
        ("eight", 8, True),
        ("seven", 7, False),
        ("small_gap", 0, False),
    ]
    eight = rows[1]
    deltas = [0.7] * 8 + [-0.1] * 2
    assert eight["mean_delta"] == pytest.approx(np.mean(deltas)) and eight["std_delta"] == pytest.approx(np.std(deltas))
    assert eight["mean_cov"] == pytest.approx(0.4) and eight["std_cov"] == pytest.approx(0.0, abs=1e-12)
    assert eight["runs_total"] == 10
    # The thresholds are the caller's: a looser coverage bar alone does not pass a small gap.
    assert not next(r for r in select(runs, coverage=0.0, min_runs=1) if r["name"] == "small_gap")["selected"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda run: run["labels"]["c"]["na_failed"].append("f0"), "failed lists hold 21 ids"),
        (lambda run: run["totals"].update(total_passed=11), "totals say 11"),
        (lambda run: run["labels"]["c"].pop("present_passed"), "not a labelling run"),
        (lambda run: run["labels"]["d"]["na_failed"].__setitem__(0, "f99"), "ids differ from another"),
        (lambda run: run.update(labels={}), "labels no capability"),
    ],
)
def test_a_run_that_is_not_a_partition_is_refused_naming_why(mutate, message):
    run = _run({"c": _labels(3, 3, 3), "d": {t: "NA" for t in FAILED + PASSED}})
    mutate(run)
    with pytest.raises(InvalidRun, match=message):
        LabellingRun.from_json(run)


def test_the_cli_reads_a_folder_drops_invalid_runs_and_prints_one_json_line(tmp_path):
    for i in range(3):
        (tmp_path / f"run_{i}.json").write_text(
            json.dumps(_run({"wide": _labels(12, 0, 0), "never": _labels(0, 10, 0)}, i))
        )
    (tmp_path / "run_3.json").write_text("{not json")
    (tmp_path / "notes.txt").write_text("ignored")
    command = [sys.executable, "-m", "launch.select_capabilities", f"--runs={tmp_path}", "--min_runs=3", "--json"]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, failure_report(out)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(c["name"], c["selected"], c["runs_passed"]) for c in result["capabilities"]] == [
        ("wide", True, 3),
        ("never", False, 0),
    ]
    assert set(result["capabilities"][0]) == {
        "name",
        "mean_cov",
        "std_cov",
        "mean_delta",
        "std_delta",
        "runs_passed",
        "runs_total",
        "selected",
    }
    assert len(result["dropped_runs"]) == 1 and result["dropped_runs"][0].startswith("run_3.json: invalid JSON")
    assert load_runs(tmp_path)[0][0].to_json() == json.loads((tmp_path / "run_0.json").read_text())
    empty = subprocess.run(
        [*command[:3], f"--runs={tmp_path / 'none'}"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert empty.returncode != 0 and "no valid labelling run" in empty.stderr


def test_a_resample_keeps_the_outcome_totals_and_each_drawn_trajectorys_labels():
    by_task = _labels(6, 8, 3)
    run = LabellingRun.from_json(_run({"c": by_task, "all_na": {t: "NA" for t in FAILED + PASSED}}))
    again = resample(run, np.random.default_rng(7), attempt=3)
    assert again.to_json() == resample(run, np.random.default_rng(7), attempt=3).to_json()  # seeded
    assert (again.attempt, again.total_failed, again.total_passed) == (3, 20, 10)
    drawn = {i: key.split("_")[0].upper() for key, ids in again.labels["c"].items() for i in ids}
    assert len(drawn) == 30 and all(label == by_task[i.split("#")[0]] for i, label in drawn.items())
    assert len({i.split("#")[0] for i in drawn}) < 30  # drawn with replacement


def test_bootstrap_intervals_cover_the_sampling_spread_and_handle_empty_outcomes():
    exact = LabellingRun.from_json(_run({"c": _labels(20, 0, 0)}))  # every failure lacks it, no success does
    assert intervals([exact], num=200)["c"] == {"delta": [1.0, 1.0], "cov": [1.0, 1.0]}
    failed = [f"f{i}" for i in range(400)]  # Cov 0.4 over 400 failures: binomial 95% half-width 0.048
    cells = {
        "lacking_failed": failed[:160],
        "present_failed": failed[160:],
        "na_failed": [],
        "lacking_passed": [],
        "present_passed": [],
        "na_passed": [],
    }
    no_success = LabellingRun.from_json({"totals": {"total_failed": 400, "total_passed": 0}, "labels": {"c": cells}})
    span = intervals([no_success], num=2000, seed=1)["c"]
    assert span["cov"] == pytest.approx([0.4 - 0.048, 0.4 + 0.048], abs=0.012)
    assert span["delta"] == span["cov"]  # ER- = Cov here (no NA), and ER+ = 0 with no success
