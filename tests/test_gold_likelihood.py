"""The gold turns' likelihood (`rl.gold_likelihood`, `eval.ties = "gold_logp"`): the gold agent's episodes of
held-out tasks, packed once with the frozen layers' streams, scored per task under the base or an adapter.

Against each gold episode's own full forward pass, NumPy's log-softmax at the agent's tokens summed (a tiny
random two-layer model with SmolLM2's chat tokenizer, the adapter on the upper layer only, so the lower layer's
streams are the frozen ones). The tool_calling environment's most scaffolded level: every held-out gold episode
succeeds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it

from trace_jax import lora
from trace_jax.envs.capability import CAPABILITIES, CapabilityEnvironment
from trace_jax.models import decoder
from trace_jax.models.model import load_model
from trace_jax.rl.gold_likelihood import GOLD_MAX_TURNS, GoldLikelihood, gold_trajectories


@pytest.fixture(scope="module")
def setup(tiny_chat_model):
    model = load_model(tiny_chat_model)
    capability = CAPABILITIES["tool_calling"]
    env = CapabilityEnvironment(capability, difficulty=capability.max_difficulty, policy=False)
    tasks = env.tasks("heldout", 3)
    fresh = lora.init_adapters(jax.random.key(0), model.cfg, lora.LoraSpec(rank=4, alpha=8.0, first_layer=1), 1)
    adapters = lora.Adapters(
        {
            t: {"a": w["a"], "b": 0.2 * jax.random.normal(jax.random.key(3), w["b"].shape)}
            for t, w in fresh.weights.items()
        },
        fresh.scale,
    )
    return model, env, tasks, adapters


def test_each_tasks_gold_turns_are_scored_as_their_own_forward_pass_under_the_base_and_an_adapter(setup):
    model, env, tasks, adapters = setup
    gold = GoldLikelihood(
        env, model.tokenizer, tasks, model.params, model.cfg, token_budget=256, frozen_layers=1, min_shared_prefix=8
    )
    played = gold_trajectories(env, model.tokenizer, tasks, GOLD_MAX_TURNS, lora.NO_ADAPTER)
    assert all(t.outcome.success for t in played) and all(sum(t.loss_mask) > 0 for t in played)
    for adapter_idx in (lora.NO_ADAPTER, 0):
        want = []
        for t in played:  # the whole sequence through every layer, projected at the agent's tokens alone
            row_lora = lora.for_rows(adapters, jnp.full(1, adapter_idx, jnp.int32))
            hidden = decoder.forward_hidden(
                model.params, jnp.asarray([t.token_ids[:-1]]), model.cfg, row_lora=row_lora
            )[0]
            learned = np.flatnonzero(t.loss_mask)
            logits = np.asarray(decoder.logits_from_hidden(model.params, hidden[0, learned - 1], model.cfg), np.float64)
            top = logits.max(axis=-1)
            logz = top + np.log(np.exp(logits - top[:, None]).sum(axis=-1))
            want.append(float((logits[np.arange(len(learned)), np.asarray(t.token_ids)[learned]] - logz).sum()))
        got = gold.per_task(model.params, adapters.weights, adapters.scale, adapter_idx)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
        assert gold(model.params, adapters.weights, adapters.scale, adapter_idx) == pytest.approx(
            np.mean(want), abs=1e-3
        )
    base = gold.per_task(model.params, adapters.weights, adapters.scale, lora.NO_ADAPTER)
    adapted = gold.per_task(model.params, adapters.weights, adapters.scale, 0)
    assert np.all(np.abs(adapted - base) > 1e-2)  # the adapter moved every task's score


def test_no_held_out_task_is_refused(setup):
    model, env, _, _ = setup
    with pytest.raises(ValueError, match="no held-out task"):
        GoldLikelihood(env, model.tokenizer, [], model.params, model.cfg, token_budget=256)
