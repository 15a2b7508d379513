"""Calibrates built-in capability environments against a pipeline config's base agent (TRACE stage 2's gates).

  python -m launch.calibrate --config=configs/trace_embedded.py --workdir=runs/calibration_embedded \
      [--capabilities=tool_calling,precondition]

Plays each capability's environment with the config's base agent as the pipeline's environments
stage does (`calibration.seeds` x `calibration.samples` episodes at `calibration.temperature`, the
first `calibration.hint_share` of each task's samples hinted, cut as training cuts them), walking the
difficulty down into the scaffolded levels and up to the gates, per family where a capability has
them. Each capability's episodes, each try's groups (groups.json) and calibration.json go to
<workdir>/<capability>/ (a rerun resumes, from the groups alone where the episodes are gone), the table
of every try to <workdir>/calibration.md; the last line is JSON: per capability, calibrated or not and
the environment to train on.
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags
from ml_collections import config_flags

from launch import agents, multihost
from launch.workdir import job_workdir
from trace_jax import distributed
from trace_jax.envs.capability import CAPABILITIES
from trace_jax.trace.calibration import calibrate_builtin, calibration_table
from trace_jax.trace.pipeline import calibration_evaluation, validate_config
from trace_jax.workdirs import claimed

_CONFIG = config_flags.DEFINE_config_file("config", None, "Pipeline config (configs/trace_*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for the episodes, results and table.", required=True)
_CAPABILITIES = flags.DEFINE_list("capabilities", list(CAPABILITIES), "Built-in capability environments.")
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    multihost.start(argv)
    unknown = [name for name in _CAPABILITIES.value if name not in CAPABILITIES]
    if unknown:
        raise app.UsageError(f"--capabilities: no built-in environment for {unknown}; there are {list(CAPABILITIES)}")
    config = _CONFIG.value
    settings = validate_config(config)
    base = calibration_evaluation(config)
    decisive = {"evaluation": base.to_dict(), "calibration": config.calibration.to_dict()}  # what a try plays
    workdir = pathlib.Path(job_workdir(_WORKDIR.value, "calibration", decisive))
    agents.ensure_config_agents(config)
    with claimed(workdir, "calibration", decisive, main=distributed.is_main()):
        results = [calibrate_builtin(name, base, settings.calibration, workdir / name) for name in _CAPABILITIES.value]
    if not distributed.is_main():
        return
    table = calibration_table(results)
    (workdir / "calibration.md").write_text(table + "\n", encoding="utf-8")
    print(table, flush=True)
    print(json.dumps({r["capability"]: {"calibrated": r["calibrated"], "env": r["env"]} for r in results}), flush=True)


if __name__ == "__main__":
    app.run(main)
