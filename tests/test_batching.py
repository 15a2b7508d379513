"""Learner batches from rollouts: layout, padding rows, and shared prefixes that change nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import lora
from trace_jax.models.config import ModelConfig
from trace_jax.models.loading import load_params
from trace_jax.rl.batching import build_learner_batch
from trace_jax.sampling import Sampler
from trace_jax.rl.learner import PREFIX_KEYS, token_logprobs

_logprobs = jax.jit(token_logprobs, static_argnames=("cfg", "temperature"))


def _rollouts(seed=0, n=5, prefix_len=20):
    rng = np.random.RandomState(seed)
    prefix = rng.randint(1, 100, prefix_len).tolist()
    prompts = [prefix + rng.randint(1, 100, rng.randint(1, 6)).tolist() for _ in range(n)]
    completions = [rng.randint(1, 100, rng.randint(1, 9)).tolist() for _ in range(n)]
    logprobs = [(-rng.rand(len(c))).tolist() for c in completions]
    return prompts, completions, logprobs


@pytest.mark.parametrize("min_shared_prefix", [None, 8])
def test_rows_hold_prompt_tail_then_completion_and_the_mask_covers_the_completion(min_shared_prefix):
    prompts, completions, logprobs = _rollouts()
    batch = build_learner_batch(prompts, completions, logprobs, np.arange(5.0), [0] * 5, num_rows=6,
                                row_multiple=4, min_shared_prefix=min_shared_prefix, pad_id=0)
    cut = 20 if min_shared_prefix else 0
    assert batch["tokens"].shape[0] == 8 and batch["loss_mask"][5:].sum() == 0
    assert batch["advantages"].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        row = batch["tokens"][i]
        assert row[: len(p) - cut + len(c)].tolist() == p[cut:] + c
        scored = np.flatnonzero(batch["loss_mask"][i])
        assert row[scored + 1].tolist() == c  # logprob j scores token j + 1
        np.testing.assert_allclose(batch["old_logp"][i, scored], lp, rtol=1e-6)
    if min_shared_prefix:  # padded to a multiple of 64, so a step whose prompts share a token more does not recompile
        assert batch["prefix_tokens"].tolist() == [prompts[0][:20] + [0] * 44] and batch["prefix_lengths"].tolist() == [20]
    else:
        assert not set(PREFIX_KEYS) & set(batch)


def test_rows_are_never_narrower_than_min_width():
    prompts, completions, logprobs = _rollouts()
    narrow = build_learner_batch(prompts, completions, logprobs, np.ones(5), [0] * 5, min_shared_prefix=8)
    wide = build_learner_batch(prompts, completions, logprobs, np.ones(5), [0] * 5, min_shared_prefix=8,
                               min_width=narrow["tokens"].shape[1] + 1)
    assert narrow["tokens"].shape[1] == 16 and wide["tokens"].shape[1] == 24
    np.testing.assert_array_equal(wide["tokens"][:, :16], narrow["tokens"])
    assert wide["loss_mask"].sum() == narrow["loss_mask"].sum()


def test_mixed_adapters_get_one_prefix_each_and_logprobs_equal_full_rows(tiny_checkpoints):
    path, _ = tiny_checkpoints["llama"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    fresh = lora.init_adapters(jax.random.key(1), cfg, lora.LoraSpec(rank=4, targets=("q", "v", "down")), 2)
    adapters = lora.Adapters({t: {"a": w["a"], "b": 0.1 * jax.random.normal(jax.random.key(i), w["b"].shape)}
                              for i, (t, w) in enumerate(sorted(fresh.weights.items()))}, fresh.scale)
    prompts, completions, logprobs = _rollouts(seed=1, n=6)
    adapter_idx = [0, 1, 1, -1, 0, 1]
    batch = build_learner_batch(prompts, completions, logprobs, np.ones(6), adapter_idx, min_shared_prefix=8)
    assert batch["prefix_adapter"].tolist() == [-1, 0, 1]
    assert batch["prefix_adapter"][batch["prefix_of_row"]].tolist() == adapter_idx
    prefix = {k: jnp.asarray(batch[k]) for k in (*PREFIX_KEYS, "prefix_of_row")}
    split = np.asarray(_logprobs(params, adapters, jnp.asarray(batch["tokens"]), jnp.asarray(batch["adapter_idx"]),
                                 cfg=cfg, prefix=prefix))
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))  # full rows, right-padded (causal: exact)
    full_rows = [p + c + [0] * (width - len(p) - len(c)) for p, c in zip(prompts, completions)]
    full = np.asarray(_logprobs(params, adapters, jnp.asarray(full_rows), jnp.asarray(adapter_idx), cfg=cfg))
    for i, (p, c) in enumerate(zip(prompts, completions)):
        scored = np.flatnonzero(batch["loss_mask"][i])
        np.testing.assert_allclose(split[i, scored], full[i, len(p) - 1 : len(p) + len(c) - 1], atol=1e-5)


def test_mismatched_inputs_are_rejected():
    prompts, completions, logprobs = _rollouts()
    with pytest.raises(ValueError, match="differ in length"):
        build_learner_batch(prompts, completions, logprobs, np.zeros(4), [0] * 5)
    with pytest.raises(ValueError, match="num_rows"):
        build_learner_batch(prompts, completions, logprobs, np.zeros(5), [0] * 5, num_rows=4)
    with pytest.raises(ValueError, match="one logprob per token"):
        build_learner_batch(prompts, completions, [lp[:-1] for lp in logprobs], np.zeros(5), [0] * 5)


def test_sampler_logprobs_equal_learner_logprobs_of_the_built_batch(tiny_checkpoints):
    """At temperature 0.7 with a shared prefix on both sides, the sampler's completion logprobs are
    the learner's `old_logp` exactly: they agree with a fresh learner pass over the batch."""
    path, _ = tiny_checkpoints["qwen2"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    adapters = lora.init_adapters(jax.random.key(2), cfg, lora.LoraSpec(rank=4), 1)
    adapters = lora.Adapters({t: {"a": w["a"], "b": 0.1 * jax.random.normal(jax.random.key(i), w["b"].shape)}
                              for i, (t, w) in enumerate(sorted(adapters.weights.items()))}, adapters.scale)
    prompts, _, _ = _rollouts(seed=2, n=4, prefix_len=30)
    sampler = Sampler(cfg, params, adapters=adapters, min_shared_prefix=8)
    outs, _ = sampler.generate(prompts, key=jax.random.key(5), max_new_tokens=10, temperature=0.7, adapter_idx=0)
    batch = build_learner_batch(prompts, [o.token_ids for o in outs], [o.logprobs for o in outs], np.ones(4),
                                [0] * 4, completion_budget=10, min_shared_prefix=8)
    assert batch["prefix_lengths"].tolist() == [30]
    prefix = {k: jnp.asarray(batch[k]) for k in (*PREFIX_KEYS, "prefix_of_row")}
    learner = np.asarray(_logprobs(params, adapters, jnp.asarray(batch["tokens"]), jnp.asarray(batch["adapter_idx"]),
                                   cfg=cfg, prefix=prefix, temperature=0.7))
    mask = batch["loss_mask"] > 0
    assert mask.sum() == sum(len(o.token_ids) for o in outs)
    np.testing.assert_allclose(learner[mask], batch["old_logp"][mask], atol=1e-5)
    plain = np.asarray(_logprobs(params, adapters, jnp.asarray(batch["tokens"]), jnp.asarray(batch["adapter_idx"]),
                                 cfg=cfg, prefix=prefix))
    assert np.abs(plain[mask] - batch["old_logp"][mask]).max() > 1e-2  # the temperature matters
