"""GRPO on one built-in capability environment from the embedded base agent, with the training settings of
configs/trace_embedded.py (half of each group hinted, groups of 8, constant groups re-sampled): the job one
TRACE adapter is, run on its own, for measuring how the agent learns a capability.

  python -m launch.grpo --config=configs/grpo_capability_embedded.py --workdir=runs/grpo_return \\
      [--config.env.difficulty=-3] [--config.loss.tis_cap=2.0] \\
      [--config.train.updates_per_step=1 --config.optimizer.lr=1e-4]

By default tool_calling's return family at level 0 (the write of the target's return_delivered tickets, which
the base agent never makes); `loss.tis_cap` None learns the hinted rows as on-policy ones, a number with the
truncated importance weight (docs/trace_pipeline.md, "Hinted rows in the learner"). Held out: 16 of the
environment's held-out tasks, greedy and unhinted, before and after. `train.updates_per_step` and the
learning rate set how far a step moves the policy (docs/results.md, "GRPO on the return family from the written
call").
"""

import ml_collections
from ml_collections import config_dict

from configs import trace_embedded
from trace_jax.trace.calibration import environment_config
from trace_jax.trace.pipeline import grpo_config


def get_config() -> ml_collections.ConfigDict:
    trace = trace_embedded.get_config()
    env = environment_config("tool_calling", 0, trace.calibration, variant="return")
    config = grpo_config(trace, {**env, "split": "train"}, hints=True)
    config.loss.tis_cap = config_dict.placeholder(float)  # the copy above dropped the type that lets a flag set it
    config.train.steps = 8
    config.eval.update(num_tasks=16, every=4)
    return config
