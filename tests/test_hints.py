"""Optional hints of capability environments: a share of each GRPO group is played with the capability's hint
in the system prompt, and learned from without it.

A hinted episode differs from its unhinted twin by the hint alone; the learner row of a hinted episode is,
token for token, the unhinted rendering of the same turns (the scripted gold agent, SmolLM2's tokenizer),
with the loss mask on the agent's turns and the sampler's logprobs moved with them. On a tiny random Llama
with SmolLM2's tokenizer, the sampler's logprobs of a hinted row are the hinted context's, and rescoring
gives it the policy's own logprobs on the unhinted one while the unhinted row keeps its own bit for bit.
Bad settings fail at start naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it

from configs import grpo_env_tiny, grpo_target_embedded
from trace_jax import lora
from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs.capability import CAPABILITIES, CapabilityEnvironment
from trace_jax.envs.scripted import GoldAgent, ScriptedUser
from trace_jax.models.embedded import embedded_model_dir
from trace_jax.models.model import load_model
from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.rl.batching import pack_sequences
from trace_jax.rl.environment_rollouts import EnvironmentRollouts, unhinted_sequence, variant_metrics
from trace_jax.rl.learner import make_rescore_fn, token_logprobs
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import _loss_config, train, validate_config
from trace_jax.sampling import Sampler

TIS_CAP = 2.0


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_dir(embedded_model_dir())


def _config(capability: str = "tool_calling", difficulty: int = 0, **rollout):
    """configs/grpo_env_tiny.py with half of each group hinted (and `rollout` changes)."""
    config = grpo_env_tiny.get_config()
    config.env.update(capability=capability, difficulty=difficulty)
    config.rollout.update({"hint_share": 0.5, **rollout})
    return config


@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_a_hinted_episode_differs_from_its_twin_by_the_task_hint_after_the_system_prompt_alone(capability):
    env = CapabilityEnvironment(
        CAPABILITIES[capability], difficulty=CAPABILITIES[capability].max_difficulty, policy=False
    )
    for task in env.tasks("train", 3):
        hint, gold = env.hint_for(task), env.scenario(task).gold_calls
        assert hint.startswith(env.capability.hint) and all(f"call {c['name']} with" in hint for c in gold)
        plain, hinted = env.episode(task), env.episode(task, hint=True)
        opening, hinted_opening = plain.reset(), hinted.reset()
        assert hinted_opening[0]["content"] == opening[0]["content"] + "\n\nHint: " + hint
        assert hinted_opening[1:] == opening[1:] and hinted.tools == plain.tools


def test_a_hint_names_each_call_with_where_its_arguments_are_and_an_exact_hint_spells_them_out():
    capability = CAPABILITIES["tool_calling"]
    env = CapabilityEnvironment(capability, difficulty=0, variant="return", policy=False)
    exact = CapabilityEnvironment(capability, difficulty=-1, variant="return", policy=False)
    for task, exact_task in zip(env.tasks("train", 6), exact.tasks("train", 6)):
        scenario = env.scenario(task)
        to_gift_card = "gift card" in scenario.ticket
        assert (
            f"call return_delivered_order_items with order_id from the ticket, item_ids from the result of "
            f"get_order_details above, payment_method_id from the result of "
            f"{'get_user_details' if to_gift_card else 'get_order_details'} above."
        ) in env.hint_for(task)
        (exact_call,) = exact.scenario(exact_task).gold_calls  # an exact hint pre-fills nothing more here
        assert f"call return_delivered_order_items({json.dumps(exact_call['arguments'])})" in exact.hint_for(exact_task)
    refusal = CapabilityEnvironment(CAPABILITIES["precondition"], difficulty=0, policy=False)
    forbidden = next(t for t in refusal.tasks("train", 20) if t.family != "allowed")
    assert "make no write" in refusal.hint_for(forbidden)
    cancels = CapabilityEnvironment(capability, difficulty=0, variant="cancel", policy=False)
    for task in cancels.tasks("train", 12):  # a reason the ticket words its own way is no value on the page
        reason = cancels.scenario(task).gold_calls[0]["arguments"]["reason"]
        worded = (
            "reason from the ticket"
            if reason in cancels.scenario(task).ticket
            else "reason as the ticket's words mean it (one of the allowed values)"
        )
        assert worded in cancels.hint_for(task)


def _spans(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a loss mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def test_the_hinted_row_is_the_unhinted_rendering_of_the_same_turns(tokenizer, tmp_path):
    """The gold agent plays each task with and without the hint (the same turns): the hinted episode's learner
    row is the unhinted episode's ids and loss mask exactly, and its sampler logprobs (here made up, one value
    per position) are the hinted ones moved to the new positions."""
    rollouts = EnvironmentRollouts(validate_config(_config("multi_step", 1)), tokenizer, 1, tmp_path)
    env = rollouts.env
    engine = RolloutEngine(
        env,
        agent=GoldAgent(),
        user=ScriptedUser(),
        tokenizer=tokenizer,
        config=RolloutConfig(batch_size=4, max_turns=8),
    )
    tasks = env.tasks("train", 3)
    played = engine.run(
        [EpisodeSpec(task, hint=hint) for task in tasks for hint in (True, False)], key=jax.random.key(0)
    )
    for hinted, plain in zip(played[::2], played[1::2]):
        assert hinted.outcome.reward == plain.outcome.reward == 1.0 and hinted.num_turns == plain.num_turns >= 5
        hinted_prompt, prompt = rollouts.first_prompts(hinted.spec.task)
        hint = env.hint_for(hinted.spec.task)
        assert hint in tokenizer.decode(hinted.token_ids[: len(hinted_prompt)])
        made_up = [-(i + 1) * 1e-4 if m else 0.0 for i, m in enumerate(hinted.loss_mask)]
        row = unhinted_sequence(dataclasses.replace(hinted, logprobs=made_up), hinted_prompt, prompt)
        assert row.hinted and list(row.tokens) == plain.token_ids and list(row.loss_mask) == plain.loss_mask
        assert hint not in tokenizer.decode(row.tokens)
        shift = len(hinted_prompt) - len(prompt)
        assert shift == len(hinted.token_ids) - len(plain.token_ids) > 0
        sampled = np.flatnonzero(row.loss_mask)
        assert np.array_equal(np.asarray(row.logprobs)[sampled], np.asarray(made_up)[sampled + shift])
        assert not np.asarray(row.logprobs)[np.asarray(row.loss_mask) == 0].any()
        # The mask covers exactly the agent's turns: each span is one turn's text and its end-of-turn token.
        turns = [m["content"] for m in plain.messages if m["role"] == "assistant"][-plain.num_turns :]
        spans = _spans(row.loss_mask)
        assert [tokenizer.decode(row.tokens[start : end - 1]) for start, end in spans] == turns
    with pytest.raises(ValueError, match="does not open with the hinted first prompt"):
        unhinted_sequence(played[1], *rollouts.first_prompts(played[1].spec.task))  # an unhinted episode


@pytest.fixture(scope="module")
def tiny_smollm2(tiny_chat_model):
    """(model, adapters): the tiny random model with SmolLM2's tokenizer, and a random rank-4 adapter."""
    model = load_model(tiny_chat_model)
    fresh = lora.init_adapters(jax.random.key(0), model.cfg, lora.LoraSpec(rank=4, alpha=8.0), 1)
    adapters = lora.Adapters(
        {
            t: {"a": w["a"], "b": 0.05 * jax.random.normal(jax.random.key(i), w["b"].shape)}
            for i, (t, w) in enumerate(sorted(fresh.weights.items()))
        },
        fresh.scale,
    )
    return model, adapters


def test_sampled_hinted_rows_carry_the_hinted_logprobs_and_rescore_to_the_unhinted_policy(tiny_smollm2, tmp_path):
    """One step of two episodes, the first hinted. Its row opens with the unhinted prompt, as the other's does;
    its sampler logprobs are those of the hinted rendering (a full forward pass reproduces them), not of the
    row's own tokens; rescoring sets its old logprobs to a full forward pass on the row (<= 1e-4) and keeps
    the sampler's as sampler_logp, while the unhinted row keeps old = sampler logprobs bit for bit."""
    model, adapters = tiny_smollm2
    config = _config(group_size=2, batch_size=2, max_turns=1, max_tokens_per_turn=8, temperature=1.0)
    rollouts = EnvironmentRollouts(validate_config(config), model.tokenizer, 1, tmp_path)
    sampler = Sampler(model.cfg, model.params, adapters=adapters, detokenize=model.tokenizer.decode)
    step = rollouts.sample(sampler, 0, jax.random.key(1), 0)
    hinted, plain = step.sequences
    assert hinted.hinted and not plain.hinted and step.metrics["rollout/hinted_share"] == 0.5
    assert {"rollout/hinted_reward", "rollout/unhinted_reward"} <= set(step.metrics)
    hinted_prompt, prompt = rollouts.first_prompts(rollouts.train_tasks[0])
    assert plain.first_learned() == hinted.first_learned() == len(prompt)
    assert list(hinted.tokens[: len(prompt)]) == list(plain.tokens[: len(prompt)]) == prompt

    score = jax.jit(token_logprobs, static_argnames="cfg")
    logp = lambda ids: np.asarray(
        score(model.params, adapters, jnp.asarray([ids]), jnp.zeros(1, jnp.int32), cfg=model.cfg)
    )[0]
    sampled = np.flatnonzero(hinted.loss_mask)
    shift = len(hinted_prompt) - len(prompt)
    sampler_logp = np.asarray(hinted.logprobs, np.float32)[sampled]
    as_sampled = logp(hinted_prompt + list(hinted.tokens[len(prompt) :]))[sampled + shift - 1]
    unhinted = logp(list(hinted.tokens))[sampled - 1]
    gap = np.abs(unhinted - sampler_logp).max()
    print(
        f"\n[hints] {len(sampled)} sampled tokens: |sampler - hinted rendering| "
        f"{np.abs(as_sampled - sampler_logp).max():.2e}, |sampler - unhinted rendering| {gap:.2e}"
    )
    np.testing.assert_allclose(as_sampled, sampler_logp, atol=1e-4)
    assert gap > 1e-2  # the hint changes this policy's logprobs: a row scored with the hint would be told apart

    sequences = [dataclasses.replace(hinted, advantage=1.0), dataclasses.replace(plain, advantage=-1.0)]
    batch = pack_sequences(sequences, token_budget=64, min_shared_prefix=64)
    rescore = make_rescore_fn(model.cfg, LossConfig(tis_cap=TIS_CAP))
    rescored, metrics = rescore(model.params, adapters.weights, adapters.scale, batch, [True, False])
    cut = int(batch.prefix.lengths[0])
    rows = [
        (mb, before, row, index)
        for mb, before in zip(rescored.micro_batches, batch.micro_batches)
        for row, index in enumerate(mb["sequence"])
        if index >= 0
    ]
    assert sorted(index for *_, index in rows) == [0, 1]
    for mb, before, row, index in rows:
        scored = mb["loss_mask"][row] > 0
        assert (mb["loss_positions"][row][scored] + cut + 1).tolist() == np.flatnonzero(
            sequences[index].loss_mask
        ).tolist()
        assert np.array_equal(mb["sampler_logp"][row], before["old_logp"][row])
        if index == 0:
            np.testing.assert_allclose(mb["old_logp"][row][scored], unhinted, atol=1e-4)
            assert np.array_equal(mb["sampler_logp"][row][scored], sampler_logp)
        else:
            assert np.array_equal(mb["old_logp"][row], before["old_logp"][row])
    weights = np.minimum(np.exp(unhinted.astype(np.float64) - sampler_logp), TIS_CAP)
    assert abs(metrics["hinted_is_weight"] - weights.mean()) <= 1e-4


def test_a_grpo_step_with_hints_learns_from_the_hinted_row_and_logs_the_hint_metrics(
    tiny_smollm2, tmp_path, monkeypatch
):
    """One step of the GRPO job (in process, the tiny model on the 8 test devices), its two episodes given
    rewards 1 and 0 so that the group is learned from: the hinted row (the group's first) is rescored before
    the update, imitated (`loss.hinted_sft_coef`: the better of the two), and the hint metrics are logged with
    the step's."""
    model, _ = tiny_smollm2
    config = _config(group_size=2, batch_size=2, max_turns=1, max_tokens_per_turn=8, temperature=1.0)
    config.model, config.lora.first_layer = str(model.path), 0
    config.loss.hinted_sft_coef = 1.0
    config.train.update(steps=1, micro_batch_tokens=64)  # and no held-out evaluation (configs/grpo_env_tiny.py)
    sample = EnvironmentRollouts.sample
    monkeypatch.setattr(
        EnvironmentRollouts,
        "sample",
        lambda self, *args, **kwargs: dataclasses.replace(sample(self, *args, **kwargs), rewards=np.array([1.0, 0.0])),
    )
    assert train(config, tmp_path)["steps"] == 1
    logged = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.pop("step") == 1:
            logged.update(record)
    print(f"\n[hints] one GRPO step: { {k: round(v, 4) for k, v in logged.items() if 'hint' in k or 'tis' in k} }")
    assert logged["rollout/hinted_share"] == 0.5 and {"rollout/hinted_reward", "rollout/unhinted_reward"} <= set(logged)
    assert 0.0 < logged["learner/hinted_is_weight"] <= TIS_CAP and 0.0 <= logged["learner/hinted_capped"] <= 1.0
    assert "learner/hinted_logp_gain" in logged
    assert logged["learner/hinted_sft_nll"] > 0.0  # the mean negative log-likelihood of the imitated row's tokens
    assert logged["learner/tis_weight"] != 1.0 and logged["learner/sampler_abs_diff"] > 1e-2  # the hinted row's


def test_a_mixed_environments_variants_are_logged_apart_with_their_unhinted_reward():
    """A step over two variants logs each one's mean reward and that of its unhinted episodes (what the adapter
    does without help), so a variant learned only under hints shows; one variant alone logs nothing extra."""
    played = lambda family, hint, reward: types.SimpleNamespace(
        spec=types.SimpleNamespace(task=types.SimpleNamespace(family=family), hint=hint),
        outcome=types.SimpleNamespace(reward=reward),
    )
    step = [played("return", True, 1.0), played("return", False, 0.0), played("cancel", False, 1.0)]
    step.append(played("cancel", False, 0.5))
    assert variant_metrics(step, "rollout") == {
        "rollout/cancel/reward": 0.75,
        "rollout/return/reward": 0.5,
        "rollout/return/unhinted_reward": 0.0,
    }
    assert variant_metrics(step[:2], "rollout") == {}


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hint_share=1.5), "config.rollout.hint_share = 1.5 is invalid; it must be a number in [0, 1]"),
        (dict(hint_share=-0.25), "config.rollout.hint_share = -0.25 is invalid; it must be a number in [0, 1]"),
        (dict(hint_share=0.01), "config.rollout.hint_share = 0.01 is invalid: it hints no episode of a group of 16"),
        (dict(hint_share=0.25, tis_cap=0.5), "config.loss.tis_cap = 0.5 is invalid; it must be None (hinted rows"),
        (
            dict(hint_share=0.25, hinted_eps_high=-1.0),
            "config.loss.hinted_eps_high = -1.0 is invalid; it must be None (hinted rows clipped as the others)",
        ),
        (
            dict(hint_share=0.25, hinted_sft_coef=-0.5),
            "config.loss.hinted_sft_coef = -0.5 is invalid; it must be a number >= 0: the weight of the imitation",
        ),
    ],
)
def test_bad_hint_settings_fail_at_start_naming_the_key(changes, message):
    config = grpo_env_tiny.get_config()
    validate_config(config)
    config.rollout.hint_share = changes["hint_share"]
    for key in ("tis_cap", "hinted_eps_high", "hinted_sft_coef"):
        if key in changes:
            config.loss[key] = changes[key]
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_config(config)


def test_a_share_on_an_environment_without_hints_fails_at_start(tokenizer, tmp_path):
    config = grpo_target_embedded.get_config()
    config.env = ml_collections.ConfigDict(dict(name="tau2", domain="retail", split="train"))  # τ²'s own tasks
    config.rollout.hint_share = 0.25
    validate_config(config)  # well-formed; only the environment can tell it offers no hints
    with pytest.raises(
        ValueError,
        match=re.escape(
            "config.rollout.hint_share = 0.25 is invalid here: the environment "
            "of config.env (name = 'tau2') offers no hints"
        ),
    ):
        EnvironmentRollouts(validate_config(config), tokenizer, 4, tmp_path)


def test_the_targets_tickets_offer_hints_naming_each_gold_call_and_its_arguments_sources():
    from trace_jax.envs.embedded_retail import EmbeddedRetail

    env = EmbeddedRetail(families=["return_delivered"])
    for task in env.tasks("train", 3):
        hint, gold = env.hint_for(task), env.retail_task(task).gold.tool_calls
        assert [c["name"] for c in gold][1:] == ["get_order_details", "return_delivered_order_items"]
        assert f"call {gold[0]['name']} with" in hint
        assert (
            "call return_delivered_order_items with order_id from the ticket, item_ids from the result of your "
            "get_order_details call"
        ) in hint
        assert env.episode(task, hint=True).reset()[0]["content"].endswith("\n\nHint: " + hint)


def test_only_a_job_with_hints_weighs_its_tokens():
    """Without hints the loss is today's (no importance weight); with them it is capped at loss.tis_cap."""
    assert _loss_config(validate_config(_config(hint_share=0.0))).tis_cap is None
    assert _loss_config(validate_config(_config())).tis_cap == grpo_target_embedded.get_config().loss.tis_cap == TIS_CAP
