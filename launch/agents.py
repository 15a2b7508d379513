"""Builds the embedded agents: an embedded model with a warm-start adapter merged in.

  python -m launch.agents [--agent=smollm2-135m-retail-agent]     # make agent

The embedded base agent of the CPU default is SmolLM2-135M-Instruct after behaviour cloning
of the gold agent on train tickets (`configs/warmstart_embedded.py`, run by `launch.sft`).
Building runs that job in the model cache and keeps the merged HF folder, where
`trace_jax.models.embedded.resolve_model_dir` finds it by name (resolving a name never builds). The job's
workdir sits next to it, so a killed build resumes from its checkpoints, and the folder is keyed by the
config, so a changed config builds anew. Every launch job calls `ensure_built` on the model names its config
holds before it starts, so a job on a fresh machine builds what it needs first. The job runs as its own
process, as a user would run it: the caller does not keep the training's memory, which a process keeps once
it has grown its heap (`runtime.retain_freed_memory`).
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

from absl import app, flags, logging

from trace_jax.files import read_json
from trace_jax.models.embedded import AGENT_MARKER, EMBEDDED_AGENTS, agents_dir

# name -> the config module of the SFT job that builds it (the tiny agent: minutes to build, for CI and trials)
AGENTS = {
    "smollm2-135m-retail-agent": "configs.warmstart_embedded",
    "smollm2-135m-tiny-agent": "configs.warmstart_tiny",
    "gemma-3-270m-retail-agent": "configs.warmstart_embedded_gemma",
}
assert set(AGENTS) == set(EMBEDDED_AGENTS), "every embedded agent name needs its build config"


def build_config(name: str):
    """The SFT job config that builds agent `name`."""
    if name not in AGENTS:
        raise ValueError(f"unknown embedded agent {name!r}; embedded agents: {', '.join(sorted(AGENTS))}")
    config = importlib.import_module(AGENTS[name]).get_config()
    config.export.merged = True
    return config


def _fingerprint(config) -> str:
    return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]


def ensure_built(*names: str) -> None:
    """Builds every embedded agent among `names` (model names or folders) that the cache lacks."""
    for name in names:
        if name in AGENTS:
            agent_dir(name)


def ensure_config_agents(config) -> None:
    """Builds the embedded agents a job config names: `model`, and a comparison's `trace.model`."""
    names = [config.get("model"), config.trace.get("model") if "trace" in config else None]
    ensure_built(*[name for name in names if isinstance(name, str)])


def agent_dir(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The merged HF folder of embedded agent `name`, built first if the cache lacks it (minutes)."""
    config = build_config(name)
    fingerprint = _fingerprint(config)
    root = agents_dir(cache_dir)
    target, workdir = root / name, root / f".{name}-{fingerprint}.work"
    if _built_from(target) == fingerprint:
        return target
    logging.info("building the embedded agent %s (once; config %s, workdir %s)", name, AGENTS[name], workdir)
    summary = run_build(AGENTS[name], workdir)
    (workdir / "merged" / AGENT_MARKER).write_text(
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
        return read_json(folder / AGENT_MARKER)["fingerprint"]
    except (OSError, ValueError, KeyError):
        return None


def main(argv: list[str]) -> None:
    del argv
    print(agent_dir(flags.FLAGS.agent), flush=True)


if __name__ == "__main__":
    flags.DEFINE_enum("agent", "smollm2-135m-retail-agent", sorted(AGENTS), "The embedded agent to build.")
    app.run(main)
