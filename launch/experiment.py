"""TRACE against its baselines at equal training-rollout budgets: GRPO on the target, one adapter on every
capability environment mixed, GEPA, and TRACE's own routed, oracle-routed and best-single-adapter results.

  python -m launch.experiment --config=configs/experiment_embedded.py --workdir=runs/experiment_embedded \
      [--config.trace_run=runs/trace_embedded]

Runs (or takes, with `trace_run`) the TRACE pipeline's run, then each arm, every one resumable from the
workdir. Ends with report.md and results.json in the workdir, the table, and one JSON line: success per arm,
the budget, seconds.
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags
from ml_collections import config_flags

from launch import agents, multihost
from launch.workdir import job_workdir
from trace_jax import distributed
from trace_jax.baselines.experiment import Experiment, validate_config

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config (configs/experiment_*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for every arm's outputs and the report.", required=True)
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    multihost.start(argv)
    validate_config(_CONFIG.value)  # a bad config fails before an agent is built
    workdir = job_workdir(_WORKDIR.value, "experiment", _CONFIG.value)
    agents.ensure_config_agents(_CONFIG.value)
    summary = Experiment(_CONFIG.value, workdir).run()
    if not distributed.is_main():
        return
    print(pathlib.Path(workdir, "report.md").read_text(encoding="utf-8").rstrip(), flush=True)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
