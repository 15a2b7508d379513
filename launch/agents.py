"""Builds the embedded agents: an embedded model with a warm-start adapter merged in.

  python -m launch.agents [--agent=smollm2-135m-retail-agent] [--pin]     # make agent

The embedded base agent of the CPU default is SmolLM2-135M-Instruct after behaviour cloning
of the gold agent on train tickets (`configs/warmstart_embedded.py`, run by `launch.sft`).
Building merges the warm-start adapter into the embedded model and keeps the merged HF folder in the model
cache, where `trace_jax.models.embedded.resolve_model_dir` finds it by name (resolving a name never builds).

The adapter is the one pinned in the repository (`configs/agents/<name>/`) when it was made by the agent's
config as it is now: the merge (`lora.merge_peft_folder`) gives the same bytes on every machine, so an agent's
weights fingerprint, and every result recorded against it, holds across machines and sessions (a training run's
floats follow the CPU's vector width). Otherwise the SFT job trains it in the cache; its workdir sits next to the
agent, so a killed build resumes from its checkpoints, and `--pin` then writes the adapter into the repository
for everyone. The folder is keyed by the config, so a changed config builds anew. Every launch job calls
`ensure_built` on the model names its config holds before it starts, so a job on a fresh machine builds what it
needs first. The SFT job runs as its own process, as a user would run it: the caller does not keep the
training's memory, which a process keeps once it has grown its heap (`runtime.retain_freed_memory`).
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

import numpy as np
from absl import app, flags, logging
from safetensors.numpy import load_file, save_file

from trace_jax import lora
from trace_jax.files import read_json, write_json_atomic
from trace_jax.models.embedded import AGENT_MARKER, EMBEDDED_AGENTS, agents_dir, resolve_model_dir
from trace_jax.models.model import weights_fingerprint

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
    config.export.merged = False  # merged by `agent_dir`, as from a pinned adapter
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


PINNED = pathlib.Path(__file__).resolve().parents[1] / "configs" / "agents"  # <name>/: a pinned warm-start adapter
PIN_RECORD = "pinned.json"  # beside a pinned adapter: the config fingerprint it was made by, the agent's, the build
ADAPTER_DIR = "warmstart_adapter"  # in a built agent's folder: the adapter merged into it


def agent_dir(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The merged HF folder of embedded agent `name`, built first if the cache lacks it (seconds from a pinned
    adapter, else minutes of training)."""
    config = build_config(name)
    fingerprint = _fingerprint(config)
    root = agents_dir(cache_dir)
    target, workdir = root / name, root / f".{name}-{fingerprint}.work"
    if _built_from(target) == fingerprint:
        return target
    pinned = pinned_adapter(name, fingerprint)
    if pinned is not None:
        logging.info("building the embedded agent %s from its pinned warm-start adapter %s", name, PINNED / name)
        adapter, summary = PINNED / name, pinned["build"]
    else:
        logging.info("building the embedded agent %s (once; config %s, workdir %s)", name, AGENTS[name], workdir)
        adapter, summary = workdir / "adapter", run_build(AGENTS[name], workdir)
    merged = workdir / "merged"
    lora.merge_peft_folder(resolve_model_dir(config.model), adapter, merged)
    shutil.copytree(adapter, merged / ADAPTER_DIR, ignore=shutil.ignore_patterns(PIN_RECORD), dirs_exist_ok=True)
    marker = {"config": AGENTS[name], "fingerprint": fingerprint, "build": summary, "pinned": pinned is not None}
    (merged / AGENT_MARKER).write_text(json.dumps(marker), encoding="utf-8")
    if target.exists():
        shutil.rmtree(target)  # built from another config
    os.replace(merged, target)
    shutil.rmtree(workdir, ignore_errors=True)
    return target


def pinned_adapter(name: str, fingerprint: str) -> dict | None:
    """The record (`PIN_RECORD`) of the repository's pinned warm-start adapter of agent `name` (in `PINNED`/name)
    if it was made by the config of `fingerprint`, else None."""
    folder = PINNED / name
    if not (folder / PIN_RECORD).is_file():
        return None
    record = read_json(folder / PIN_RECORD)
    if record["fingerprint"] != fingerprint:
        logging.warning(
            "the pinned adapter %s was made by another config (%s, now %s): training",
            folder,
            record["fingerprint"],
            fingerprint,
        )
        return None
    return record


def pin(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Writes agent `name`'s warm-start adapter (built first if need be) into the repository, its layers that the
    adapter leaves at zero dropped, with the config fingerprint it was made by and the agent's weights
    fingerprint (which a build from it on any machine reproduces)."""
    folder = agent_dir(name, cache_dir)
    built = read_json(folder / AGENT_MARKER)
    out, adapter = PINNED / name, folder / ADAPTER_DIR
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    layer_of = {k: int(k.split(".layers.")[1].split(".")[0]) for k in tensors}
    layers = sorted({layer_of[k] for k, v in tensors.items() if np.any(v)})
    kept = {k: v for k, v in tensors.items() if layer_of[k] in layers}
    save_file(kept, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {**read_json(adapter / "adapter_config.json"), "layers_to_transform": layers}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2), encoding="utf-8")
    write_json_atomic(
        out / PIN_RECORD,
        {
            "config": built["config"],
            "fingerprint": built["fingerprint"],
            "agent_fingerprint": weights_fingerprint(folder),
            "build": built["build"],
        },
    )
    return out


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
        "--config.export.merged=False",  # `build_config`'s
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
    name = flags.FLAGS.agent
    print(pin(name) if flags.FLAGS.pin else agent_dir(name), flush=True)


if __name__ == "__main__":
    flags.DEFINE_enum("agent", "smollm2-135m-retail-agent", sorted(AGENTS), "The embedded agent to build.")
    flags.DEFINE_bool("pin", False, "Also write its warm-start adapter into the repository (configs/agents/).")
    app.run(main)
