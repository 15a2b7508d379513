"""The embedded base agent on the embedded retail environment's held-out tasks (the README's main command).

python -m launch.evaluate --config=configs/embedded_retail.py --workdir=runs/embedded_retail
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    # The embedded base agent: SmolLM2-135M-Instruct with its warm start merged (built by the first job that names
    # it, from configs/warmstart_embedded.py); "smollm2-135m-instruct" is the bare model.
    config.model = "smollm2-135m-retail-agent"
    config.dtype = "float32"
    config.adapter = ""  # "" = the base model; or a PEFT adapter folder
    config.seed = 0
    config.env = ml_collections.ConfigDict(dict(name="embedded_retail", seed=0, families=()))  # () = all families
    config.split = "heldout"
    config.num_tasks = 200
    config.trials = 1
    config.rollout = ml_collections.ConfigDict(
        dict(
            batch_size=16,
            max_turns=6,
            max_tokens_per_turn=256,
            max_errors=4,
            temperature=0.0,
            top_p=1.0,
            user_temperature=0.0,
        )
    )
    config.log_every_s = 10.0
    return config
