"""The tiny embedded agent and the GRPO job on an environment, run as a user runs them (subprocesses on one
CPU device). The agent `smollm2-135m-tiny-agent` (SmolLM2 cloning gold trajectories, configs/warmstart_tiny.py)
is built by the SFT job on first use, once per config, then taken from the cache. The GRPO job on
`configs/grpo_env_tiny.py` (the tiny agent, one tool_calling ticket played sixteen times a step for one
agent turn, no held-out evaluation): the training reward rises, steps and rollouts are as configured, and
every training episode is logged per step.
(The GRPO job's held-out evaluation on an environment is tested in the TRACE pipeline's training stage,
tests/test_trace_pipeline.py, on the tiny random model.)
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from configs import grpo_env_tiny, warmstart_tiny
from trace_jax import warmstart
from trace_jax.models.embedded import resolve_model_dir

pytestmark = pytest.mark.optimized_xla  # SmolLM2 runs long here (tests/conftest.py)

REPO = pathlib.Path(__file__).resolve().parents[1]
AGENT = "smollm2-135m-tiny-agent"
CONFIG = grpo_env_tiny.get_config()
STEPS = CONFIG.train.steps
# The rollout reward's rise from the first step (the untrained agent's episodes) to the mean of the last two:
# +0.225, +0.30, +0.20 for seeds 0, 1, 2 (docs/agentic_rl.md, "A tiny environment run for CI").
MIN_RISE = 0.1


@pytest.fixture(scope="module")
def tiny_agent(tmp_path_factory, job_env) -> tuple[pathlib.Path, pathlib.Path]:
    """(model cache, folder) of the tiny agent, built in a subprocess as its first use builds it."""
    cache = tmp_path_factory.mktemp("model_cache")
    build = f"import sys; from trace_jax import warmstart; print(warmstart.agent_dir({AGENT!r}, sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", build, str(cache)], cwd=REPO, env=job_env, capture_output=True,
                         text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return cache, pathlib.Path(out.stdout.strip().splitlines()[-1])


def test_the_tiny_agent_is_built_once_per_config(tiny_agent, monkeypatch):
    cache, folder = tiny_agent
    marker = json.loads((folder / "trace_jax_warmstart.json").read_text())
    print(f"\n[grpo env job] tiny agent build: {marker['build']}")
    assert marker["config"] == "configs.warmstart_tiny"
    assert marker["build"]["steps"] == warmstart_tiny.get_config().train.steps
    assert (folder / "model.safetensors").is_file() and not list((cache / "agents").glob(".*"))  # workdir removed

    def no_training(*_):
        raise AssertionError("a cached agent was built again")

    monkeypatch.setattr(warmstart, "run_build", no_training)
    assert warmstart.agent_dir(AGENT, cache) == folder  # from the cache
    monkeypatch.setenv("TRACE_JAX_CACHE", str(cache))
    assert resolve_model_dir(AGENT) == folder  # the name is a model name like any embedded one
    config = warmstart.build_config(AGENT)
    config.seed = 1
    monkeypatch.setattr(warmstart, "build_config", lambda name: config)
    with pytest.raises(AssertionError, match="built again"):  # another config: another agent
        warmstart.agent_dir(AGENT, cache)


def test_tiny_environment_run_raises_the_reward(tiny_agent, job_env, tmp_path):
    cache, _ = tiny_agent
    command = [sys.executable, "-m", "launch.grpo", "--config=configs/grpo_env_tiny.py", f"--workdir={tmp_path}"]
    out = subprocess.run(command, cwd=REPO, env={**job_env, "TRACE_JAX_CACHE": str(cache)}, capture_output=True,
                         text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n[grpo env job] tiny config, {STEPS} steps: {summary}")
    assert summary["steps"] == STEPS and summary["rollouts"] == STEPS * CONFIG.rollout.group_size
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    reward = [e.value for e in events.Scalars("rollout/reward")]
    print(f"[grpo env job] rollout reward per step: {[round(r, 3) for r in reward]}")
    assert len(reward) == STEPS and all(0.0 <= r <= 1.0 for r in reward)
    assert np.mean(reward[-2:]) >= reward[0] + MIN_RISE
    for step, mean in enumerate(reward, start=1):  # every training episode is logged, as evaluations record them
        records = [json.loads(line) for line in (tmp_path / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(records) == CONFIG.rollout.group_size and all(r["messages"] and "components" in r for r in records)
        assert abs(np.mean([r["reward"] for r in records]) - mean) <= 1e-6
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    # eval.num_tasks = 0: no held-out evaluation, before or after.
    assert "base_reward" not in summary and not (tmp_path / "eval").exists()
    assert not any(tag.startswith("eval/") for tag in events.Tags()["scalars"])
