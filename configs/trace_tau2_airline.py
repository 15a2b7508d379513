"""TRACE on τ²-bench airline with the paper's settings, for a real model on an accelerator.

  python -m launch.trace --config=configs/trace_tau2_airline.py --workdir=runs/trace_tau2_airline \
      --config.model=/path/to/hf_checkpoint --config.llm.model=... [--config.llm.base_url=...]

As configs/trace_tau2_retail.py on τ²'s airline domain, with the LLM analyst (the programmatic
one's labellers read retail's tools). The built-in capability environments and the authoring API
of LLM-written ones are over retail's data model, so every airline capability is reported and
dropped at synthesis until the authoring API covers airline; the analysis stage is complete.
"""

import ml_collections

from configs import trace_tau2_retail


def get_config() -> ml_collections.ConfigDict:
    config = trace_tau2_retail.get_config()
    config.target.env.domain = "airline"
    config.target.update(analysis_tasks=30, heldout_tasks=20)  # τ²'s airline train / test split sizes
    config.analysis.analyst = "llm"
    config.environments.source = "builtin"  # see above: no airline environments yet
    return config
