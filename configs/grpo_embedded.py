"""GRPO on the single-turn tool-call task with the embedded SmolLM2-135M-Instruct (CPU-sized).

python -m launch.grpo --config=configs/grpo_embedded.py --workdir=/tmp/grpo_embedded
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = "smollm2-135m-instruct"
    config.dtype = "float32"
    config.seed = 0
    config.task = "tool_call"
    config.advantage = "group_normalized"
    config.log_every_s = 10.0

    config.lora = ml_collections.ConfigDict(
        dict(
            rank=16,
            alpha=32.0,
            targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            first_layer=0,
        )
    )
    config.rollout = ml_collections.ConfigDict(
        dict(
            tasks_per_step=8,
            group_size=4,
            temperature=0.7,
            top_p=1.0,
            max_new_tokens=64,
            batch_size=32,
            min_shared_prefix=config_dict.placeholder(int),
        )
    )
    config.rollout.min_shared_prefix = 64
    config.loss = ml_collections.ConfigDict(
        dict(aggregation="seq_mean_token_mean", eps_low=0.2, eps_high=0.28, kl_coef=0.0)
    )
    config.optimizer = ml_collections.ConfigDict(dict(lr=5e-4, weight_decay=0.0, clip_norm=1.0))
    config.train = ml_collections.ConfigDict(
        dict(
            steps=config_dict.placeholder(int),
            rollout_budget=config_dict.placeholder(int),
            micro_batch_tokens=512,
            remat=False,
            updates_per_step=1,
            checkpoint_every=5,
            keep_checkpoints=2,
            snapshot_fractions=(),
        )
    )
    config.train.steps = 20
    config.eval = ml_collections.ConfigDict(
        dict(splits=("heldout",), num_tasks=64, every=20, batch_size=32, max_new_tokens=64)
    )
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    return config
