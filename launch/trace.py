"""TRACE end to end: base evaluation, capability analysis, calibrated capability environments, one
GRPO adapter per capability, Select & Adapt routing and the final held-out evaluation.

  python -m launch.trace --config=configs/trace_quick.py --workdir=runs/trace_quick

Each stage writes to the workdir and a rerun skips what is done (a killed stage resumes). Ends
with report.md (tables and plots/*.png) in the workdir, the held-out table, and one JSON line:
base_success, trace_success, capabilities, trained, episodes, routing, oracle, seconds.
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags
from ml_collections import config_flags

from launch import agents, multihost
from launch.workdir import job_workdir
from trace_jax import distributed
from trace_jax.trace.pipeline import Pipeline, validate_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "Pipeline config (configs/trace_*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for every stage's outputs and the report.", required=True)
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    multihost.start(argv)
    validate_config(_CONFIG.value)  # a bad config fails before an agent is built
    workdir = job_workdir(_WORKDIR.value, "trace", _CONFIG.value)
    agents.ensure_config_agents(_CONFIG.value)
    summary = Pipeline(_CONFIG.value, workdir).run()
    if not distributed.is_main():
        return
    report = pathlib.Path(workdir, "report.md").read_text(encoding="utf-8")
    print(report[report.index("## Held-out success per family") :].split("\n![")[0].rstrip(), flush=True)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
