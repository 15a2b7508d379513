"""Runs of several processes (`trace_jax.distributed`): when a process starts `jax.distributed`, and the
calibration job (through the evaluation job) as two local processes of one JAX run (gloo on the CPU), equal
to one process. (The GRPO job as two processes: tests/test_grpo_job.py on a task set, tests/test_grpo_env_job.py
on an environment, with a kill; the SFT job: tests/test_sft_job.py.)
"""

import json
import os
import sys

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("tau2")

from configs import trace_tiny  # noqa: E402
from multiprocess import run_processes  # noqa: E402
from trace_jax import distributed  # noqa: E402
from trace_jax.trace.calibration import calibrate_capability  # noqa: E402
from trace_jax.trace.pipeline import calibration_evaluation  # noqa: E402


@pytest.mark.parametrize("environ, detected", [
    ({}, False),
    ({"TPU_WORKER_HOSTNAMES": "t1v-n-0"}, False),  # a single-host TPU VM
    ({"TPU_WORKER_HOSTNAMES": "t1v-n-0,t1v-n-1"}, True),  # a pod slice's workers
    ({"SLURM_NTASKS": "1"}, False),
    ({"SLURM_NTASKS": "4"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
])
def test_a_cluster_launcher_is_detected_only_when_it_started_several_processes(environ, detected):
    assert distributed.cluster_detected(environ) is detected


def test_a_lone_process_stays_alone_and_a_partial_address_fails_naming_what_is_missing():
    assert distributed.initialize(environ={}) is False
    with pytest.raises(ValueError, match="needs the coordinator's address, the process count and its id"):
        distributed.initialize("127.0.0.1:1234", environ={})
    with pytest.raises(ValueError, match="needs the coordinator's address"):
        distributed.initialize(environ={"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match=r"--process_id = 2 is invalid; it must be in \[0, --num_processes = 2\)"):
        distributed.initialize("127.0.0.1:1234", 2, 2, environ={})


def test_two_processes_calibrate_as_one(tiny_chat_model, job_env, tmp_path):
    """The calibration job (stage 2's episodes at temperature 1 through the evaluation job) as two processes:
    each plays every other episode and records it in its own file, process 0 merges them and writes the
    calibration; the episodes and the calibration are one process's (here the test's own, on one device)."""
    overrides = {"model": str(tiny_chat_model), "calibration.seeds": 2, "calibration.samples": 2,
                 "training.rollout.max_turns": 1, "training.rollout.max_tokens_per_turn": 24}
    config = trace_tiny.get_config()
    config.update_from_flattened_dict(overrides)
    one = calibrate_capability("tool_calling", 0, calibration_evaluation(config), config.calibration,
                               tmp_path / "one" / "tool_calling")
    command = [sys.executable, "-m", "launch.calibrate", "--config=configs/trace_tiny.py",
               "--capabilities=tool_calling",
               f"--workdir={tmp_path / 'two'}", *(f"--config.{k}={v}" for k, v in overrides.items())]
    outputs = run_processes(command, 2, job_env, tmp_path / "logs")
    assert '"tool_calling"' in outputs[0].strip().splitlines()[-1] and "tool_calling" not in outputs[1]
    two = json.loads((tmp_path / "two" / "tool_calling" / "calibration.json").read_text())
    assert two == one and one["tries"][0]["episodes"] == 4
    episodes = [sorted(({k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in
                        (tmp_path / run / "tool_calling" / "difficulty_0" / "episodes.jsonl").read_text().splitlines()),
                       key=lambda r: (r["task_id"], r["trial"])) for run in ("one", "two")]
    assert len(episodes[0]) == 4 and episodes[0] == episodes[1]
    assert not list((tmp_path / "two").rglob("episodes.jsonl.process*"))
