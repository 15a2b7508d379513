"""TRACE against its baselines on τ²-bench airline with the paper's budget (configs/experiment_tau2_retail.py's
settings around configs/trace_tau2_airline.py: LLM-written airline capability environments), for a real model
on an accelerator.

  python -m launch.experiment --config=configs/experiment_tau2_airline.py --workdir=runs/experiment_tau2_airline \
      --config.trace.model=/path/to/hf_checkpoint --config.trace.llm.model=...
"""

import ml_collections

from configs import experiment_tau2_retail, trace_tau2_airline


def get_config() -> ml_collections.ConfigDict:
    return experiment_tau2_retail.with_trace(trace_tau2_airline.get_config())
