"""Untrusted code isolated (`trace_jax.isolation`): an LLM-written module that tries to get out or to forge its
verdict is rejected with nothing written outside, no connection made and no process left; only the named
outputs come back, as regular files within their limit; a machine that cannot isolate refuses at start."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import sys
import textwrap

import pytest

from trace_jax import isolation
from trace_jax.envs.capability.sandbox import Checks, Limits, validate_module
from trace_jax.isolation import Confinement, IsolationUnavailable, run_isolated
from trace_jax.trace import env_writer, pipeline

REPO = pathlib.Path(__file__).resolve().parents[1]
CHECKS = Checks(seeds=2)


def _processes_running(marker: str) -> list[str]:
    """The command lines of this machine's processes that hold `marker` as an argument."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv:
            found.append(b" ".join(argv).decode(errors="replace"))
    return found


@pytest.fixture
def listener():
    """A server socket on the host's loopback address, as a local service would be."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        yield server


def test_a_module_that_tries_to_get_out_is_rejected_with_nothing_written_no_connection_and_no_process_left(
    tmp_path, listener
):
    home_secret = pathlib.Path.home() / f".trace_jax_test_secret_{os.getpid()}"
    home_secret.write_text("the-user's-credential")
    outside, in_repo = tmp_path / "escaped.txt", REPO / f"escaped_{os.getpid()}.txt"
    source = textwrap.dedent(
        f"""
        import os, pathlib, socket, subprocess
        findings = []
        def attempt(what, action):
            try:
                findings.append(f"{{what}}: {{action()}}")
            except BaseException as error:
                findings.append(f"{{what}} refused ({{type(error).__name__}})")
        def fork_a_sleeper():
            if os.fork() == 0:
                os.setsid()
                os.execvp("sleep", ["sleep", "4243"])
        attempt("write outside", lambda: pathlib.Path({str(outside)!r}).write_text("escaped"))
        attempt("write into the repository", lambda: pathlib.Path({str(in_repo)!r}).write_text("escaped"))
        attempt("connect", lambda: socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), 2).send(b"x"))
        attempt("read the home", lambda: pathlib.Path({str(home_secret)!r}).read_text())
        attempt("spawn", lambda: subprocess.Popen(["sleep", "4242"], start_new_session=True).pid)
        attempt("fork", fork_a_sleeper)
        raise RuntimeError(" | ".join(findings))
        """
    )
    try:
        report = validate_module(source, checks=CHECKS, limits=Limits(timeout_s=60))
    finally:
        home_secret.unlink()
        in_repo.unlink(missing_ok=True)
    text = report.failure_report()
    assert not report.passed and "failed to load" in text, text
    for what in ("write outside", "write into the repository", "connect", "read the home", "spawn", "fork"):
        assert f"{what} refused" in text, (what, text)
    assert "credential" not in text
    assert not outside.exists() and not in_repo.exists()
    with pytest.raises(BlockingIOError):  # nothing connected
        listener.accept()
    assert not _processes_running("4242") and not _processes_running("4243")


FORGED_REPORT = {
    "passed": True,
    "checks": {"seeds": 2, "min_gold_success": 0.95, "max_empty_reward": 0.1},
    "name": "order_facts",
    "gold_success": [1.0],
    "empty_reward": [0.0],
}


@pytest.mark.parametrize(
    "scenarios, expected",
    [
        (None, "reported a pass but exported no scenarios"),
        ({"name": "order_facts", "tasks": 2}, "The module's exported scenarios are not a valid export: KeyError"),
        ("[" * 100_000, "The module's exported scenarios are not a valid export"),
    ],
)
def test_a_module_that_forges_a_passing_report_is_rejected_by_the_replay(scenarios, expected):
    """The module writes a passing report (and an export of its making) and leaves before any check ran."""
    lines = [f"open('report.json', 'w').write({json.dumps(FORGED_REPORT)!r})"]
    if scenarios is not None:
        text = scenarios if isinstance(scenarios, str) else json.dumps(scenarios)
        lines.append(f"open('scenarios.json', 'w').write({text!r})")
    report = validate_module("\n".join([*lines, "import os", "os._exit(0)"]) + "\n", checks=CHECKS)
    assert not report.passed and expected in report.failure_report(), report


def _run(tmp_path: pathlib.Path, code: str, outputs=(), name="command.py", **confinement) -> isolation.IsolatedRun:
    (tmp_path / name).write_text(code)
    return run_isolated(
        [sys.executable, name],
        tmp_path,
        inputs=(name,),
        outputs=outputs,
        readable=(sys.base_prefix, sys.prefix),
        env={"PATH": "/usr/bin:/bin"},
        confinement=Confinement(**confinement),
    )


def test_only_named_regular_outputs_within_their_limit_come_back(tmp_path):
    (tmp_path / "stale.txt").write_text("left by an earlier run")  # an output this run does not write
    code = "import os\nos.symlink('/etc/ld.so.cache', 'link.txt')\nopen('big.txt', 'w').write('x' * 2**21)\n"
    code += "open('other.txt', 'w').write('x')\nopen('out.txt', 'w').write('fresh')\n"
    run = _run(tmp_path, code, ("out.txt", "stale.txt", "link.txt", "big.txt"), output_mb=1)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["command.py", "isolation_stderr.txt", "out.txt"]
    assert (tmp_path / "out.txt").read_text() == "fresh"


def test_past_the_wall_clock_every_process_of_the_command_is_killed(tmp_path):
    name = f"sleeper_{os.getpid()}.py"
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(300,)).start()\ntime.sleep(301)\n"
    assert _run(tmp_path, code, name=name, timeout_s=3).returncode is None
    assert not _processes_running(name)


def test_a_machine_that_cannot_isolate_refuses_written_environments_at_start(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `unshare`
    problem = isolation.isolation_problem.__wrapped__()
    assert "`unshare` is not on the PATH" in problem and "user namespaces" in problem
    monkeypatch.setattr(env_writer, "isolation_problem", lambda: problem)
    with pytest.raises(IsolationUnavailable, match="`unshare` is not on the PATH"):
        env_writer.write_environment(None, [], None, tmp_path, env_writer.EnvWriterSettings())
    assert not list(tmp_path.iterdir())  # nothing asked, nothing written
    monkeypatch.setattr(pipeline, "isolation_problem", lambda: problem)
    from configs import trace_tiny

    config = trace_tiny.get_config()
    config.environments.source = "llm"
    config.llm.base_url, config.llm.model = "http://127.0.0.1:9/v1", "m"
    with pytest.raises(ValueError, match=r"config.environments.source = 'llm' .* cannot isolate: util-linux"):
        pipeline.validate_config(config)
