"""The embedded base agent's warm start: SmolLM2-135M-Instruct cloning the gold agent on train tickets.

  python -m launch.sft --config=configs/warmstart_embedded.py --workdir=/tmp/warmstart

The data is chosen so that the agent learns the tool-call format and some of the work, not
all of it: gold trajectories of the four read-and-simple-write families only (18 train tickets
each), 18 steps of 8 (each trajectory seen twice), which leaves it imperfect on them too. The
families left out (change_address, return_delivered, refuse) are the gaps TRACE is meant to
find. The first use of the model name `smollm2-135m-retail-agent` builds this merged agent
into the model cache (`launch/agents.py`); the adapter sits on layers 20-29, so each step
trains through those ten layers only (see `lora.first_layer`).
"""

import ml_collections

TRAINED_FAMILIES = ("order_status", "lookup_by_email", "lookup_by_name_zip", "cancel_pending")


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = "smollm2-135m-instruct"
    config.dtype = "float32"
    config.seed = 0
    config.env = ml_collections.ConfigDict(
        dict(name="embedded_retail", seed=0, families=TRAINED_FAMILIES, split="train")
    )
    config.data = ml_collections.ConfigDict(dict(num_tasks=72, trajectories_per_step=8, max_turns=10))
    config.lora = ml_collections.ConfigDict(
        dict(
            rank=16,
            alpha=32.0,
            targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            first_layer=20,
        )
    )
    config.optimizer = ml_collections.ConfigDict(dict(lr=3e-3, weight_decay=0.0, clip_norm=1.0))
    config.train = ml_collections.ConfigDict(
        dict(steps=18, micro_batch_tokens=2048, remat=True, checkpoint_every=2, keep_checkpoints=2)
    )
    config.export = ml_collections.ConfigDict(dict(merged=True))
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    config.log_every_s = 0.0
    return config
