"""The single-turn GRPO job end to end: bad configs fail at start naming the key, and the tiny config runs on
the tiny random chat model through the task-set path (sampling, scoring, held-out evaluation before and after,
TensorBoard metrics, progress, the exported adapter, summary). The random model earns no reward on the
tool-call task, so its groups carry no signal and its adapter is not updated: the learner, the per-step
adapter changes and the exact resume are tested on an environment (tests/test_grpo_env_job.py), the same
trainer and learner on multi-turn episodes. The run is one process on two CPU devices, and the same run as two
processes of one device each (one JAX run over both) logs the same metrics and summary.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from multiprocess import TWO_DEVICES, failure_report, run_processes, step_metrics
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from configs import grpo_tiny
from trace_jax.models.model import weights_fingerprint
from trace_jax.rl.trainer import validate_config

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = grpo_tiny.get_config()
STEPS = CONFIG.train.steps


def _command(workdir, *overrides):
    return [sys.executable, "-m", "launch.grpo", "--config=configs/grpo_tiny.py", f"--workdir={workdir}", *overrides]


def _tiny_model_command(workdir, model):
    return _command(workdir, f"--config.model={model}", "--config.lora.first_layer=0")


@pytest.fixture(scope="module")
def tiny_run(tiny_chat_model, job_env, tmp_path_factory):
    """(workdir, summary, log) of the tiny config on the tiny random model, one process on two CPU devices."""
    workdir = tmp_path_factory.mktemp("grpo_tiny")
    out = subprocess.run(
        _tiny_model_command(workdir, tiny_chat_model),
        cwd=REPO,
        env={**job_env, **TWO_DEVICES},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, failure_report(out)
    return workdir, json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_tiny_config_samples_scores_evaluates_and_logs_metrics(tiny_run):
    workdir, summary, log = tiny_run
    print(f"\n[grpo job] tiny config on the tiny random model: {summary}")
    assert set(summary) == {"base_reward", "final_reward", "steps", "rollouts", "seconds"} and summary["steps"] == STEPS
    per_step = CONFIG.rollout.tasks_per_step * CONFIG.rollout.group_size
    assert summary["rollouts"] == STEPS * per_step and (workdir / "adapter" / "adapter_config.json").is_file()
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    rollout_reward = [e.value for e in events.Scalars("rollout/reward")]
    print(f"[grpo job] rollout reward per step: {np.round(rollout_reward, 3).tolist()}")
    assert all(0.0 <= r <= 1.0 for r in rollout_reward)
    assert [e.step for e in events.Scalars("rollout/rows")] == list(range(1, STEPS + 1))
    assert all(e.value == per_step for e in events.Scalars("rollout/rows"))
    held_out = [(e.step, round(e.value, 6)) for e in events.Scalars("eval/reward")]
    assert held_out == [(0, round(summary["base_reward"], 6)), (STEPS, round(summary["final_reward"], 6))]
    assert f"step {STEPS}/{STEPS} (100%)" in log and "ETA" in log
    assert json.loads((workdir / "summary.json").read_text()) == summary


def test_two_processes_run_the_task_set_as_one(tiny_run, tiny_chat_model, job_env, tmp_path):
    """Each process samples every other row of a step and of an evaluation; all see all rows, so the held-out
    rewards, the step metrics and the summary are the single-process run's; process 0 alone writes them."""
    workdir, summary, _ = tiny_run
    two_dir = tmp_path / "run"
    outputs = run_processes(_tiny_model_command(two_dir, tiny_chat_model), 2, job_env, tmp_path / "logs")
    two = json.loads(outputs[0].strip().splitlines()[-1])
    assert {**two, "seconds": 0} == {**summary, "seconds": 0} and '"steps"' not in outputs[1]
    assert [step_metrics(two_dir, s) for s in range(STEPS + 1)] == [step_metrics(workdir, s) for s in range(STEPS + 1)]
    assert len((two_dir / "metrics.jsonl").read_text().splitlines()) == len(
        (workdir / "metrics.jsonl").read_text().splitlines()
    )
    assert (two_dir / "adapter" / "adapter_config.json").is_file()


def test_a_finished_run_run_again_returns_its_summary(tiny_run, tiny_chat_model, job_env, tmp_path):
    """A finished job run again (as the experiment and the pipeline do when a later stage was interrupted), from
    a copy of its workdir without checkpoints (a result committed without them, taken up on another machine),
    returns its summary and rewrites nothing: no second run from the first step, and the adapter's files keep the
    fingerprint to which an evaluation of it ties its episodes, so that evaluation resumes."""
    workdir, summary, _ = tiny_run
    rerun = tmp_path / "run"
    shutil.copytree(workdir, rerun, ignore=shutil.ignore_patterns("checkpoints"))  # modification times kept
    # every file as it was (the lock and the marker, which the job takes and checks, aside)
    files = lambda: {
        p: (p.stat().st_mtime_ns, p.read_bytes())
        for p in rerun.rglob("*")
        if p.is_file() and p.name not in {".lock", "job.json"}
    }
    before, fingerprint = files(), weights_fingerprint(rerun / "adapter")
    out = subprocess.run(
        _tiny_model_command(rerun, tiny_chat_model),
        cwd=REPO,
        env={**job_env, **TWO_DEVICES},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, failure_report(out)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == summary  # the first run's, its seconds included
    assert "finished before" in out.stderr and "step 1/" not in out.stderr
    assert files() == before and weights_fingerprint(rerun / "adapter") == fingerprint
    assert not (rerun / "checkpoints").exists()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("rollout.group_size", 1, "config.rollout.group_size = 1 is invalid"),
        ("advantage", "grpo", "config.advantage = 'grpo' is invalid; it must be one of"),
        ("loss.aggregation", "mean", "config.loss.aggregation"),
        ("eval.num_tasks", -1, "config.eval.num_tasks = -1 is invalid; it must be an int >= 0"),
        ("train.target_kl", 0.0, "config.train.target_kl = 0.0 is invalid; it must be None .every update applied"),
        (
            "loss.negative_advantage_scale",
            1.5,
            "config.loss.negative_advantage_scale = 1.5 is invalid; it must be a number in .0, 1.: the weight",
        ),
    ],
)
def test_invalid_setting_fails_naming_the_key(key, value, message):
    config = grpo_tiny.get_config()
    section, _, name = key.rpartition(".")
    (config[section] if section else config)[name] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_config(config)


def test_missing_setting_fails_naming_the_key():
    config = grpo_tiny.get_config()
    del config.eval["every"]
    with pytest.raises(ValueError, match="config.eval.every is missing"):
        validate_config(config)


def test_unknown_override_on_the_command_line_names_the_key(tmp_path):
    out = subprocess.run(
        _command(tmp_path, "--config.rollout.group_sise=2"), cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0 and "group_sise" in out.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_task_or_environment_and_steps_or_budget_exactly_one_each():
    config = grpo_tiny.get_config()
    config.env = dict(name="embedded_retail", seed=0, families=(), split="train")
    with pytest.raises(ValueError, match="exactly one of config.task"):
        validate_config(config)
    config = grpo_tiny.get_config()
    config.train.rollout_budget = 60
    with pytest.raises(ValueError, match="set exactly one"):
        validate_config(config)
    config.train.steps = None
    validate_config(config)
    from trace_jax.rl.trainer import num_steps

    assert num_steps(config) == 8  # 60 episodes of 2 tasks x 4 samples, rounded up


def test_environment_config_names_its_missing_keys():
    config = grpo_tiny.get_config()
    del config["task"]
    config.env = dict(name="embedded_retail", seed=0, families=(), split="train")
    with pytest.raises(ValueError, match="config.eval.split is missing"):
        validate_config(config)


def test_the_tau2_config_for_accelerators_validates_once_given_a_model():
    from configs import grpo_target_tau2_retail

    config = grpo_target_tau2_retail.get_config()
    with pytest.raises(ValueError, match="config.model = '' is invalid"):
        validate_config(config)
    config.model = "/path/to/hf_checkpoint"
    validate_config(config)
    assert (config.env.name, config.env.split, config.eval.split, config.dtype) == ("tau2", "train", "test", "bfloat16")


def test_the_capability_config_trains_tool_callings_return_family_hinted_as_trace_does():
    from configs import grpo_capability_embedded, trace_embedded

    config = grpo_capability_embedded.get_config()
    validate_config(config)
    trace = trace_embedded.get_config()
    assert (config.env.capability, config.env.variant, config.env.difficulty) == ("tool_calling", "return", 0)
    assert config.rollout.hint_share == trace.calibration.hint_share > 0 and config.loss.tis_cap is None
    assert config.rollout.to_dict() == trace.training.rollout.to_dict() and config.model == trace.model
