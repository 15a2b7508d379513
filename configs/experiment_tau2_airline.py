"""TRACE against its baselines on τ²-bench airline with the paper's budget (configs/experiment_tau2_retail.py's
settings around configs/trace_tau2_airline.py), for a real model on an accelerator. Until the authoring API
covers airline, TRACE trains no airline capability (configs/trace_tau2_airline.py), so the budget is set to
the paper's 5,120 and only GRPO on the target runs beside the base agent.

  python -m launch.experiment --config=configs/experiment_tau2_airline.py --workdir=runs/experiment_tau2_airline \
      --config.trace.model=/path/to/hf_checkpoint --config.trace.llm.model=...
"""

import ml_collections

from configs import experiment_tau2_retail, trace_tau2_airline


def get_config() -> ml_collections.ConfigDict:
    config = experiment_tau2_retail.with_trace(trace_tau2_airline.get_config())
    config.budget = 5120
    return config
