"""A short GRPO run on an environment: the tiny agent on the tool_calling capability environment.

  python -m launch.grpo --config=configs/grpo_env_tiny.py --workdir=/tmp/grpo_env_tiny

The agent is `smollm2-135m-tiny-agent` (configs/warmstart_tiny.py, built on first use in about
two minutes); each step plays two train tasks eight times at temperature 1 and scores them with
the environment's multi-level reward, so groups differ while the agent is weak. Meant for CI
once a step is cheap enough: on the slower CPU kind a step takes about 5 minutes (sampling,
bound by prefilling the 1.3k-token contexts, about 190 s; learning about 100 s), see
docs/agentic_rl.md.
"""

import ml_collections

from configs import grpo_target_embedded


def get_config() -> ml_collections.ConfigDict:
    config = grpo_target_embedded.get_config()
    config.model = "smollm2-135m-tiny-agent"
    config.env = ml_collections.ConfigDict(dict(name="capability", capability="tool_calling", seed=0, difficulty=0,
                                                policy=False, split="train"))
    config.lora.first_layer = 24
    config.rollout.update(tasks_per_step=2, group_size=8, max_turns=3, max_tokens_per_turn=64)
    config.optimizer.lr = 2e-3
    config.train.rollout_budget = None
    config.train.steps = 4
    config.train.keep_checkpoints = 8
    config.eval.update(num_tasks=8, every=4)
    config.log_every_s = 0.0
    return config
