"""A workdir holds one run (`trace_jax.workdirs`): the settings that decide results are recorded, a job rerun
with one of them changed refuses the workdir naming the key (GRPO, SFT, the pipeline, the experiment and the
calibration job), `--fresh` finds the next free folder, and a second process cannot take a held workdir."""

from __future__ import annotations

import subprocess
import sys

import pytest

from configs import experiment_tiny, grpo_env_tiny, trace_tiny, warmstart_tiny
from trace_jax.baselines.experiment import Experiment
from trace_jax.rl import sft, trainer
from trace_jax.trace.pipeline import Pipeline
from trace_jax.workdirs import (
    WorkdirMismatch,
    check_marker,
    decisive_settings,
    fresh_workdir,
    locked,
)


def test_the_settings_that_decide_results_leave_out_how_a_run_is_carried_out():
    config = {
        "train": {"steps": 8, "checkpoint_every": 2, "micro_batch_tokens": 4096, "remat": True},
        "rollout": {"batch_size": 8, "group_size": 4, "lengths": (1, 2)},
        "mesh": {"data": 2, "tensor": 1},
        "log_every_s": 30.0,
        "eval": {"base_run": "runs/base", "every": 4, "num_tasks": 20},
        "arms": ("oracle", "gepa"),  # a comparison run arm by arm, its record copied elsewhere
        "results_file": "docs/results/comparison.json",
    }
    assert decisive_settings(config) == {
        "train.steps": 8,
        "rollout.group_size": 4,
        "rollout.lengths": [1, 2],
        "eval.num_tasks": 20,
    }
    config["eval"]["keep_best"] = True  # then which steps are evaluated decides the adapter kept
    assert {k: v for k, v in decisive_settings(config).items() if k.startswith("eval.")} == {
        "eval.every": 4,
        "eval.keep_best": True,
        "eval.num_tasks": 20,
    }


def _marked(workdir, job: str, config) -> None:
    check_marker(workdir, job, decisive_settings(config.to_dict()))


@pytest.mark.parametrize("job", ["grpo", "sft", "trace", "experiment"])
def test_a_rerun_with_a_changed_result_deciding_key_refuses_naming_it(job, tmp_path):
    if job == "grpo":
        config = grpo_env_tiny.get_config()
        _marked(tmp_path, job, config)
        config.train.steps += 1
        run, key = lambda: trainer.train(config, tmp_path), "config.train.steps"
    elif job == "sft":
        config = warmstart_tiny.get_config()
        _marked(tmp_path, job, config)
        config.optimizer.lr *= 2
        run, key = lambda: sft.train(config, tmp_path), "config.optimizer.lr"
    elif job == "trace":
        config = trace_tiny.get_config()
        _marked(tmp_path, job, config)
        config.training.train.steps += 1
        run, key = lambda: Pipeline(config, tmp_path).run(), "config.training.train.steps"
    else:
        config = experiment_tiny.get_config()
        _marked(tmp_path, job, config)
        config.trace.seed += 1
        run, key = lambda: Experiment(config, tmp_path).run(), "config.trace.seed"
    marker = (tmp_path / "job.json").read_text()
    with pytest.raises(WorkdirMismatch, match=rf"holds a {job} run made with other settings \({key} = "):
        run()
    assert (tmp_path / "job.json").read_text() == marker  # nothing written, nothing deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "job.json"]


def test_the_calibration_job_refuses_a_workdir_of_other_tries_before_it_builds_anything(tmp_path, job_env):
    common = [sys.executable, "-m", "launch.calibrate", "--config=configs/trace_tiny.py", f"--workdir={tmp_path}"]
    check_marker(tmp_path, "calibration", {"calibration.samples": 1})
    done = subprocess.run(
        [*common, "--capabilities=tool_calling"], capture_output=True, text=True, timeout=600, env=job_env
    )
    assert done.returncode != 0 and "holds a calibration run made with other settings" in done.stderr, done.stderr
    assert "config.calibration.samples = 1 there" in done.stderr


def test_fresh_takes_the_next_folder_that_is_free_or_holds_this_run(tmp_path):
    mine, other = {"train.steps": 8}, {"train.steps": 4}
    assert fresh_workdir(tmp_path / "run", "grpo", mine) == tmp_path / "run"
    check_marker(tmp_path / "run", "grpo", other)
    check_marker(tmp_path / "run-2", "sft", mine)
    assert fresh_workdir(tmp_path / "run", "grpo", mine) == tmp_path / "run-3"
    check_marker(tmp_path / "run-3", "grpo", mine)
    assert fresh_workdir(tmp_path / "run", "grpo", mine) == tmp_path / "run-3"  # resumed there


def test_fresh_in_a_multi_process_job_takes_the_main_process_choice(tmp_path, monkeypatch):
    """A worker that sees the folder free on its own disk still runs where process 0 found room."""
    import jax
    from absl import flags
    from absl.testing import flagsaver

    from launch.workdir import job_workdir
    from trace_jax import distributed

    mine = {"train": {"steps": 8}}
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(distributed, "allgather_objects", lambda value: [str(tmp_path / "run-2"), value])
    parsed = flags.FLAGS.is_parsed()
    flags.FLAGS.mark_as_parsed()
    try:
        with flagsaver.flagsaver(fresh=True):
            assert job_workdir(str(tmp_path / "run"), "grpo", mine) == str(tmp_path / "run-2")
    finally:
        if not parsed:
            flags.FLAGS.unparse_flags()
    assert not (tmp_path / "run").exists()  # nothing written where the worker alone would have gone


def test_a_held_workdir_is_refused_to_another_process_and_nests_within_one(tmp_path):
    code = f"from trace_jax.workdirs import locked\nwith locked({str(tmp_path)!r}):\n    pass\n"
    take = lambda: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    with locked(tmp_path), locked(tmp_path):  # one process: claims nest
        other = take()
        assert other.returncode != 0 and "WorkdirInUse" in other.stderr and "in use by pid" in other.stderr
    assert take().returncode == 0  # released with its last claim
    with locked(tmp_path, main=False):  # a multi-process job's other processes take no lock
        assert take().returncode == 0
