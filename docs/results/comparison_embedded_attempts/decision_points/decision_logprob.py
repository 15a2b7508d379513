"""Decision-point logprobs: how likely the agent is, WITHOUT the hint, to make the write a hinted success made.

For each hinted successful episode of a rollouts file (tool_calling's step-1 episodes, the same in every probe),
the context is the episode up to the write turn with the hint removed from the system prompt; the score is the
log-probability of that write turn (its whole text) and of its tool name's tokens, under the base and under each
given adapter (an orbax checkpoint folder or a PEFT folder). argv: out.json name=path ...; env POINTS picks
other rollouts files.
"""
import json, os, pathlib, sys

import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp

from configs import experiment_embedded
from trace_jax import lora
from trace_jax.agent.chat_codec import ChatCodec
from trace_jax.envs import make_environment
from trace_jax.models.adapters import Adapters
from trace_jax.models.model import load_model
from trace_jax.rl import learner
from trace_jax.rl.learner_batch import SharedPrefix
from trace_jax.trace import pipeline

WRITES = ("cancel_pending_order", "return_delivered_order_items", "modify_pending_order_address", "modify_user_address")
source = pathlib.Path("/work/exp/docs/results/comparison_embedded/trace")
calibrated = json.loads((source / "stages.json").read_text())["environments"]["result"]["tool_calling"]
config = pipeline.training_config(experiment_embedded.get_config().trace, calibrated)
import ml_collections
env = make_environment(ml_collections.ConfigDict(config.env))
model = load_model(config.model)
tasks = {t.task_id: t for t in env.tasks("train")}

SETS = {  # "seen": tool_calling's step-1 episodes, which every probe learned from; "unseen": step 7's (task 6 of
    # each variant), which no probe reached and the comparison's checkpoint 6 had not yet played
    "seen": "/work/sft/runs/tool_calling_sft1_tkl003/rollouts/step_1.jsonl",
    "unseen": str(source / "adapters/tool_calling/rollouts/step_7.jsonl"),
}
if os.environ.get("POINTS"):  # other rollouts files: POINTS="name=path,name=path"
    SETS = dict(item.split("=", 1) for item in os.environ["POINTS"].split(","))
records = [dict(json.loads(line), set=name) for name, f in SETS.items() for line in open(f)]
points = []
for r in records:
    if not (r["hint"] and r["success"]):
        continue
    msgs = r["messages"]
    i = next(k for k, m in enumerate(msgs) if m["role"] == "assistant" and any(f'"{w}"' in m["content"] for w in WRITES))
    plain = env.episode(tasks[r["task_id"]])
    codec = ChatCodec(model.tokenizer, plain.tools)
    system = plain.reset()[0]
    assert system["role"] == "system" and msgs[0]["content"].startswith(system["content"]), r["task_id"]
    context = codec.first_prompt([system] + msgs[1:i])
    turn = codec.assistant_turn(msgs[i]["content"])
    name = next(w for w in WRITES if f'"{w}"' in msgs[i]["content"])
    head = codec.tokenizer.encode(msgs[i]["content"].split(name)[0])  # the turn's tokens before the tool name
    head_len = len(head) if turn[: len(head)] == head else 0
    name_len = len(codec.tokenizer.encode(msgs[i]["content"].split(name)[0] + name)) - head_len
    points.append((r["set"] + "/" + r["family"], r["task_id"], context, turn, head_len, name_len))
print(f"{len(points)} decision points:", {f: sum(p[0] == f for p in points) for f in sorted({p[0] for p in points})})


def adapters_of(path: str | None) -> Adapters | None:
    if path is None:
        return None
    p = pathlib.Path(path)
    if (p / "adapter_model.safetensors").exists():
        return lora.load_peft(p, model.cfg)
    arrays = ocp.StandardCheckpointer().restore((p / "arrays").absolute())
    return Adapters(weights=jax.tree.map(jnp.asarray, arrays["adapter_weights"]), scale=jnp.asarray(arrays["scale"]))


SCORE = jax.jit(learner.token_logprobs, static_argnums=4)
HEAD = min(next((k for k, (a, b) in enumerate(zip(points[0][2], p[2])) if a != b), len(p[2])) for p in points)
HEAD -= 1  # every context's shared head (the system prompt), run once as the learner's shared prefix
LENGTH = -(-max(len(p[2]) + len(p[3]) - HEAD for p in points) // 128) * 128
print(f"shared head {HEAD} tokens, rows padded to {LENGTH}", flush=True)
CHUNK = 9


def prefix_of(idx):
    head = jnp.asarray([points[0][2][:HEAD]], jnp.int32)
    return SharedPrefix(tokens=head, lengths=jnp.asarray([HEAD], jnp.int32), adapter=idx)


results = {}
for label, path in [("base", None)] + [tuple(a.split("=", 1)) for a in sys.argv[2:]]:
    adapters = adapters_of(path)
    idx = jnp.asarray([0 if adapters is not None else lora.NO_ADAPTER], jnp.int32)
    all_ids = [(context + turn)[HEAD:] for _, _, context, turn, _, _ in points]  # right-padded to one length
    padded = np.asarray([ids + [0] * (LENGTH - len(ids)) for ids in all_ids], np.int32)
    lps = []
    for start in range(0, len(points), CHUNK):  # CHUNK rows a call, all continuing the one shared head
        rows = padded[start : start + CHUNK]
        rows = np.concatenate([rows, np.repeat(rows[-1:], CHUNK - len(rows), 0)])
        out = SCORE(model.params, adapters, jnp.asarray(rows), jnp.repeat(idx, CHUNK), model.cfg,
                    prefix=prefix_of(idx), prefix_of_row=jnp.zeros((CHUNK,), jnp.int32))
        lps.extend(np.asarray(out))
    rows = []
    for (family, task_id, context, turn, head_len, name_len), ids, lp in zip(points, all_ids, lps):
        turn_lp = lp[len(context) - HEAD - 1 : len(ids) - 1]
        rows.append({
            "family": family, "task_id": task_id, "turn_logprob": float(turn_lp.sum()), "turn_tokens": len(turn),
            "name_logprob": float(turn_lp[head_len : head_len + name_len].sum()),
            "call_logprob": float(turn_lp[0]), "head_len": head_len, "name_len": name_len,
            "turn_ids": turn, "token_logprobs": [round(float(v), 4) for v in turn_lp],
        })
    by_family = {}
    for f in sorted({r["family"] for r in rows}):
        mine = [r for r in rows if r["family"] == f]
        by_family[f] = {
            "n": len(mine),
            "turn_logprob": float(np.mean([r["turn_logprob"] for r in mine])),
            "name_prob": float(np.mean([np.exp(r["name_logprob"]) for r in mine])),
            "call_prob": float(np.mean([np.exp(r["call_logprob"]) for r in mine])),
        }
    results[label] = {"path": path, "families": by_family, "rows": rows}
    print(label, json.dumps(by_family), flush=True)
    pathlib.Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
