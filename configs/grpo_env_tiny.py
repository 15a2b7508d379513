"""A few-minute GRPO run on an environment (CI): the tiny agent on the tool_calling capability environment.

  python -m launch.grpo --config=configs/grpo_env_tiny.py --workdir=/tmp/grpo_env_tiny

The agent is `smollm2-135m-tiny-agent` (configs/warmstart_tiny.py, built by the first job that names it in about
two minutes). Each step plays one train ticket sixteen times at temperature 0.7 for one agent turn
(the write call the ticket asks for, after its pre-filled look-ups) at the environment's scaffolded
level -1: half of each group is played with the hint that spells the call out, and learned from
without it. Under the paper's reward a weak agent's unhinted group is all zeros (no gradient); the
hinted half makes the call, so the group differs from the first step. `env.cut_share = 1` keeps the
calls' share of the reward (0.6 for the exact call) for an episode cut at the turn limit, as every
episode here is (by default such an episode earns nothing, as in τ²). One turn, not two (the call,
then the reply), keeps a step cheap in CI; one ticket a step lets the sampler prefill the opening
once and the learner run it once as the shared head. No held-out evaluation (`eval.num_tasks = 0`;
set it to evaluate before and after).
"""

import ml_collections

from configs import grpo_target_embedded


def get_config() -> ml_collections.ConfigDict:
    config = grpo_target_embedded.get_config()
    config.model = "smollm2-135m-tiny-agent"
    config.env = ml_collections.ConfigDict(
        dict(
            name="capability",
            capability="tool_calling",
            seed=0,
            difficulty=-1,
            policy=False,
            split="train",
            cut_share=1.0,
        )
    )
    config.lora.first_layer = 24
    config.rollout.update(
        tasks_per_step=1,
        group_size=16,
        batch_size=16,
        temperature=0.7,
        max_turns=1,
        max_tokens_per_turn=64,
        train_tasks=1,
        hint_share=0.5,
    )
    config.optimizer.lr = 2e-3
    config.train.rollout_budget = None
    config.train.steps = 5
    # 2048-token micro-batches: a step's one-turn episodes fit in one, and the suite's memory stays low
    # (docs/trace_pipeline.md, "Suite time").
    config.train.update(micro_batch_tokens=2048, remat=False)
    config.train.keep_checkpoints = 8
    # No held-out evaluation: it would mostly compile its own programs, and CI tests that path in the TRACE
    # pipeline's training stage (tests/test_trace_pipeline.py).
    config.eval.num_tasks = 0
    config.log_every_s = 0.0
    return config
