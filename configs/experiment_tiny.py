"""The comparison at CI size: configs/trace_tiny.py's run (one GRPO step per capability, so a budget of a
few episodes) and every arm on the tiny agent, GEPA reflecting with the same model. Nothing is measured here;
the point is that every arm runs, counts its rollouts and is evaluated on the held-out tickets.

  python -m launch.experiment --config=configs/experiment_tiny.py --workdir=/tmp/experiment_tiny
"""

import ml_collections

from configs import experiment_embedded, trace_tiny


def get_config() -> ml_collections.ConfigDict:
    config = experiment_embedded.get_config()
    config.trace = trace_tiny.get_config()
    config.results_file = ""  # nothing committed from CI's run
    config.gepa.update(train_tasks=2, val_tasks=2, minibatch_size=2, reflection_max_tokens=24)
    return config
