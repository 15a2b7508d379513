"""Embedded agents: an embedded model with a warm-start adapter merged in, built on first use.

The embedded base agent of the CPU default is SmolLM2-135M-Instruct after behaviour cloning
of the gold agent on train tickets (`configs/warmstart_embedded.py`, run by `launch.sft`).
The first use of its name runs that job in the model cache and keeps the merged HF folder,
like the GGUF conversion: the job's workdir sits next to it, so a killed build resumes from
its checkpoints, and the folder is keyed by the config, so a changed config builds anew.
The job runs as its own process, as a user would run it: the caller (an evaluation, say)
does not keep the training's memory, which a process keeps once it has grown its heap
(`runtime.retain_freed_memory`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

from absl import logging

from trace_jax.files import read_json
from trace_jax.runtime import default_cache_dir

# name -> the config module of the SFT job that builds it
AGENTS = {
    "smollm2-135m-retail-agent": "configs.warmstart_embedded",
    "smollm2-135m-tiny-agent": "configs.warmstart_tiny",
}  # minutes to build: for CI and quick trials
_MARKER = "trace_jax_warmstart.json"


def build_config(name: str):
    """The SFT job config that builds agent `name`."""
    if name not in AGENTS:
        raise ValueError(f"unknown embedded agent {name!r}; embedded agents: {', '.join(sorted(AGENTS))}")
    config = importlib.import_module(AGENTS[name]).get_config()
    config.export.merged = True
    return config


def _fingerprint(config) -> str:
    return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]


def agent_dir(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The merged HF folder of embedded agent `name`, built first if the cache lacks it (minutes)."""
    config = build_config(name)
    fingerprint = _fingerprint(config)
    root = pathlib.Path(cache_dir or default_cache_dir()) / "agents"
    target, workdir = root / name, root / f".{name}-{fingerprint}.work"
    if _built_from(target) == fingerprint:
        return target
    logging.info("building the embedded agent %s (once; config %s, workdir %s)", name, AGENTS[name], workdir)
    summary = run_build(AGENTS[name], workdir)
    (workdir / "merged" / _MARKER).write_text(
        json.dumps({"config": AGENTS[name], "fingerprint": fingerprint, "build": summary}), encoding="utf-8"
    )
    if target.exists():
        shutil.rmtree(target)  # built from another config
    os.replace(workdir / "merged", target)
    shutil.rmtree(workdir, ignore_errors=True)
    return target


def run_build(config_module: str, workdir: pathlib.Path) -> dict:
    """Runs the SFT job of `config_module` (merged export on) into `workdir` as a subprocess, its
    log passed through; returns the job's summary (its last line)."""
    spec = importlib.util.find_spec(config_module)
    root = pathlib.Path(spec.origin).parents[len(config_module.split(".")) - 1]  # where `configs` is importable
    command = [
        sys.executable,
        "-m",
        "launch.sft",
        f"--config={spec.origin}",
        f"--workdir={workdir}",
        "--config.export.merged=True",
    ]
    out = subprocess.run(command, cwd=root, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(
            f"building the embedded agent failed ({' '.join(command)} exited {out.returncode}); "
            f"rerun to resume it from {workdir}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _built_from(folder: pathlib.Path) -> str | None:
    try:
        return read_json(folder / _MARKER)["fingerprint"]
    except (OSError, ValueError, KeyError):
        return None
