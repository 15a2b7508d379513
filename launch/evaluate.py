"""Evaluates an agent on an environment's tasks and prints a per-family table.

  python -m launch.evaluate --config=configs/embedded_retail.py --workdir=runs/eval [--agent=model|gold|noop]
      [--config.split=heldout] [--config.num_tasks=50] [--config.trials=4] [--json]

Writes episodes.jsonl, summary.json and table.md to the workdir. With --json it ends
with one JSON line: num_episodes, mean_reward, pass1, pass_k, k and more.
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags
from ml_collections import config_flags

from launch import agents, multihost
from launch.workdir import job_workdir
from trace_jax import distributed
from trace_jax.evaluation import AGENTS, evaluate, validate_config
from trace_jax.workdirs import claimed

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Evaluation config (configs/tau2_*.py, configs/embedded_retail.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for episodes.jsonl, summary.json and table.md.", required=True
)
_AGENT = flags.DEFINE_enum(
    "agent", "model", AGENTS, "model: the (adapted) model; gold: replay gold actions; noop: end at once."
)
_JSON = flags.DEFINE_bool("json", False, "End with one JSON line of the summary.")
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    multihost.start(argv)
    validate_config(_CONFIG.value)  # a bad config fails before an agent is built
    decisive = {**_CONFIG.value.to_dict(), "agent": _AGENT.value}
    workdir = job_workdir(_WORKDIR.value, "evaluation", decisive)
    if _AGENT.value == "model":  # scripted agents need no model
        agents.ensure_config_agents(_CONFIG.value)
    with claimed(workdir, "evaluation", decisive, main=distributed.is_main()):
        summary = evaluate(_CONFIG.value, workdir, agent=_AGENT.value)
    if not distributed.is_main():
        return
    print(pathlib.Path(workdir, "table.md").read_text(encoding="utf-8").rstrip(), flush=True)
    if _JSON.value:
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
