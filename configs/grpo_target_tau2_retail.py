"""GRPO on τ²-bench retail's train split (the paper's GRPO-on-target baseline) for a real model on accelerators,
on one host or as several processes (docs/multihost.md).

  python -m launch.grpo --config=configs/grpo_target_tau2_retail.py --workdir=runs/grpo_tau2_retail \
      --config.model=/path/to/hf_checkpoint [--config.mesh.fsdp=8 --config.mesh.data=-1]

The training settings are configs/trace_tau2_retail.py's (the released code's): groups of 16, 4 groups a step,
LoRA rank 16 / alpha 16 on q, k, v, o, lr 1e-5, bf16, up to 30 agent turns of 1,024 tokens with the base model
as the user simulator; 40 steps (2,560 training episodes); the held-out evaluation plays the test split's 40
tasks greedily before and after, scored by τ²'s own evaluator. As several processes each plays its share of a
step's 64 episodes; a model too large for one device's memory shards its weights with `mesh.fsdp`.
"""

import ml_collections

from configs import trace_tau2_retail
from trace_jax.trace.pipeline import grpo_config


def get_config() -> ml_collections.ConfigDict:
    trace = trace_tau2_retail.get_config()
    config = grpo_config(trace, {**trace.target.env.to_dict(), "split": "train"}, hints=False)
    config.eval.update(split="test", num_tasks=trace.target.heldout_tasks)
    return config
