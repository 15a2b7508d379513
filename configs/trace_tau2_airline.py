"""TRACE on τ²-bench airline with the paper's settings, for a real model on an accelerator.

  python -m launch.trace --config=configs/trace_tau2_airline.py --workdir=runs/trace_tau2_airline \
      --config.model=/path/to/hf_checkpoint --config.llm.model=... [--config.llm.base_url=...]

As configs/trace_tau2_retail.py on τ²'s airline domain, with the LLM analyst (the programmatic
one's labellers read retail's tools) and LLM-written capability environments (the built-in
generators are retail's): the writer is shown the authoring API's airline part and an airline
example module (trace_jax/envs/capability/example_airline.py), and its modules build synthetic
customers and reservations on τ²'s flight schedule.
"""

import ml_collections

from configs import trace_tau2_retail


def get_config() -> ml_collections.ConfigDict:
    config = trace_tau2_retail.get_config()
    config.target.env.domain = "airline"
    config.target.update(analysis_tasks=30, heldout_tasks=20)  # τ²'s airline train / test split sizes
    config.analysis.analyst = "llm"
    config.environments.source = "llm"
    return config
