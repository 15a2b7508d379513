"""The warm start of `configs/warmstart_embedded.py` applied to google's gemma-3-270m base model.

  python -m launch.sft --config=configs/warmstart_embedded_gemma.py --workdir=/tmp/warmstart_gemma

The same data and recipe as the SmolLM2 agent (gold trajectories of the four read-and-simple-write
families, 18 steps of 8), so that the two agents differ by their base model alone. The adapter sits
on the top third of the layers as SmolLM2's does (12-17 of Gemma 3 270M's 18). Its merged output is
the embedded agent `gemma-3-270m-retail-agent`, built by the first job that names it
(`launch/agents.py`). Gemma's terms of use apply to the weights it starts from and to the agent.
"""

import ml_collections

from configs import warmstart_embedded


def get_config() -> ml_collections.ConfigDict:
    config = warmstart_embedded.get_config()
    config.model = "gemma-3-270m"
    config.lora.first_layer = 12
    return config
