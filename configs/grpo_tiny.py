"""A smoke run of the single-turn GRPO job (CI): two steps of 2 tasks x 4 samples on the top six layers,
an 8-task held-out evaluation before and after (8 rows, as a step samples: the same compiled programs).

  python -m launch.grpo --config=configs/grpo_tiny.py --workdir=/tmp/grpo_tiny

It shows the job trains, logs, checkpoints and resumes; that GRPO raises the reward is shown at CI
size on an environment (configs/grpo_env_tiny.py), the same learner on multi-turn episodes.
"""

import ml_collections

from configs import grpo_embedded


def get_config() -> ml_collections.ConfigDict:
    config = grpo_embedded.get_config()
    config.lora.first_layer = 24
    config.rollout.tasks_per_step = 2
    config.optimizer.lr = 1e-3
    config.train.steps = 2
    config.train.checkpoint_every = 1
    config.train.keep_checkpoints = 8
    config.eval.splits = ("heldout",)
    config.eval.num_tasks = 8
    config.eval.every = 2
    config.log_every_s = 0.0
    return config
