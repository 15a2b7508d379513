# Probe script (provenance): where the greedy agent leaves the gold turns, run from the main checkout.
"""For each of tool_calling's held-out tasks (the comparison's mixed environment), the gold agent's episode scored
token by token under the base model and under given PEFT adapters: the gold turns' summed logprob, how many of
their tokens are not the model's argmax, and the first such token (its turn, the gold token and the argmax with
their probabilities, the text before it): a JSON line a task on stdout, all of them in out.json at the end.
argv: out.json name=peft_folder ...
divergence_first_tasks.jsonl: the first five tasks' lines (stopped there: about 3 minutes a task beside two runs)."""

import json
import pathlib
import sys

import jax.numpy as jnp
import ml_collections
import numpy as np

from configs import experiment_embedded
from trace_jax import lora
from trace_jax.envs import make_environment
from trace_jax.models import decoder
from trace_jax.models.model import load_model
from trace_jax.rl.gold_likelihood import GOLD_MAX_TURNS, gold_trajectories
from trace_jax.trace import pipeline

source = pathlib.Path("/work/exp/docs/results/comparison_embedded/trace")
calibrated = json.loads((source / "stages.json").read_text())["environments"]["result"]["tool_calling"]
config = pipeline.training_config(experiment_embedded.get_config().trace, calibrated)
env = make_environment(ml_collections.ConfigDict(config.env))
model = load_model(config.model)
tok = model.tokenizer
tasks = env.tasks(config.eval.split, config.eval.num_tasks)
played = gold_trajectories(env, tok, tasks, GOLD_MAX_TURNS, lora.NO_ADAPTER)
systems = [("base", None)] + [tuple(item.split("=", 1)) for item in sys.argv[2:]]


def scored(t, adapters):
    """Per agent token: logprob of the gold token, the argmax token and its logprob."""
    row_lora = None if adapters is None else lora.for_rows(adapters, jnp.zeros(1, jnp.int32))
    hidden = decoder.forward_hidden(model.params, jnp.asarray([t.token_ids[:-1]]), model.cfg, row_lora=row_lora)[0]
    learned = np.flatnonzero(t.loss_mask)
    logits = np.asarray(decoder.logits_from_hidden(model.params, hidden[0, learned - 1], model.cfg), np.float64)
    top = logits.max(axis=-1)
    logp = logits - (top + np.log(np.exp(logits - top[:, None]).sum(axis=-1)))[:, None]
    gold = np.asarray(t.token_ids)[learned]
    return learned, gold, logp[np.arange(len(learned)), gold], logp.argmax(-1), logp.max(-1)


out = {"tasks": []}
loaded = {name: None if folder is None else lora.load_peft(folder, model.cfg) for name, folder in systems}
for task, t in zip(tasks, played):
    row = {"task_id": task.task_id, "family": task.family, "gold_reward": t.outcome.reward}
    for name, adapters in loaded.items():
        learned, gold, gold_lp, argmax, argmax_lp = scored(t, adapters)
        wrong = np.flatnonzero(argmax != gold)
        entry = {"gold_logp": round(float(gold_lp.sum()), 3), "agent_tokens": len(gold), "not_argmax": len(wrong)}
        if len(wrong):
            i = int(wrong[0])
            position = int(learned[i])
            turn = 1 + sum(1 for a, b in zip(learned[:i], learned[1 : i + 1]) if b != a + 1)
            entry["first"] = {
                "agent_turn": turn,
                "gold": tok.decode([int(gold[i])]),
                "p_gold": round(float(np.exp(gold_lp[i])), 3),
                "argmax": tok.decode([int(argmax[i])]),
                "p_argmax": round(float(np.exp(argmax_lp[i])), 3),
                "before": tok.decode(t.token_ids[max(0, position - 24) : position])[-80:],
            }
        row[name] = entry
    out["tasks"].append(row)
    print(json.dumps(row), flush=True)
pathlib.Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
