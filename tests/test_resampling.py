"""Re-sampling constant groups (the TRACE authors' GRPO): constant groups are replaced by new tasks' until half
the groups vary or the rounds run out, every episode played is counted, and a budget counts them."""

import ml_collections
import numpy as np
import pytest

from trace_jax.rl.batching import LearnerSequence, StepRollouts
from trace_jax.rl.resampling import constant_groups, sample_informative
from trace_jax.rl.trainer import budget_spent

GROUP = 4


def _draws(rewards_by_task: dict[int, list[float]]):
    """A draw whose task t (counted from the step's first) has the given rewards; records which tasks it drew."""
    drawn = []

    def draw(offset, num, attempt):
        first = offset + STEP_TASKS if attempt else 0  # offsets count from the first task after the step's own
        tasks = list(range(first, first + num))
        drawn.append((attempt, tasks))
        rewards = np.array([r for t in tasks for r in rewards_by_task[t]])
        sequences = [LearnerSequence([t, 1], [0, 1], [0.0, -1.0], 0.0, 0) for t in tasks for _ in range(GROUP)]
        return StepRollouts(
            sequences,
            rewards,
            np.repeat(np.arange(num), GROUP),
            {"rollout/reward": rewards.mean()},
            [{"task": t} for t in tasks for _ in range(GROUP)],
        )

    return draw, drawn


STEP_TASKS = 4
VARIES, ZEROS = [0.0, 1.0, 0.0, 0.0], [0.0] * GROUP


def test_constant_groups_are_replaced_by_the_next_tasks_until_half_vary():
    # the step's tasks 0-3: one varies; then 4-6 all constant; then 7 and 9 vary
    draw, drawn = _draws(
        {
            0: VARIES,
            1: ZEROS,
            2: ZEROS,
            3: [1.0] * GROUP,
            4: ZEROS,
            5: ZEROS,
            6: [0.2] * GROUP,
            7: VARIES,
            8: ZEROS,
            9: VARIES,
        }
    )
    rollouts, used, played = sample_informative(draw, STEP_TASKS, resamples=3, min_informative=0.5)
    assert drawn == [(0, [0, 1, 2, 3]), (1, [4, 5, 6]), (2, [7, 8, 9])]  # 1 of 4 varies, 1 of 4, then 3 of 4
    assert (used, played) == (10, 10 * GROUP) and len(rollouts.records) == played  # every episode counted
    assert [s.tokens[0] for s in rollouts.sequences[::GROUP]] == [0, 7, 8, 9]  # the batch: four groups
    assert constant_groups(rollouts.rewards, rollouts.group_ids).tolist() == [False, False, True, False]
    assert rollouts.metrics["rollout/reward"] == pytest.approx(np.mean(VARIES + ZEROS * 2 + [1.0] * GROUP))
    assert (
        rollouts.metrics["rollout/episodes"],
        rollouts.metrics["rollout/resampled_groups"],
        rollouts.metrics["rollout/informative_groups"],
    ) == (40.0, 6.0, 0.75)


def test_re_sampling_stops_after_its_rounds_and_is_off_by_default():
    draw, drawn = _draws({t: ZEROS for t in range(40)})
    rollouts, used, played = sample_informative(draw, STEP_TASKS, resamples=3, min_informative=0.5)
    assert [a for a, _ in drawn] == [0, 1, 2, 3] and (used, played) == (16, 16 * GROUP)
    draw, drawn = _draws({t: ZEROS for t in range(40)})
    assert sample_informative(draw, STEP_TASKS, resamples=0, min_informative=0.5)[1:] == (4, 4 * GROUP)


def test_a_budget_counts_the_re_sampled_episodes():
    config = ml_collections.ConfigDict({"train": {"rollout_budget": 64, "steps": None}})
    assert not budget_spent(config, 63) and budget_spent(config, 64)
    config.train.update(rollout_budget=None, steps=4)
    assert not budget_spent(config, 10_000)


def test_a_grpo_run_that_re_samples_stops_when_its_episodes_reach_the_budget_and_resumes_there(
    tiny_chat_model, tmp_path, monkeypatch
):
    """The GRPO job in process (the tiny model): every group scores 0, so each step re-samples twice (three groups
    of 2 played); a budget of 8 episodes, 4 steps as planned, is spent after 2 steps (12 episodes), and a rerun on
    the workdir plays nothing more."""
    import dataclasses

    from configs import grpo_env_tiny
    from trace_jax.rl.environment_rollouts import EnvironmentRollouts
    from trace_jax.rl.trainer import train

    config = grpo_env_tiny.get_config()
    config.model, config.lora.first_layer = str(tiny_chat_model), 0
    config.rollout.update(group_size=2, batch_size=2, max_turns=1, max_tokens_per_turn=8, resamples=2)
    config.train.update(steps=None, rollout_budget=8, micro_batch_tokens=64)
    sample = EnvironmentRollouts.sample
    played = []

    def constant(self, *args, **kwargs):
        rollouts = sample(self, *args, **kwargs)
        played.append(len(rollouts.rewards))
        return dataclasses.replace(rollouts, rewards=np.zeros(len(rollouts.rewards)))

    monkeypatch.setattr(EnvironmentRollouts, "sample", constant)
    summary = train(config, tmp_path)
    assert (summary["steps"], summary["rollouts"]) == (2, 12) and played == [2] * 6
    again = train(config, tmp_path)
    assert {k: again[k] for k in ("steps", "rollouts")} == {"steps": 2, "rollouts": 12} and played == [2] * 6
