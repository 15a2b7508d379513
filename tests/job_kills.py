"""SIGKILLing a job subprocess at a known point, for the exact-resume tests of the training jobs."""

import os
import pathlib
import signal
import subprocess
import time


def kill_after_checkpoint(command: list[str], env: dict[str, str], workdir: pathlib.Path, step: int,
                          log_path: pathlib.Path, timeout_s: float) -> str:
    """Runs `command` (from the repository root), SIGKILLs it as soon as its checkpoint of `step` is complete in
    `workdir` (orbax renames the folder into place once written), and returns what it printed. Fails unless the
    checkpoint was written and the kill is what ended the job."""
    done, deadline = workdir / "checkpoints" / str(step), time.monotonic() + timeout_s
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, cwd=pathlib.Path(__file__).resolve().parents[1], env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
        while child.poll() is None and time.monotonic() < deadline and not done.is_dir():
            time.sleep(0.05)
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait()
    output = log_path.read_text()
    assert done.is_dir() and child.returncode == -signal.SIGKILL, output[-3000:]
    return output
