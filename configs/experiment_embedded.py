"""TRACE against its baselines on the embedded default (CPU): configs/trace_embedded.py's run, then GRPO on
the embedded retail train tickets, one adapter on the calibrated capability environments mixed, and GEPA
with the base model as its reflection LM, each with TRACE's training budget (its GRPO episodes, summed over
capabilities: 8 steps x 4 tickets x 4 per capability), all evaluated on the same 200 held-out tickets.

  python -m launch.experiment --config=configs/experiment_embedded.py --workdir=runs/experiment_embedded \
      [--config.trace_run=runs/trace_embedded]
"""

import ml_collections
from ml_collections import config_dict

from configs import trace_embedded
from trace_jax.baselines.experiment import ARMS
from trace_jax.baselines.gepa import gepa_defaults


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.trace = trace_embedded.get_config()
    config.trace_run = ""  # "" runs the pipeline in <workdir>/trace; else a TRACE run's workdir
    config.budget = config_dict.placeholder(int)  # None: TRACE's own training episodes
    config.arms = ARMS
    config.grpo_target = ml_collections.ConfigDict(dict(split="train"))
    config.gepa = gepa_defaults()
    return config
