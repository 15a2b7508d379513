"""τ²-bench retail through τ²'s own environment and evaluator; the user simulator is the base model.

python -m launch.evaluate --config=configs/tau2_retail.py --workdir=runs/tau2_retail [--config.split=train|test|base]
    [--agent=gold|noop] [--config.trials=4] [--config.num_tasks=5]
"""

import ml_collections

from configs import tau2_airline


def get_config() -> ml_collections.ConfigDict:
    config = tau2_airline.get_config()  # the same settings, another domain
    config.env.domain = "retail"
    return config
