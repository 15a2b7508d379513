"""The rollout engine with scripted agents on the embedded retail environment (τ²'s real tools and evaluator).

The gold agent replays each task's gold calls and states its facts through the engine's
parsing, tool execution, episode ends and scoring: every task scores 1. The noop agent
ends at once and scores 0. A model agent's sampled episodes do not depend on the batch or order
they are played in (each episode has its own random streams).
"""

from __future__ import annotations

import collections

import jax
import pytest
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it

from trace_jax.agent.rollout import (
    MODEL,
    EpisodeSpec,
    RolloutConfig,
    RolloutEngine,
    rollout_profile,
    session_rows,
)
from trace_jax.envs import base
from trace_jax.envs.capability import CAPABILITIES, CapabilityEnvironment
from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.envs.scripted import GoldAgent, NoopAgent, StoppingUser
from trace_jax.models.model import load_model
from trace_jax.sampling import Sampler


@pytest.fixture(scope="module")
def env():
    return EmbeddedRetail(seed=0)


def _run(env, agent, tasks):
    engine = RolloutEngine(env, agent=agent, user=StoppingUser(), config=RolloutConfig(batch_size=4))
    return engine.run([EpisodeSpec(task) for task in tasks], key=jax.random.key(0))


def test_gold_agent_scores_one_on_every_task_through_the_engine(env):
    tasks = env.tasks("heldout", 12)
    trajectories = _run(env, GoldAgent(), tasks)
    assert [t.spec.task for t in trajectories] == tasks  # results come back in the specs' order
    for trajectory in trajectories:
        assert trajectory.end_reason == base.END_AGENT_STOP
        assert trajectory.outcome.reward == 1.0, trajectory.record()
        calls = [m for m in trajectory.messages if m["role"] == "tool"]
        assert len(calls) == len(env.episode(trajectory.spec.task).gold().tool_calls)
        assert not any(m["content"].startswith("Error") for m in calls)
    assert len({t.spec.task.family for t in trajectories}) >= 3


def test_noop_agent_ends_at_once_and_scores_zero(env):
    trajectories = _run(env, NoopAgent(), env.tasks("heldout", 6))
    assert all(t.num_turns == 1 and t.end_reason == base.END_AGENT_STOP for t in trajectories)
    assert all(t.outcome.reward == 0.0 for t in trajectories)


def test_max_turns_ends_an_episode_with_its_reason(env):
    engine = RolloutEngine(env, agent=GoldAgent(), user=StoppingUser(), config=RolloutConfig(max_turns=1))
    long_tasks = [t for t in env.tasks("heldout", 40) if len(env.episode(t).gold().tool_calls) >= 2][:2]
    for trajectory in engine.run([EpisodeSpec(task) for task in long_tasks], key=jax.random.key(0)):
        assert trajectory.end_reason == base.END_MAX_TURNS and trajectory.num_turns == 1
        assert trajectory.outcome.reward == 0.0


def test_the_profile_splits_a_run_into_prefill_decode_and_host():
    stats = collections.Counter(
        run_s=10.0,
        prefill_s=4.0,
        decode_s=5.0,
        decode_steps=20,
        decode_tokens=50,
        prefix_prefills=1,
        prefix_tokens=1200,
        prefill_tokens=300,
        prefill_positions=sum(range(1200)) + sum(range(1500, 1800)),
    )
    profile = rollout_profile(stats)
    assert (profile["prefill_s"], profile["decode_s"], profile["host_s"]) == (4.0, 5.0, 1.0)
    assert profile["rows_per_decode_step"] == 2.5 and profile["s_per_decode_step"] == 0.25
    assert (profile["prefix_prefills"], profile["prefix_tokens"], profile["prefill_calls"]) == (1, 1200, 0)
    assert profile["prefill_position"] == (sum(range(1200)) + sum(range(1500, 1800))) / 1500  # per prefilled token


def test_a_run_whose_episodes_all_start_at_once_takes_only_the_rows_they_use():
    assert [session_rows(used, 16, False) for used in (1, 2, 3, 7, 8, 9, 14, 16)] == [1, 2, 4, 8, 8, 16, 16, 16]
    assert session_rows(5, 6, False) == 6  # never more than the batch
    # Episodes still to start need every row (a solo episode takes one of the two rows an episode may need).
    assert session_rows(1, 2, True) == 2 and session_rows(15, 16, True) == 16


def test_sampled_episodes_are_the_same_in_any_batch_or_order(env, tiny_chat_model):
    """Four episodes (two tasks x two trials) at temperature 1 on the tiny random model: played together in one
    batch, and in reverse order two rows at a time, each job's episode is token for token the same, so a run
    can be split across processes (each playing its share) without changing what is played."""
    model = load_model(tiny_chat_model)
    sampler = Sampler(model.cfg, model.params, detokenize=model.tokenizer.decode)
    specs = [EpisodeSpec(task, trial) for task in env.tasks("heldout", 2) for trial in range(2)]

    def play(batch_size, order):
        config = RolloutConfig(batch_size=batch_size, max_turns=2, max_tokens_per_turn=12, temperature=1.0)
        engine = RolloutEngine(
            env, agent=MODEL, user=StoppingUser(), sampler=sampler, tokenizer=model.tokenizer, config=config
        )
        played = engine.run([specs[i] for i in order], key=jax.random.key(5))
        return {(t.spec.task.task_id, t.spec.trial): t.token_ids for t in played}

    together = play(4, [0, 1, 2, 3])
    assert play(2, [3, 2, 1, 0]) == together
    assert len({tuple(ids) for ids in together.values()}) == 4  # trials of one task sample differently


def test_an_opened_turn_is_fed_and_recorded_as_the_agents_own(tiny_chat_model):
    """tool_calling's returns at their "opened_call" level (-2) on the tiny random model: a hinted episode's first
    turn is the return's opening (`<tool_call>` and the tool name) followed by what the model sampled, and its
    token ids hold that opening right after the first prompt, on the loss mask with sampler logprob 0; an
    unhinted episode of the same task opens nothing."""
    env = CapabilityEnvironment(CAPABILITIES["tool_calling"], difficulty=-2, variant="return", policy=False)
    model = load_model(tiny_chat_model)
    sampler = Sampler(model.cfg, model.params, detokenize=model.tokenizer.decode)
    config = RolloutConfig(batch_size=2, max_turns=1, max_tokens_per_turn=6, temperature=1.0)
    engine = RolloutEngine(env, agent=MODEL, sampler=sampler, tokenizer=model.tokenizer, config=config)
    task = env.tasks("train", 1)[0]
    hinted, plain = engine.run([EpisodeSpec(task, 0, hint=True), EpisodeSpec(task, 1)], key=jax.random.key(0))
    opening = env.episode(task, hint=True).opening
    forced = model.tokenizer.encode(opening)
    assert opening.endswith("return_delivered_order_items") and forced
    start = hinted.loss_mask.index(1)
    assert hinted.token_ids[start : start + len(forced)] == forced
    assert hinted.loss_mask[start : start + len(forced)] == [1] * len(forced)
    assert hinted.logprobs[start : start + len(forced)] == [0.0] * len(forced)
    assert all(p < 0 for p in hinted.logprobs[start + len(forced) :] if p)  # then sampled, at temperature 1
    assert hinted.generated_tokens == len(hinted.token_ids) - start - len(forced)
    turn = [m for m in hinted.messages if m["role"] == "assistant"][-1]  # after the pre-filled look-ups
    assert turn["content"].startswith(opening) and turn["content"] != opening
    first = plain.loss_mask.index(1)
    assert plain.token_ids[first : first + len(forced)] != forced
