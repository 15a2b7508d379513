"""A few-minute GRPO run on an environment (CI): the tiny agent on the tool_calling capability environment.

  python -m launch.grpo --config=configs/grpo_env_tiny.py --workdir=/tmp/grpo_env_tiny

The agent is `smollm2-135m-tiny-agent` (configs/warmstart_tiny.py, built on first use in about
two minutes). Each step plays one train ticket sixteen times at temperature 0.7 for one agent turn
(the write call the ticket asks for, after its pre-filled look-ups) and scores the episodes with the
environment's multi-level reward (0.2 a well-formed call, 0.5 the right tool, 0.8 the right
arguments; 1.0 needs a final reply, which one turn leaves no room for), so a group differs while the
agent is weak; `env.cut_share = 1` keeps the call levels for an episode cut at the turn limit, as
every episode that makes its call is here (by default such an episode earns nothing, as in τ²).
One turn, not two (the call, then the reply), makes a step about 2.5x cheaper in CI; the reward
rises as much from the first step (docs/agentic_rl.md, "A tiny environment run for CI"). One
ticket a step keeps a step cheap: its episodes open alike, so the sampler prefills the opening once
and the learner runs it once as the shared head. Sixteen episodes at 0.7, not eight at 1.0, are what
made the rise dependable: with eight, a group often never found the right arguments and the
reward stayed flat.
No held-out evaluation (`eval.num_tasks = 0`; set it to evaluate before and after).
Hints are off (`--config.rollout.hint_share=0.25` plays a quarter of each group with the capability's
hint in the system prompt, learned from without it; see configs/grpo_target_embedded.py).
"""

import ml_collections

from configs import grpo_target_embedded


def get_config() -> ml_collections.ConfigDict:
    config = grpo_target_embedded.get_config()
    config.model = "smollm2-135m-tiny-agent"
    config.env = ml_collections.ConfigDict(dict(name="capability", capability="tool_calling", seed=0, difficulty=0,
                                                policy=False, split="train", cut_share=1.0))
    config.lora.first_layer = 24
    config.rollout.update(tasks_per_step=1, group_size=16, batch_size=16, temperature=0.7, max_turns=1,
                          max_tokens_per_turn=64, train_tasks=1)
    config.optimizer.lr = 2e-3
    config.train.rollout_budget = None
    config.train.steps = 5
    # 2048-token micro-batches: a step's one-turn episodes fit in one (two-turn ones took four, and the run
    # peaked at 11.0 GB with them, 16.8 GB with 4096-token ones; docs/trace_pipeline.md, "Suite time").
    config.train.update(micro_batch_tokens=2048, remat=False)
    config.train.keep_checkpoints = 8
    # No held-out evaluation: with 2 tasks before and after it took a fifth of the run, mostly compiling its own
    # programs (CI tests that path in the TRACE pipeline's training stage, tests/test_trace_pipeline.py).
    config.eval.num_tasks = 0
    config.log_every_s = 0.0
    return config
