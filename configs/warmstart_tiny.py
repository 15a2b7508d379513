"""A few-minute warm start (CI): SmolLM2-135M-Instruct cloning the gold agent on the tool_calling
capability environment (difficulty 0: cancel a pending order once the look-ups are done, the short
head without τ²'s policy), adapters on the top six layers.

  python -m launch.sft --config=configs/warmstart_tiny.py --workdir=/tmp/warmstart_tiny

Its merged output is the embedded agent `smollm2-135m-tiny-agent` (built by the first job that names it), the
starting point of `configs/grpo_env_tiny.py`: enough cloning that it sometimes makes the call
right, not so much that GRPO has nothing left to learn.
"""

import ml_collections

from configs import warmstart_embedded


def get_config() -> ml_collections.ConfigDict:
    config = warmstart_embedded.get_config()
    config.env = ml_collections.ConfigDict(
        dict(name="capability", capability="tool_calling", seed=0, difficulty=0, policy=False, split="train")
    )
    config.data.num_tasks = 8
    config.data.trajectories_per_step = 4
    config.lora.first_layer = 24
    config.optimizer.lr = 2e-3
    config.train.steps = 6
    config.train.checkpoint_every = 1
    return config
