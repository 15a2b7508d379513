"""Runs of several processes (`trace_jax.distributed`): when a process starts `jax.distributed`, and the
evaluation job as two local processes of one JAX run (gloo on the CPU), equal to one process. (The GRPO job as
two processes: tests/test_grpo_job.py on a task set, tests/test_grpo_env_job.py on an environment, with a kill.)
"""

import json
import os
import sys

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("tau2")

from configs import embedded_retail  # noqa: E402
from multiprocess import run_processes  # noqa: E402
from trace_jax import distributed  # noqa: E402
from trace_jax.evaluation import evaluate  # noqa: E402


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


def test_two_processes_evaluate_as_one(tiny_chat_model, job_env, tmp_path):
    """Each process plays every other episode and records it in its own file; process 0 merges them, so the
    episodes file, summary and table are one process's (here the test's own, on one device; the episodes in
    another order)."""
    overrides = {"model": str(tiny_chat_model), "num_tasks": 3, "log_every_s": 0.0}
    rollout = {"max_turns": 1, "max_tokens_per_turn": 24, "temperature": 1.0}
    config = embedded_retail.get_config()
    config.update(overrides)
    config.rollout.update(rollout)
    one = evaluate(config, tmp_path / "one")
    command = [sys.executable, "-m", "launch.evaluate", "--config=configs/embedded_retail.py", "--json",
               f"--workdir={tmp_path / 'two'}", *(f"--config.{k}={v}" for k, v in overrides.items()),
               *(f"--config.rollout.{k}={v}" for k, v in rollout.items())]
    outputs = run_processes(command, 2, job_env, tmp_path / "logs")
    two = json.loads(outputs[0].strip().splitlines()[-1])
    assert "success" not in outputs[1]  # process 1 prints nothing
    assert {k: v for k, v in two.items() if "seconds" not in k} == {k: v for k, v in one.items() if "seconds" not in k}
    episodes = [sorted(({k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
                        for line in (tmp_path / run / "episodes.jsonl").read_text().splitlines()),
                       key=lambda r: r["task_id"]) for run in ("one", "two")]
    assert len(episodes[0]) == 3 and episodes[0] == episodes[1]
    assert (tmp_path / "one" / "table.md").read_text() == (tmp_path / "two" / "table.md").read_text()
    assert not list((tmp_path / "two").glob("episodes.jsonl.process*"))
