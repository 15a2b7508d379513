"""The single-turn GRPO job end to end on the embedded SmolLM2: bad configs fail at start naming the key,
the tiny config trains its adapter and writes TensorBoard metrics, and a SIGKILLed run resumes exactly.
(That GRPO raises the reward is tested on an environment, tests/test_grpo_env_job.py: the same learner.)

The job runs as a subprocess (`python -m launch.grpo`), as a user would launch it. The
processes share a JAX compilation cache so the second one does not compile again.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from configs import grpo_tiny
from job_kills import kill_after_checkpoint
from trace_jax.rl.trainer import validate_config

pytestmark = pytest.mark.optimized_xla  # SmolLM2 runs long here (tests/conftest.py)

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = grpo_tiny.get_config()
STEPS = CONFIG.train.steps


def _command(workdir, *overrides):
    return [sys.executable, "-m", "launch.grpo", "--config=configs/grpo_tiny.py", f"--workdir={workdir}", *overrides]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, job_env):
    """(workdir, summary, log) of one uninterrupted tiny run."""
    workdir = tmp_path_factory.mktemp("full_run")
    out = subprocess.run(_command(workdir), cwd=REPO, env=job_env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return workdir, json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _adapter_at(workdir: pathlib.Path, step: int) -> dict:
    arrays = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "arrays")
    return arrays["adapter_weights"]


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_tiny_config_trains_the_adapter_and_logs_metrics(full_run):
    workdir, summary, log = full_run
    print(f"\n[grpo job] tiny config: {summary}")
    assert set(summary) == {"base_reward", "final_reward", "steps", "rollouts", "seconds"} and summary["steps"] == STEPS
    per_step = CONFIG.rollout.tasks_per_step * CONFIG.rollout.group_size
    assert summary["rollouts"] == STEPS * per_step and (workdir / "adapter" / "adapter_config.json").is_file()
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    rollout_reward = [e.value for e in events.Scalars("rollout/reward")]
    print(f"[grpo job] rollout reward per step: {np.round(rollout_reward, 3).tolist()}")
    assert all(0.0 <= r <= 1.0 for r in rollout_reward)
    # Every step moves the adapter, so the resume test below compares trained weights: step 1 from B = 0
    # (A starts random), each later step from the step before.
    first = max(float(np.abs(np.asarray(w["b"])).max()) for w in _adapter_at(workdir, 1).values())
    moved = [first] + [_max_diff(_adapter_at(workdir, step), _adapter_at(workdir, step - 1))
                       for step in range(2, STEPS + 1)]
    print(f"[grpo job] adapter change per step (max |diff|): {[f'{m:.1e}' for m in moved]}")
    assert min(moved) > 1e-4
    held_out = [(e.step, round(e.value, 6)) for e in events.Scalars("eval/reward")]
    assert held_out[0] == (0, round(summary["base_reward"], 6)) and held_out[-1] == (STEPS, round(summary["final_reward"], 6))
    assert [e.step for e in events.Scalars("rollout/reward")] == list(range(1, STEPS + 1))
    assert {"learner/loss", "learner/grad_norm", "learner/clip_fraction", "learner/entropy", "learner/approx_kl",
            "learner/dropped_fraction"} <= set(events.Tags()["scalars"])
    assert f"step {STEPS}/{STEPS} (100%)" in log and "ETA" in log
    assert json.loads((workdir / "summary.json").read_text()) == summary


def test_sigkilled_run_resumes_to_the_same_adapter(full_run, job_env, tmp_path):
    """A run restarted from the uninterrupted run's checkpoint of step STEPS - 1 trains the last step,
    and is SIGKILLed as soon as it has saved that step (during its final evaluation). Restarted on the
    same workdir, the job resumes from the killed process's checkpoint, makes and logs the interrupted
    evaluation, and ends with the uninterrupted run's adapter and final reward. One trained step shows
    that a resumed run continues exactly; the kill shows that a checkpoint is whole once saved. (One
    step of training instead of a second run.)"""
    full_dir, full_summary, _ = full_run
    workdir, last = tmp_path / "resumed", STEPS - 1
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copytree(full_dir / "checkpoints" / str(last), workdir / "checkpoints" / str(last))
    shutil.copy(full_dir / "base_eval.json", workdir)  # the base evaluation is not under test
    first_log = kill_after_checkpoint(_command(workdir), job_env, workdir, STEPS, tmp_path / "first.log", 1200)
    assert f"resumed from step {last}" in first_log and "base_reward" not in first_log  # killed before the end
    out = subprocess.run(_command(workdir), cwd=REPO, env=job_env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"resumed from step {STEPS}" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert {**summary, "seconds": 0} == {**full_summary, "seconds": 0}
    # The evaluation the kill interrupted is made by the resumed process and logged once.
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/reward"]) for r in logged if "eval/reward" in r] == [(STEPS, summary["final_reward"])]
    diff = _max_diff(_adapter_at(workdir, STEPS), _adapter_at(full_dir, STEPS))
    print(f"\n[grpo job] killed-and-resumed vs uninterrupted adapter at step {STEPS}: max |diff| {diff:.2e}")
    assert diff <= 1e-6


@pytest.mark.parametrize("key, value, message", [
    ("rollout.group_size", 1, "config.rollout.group_size = 1 is invalid"),
    ("advantage", "grpo", "config.advantage = 'grpo' is invalid; it must be one of"),
    ("loss.aggregation", "mean", "config.loss.aggregation"),
    ("eval.num_tasks", -1, "config.eval.num_tasks = -1 is invalid; it must be an int >= 0"),
])
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
    out = subprocess.run(_command(tmp_path, "--config.rollout.group_sise=2"), cwd=REPO, capture_output=True,
                         text=True, timeout=300)
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
