"""A job's workdir holds one run: made by one process (or one multi-process job) at a time, and resumed only by
a run with the same result-deciding settings.

- **The lock**: `claimed` takes an exclusive `flock` on `<workdir>/.lock`, whose text names the holder (pid,
  host, start time), so a second job started on the same workdir fails at once, naming the first, instead of
  interleaving its files. The kernel drops the lock when its process ends, however it ends. Only the main
  process of a multi-process job takes it (`main=`); its other processes write nothing there alone.
- **The marker**: `job.json` records the job's name and its result-deciding settings: the config's leaves, less
  those that change how a run is carried out but not its results (`NOT_DECISIVE`: logging, batching, device
  layout, checkpoint cadence, where finished results are reused from; an evaluation's `every`, unless its block
  keeps the best evaluated step). A run whose settings differ refuses the
  workdir, naming each differing key with both values; it never deletes what the other run made. `fresh_workdir`
  gives such a run the next free folder beside it instead (`--fresh`).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import socket
from collections.abc import Iterator, Mapping
from typing import Any

from trace_jax.files import UnreadableJson, read_json, write_json_atomic

MARKER = "job.json"
LOCK = ".lock"
# Config keys (any component of a dotted key) that decide how a run is carried out, not what it computes.
NOT_DECISIVE = frozenset(
    {
        "log_every_s",
        "batch_size",
        "mesh",
        "tensor",
        "checkpoint_every",
        "keep_checkpoints",
        "micro_batch_tokens",
        "remat",
        "base_run",
        "resume_from",
        "results_file",  # where a copy of the results is also written
        "arms",  # which of a comparison's arms to run now; each arm's results are its own
        "timeout_s",
        "max_retries",
        "every",
        "sampler_policy",  # how rollouts are scheduled on the device; the same tokens up to float rounding
        "base_url",  # where an LLM is served, not which
        "api_key_env",
    }
)


class WorkdirInUse(RuntimeError):
    """Another process holds the workdir."""


class WorkdirMismatch(ValueError):
    """The workdir holds a run made with other result-deciding settings."""


def decisive_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's result-deciding leaves by dotted key, as JSON gives them back (tuples as lists)."""
    flat: dict[str, Any] = {}

    def walk(block: Mapping[str, Any], prefix: str) -> None:
        for key, value in block.items():
            # a block that keeps its best evaluated step chooses among the steps `every` evaluates
            if key in NOT_DECISIVE and not (key == "every" and block.get("keep_best")):
                continue
            if isinstance(value, Mapping) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(config, "")
    return json.loads(json.dumps(flat, sort_keys=True, default=str))


def differences(there: Mapping[str, Any], here: Mapping[str, Any], prefix: str = "config.") -> list[str]:
    """`<prefix><key> = <there> there, <here> here` for each key whose values differ (a missing one as unset)."""
    unset = "unset"
    return [
        f"{prefix}{key} = {json.dumps(there.get(key, unset))} there, {json.dumps(here.get(key, unset))} here"
        for key in sorted({*there, *here})
        if there.get(key, unset) != here.get(key, unset)
    ]


def mismatch(workdir: pathlib.Path, job: str, found: list[str]) -> WorkdirMismatch:
    """The refusal of `workdir` to a run of `job` that differs from its run by `found` (see `differences`)."""
    shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
    return WorkdirMismatch(
        f"{workdir} holds a {job} run made with other settings ({shown}). Resume it with its settings, use "
        "another --workdir, or pass --fresh to start this run in a new folder beside it (the old one is kept)."
    )


def check_marker(workdir: pathlib.Path, job: str, settings: dict[str, Any], *, write: bool = True) -> None:
    """Refuses (WorkdirMismatch) a workdir whose marker is another job's or has other `settings`; otherwise
    writes the marker (atomically, with `write`)."""
    path = workdir / MARKER
    if path.exists():
        try:
            marker = read_json(path)
            there_job, there = marker["job"], marker["settings"]
        except (UnreadableJson, KeyError, TypeError) as error:
            raise WorkdirMismatch(f"{path} is not a job marker ({error}): restore it, or use another workdir") from None
        if there_job != job:
            raise WorkdirMismatch(f"{workdir} holds a {there_job} run, not a {job} run: use another --workdir")
        found = differences(there, settings)
        if found:
            raise mismatch(workdir, job, found)
    if write:
        workdir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"job": job, "settings": settings})


def fresh_workdir(workdir: str | os.PathLike, job: str, settings: dict[str, Any]) -> pathlib.Path:
    """`workdir` if it is free or holds this very run; else the first of `<workdir>-2`, `<workdir>-3`, ... that
    is (the folder a run started with --fresh uses)."""
    base = pathlib.Path(workdir)
    for n in range(1, 1000):
        folder = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            check_marker(folder, job, settings, write=False)
        except WorkdirMismatch:
            continue
        return folder
    raise WorkdirMismatch(f"no free folder beside {base} (tried {base.name}-2 to -999)")


_held: collections.Counter[str] = collections.Counter()  # workdirs this process holds, by how many claims
_locks: dict[str, int] = {}


@contextlib.contextmanager
def locked(workdir: str | os.PathLike, *, main: bool = True) -> Iterator[pathlib.Path]:
    """Holds the workdir's lock (see the module docstring) while the block runs; claims by this process nest.
    Raises WorkdirInUse, naming the holder, when another process holds it."""
    folder = pathlib.Path(workdir)
    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder.resolve())
    if not main:
        yield folder
        return
    if _held[key]:
        _held[key] += 1
        try:
            yield folder
        finally:
            _held[key] -= 1
        return
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise WorkdirInUse(
            f"{folder} is in use by {holder}; two runs in one workdir would mix their files: wait for it to end, "
            "or use another --workdir"
        ) from None
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} (since {started})\n".encode(), 0)
    _held[key], _locks[key] = 1, fd
    try:
        yield folder
    finally:
        _held[key] -= 1
        if not _held[key]:
            os.close(_locks.pop(key))  # releases the lock


@contextlib.contextmanager
def claimed(
    workdir: str | os.PathLike, job: str, config: Mapping[str, Any], *, main: bool = True
) -> Iterator[pathlib.Path]:
    """The workdir, locked and checked against `config`'s result-deciding settings while the block runs (see the
    module docstring); the main process writes the marker."""
    with locked(workdir, main=main) as folder:
        check_marker(folder, job, decisive_settings(config), write=main)
        yield folder
