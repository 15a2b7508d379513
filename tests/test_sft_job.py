"""The SFT job on the embedded SmolLM2 (`configs/warmstart_tiny.py`: a few gold trajectories of the
tool_calling capability environment, adapters on the top six layers), run as a user runs it
(subprocesses on one CPU device): the embedded agent it builds is built once per config and then
taken from the cache; a stopped run resumes to the same weights; the loss falls; the PEFT adapter
and the merged HF folder agree.
"""

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import warmstart_tiny
from trace_jax import lora, warmstart
from trace_jax.models import decoder
from trace_jax.models.embedded import resolve_model_dir
from trace_jax.models.model import load_model

REPO = pathlib.Path(__file__).resolve().parents[1]
AGENT = "smollm2-135m-tiny-agent"
CONFIG = warmstart_tiny.get_config()


def _run(args, env):
    out = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, job_env):
    """The workdir of a tiny run stopped after step 1 and run again to the end."""
    workdir = tmp_path_factory.mktemp("sft_resumed")
    command = ["-m", "launch.sft", "--config=configs/warmstart_tiny.py", f"--workdir={workdir}"]
    _run([*command, "--config.train.steps=1"], job_env)
    assert json.loads(_run(command, job_env))["steps"] == CONFIG.train.steps
    return workdir


def test_an_embedded_agent_is_built_once_per_config(tiny_agent, monkeypatch):
    cache, folder = tiny_agent
    marker = json.loads((folder / "trace_jax_warmstart.json").read_text())
    print(f"\n[sft job] tiny agent build: {marker['build']}")
    assert marker["config"] == "configs.warmstart_tiny" and marker["build"]["steps"] == CONFIG.train.steps
    assert (folder / "model.safetensors").is_file() and not list((cache / "agents").glob(".*"))  # workdir removed

    def no_training(*_):
        raise AssertionError("a cached agent was built again")

    monkeypatch.setattr(warmstart, "run_build", no_training)
    assert warmstart.agent_dir(AGENT, cache) == folder  # from the cache
    monkeypatch.setenv("TRACE_JAX_CACHE", str(cache))
    assert resolve_model_dir(AGENT) == folder  # the name is a model name like any embedded one
    config = warmstart.build_config(AGENT)
    config.seed = 1
    monkeypatch.setattr(warmstart, "build_config", lambda name: config)
    with pytest.raises(AssertionError, match="built again"):  # another config: another agent
        warmstart.agent_dir(AGENT, cache)


def test_a_stopped_run_resumes_to_the_same_weights_and_lowers_the_loss(tiny_agent, resumed):
    _, folder = tiny_agent
    losses = [json.loads(line)["learner/loss"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == CONFIG.train.steps and losses[-1] < losses[0]
    merged, uninterrupted = load_file(resumed / "merged" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert merged.keys() == uninterrupted.keys()
    for name in merged:
        np.testing.assert_array_equal(merged[name], uninterrupted[name], err_msg=name)


def test_the_merged_folder_is_the_base_with_the_peft_adapter(resumed):
    base, merged = load_model("smollm2-135m-instruct"), load_model(resumed / "merged")  # what --config.model= takes
    adapters = lora.load_peft(resumed / "adapter", base.cfg)
    first = CONFIG.lora.first_layer
    assert all(float(jnp.abs(w["b"][:, :first]).max()) == 0 < float(jnp.abs(w["b"][:, first:]).max())
               for w in adapters.weights.values())  # only the layers from lora.first_layer on were trained
    tokens = jnp.asarray([base.tokenizer.encode("Where is my order #W1234567?")])
    row_lora = lora.for_rows(adapters, jnp.zeros(1, jnp.int32))
    with_adapter = decoder.forward(base.params, tokens, base.cfg, row_lora=row_lora)[0]
    from_merged = decoder.forward(merged.params, tokens, merged.cfg)[0]
    moved = float(jnp.abs(with_adapter - decoder.forward(base.params, tokens, base.cfg)[0]).max())
    err = float(jnp.abs(from_merged - with_adapter).max())
    print(f"\n[sft job] merged model vs base + adapter: max |logit diff| {err:.2e} (the adapter moves them {moved:.2e})")
    assert err <= 1e-3 < moved
