"""TRACE against its baselines on the embedded default (CPU): configs/trace_embedded.py's run, then GRPO on
the embedded retail train tickets (without hints, and with TRACE's hints in TRACE's share of each group), one
adapter on the calibrated capability environments mixed, and GEPA with the base model as its reflection LM,
each with TRACE's training budget (the episodes its GRPO jobs played, re-sampled ones included, summed over
capabilities: 8 steps x 4 tickets x 8 per capability before re-sampling), all evaluated on the same 200
held-out tickets. Oracle routing (per family the best of the base agent and each adapter alone) is chosen on
the 140 train tickets of TRACE's analysis.

  python -m launch.experiment --config=configs/experiment_embedded.py --workdir=runs/experiment_embedded \
      [--config.trace_run=runs/trace_embedded]

A second training seed: the same command into another workdir with --config.trace.training.seed=1 (every GRPO
job's draws change; the base agent's episodes, calibration's and the diagnostics' do not), taking the first run's
held-out base episodes and calibration tries
(--config.trace.target.base_run=<first>/trace/heldout/base
--config.trace.calibration.resume_from=<first>/trace/environments), with the first run's best baseline as its
only arm beside TRACE (as --config.arms="('grpo_target_hinted',)") and its compact record beside the first's
(--config.results_file=docs/results/comparison_embedded_seed1.json).
"""

import ml_collections
from ml_collections import config_dict

from configs import trace_embedded
from trace_jax.baselines.experiment import ARMS
from trace_jax.baselines.gepa import GepaSettings
from trace_jax.settings import defaults


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.trace = trace_embedded.get_config()
    # the committed calibration of the built-in capabilities (launch.calibrate): its tries played with these
    # settings are taken, not played again
    config.trace.calibration.resume_from = "docs/results/calibration_embedded"
    config.trace_run = ""  # "" runs the pipeline in <workdir>/trace; else a TRACE run's workdir
    # the compact comparison, rewritten after every arm (committed as results come; the second seed's beside it)
    config.results_file = "docs/results/comparison_embedded.json"
    config.budget = config_dict.placeholder(int)  # None: TRACE's own training episodes
    config.arms = ARMS
    config.grpo_target = ml_collections.ConfigDict(dict(split="train"))
    # oracle routing's choice per family: on the first num_tasks of TRACE's analysis tasks (None: all of them)
    config.oracle = ml_collections.ConfigDict(dict(num_tasks=config_dict.placeholder(int)))
    config.gepa = defaults(GepaSettings)
    return config
