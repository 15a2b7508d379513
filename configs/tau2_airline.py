"""τ²-bench airline through τ²'s own environment and evaluator; the user simulator is the base model.

python -m launch.evaluate --config=configs/tau2_airline.py --workdir=runs/tau2_airline [--config.split=train|test|base]
    [--agent=gold|noop] [--config.trials=4] [--config.num_tasks=5]
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = "smollm2-135m-instruct"
    config.dtype = "float32"
    config.adapter = ""  # "" = the base model; or a PEFT adapter folder
    config.seed = 0
    config.env = ml_collections.ConfigDict(dict(name="tau2", domain="airline"))
    config.split = "test"
    config.num_tasks = ml_collections.config_dict.placeholder(int)  # None = every task of the split
    config.trials = 1
    config.rollout = ml_collections.ConfigDict(
        dict(
            batch_size=16,
            max_turns=30,
            max_tokens_per_turn=512,
            max_errors=10,
            temperature=1.0,
            top_p=1.0,
            user_temperature=0.0,
        )
    )
    config.log_every_s = 10.0
    return config
