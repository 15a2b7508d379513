# Probe script (provenance): eval/gold_logp of tool_calling's held-out tasks, run from the main checkout.
"""eval/gold_logp (rl.gold_likelihood) of tool_calling's held-out tasks under the base and given checkpoints.
argv: out.json name=checkpoint_dir ..."""

import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp

from configs import experiment_embedded
from trace_jax import lora
from trace_jax.envs import make_environment
from trace_jax.models.adapters import Adapters
from trace_jax.models.model import load_model
from trace_jax.rl.gold_likelihood import GoldLikelihood, gold_trajectories
from trace_jax.trace import pipeline

source = pathlib.Path("/work/exp/docs/results/comparison_embedded/trace")
calibrated = json.loads((source / "stages.json").read_text())["environments"]["result"]["tool_calling"]
config = pipeline.training_config(experiment_embedded.get_config().trace, calibrated)
env = make_environment(ml_collections.ConfigDict(config.env))
model = load_model(config.model)
tasks = env.tasks(config.eval.split, config.eval.num_tasks)
played = gold_trajectories(env, model.tokenizer, tasks, 64, lora.NO_ADAPTER)
print("gold episodes:", [round(t.outcome.reward, 2) for t in played], flush=True)
t0 = time.time()
gold = GoldLikelihood(
    env,
    model.tokenizer,
    tasks,
    model.params,
    model.cfg,
    token_budget=config.train.micro_batch_tokens,
    frozen_layers=config.lora.first_layer,
    min_shared_prefix=config.rollout.min_shared_prefix,
    remat=config.train.remat,
)
print(f"packed and frozen streams: {time.time() - t0:.0f}s", flush=True)
families = [t.task_id for t in tasks]
out = {"tasks": families}


def restore(path):
    arrays = ocp.StandardCheckpointer().restore((pathlib.Path(path) / "arrays").absolute())
    return Adapters(weights=jax.tree.map(jnp.asarray, arrays["adapter_weights"]), scale=jnp.asarray(arrays["scale"]))


named = [item.split("=", 1) for item in sys.argv[2:]]
first = restore(named[0][1])
for name, adapters, idx in [("base", first, lora.NO_ADAPTER)] + [(n, restore(p), 0) for n, p in named]:
    t0 = time.time()
    out[name] = gold(model.params, adapters.weights, adapters.scale, idx)
    print(name, out[name], f"{time.time() - t0:.0f}s", flush=True)
pathlib.Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
