"""Trains one LoRA adapter with GRPO on a single-turn verifiable task (`config.task`) or on an environment's
multi-turn episodes (`config.env`).

  python -m launch.grpo --config=configs/grpo_embedded.py --workdir=/tmp/grpo [--config.train.steps=40]
  python -m launch.grpo --config=configs/grpo_target_embedded.py --workdir=/tmp/grpo_target

Logs progress with rate and ETA, writes TensorBoard metrics and checkpoints to the
workdir (rerunning with the same workdir resumes), and ends by printing one JSON line:
base_reward, final_reward (held-out, unless `eval.num_tasks` is 0), steps, rollouts, seconds.
"""

from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from launch import agents, multihost
from launch.workdir import job_workdir
from trace_jax import distributed
from trace_jax.rl.trainer import train, validate_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "Job config file (configs/grpo_*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the summary.", required=True)
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    multihost.start(argv)
    validate_config(_CONFIG.value)  # a bad config fails before an agent is built
    workdir = job_workdir(_WORKDIR.value, "grpo", _CONFIG.value)
    agents.ensure_config_agents(_CONFIG.value)
    summary = train(_CONFIG.value, workdir)
    if distributed.is_main():
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
