"""A minute-long run of the warm-start SFT job (CI): two train tickets, two steps, adapters on the top two layers.

  python -m launch.sft --config=configs/warmstart_tiny.py --workdir=/tmp/warmstart_tiny
"""

import ml_collections

from configs import warmstart_embedded


def get_config() -> ml_collections.ConfigDict:
    config = warmstart_embedded.get_config()
    config.data.num_tasks = 2
    config.data.trajectories_per_step = 2
    config.lora.first_layer = 28
    config.train.steps = 2
    config.train.checkpoint_every = 1
    return config
