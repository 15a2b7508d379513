"""The tiny CI pipeline (configs/trace_tiny.py) on τ²-bench airline: the base model (the user simulator too) plays
4 train and 4 test tasks through τ²'s airline environment and evaluator, the LLM analyst labels them and the LLM
writes each selected capability's environment against the authoring API's airline part (the built-in generators
are retail's). Set `llm.model` and `llm.base_url`; nothing is measured here either.

  python -m launch.trace --config=configs/trace_tiny_airline.py --workdir=/tmp/trace_tiny_airline \
      --config.llm.model=... --config.llm.base_url=...
"""

import ml_collections

from configs import tau2_airline, trace_tiny


def get_config() -> ml_collections.ConfigDict:
    config = trace_tiny.get_config()
    config.target.env = tau2_airline.get_config().env
    config.target.update(analysis_split="train", heldout_split="test")
    config.target.rollout.user_temperature = 0.0
    config.analysis.analyst = "llm"
    config.environments.source = "llm"
    return config
