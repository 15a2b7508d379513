"""A few-minute TRACE pipeline for CI: every stage and artifact, on the tiny agent with tiny budgets.

  python -m launch.trace --config=configs/trace_tiny.py --workdir=/tmp/trace_tiny

The tiny agent (`smollm2-135m-tiny-agent`, configs/warmstart_tiny.py) plays 4 train and 4
held-out tickets of the embedded environment with short turns; the gates are open (any mean,
any spread), so the selected capability is calibrated, trained for one GRPO step and routed
(the oracle, which needs every adapter evaluated alone, is left to `final.per_adapter`).
Nothing is measured here; the point is that it all runs.
"""

import ml_collections

from configs import trace_embedded


def get_config() -> ml_collections.ConfigDict:
    config = trace_embedded.get_config()
    config.model = "smollm2-135m-tiny-agent"
    config.log_every_s = 0.0
    config.target.update(analysis_tasks=4, heldout_tasks=4)
    config.target.rollout.update(batch_size=8, max_turns=3, max_tokens_per_turn=48)
    config.environments.max_trained = 1
    config.analysis.update(runs=4, min_runs=1, delta=-1.0, coverage=0.0, interval_resamples=100)
    config.calibration.update(seeds=2, samples=2, gates="none", policy=False)
    config.training.rollout.update(
        tasks_per_step=1, group_size=2, batch_size=4, max_turns=2, max_tokens_per_turn=48, resamples=0
    )
    config.training.lora.first_layer = 24
    config.training.train.update(steps=1, micro_batch_tokens=4096, remat=False)
    config.training.eval.update(num_tasks=1, batch_size=2)
    config.diagnostics.update(samples=2, per_family=1)
    config.final.per_adapter = False
    return config
