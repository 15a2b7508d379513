"""`python -m launch.generate` keeps its contract: flags, JSON fields, same tokens as the library (on the
tiny random model with SmolLM2's tokenizer: the contract, not the model, is under test here)."""

import json
import subprocess
import sys

import jax
import pytest
from multiprocess import failure_report

from trace_jax import lora
from trace_jax.models.model import load_model
from trace_jax.sampling import Sampler

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def model(tiny_chat_model):
    return load_model(tiny_chat_model)


def _run_cli(model, *flags: str) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.generate",
            f"--model={model.path}",
            f"--prompt={PROMPT}",
            "--max_new_tokens=8",
            "--temperature=0",
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, failure_report(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def adapter_dir(model, tmp_path_factory):
    """A PEFT adapter with non-zero B, so it changes the output."""
    spec = lora.LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    adapters = lora.init_adapters(jax.random.key(0), model.cfg, spec)
    weights = {
        t: {"a": w["a"], "b": jax.random.normal(jax.random.key(1), w["b"].shape) * 0.05}
        for t, w in adapters.weights.items()
    }
    path = tmp_path_factory.mktemp("adapter")
    lora.save_peft(lora.Adapters(weights, adapters.scale), path)
    return path


def _library_generate(model, prompt_ids, adapters=None):
    sampler = Sampler(model.cfg, model.params, adapters=adapters)
    (out,), _ = sampler.generate(
        [prompt_ids],
        key=jax.random.key(0),
        max_new_tokens=8,
        adapter_idx=0 if adapters is not None else lora.NO_ADAPTER,
        stop_token_ids=sorted(model.tokenizer.eos_token_ids),
    )
    return out


def test_raw_prompt_json_contract(model):
    out = _run_cli(model)
    assert {"token_ids", "text", "finish_reason", "logprobs", "prompt_token_ids"} <= set(out)
    assert out["prompt_token_ids"] == model.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert out["token_ids"] == _library_generate(model, out["prompt_token_ids"]).token_ids
    assert out["text"] == model.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_chat_with_adapter_matches_library(model, adapter_dir):
    adapted = _run_cli(model, "--chat", f"--adapter={adapter_dir}")
    chat_ids = model.tokenizer.apply_chat([{"role": "user", "content": PROMPT}])
    assert adapted["prompt_token_ids"] == chat_ids
    expected = _library_generate(model, chat_ids, lora.load_peft(adapter_dir, model.cfg))
    assert adapted["token_ids"] == expected.token_ids
    plain = _library_generate(model, chat_ids)
    n = min(len(plain.logprobs), len(adapted["logprobs"]))
    assert max(abs(a - b) for a, b in zip(plain.logprobs[:n], adapted["logprobs"][:n])) > 1e-3  # adapter applied
