"""`eval.keep_best`: the step a run keeps, its adapter's export, and the same choice after a resume.

The trainer's use of it (the exported adapter is best/'s, the summary's final metrics the best step's) runs in the
TRACE pipeline's and the experiment's tiny runs (tests/test_trace_pipeline.py)."""

import json

import pytest

from configs import grpo_env_tiny, grpo_tiny
from trace_jax.lora import NO_ADAPTER
from trace_jax.metrics import MetricsWriter, logged_lines, scalars_by_step
from trace_jax.rl.best_adapter import BestAdapter
from trace_jax.rl.job import ADAPTER
from trace_jax.rl.trainer import GOLD_METRIC, _measure_gold_where_missing, validate_config

REWARDS = [0.2, 0.1, 0.3, 0.3, 0.25]  # steps 0-4: step 2 is the best, step 3 only ties it


def _exporter(exports: list, step: int):
    def export(folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_model.safetensors").write_text(f"step {step}")
        exports.append(step)

    return export


def _log(workdir, rewards):
    with open(workdir / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step, reward in enumerate(rewards):
            f.write(json.dumps({"step": step, "rollout/reward": 0.5}) + "\n")  # a training line, not an evaluation
            f.write(json.dumps({"step": step, "eval/reward": reward, "eval/success": reward / 2}) + "\n")


def _best(workdir, resume_step, tie_break=None):
    """The run's BestAdapter as the trainer makes it, from the run's log."""
    return BestAdapter(workdir, scalars_by_step(logged_lines(workdir)), resume_step, tie_break)


def test_the_earliest_of_the_highest_rewards_is_kept_and_exported_once_per_improvement(tmp_path):
    best, exports = _best(tmp_path, 0), []
    for step, reward in enumerate(REWARDS):
        best.offer(step, {"eval/reward": reward}, _exporter(exports, step))
    assert (best.step, best.reward, exports) == (2, 0.3, [0, 2])
    out = tmp_path / "adapter"
    best.copy_to(out)
    assert (out / "adapter_model.safetensors").read_text() == "step 2"


def test_a_resumed_run_reads_its_best_step_back_from_the_logged_evaluations(tmp_path):
    """Killed after step 4's evaluation was logged but before step 4's checkpoint: the run resumes from step 3,
    so step 3's and 4's lines are not taken, and step 3 is evaluated and offered again."""
    _log(tmp_path, REWARDS)
    best, exports = _best(tmp_path, 3), []
    assert (best.step, best.metrics) == (2, {"eval/reward": 0.3, "eval/success": 0.15})
    best.offer(3, {"eval/reward": 0.3}, _exporter(exports, 3))  # a tie: step 2 stays
    best.offer(4, {"eval/reward": 0.31}, _exporter(exports, 4))
    assert (best.step, exports) == (4, [4])
    assert _best(tmp_path, 1).step == 0 and _best(tmp_path, 0).step is None


def test_a_tie_goes_to_the_step_whose_policy_finds_the_gold_turns_likelier(tmp_path):
    """`eval.ties = "gold_logp"`: a higher reward still wins whatever the gold turns' likelihood; among steps of
    the same reward the highest eval/gold_logp is kept (a step's evaluation compared with the best one's)."""
    offers = [(0.2, -90.0), (0.2, -40.0), (0.1, -5.0), (0.2, -60.0), (0.2, -20.0), (0.3, -80.0), (0.3, -81.0)]
    best, exports = _best(tmp_path, 0, "eval/gold_logp"), []
    kept = []
    for step, (reward, gold) in enumerate(offers):
        best.offer(step, {"eval/reward": reward, "eval/gold_logp": gold}, _exporter(exports, step))
        kept.append(best.step)
    assert kept == [0, 1, 1, 1, 4, 5, 5] and exports == [0, 1, 4, 5]


def test_a_measure_logged_on_resume_joins_its_steps_evaluation_and_a_step_without_it_loses_a_tie(tmp_path):
    """A run resumed from before eval/gold_logp was logged adds it for the base (step 0) on a line of its own;
    the read-back joins the lines of a step. Step 1, logged without it, loses the tie to step 0."""
    _log(tmp_path, [0.2, 0.2, 0.1])
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": 0, "eval/gold_logp": -50.0}) + "\n")
    best, exports = _best(tmp_path, 3, "eval/gold_logp"), []
    assert (best.step, best.metrics["eval/gold_logp"]) == (0, -50.0)
    best.offer(3, {"eval/reward": 0.2, "eval/gold_logp": -51.0}, _exporter(exports, 3))
    best.offer(4, {"eval/reward": 0.2, "eval/gold_logp": -49.0}, _exporter(exports, 4))
    assert (best.step, exports) == (4, [4])
    assert _best(tmp_path, 3).step == 0  # no tie-break: the earlier step, as before


def test_a_resumed_run_measures_the_gold_turns_only_for_the_base_and_its_step_and_only_where_missing(tmp_path):
    """`_measure_gold_where_missing`: of a log written before eval/gold_logp existed, step 0 (under the base) and
    the step resumed from (under the adapter) are measured, each once; a step evaluated in between is not, nor a
    step not yet evaluated; the values join the steps' scalars and the log."""
    _log(tmp_path, [0.2, 0.2, 0.1])
    logged = scalars_by_step(logged_lines(tmp_path))
    measured = []

    def measure(adapter_idx):
        measured.append(adapter_idx)
        return -10.0 * len(measured)

    writer = MetricsWriter(tmp_path)
    _measure_gold_where_missing(logged, 2, measure, writer)
    _measure_gold_where_missing(logged, 2, measure, writer)  # nothing left to measure
    _measure_gold_where_missing(logged, 3, measure, writer)  # step 3 has no evaluation logged
    writer.close()
    assert measured == [NO_ADAPTER, ADAPTER]
    assert [logged[step].get(GOLD_METRIC) for step in range(3)] == [-10.0, None, -20.0]
    assert scalars_by_step(logged_lines(tmp_path)) == logged


def test_no_evaluation_leaves_nothing_to_copy(tmp_path):
    with pytest.raises(RuntimeError, match="no step was evaluated"):
        _best(tmp_path, 5).copy_to(tmp_path / "adapter")


def test_a_tie_break_must_be_one_the_trainer_knows():
    config = grpo_env_tiny.get_config()
    config.eval.update(keep_best=True, ties="gold")
    with pytest.raises(ValueError, match=r"config.eval.ties = 'gold' is invalid; it must be one of"):
        validate_config(config)


def test_keeping_the_best_step_needs_a_held_out_evaluation():
    config = grpo_tiny.get_config()
    config.eval.update(num_tasks=0, keep_best=True)
    with pytest.raises(ValueError, match="config.eval.keep_best = True is invalid; it must be False when num_tasks"):
        validate_config(config)
