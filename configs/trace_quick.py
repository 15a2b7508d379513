"""TRACE end to end in under half an hour on a 2-core CPU (the README's main command; 28-29 minutes for a
second run on the slower CPU kind, docs/trace_pipeline.md): the pipeline of configs/trace_embedded.py
with small budgets.

  python -m launch.trace --config=configs/trace_quick.py --workdir=runs/trace_quick

The base agent plays 7 train tickets for the analysis and 7 held-out tickets (one per family) in one
batch, each cut at 4 agent turns (every one of these 14 tickets' gold solutions takes 3 or 4; the
agent's return_delivered episodes, failures either way, ran to the 6-turn limit alone in the batch);
one capability is trained: the selected ones are calibrated in coverage order on 4 seeds x 4 samples
with the authors' looser gates (mean reward in [0.2, 0.6], half the groups informative) until one
passes (each try about 5 minutes here: a run whose first capability fails takes longer), then trained for 2 GRPO steps of 2 tickets
x 4 (episodes cut at 3 agent turns, which keep their calls' reward level: `calibration.cut_share = 1`,
as most are cut; no held-out evaluation of the adapter alone) and routed. The numbers are a smoke
run's, not a measurement: see configs/trace_embedded.py for that.
"""

import ml_collections

from configs import trace_embedded


def get_config() -> ml_collections.ConfigDict:
    config = trace_embedded.get_config()
    config.log_every_s = 20.0
    config.target.update(analysis_tasks=7, heldout_tasks=7)
    config.target.rollout.max_turns = 4
    config.environments.max_trained = 1
    config.calibration.update(seeds=4, samples=4, gates="released_code", cut_share=1.0)
    config.training.rollout.update(tasks_per_step=2, group_size=4, max_turns=3, resamples=0)
    config.training.train.steps = 2
    config.training.eval.num_tasks = 0  # the adapter's own held-out evaluation: 458 of the stage's 1,337 s here
    config.final.per_adapter = False
    config.diagnostics.update(samples=4, per_family=2)  # pass@4 on 2 tickets of each targeted family
    return config
