"""The SFT job (`configs/warmstart_tiny.py`: a few gold trajectories of the tool_calling capability
environment) on the tiny random model with SmolLM2's tokenizer, run as a user runs it (subprocesses): a run of
two processes of one CPU device each, one of them SIGKILLed and both restarted, ends with the weights of an
uninterrupted single process on two devices (the same mesh), the loss falls, and the PEFT adapter and the
merged HF folder agree. (The SFT build of the tiny SmolLM2 agent, and its cache, are
tested where the agent is used: tests/test_grpo_env_job.py.)
"""

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from multiprocess import TWO_DEVICES, failure_report, kill_one_after_checkpoint, run_processes
from safetensors.numpy import load_file

from configs import warmstart_tiny
from trace_jax import lora
from trace_jax.models import decoder
from trace_jax.models.model import load_model

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = warmstart_tiny.get_config()
FIRST_LAYER = 1  # of the tiny chat model's two: layer 0 stays untrained


def _command(workdir, model):
    return [
        sys.executable,
        "-m",
        "launch.sft",
        "--config=configs/warmstart_tiny.py",
        f"--workdir={workdir}",
        f"--config.model={model}",
        f"--config.lora.first_layer={FIRST_LAYER}",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, job_env, tiny_chat_model):
    """The workdirs of two runs on the tiny chat model: two processes, one SIGKILLed as soon as step 2 is saved
    (in step 3, each step taking seconds), then the other, both run again to the end; one uninterrupted process
    on two devices."""
    resumed, uninterrupted = tmp_path_factory.mktemp("sft_resumed"), tmp_path_factory.mktemp("sft_uninterrupted")
    killed = kill_one_after_checkpoint(
        _command(resumed, tiny_chat_model), 2, job_env, resumed, 2, resumed.parent / "killed", 1200
    )
    assert "resumed from" not in killed[0] and '"steps"' not in killed[0]  # a fresh run, killed before its end
    outputs = run_processes(_command(resumed, tiny_chat_model), 2, job_env, resumed.parent / "restarted", 1200)
    assert "resumed from step 2" in outputs[0] and '"steps"' not in outputs[1]  # process 0 alone logs and prints
    out = subprocess.run(
        _command(uninterrupted, tiny_chat_model),
        cwd=REPO,
        env={**job_env, **TWO_DEVICES},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, failure_report(out)
    for last_line in (outputs[0], out.stdout):
        assert json.loads(last_line.strip().splitlines()[-1])["steps"] == CONFIG.train.steps
    return resumed, uninterrupted


def test_two_processes_killed_and_restarted_end_with_the_weights_of_one_and_lower_the_loss(runs):
    resumed, uninterrupted = runs
    losses = [json.loads(line)["learner/loss"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == CONFIG.train.steps and losses[-1] < losses[0]
    merged, uninterrupted = (load_file(w / "merged" / "model.safetensors") for w in (resumed, uninterrupted))
    assert merged.keys() == uninterrupted.keys()
    for name in merged:
        np.testing.assert_array_equal(merged[name], uninterrupted[name], err_msg=name)


def test_the_merged_folder_is_the_base_with_the_peft_adapter(runs, tiny_chat_model):
    resumed, _ = runs
    base, merged = load_model(tiny_chat_model), load_model(resumed / "merged")  # what --config.model= takes
    adapters = lora.load_peft(resumed / "adapter", base.cfg)
    first = FIRST_LAYER
    assert all(
        float(jnp.abs(w["b"][:, :first]).max()) == 0 < float(jnp.abs(w["b"][:, first:]).max())
        for w in adapters.weights.values()
    )  # only the layers from lora.first_layer on were trained
    tokens = jnp.asarray([base.tokenizer.encode("Where is my order #W1234567?")])
    row_lora = lora.for_rows(adapters, jnp.zeros(1, jnp.int32))
    with_adapter = decoder.forward(base.params, tokens, base.cfg, row_lora=row_lora)[0]
    from_merged = decoder.forward(merged.params, tokens, merged.cfg)[0]
    moved = float(jnp.abs(with_adapter - decoder.forward(base.params, tokens, base.cfg)[0]).max())
    err = float(jnp.abs(from_merged - with_adapter).max())
    print(
        f"\n[sft job] merged model vs base + adapter: max |logit diff| {err:.2e} (the adapter moves them {moved:.2e})"
    )
    assert err <= 1e-3 < moved
