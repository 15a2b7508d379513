"""The tiny embedded agent and the GRPO job on an environment, run as a user runs them (subprocesses). The agent
`smollm2-135m-tiny-agent` (SmolLM2 cloning gold trajectories, configs/warmstart_tiny.py) is built by the SFT job for
the first job that names it (`launch.agents`), once per config, then taken from the cache. The GRPO job on
`configs/grpo_env_tiny.py` (the tiny agent, one tool_calling ticket played sixteen times a step for one agent turn,
no held-out evaluation), one process on two CPU devices: the training reward rises, steps and rollouts are as
configured, every step moves the adapter, every training episode is logged per step, the adapter snapshots are the
checkpoints' adapters. The same run's last steps as two processes of one device each (one JAX run over both, as on
two hosts): one process is SIGKILLed after a checkpoint, both restart and resume, and the episodes, adapters,
metrics and summary equal the single-process run's. (The GRPO job's held-out evaluation on an environment is tested
in the TRACE pipeline's training stage, tests/test_trace_pipeline.py, on the tiny random model.)
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
from multiprocess import TWO_DEVICES, failure_report, kill_one_after_checkpoint, run_processes, step_metrics
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from configs import grpo_env_tiny, warmstart_tiny
from launch import agents
from trace_jax import lora
from trace_jax.models.config import ModelConfig
from trace_jax.models.embedded import resolve_model_dir
from trace_jax.models.model import weights_fingerprint
from trace_jax.rl.trainer import snapshot_step

pytestmark = pytest.mark.optimized_xla  # SmolLM2 runs long here (tests/conftest.py)

REPO = pathlib.Path(__file__).resolve().parents[1]
AGENT = "smollm2-135m-tiny-agent"
CONFIG = grpo_env_tiny.get_config()
STEPS = CONFIG.train.steps
# The rollout reward's rise from the first step (the untrained agent's episodes) to the mean of the last two:
# +0.275, +0.278, +0.413 for seeds 0, 1, 2, on one CPU device and on two alike (docs/agentic_rl.md, "Random
# streams per episode").
MIN_RISE = 0.1


@pytest.fixture(scope="module")
def tiny_agent(tmp_path_factory, job_env) -> tuple[pathlib.Path, pathlib.Path]:
    """(model cache, folder) of the tiny agent, built in a subprocess as a job builds it."""
    cache = tmp_path_factory.mktemp("model_cache")
    build = f"import sys; from launch import agents; print(agents.agent_dir({AGENT!r}, sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", build, str(cache)], cwd=REPO, env=job_env, capture_output=True, text=True, timeout=3600
    )
    assert out.returncode == 0, failure_report(out)
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

    monkeypatch.setattr(agents, "run_build", no_training)
    assert agents.agent_dir(AGENT, cache) == folder  # from the cache
    monkeypatch.setenv("TRACE_JAX_CACHE", str(cache))
    assert resolve_model_dir(AGENT) == folder  # the name is a model name like any embedded one
    config = agents.build_config(AGENT)
    config.seed = 1
    monkeypatch.setattr(agents, "build_config", lambda name: config)
    with pytest.raises(AssertionError, match="built again"):  # another config: another agent
        agents.agent_dir(AGENT, cache)


def test_a_pinned_adapter_rebuilds_the_trained_agent_byte_for_byte_without_training(tiny_agent, tmp_path, monkeypatch):
    """`--pin` writes the built agent's warm-start adapter (its all-zero layers dropped) with the agent's weights
    fingerprint; a build from the pin in another cache trains nothing and gives the same bytes."""
    cache, folder = tiny_agent
    monkeypatch.setattr(agents, "PINNED", tmp_path / "pinned")
    pinned = agents.pin(AGENT, cache)
    record = json.loads((pinned / agents.PIN_RECORD).read_text())
    first = warmstart_tiny.get_config().lora.first_layer
    assert json.loads((pinned / "adapter_config.json").read_text())["layers_to_transform"] == list(range(first, 30))
    assert record["agent_fingerprint"] == weights_fingerprint(folder)

    def no_training(*_):
        raise AssertionError("a pinned agent was trained")

    monkeypatch.setattr(agents, "run_build", no_training)
    rebuilt = agents.agent_dir(AGENT, tmp_path / "cache")
    assert json.loads((rebuilt / "trace_jax_warmstart.json").read_text())["pinned"] is True
    assert weights_fingerprint(rebuilt) == record["agent_fingerprint"]
    assert (rebuilt / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def _command(workdir):
    return [sys.executable, "-m", "launch.grpo", "--config=configs/grpo_env_tiny.py", f"--workdir={workdir}"]


def _adapter_at(workdir: pathlib.Path, step: int) -> dict:
    """The adapter of the checkpoint of `step`, on this process's device (whatever devices saved it)."""
    checkpointer, path = ocp.StandardCheckpointer(), workdir / "checkpoints" / str(step) / "arrays"
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), checkpointer.metadata(path).item_metadata
    )
    return checkpointer.restore(path, target)["adapter_weights"]


def _max_diff(a: dict, b: dict) -> float:
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.fixture(scope="module")
def env_run(tiny_agent, job_env, tmp_path_factory):
    """(workdir, summary, log, the jobs' environment) of one uninterrupted run of configs/grpo_env_tiny.py, one
    process on two CPU devices (the mesh of the two-process run below)."""
    cache, _ = tiny_agent
    workdir, env = tmp_path_factory.mktemp("grpo_env"), {**job_env, "TRACE_JAX_CACHE": str(cache), **TWO_DEVICES}
    out = subprocess.run(_command(workdir), cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, failure_report(out)
    return workdir, json.loads(out.stdout.strip().splitlines()[-1]), out.stderr, env


def test_tiny_environment_run_raises_the_reward(env_run, tiny_agent):
    workdir, summary, log, _ = env_run
    print(f"\n[grpo env job] tiny config, {STEPS} steps: {summary}")
    assert summary["steps"] == STEPS and summary["rollouts"] == STEPS * CONFIG.rollout.group_size
    assert json.loads((workdir / "summary.json").read_text()) == summary
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    reward = [e.value for e in events.Scalars("rollout/reward")]
    print(f"[grpo env job] rollout reward per step: {[round(r, 3) for r in reward]}")
    assert len(reward) == STEPS and all(0.0 <= r <= 1.0 for r in reward)
    assert np.mean(reward[-2:]) >= reward[0] + MIN_RISE
    assert [e.step for e in events.Scalars("rollout/reward")] == list(range(1, STEPS + 1))
    assert {
        "learner/loss",
        "learner/grad_norm",
        "learner/clip_fraction",
        "learner/entropy",
        "learner/approx_kl",
        "learner/dropped_fraction",
    } <= set(events.Tags()["scalars"])
    assert f"step {STEPS}/{STEPS} (100%)" in log and "ETA" in log and "approx KL" in log
    for step, mean in enumerate(reward, start=1):  # every training episode is logged, as evaluations record them
        records = [json.loads(line) for line in (workdir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(records) == CONFIG.rollout.group_size and all(r["messages"] and "components" in r for r in records)
        assert abs(np.mean([r["reward"] for r in records]) - mean) <= 1e-6
    # Every step whose group's rewards differ moves the adapter (step 1 from B = 0, A starting random), and a step
    # whose group is constant leaves it as it was (no gradient), so the resume test compares trained weights.
    first = max(float(np.abs(np.asarray(w["b"])).max()) for w in _adapter_at(workdir, 1).values())
    moved = [first] + [_max_diff(_adapter_at(workdir, k), _adapter_at(workdir, k - 1)) for k in range(2, STEPS + 1)]
    print(f"[grpo env job] adapter change per step (max |diff|): {[f'{m:.1e}' for m in moved]}")
    varied = [
        len({r["reward"] for r in map(json.loads, (workdir / "rollouts" / f"step_{k}.jsonl").read_text().splitlines())})
        > 1
        for k in range(1, STEPS + 1)
    ]
    assert varied[0]  # the hinted half makes the call from the first step
    assert all((m > 1e-4) == v for m, v in zip(moved, varied)), (moved, varied)
    assert (workdir / "adapter" / "adapter_config.json").is_file()
    # The adapter snapshots along the run (train.snapshot_fractions) are the checkpoints' adapters at those steps.
    snapshots = sorted(int(p.name.split("_")[1]) for p in (workdir / "snapshots").iterdir())
    assert snapshots == sorted({snapshot_step(f, STEPS) for f in CONFIG.train.snapshot_fractions} - {0, STEPS})
    cfg = ModelConfig.from_dir(tiny_agent[1])
    for step in snapshots:
        exported = lora.load_peft(workdir / "snapshots" / f"step_{step}", cfg).weights
        assert _max_diff(_adapter_at(workdir, step), exported) <= 1e-7, step
    # eval.num_tasks = 0: no held-out evaluation, before or after.
    assert "base_reward" not in summary and not (workdir / "eval").exists()
    assert not any(tag.startswith("eval/") for tag in events.Tags()["scalars"])


def test_two_processes_train_as_one_and_resume_when_one_is_killed(env_run, tmp_path):
    """The run's last two steps as two processes of one device each, from the single-process run's checkpoint of
    step STEPS - 2: the second process is SIGKILLed as soon as step STEPS - 1 is saved, then the first; both
    restarted, they resume from that checkpoint. Each process plays half of a step's episodes and all compute
    the same update, so both steps' episodes, the summary and the last step's metrics of its episodes are the
    single-process run's, and its adapters and learner metrics as close as rescoring the hinted rows sharded over
    processes allows; process 0 alone logs, prints and writes files other than checkpoints."""
    full_dir, full_summary, _, env = env_run
    env = {k: v for k, v in env.items() if k != "XLA_FLAGS"}  # one device a process
    workdir, start = tmp_path / "two", STEPS - 2
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copytree(full_dir / "checkpoints" / str(start), workdir / "checkpoints" / str(start))
    first = kill_one_after_checkpoint(_command(workdir), 2, env, workdir, STEPS - 1, tmp_path / "first")
    assert f"resumed from step {start}" in first[0] and '"steps"' not in first[0]  # killed before the end
    outputs = run_processes(_command(workdir), 2, env, tmp_path / "second")
    assert f"resumed from step {STEPS - 1}" in outputs[0] and f"step {STEPS}/{STEPS}" in outputs[0]
    assert "resumed" not in outputs[1] and '"steps"' not in outputs[1]  # warnings only, no summary line
    summary = json.loads(outputs[0].strip().splitlines()[-1])
    assert {**summary, "seconds": 0} == {**full_summary, "seconds": 0}
    assert json.loads((workdir / "summary.json").read_text()) == summary
    episodes = lambda folder, step: (folder / "rollouts" / f"step_{step}.jsonl").read_text()
    for step in (STEPS - 1, STEPS):
        assert episodes(workdir, step) == episodes(full_dir, step), step
        diff = _max_diff(_adapter_at(workdir, step), _adapter_at(full_dir, step))
        print(f"\n[grpo env job] two processes vs one at step {step}: adapter max |diff| {diff:.2e}")
        assert diff <= 1e-5  # hinted rows are rescored by a forward pass sharded over the processes
    two, one = step_metrics(workdir, STEPS), step_metrics(full_dir, STEPS)
    exact = lambda metrics: {k: v for k, v in metrics.items() if not k.startswith("learner/")}
    assert exact(two) == exact(one)  # the episodes are the same: so is everything measured on them
    # the learner's: from adapters within 1e-5 of each other (the small entropy moves most, by about 1e-3). The
    # losses are means of advantage-weighted terms whose advantages sum to zero, so they lie near zero and only
    # their absolute error means anything: 3.4e-7 on one CI machine, relative 3.5e-3 of a loss of 1e-4.
    losses = {"learner/loss", "learner/policy_loss"}
    assert {k: two[k] for k in losses} == pytest.approx({k: one[k] for k in losses}, abs=2e-6)
    others = lambda metrics: {k: v for k, v in metrics.items() if k not in losses}
    assert others(two) == pytest.approx(others(one), rel=2e-3, abs=1e-10)
