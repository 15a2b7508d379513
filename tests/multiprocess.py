"""Running a launch job as several local processes of one JAX run (gloo collectives on the CPU), as a multi-host
user runs it on several machines, and saying why a job's process failed."""

import os
import pathlib
import signal
import socket
import subprocess
import time

from trace_jax.metrics import logged_scalars

REPO = pathlib.Path(__file__).resolve().parents[1]
# XLA:CPU runs each device's part of a program on a pool of threads sized by the cores (NPROC overrides it): on a
# 2-core machine, a process of two devices with two programs with collectives in flight can hold both threads at
# collectives that wait for the other device, with no thread left to run it. Every process of the multi-process
# tests gets the same larger pool, since the pool's size also decides how XLA splits a matrix product, and so the
# last bits of its result, which the runs compared here must share.
THREADS = {"NPROC": "8"}
# The environment of a single process whose mesh matches two processes of one device each. XLA:CPU also ends a
# process whose devices wait 40 s for each other at a collective, which a loaded CI machine can reach.
TWO_DEVICES = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_collective_call_terminate_timeout_seconds=600",
    **THREADS,
}


def step_metrics(workdir: pathlib.Path, step: int) -> dict[str, float]:
    """What a job logged for `step`, less timings and memory (which differ between runs of the same work)."""
    return {k: v for k, v in logged_scalars(workdir, step).items() if not k.startswith(("time/", "memory/"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_words(output: str, chars: int = 4000) -> str:
    """The end of a failed process's output and, where Python's fault handler dumped its threads (XLA or another
    library aborted the process), what the process printed before the dump: the cause (a failed check, a C++
    exception), which the dump and its list of extension modules push out of the output's end."""
    crash = output.find("Fatal Python error")
    if crash < 0 or len(output) <= chars:
        return output[-chars:]
    return f"{output[max(0, crash - chars) : crash + 500]}\n[...]\n{output[-chars // 2 :]}"


def failure_report(out: subprocess.CompletedProcess) -> str:
    """Why a process run with `subprocess.run(..., capture_output=True, text=True)` failed."""
    return f"exit code {out.returncode}\n--- stdout:\n{out.stdout[-2000:]}\n--- stderr:\n{last_words(out.stderr)}"


def _start(command: list[str], processes: int, env: dict[str, str], logs: pathlib.Path) -> list[subprocess.Popen]:
    """`command` as process i of `processes` (one CPU device each), its output in `logs`/process_<i>.log."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    return [
        subprocess.Popen(
            [*command, f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}", f"--process_id={i}"],
            cwd=REPO,
            env={**env, **THREADS},
            stdout=open(logs / f"process_{i}.log", "w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(processes)
    ]


def _outputs(logs: pathlib.Path, processes: int) -> list[str]:
    return [(logs / f"process_{i}.log").read_text() for i in range(processes)]


def run_processes(
    command: list[str], processes: int, env: dict[str, str], logs: pathlib.Path, timeout_s: float = 1800
) -> list[str]:
    """Runs the job as `processes` processes to the end; returns each one's output. Fails unless all succeed."""
    children = _start(command, processes, env, logs)
    codes = [child.wait(timeout=timeout_s) for child in children]
    outputs = _outputs(logs, processes)
    assert codes == [0] * processes, "\n".join(
        f"process {i} ({code}): {last_words(out)}" for i, (code, out) in enumerate(zip(codes, outputs))
    )
    return outputs


def kill_one_after_checkpoint(
    command: list[str],
    processes: int,
    env: dict[str, str],
    workdir: pathlib.Path,
    step: int,
    logs: pathlib.Path,
    timeout_s: float = 1800,
) -> list[str]:
    """Runs the job as `processes` processes, SIGKILLs the last one as soon as the checkpoint of `step` is complete
    in `workdir`, then the others (left alone they stop within JAX's heartbeat timeout, 100 s, as a cluster
    launcher would then restart them all); returns their outputs."""
    children, done = _start(command, processes, env, logs), workdir / "checkpoints" / str(step)
    deadline = time.monotonic() + timeout_s
    while all(child.poll() is None for child in children) and time.monotonic() < deadline and not done.is_dir():
        time.sleep(0.05)
    running = [child.poll() is None for child in children]
    for child in children[::-1]:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait()
    outputs = _outputs(logs, processes)
    assert done.is_dir() and all(running), "\n".join(last_words(out) for out in outputs)
    return outputs
