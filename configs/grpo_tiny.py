"""A few-minute GRPO run of the same job (CI): four steps of 16 rollouts at a high learning rate, a small held-out eval.

  python -m launch.grpo --config=configs/grpo_tiny.py --workdir=/tmp/grpo_tiny
"""

import ml_collections

from configs import grpo_embedded


def get_config() -> ml_collections.ConfigDict:
    config = grpo_embedded.get_config()
    config.rollout.tasks_per_step = 4
    config.optimizer.lr = 1e-3
    config.train.steps = 4
    config.train.checkpoint_every = 1
    config.train.keep_checkpoints = 8
    config.eval.splits = ("heldout",)
    config.eval.num_tasks = 8
    config.eval.every = 4
    config.log_every_s = 0.0
    return config
