"""GRPO on the target environment (the paper's first baseline), from the embedded base agent, on CPU.

  python -m launch.grpo --config=configs/grpo_target_embedded.py --workdir=runs/grpo_target \
      [--config.eval.base_run=runs/embedded_retail]

The embedded base agent (SmolLM2-135M-Instruct with its warm start merged, built on first
use) plays train tickets of the embedded retail environment, all seven families, in groups
of four at temperature 1; the adapter sits on the same top layers the warm start trained.
The length is a rollout budget, so runs of other methods with the same budget compare
fairly; held-out success per family is measured before training and at the end, on the same
200 tickets with the same limits as configs/embedded_retail.py, so `eval.base_run` may name that
evaluation's workdir and the base agent's episodes are read from it instead of played again.

`rollout.hint_share` (0: off; the embedded retail environment offers no hint) plays that share of each
group with the environment's hint, as TRACE's capability environments may (trace_jax/rl/trainer.py);
`loss.tis_cap` caps those episodes' importance weight at 2.0: a hint mostly makes the tokens it
suggests likelier, so most hinted tokens weigh less than 1, and the cap keeps a token the hint made
unlikely from weighing more than twice an unhinted token (whose weight is 1), which bounds the variance.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = "smollm2-135m-retail-agent"
    config.dtype = "float32"
    config.seed = 0
    config.env = ml_collections.ConfigDict(dict(name="embedded_retail", seed=0, families=(), split="train"))
    config.advantage = "group_normalized"
    config.log_every_s = 30.0

    config.lora = ml_collections.ConfigDict(
        dict(
            rank=16,
            alpha=32.0,
            targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            first_layer=20,
        )
    )
    config.rollout = ml_collections.ConfigDict(
        dict(
            tasks_per_step=4,
            group_size=4,
            temperature=1.0,
            top_p=1.0,
            batch_size=16,
            max_turns=6,
            max_tokens_per_turn=256,
            max_errors=4,
            min_shared_prefix=64,
            train_tasks=config_dict.placeholder(int),
            hint_share=0.0,
        )
    )
    config.loss = ml_collections.ConfigDict(
        dict(
            aggregation="seq_mean_token_mean",
            eps_low=0.2,
            eps_high=0.28,
            kl_coef=0.0,
            tis_cap=2.0,
            hinted_eps_high=config_dict.placeholder(float),  # None: hinted rows clipped as the others
            hinted_sft_coef=0.0,  # no imitation of the hinted successes
        )
    )  # tis_cap, hinted_eps_high, hinted_sft_coef: used with hints only
    config.optimizer = ml_collections.ConfigDict(dict(lr=5e-4, weight_decay=0.0, clip_norm=1.0))
    config.train = ml_collections.ConfigDict(
        dict(
            steps=config_dict.placeholder(int),
            rollout_budget=config_dict.placeholder(int),
            micro_batch_tokens=2048,
            remat=True,
            updates_per_step=1,
            checkpoint_every=1,
            keep_checkpoints=2,
            snapshot_fractions=(0.25, 0.5, 0.75),
        )
    )  # adapters along the run, for the comparison's scaling curve
    config.train.rollout_budget = 128
    config.eval = ml_collections.ConfigDict(
        dict(split="heldout", num_tasks=200, every=1000, batch_size=16, base_run="")
    )
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    return config
