"""Trains one LoRA adapter by behaviour cloning of an environment's gold agent (SFT on its trajectories).

  python -m launch.sft --config=configs/warmstart_embedded.py --workdir=/tmp/sft [--config.train.steps=40]

Logs progress with rate and ETA, writes TensorBoard metrics and checkpoints to the
workdir (rerunning with the same workdir resumes), exports the adapter (PEFT) to
<workdir>/adapter (and the merged model to <workdir>/merged with export.merged), and ends
by printing one JSON line: steps, trajectories, final_loss, seconds.
"""

from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from launch import agents, multihost
from launch.workdir import job_workdir
from trace_jax import distributed
from trace_jax.rl.sft import train, validate_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "Job config file (configs/warmstart_*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, metrics, the adapter and the summary.", required=True
)
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    multihost.start(argv)
    validate_config(_CONFIG.value)  # a bad config fails before an agent is built
    workdir = job_workdir(_WORKDIR.value, "sft", _CONFIG.value)
    agents.ensure_config_agents(_CONFIG.value)
    summary = train(_CONFIG.value, workdir)
    if distributed.is_main():
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
