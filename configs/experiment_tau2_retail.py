"""TRACE against its baselines on τ²-bench retail with the paper's budget, for a real model on an accelerator.

  python -m launch.experiment --config=configs/experiment_tau2_retail.py --workdir=runs/experiment_tau2_retail \
      --config.trace.model=/path/to/hf_checkpoint

The TRACE run is configs/trace_tau2_retail.py's with 20 GRPO iterations per capability (4 groups of 16 a step),
so its four capabilities spend the paper's 5,120 training episodes in all; every baseline gets what TRACE spent
(`budget = None`): GRPO on τ²'s train split, one adapter on the four capability environments mixed, and GEPA
(200 training tasks per capability as the authors' 200 seeds, the base model reflecting), all evaluated on the
held-out split with τ²'s own evaluator. configs/experiment_tau2_airline.py is the same on airline.
"""

import ml_collections

from configs import experiment_embedded, trace_tau2_retail


def with_trace(trace: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The τ² comparison around the TRACE config `trace` (a configs/trace_tau2_*.py one)."""
    config = experiment_embedded.get_config()
    config.trace = trace
    config.results_file = ""  # the embedded comparison's committed record is not this one's
    config.trace.training.train.steps = 20  # x 64 episodes x 4 capabilities = 5,120
    config.gepa.update(train_tasks=200, val_tasks=20)
    return config


def get_config() -> ml_collections.ConfigDict:
    return with_trace(trace_tau2_retail.get_config())
