"""Learner batches from rollouts: layout, token-budget packing, padding rows, and shared prefixes that change
nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import lora
from trace_jax.models.config import ModelConfig
from trace_jax.models.loading import load_params
from trace_jax.rl.batching import LearnerSequence, micro_batch_rows, pack_sequences
from trace_jax.rl.learner import token_logprobs
from trace_jax.rl.learner_batch import LearnerBatch, SharedPrefix
from trace_jax.sampling import Sampler

_logprobs = jax.jit(token_logprobs, static_argnames=("cfg", "temperature"))


def _rollouts(seed=0, n=5, prefix_len=20):
    rng = np.random.RandomState(seed)
    prefix = rng.randint(1, 100, prefix_len).tolist()
    prompts = [prefix + rng.randint(1, 100, rng.randint(1, 6)).tolist() for _ in range(n)]
    completions = [rng.randint(1, 100, rng.randint(1, 9)).tolist() for _ in range(n)]
    logprobs = [(-rng.rand(len(c))).tolist() for c in completions]
    return prompts, completions, logprobs


def _sequences(prompts, completions, logprobs, advantages=None, adapter_idx=None) -> list[LearnerSequence]:
    n = len(prompts)
    advantages = np.zeros(n) if advantages is None else advantages
    adapter_idx = [0] * n if adapter_idx is None else adapter_idx
    return [
        LearnerSequence.completion(p, c, lp, float(a), i)
        for p, c, lp, a, i in zip(prompts, completions, logprobs, advantages, adapter_idx)
    ]


def _one(batch: LearnerBatch) -> dict:
    """The only micro-batch of a packed batch as a dict of its arrays, with the shared prefix's as prefix_*."""
    (mb,) = batch.micro_batches
    rows = {k: v for k, v in mb.items() if v is not None}
    if batch.prefix is None:
        return rows
    return {**rows, **{f"prefix_{k}": v for k, v in batch.prefix.items() if v is not None}}


def _prefix(batch: dict) -> dict:
    """`token_logprobs`'s shared-prefix arguments for the rows of `_one`."""
    prefix = SharedPrefix(
        tokens=batch["prefix_tokens"], lengths=batch["prefix_lengths"], adapter=batch["prefix_adapter"]
    )
    return {"prefix": jax.tree.map(jnp.asarray, prefix), "prefix_of_row": jnp.asarray(batch["prefix_of_row"])}


@pytest.mark.parametrize("min_shared_prefix", [None, 8])
def test_rows_hold_prompt_tail_then_completion_and_the_mask_covers_the_completion(min_shared_prefix):
    prompts, completions, logprobs = _rollouts()
    packed = pack_sequences(
        _sequences(prompts, completions, logprobs, np.arange(5.0)),
        token_budget=256,
        row_multiple=4,
        min_shared_prefix=min_shared_prefix,
        pad_id=0,
    )
    batch = _one(packed)
    cut = 20 if min_shared_prefix else 0
    width = batch["tokens"].shape[1]
    assert width == (16 if cut else 32) and batch["tokens"].shape[0] == micro_batch_rows(width, 256, 4) == 256 // width
    order = [int(a) for a in batch["advantages"][:5]]  # rows are sorted longest first
    lengths = [len(prompts[i]) + len(completions[i]) for i in order]
    assert lengths == sorted(lengths, reverse=True) and sorted(order) == list(range(5))
    assert batch["loss_mask"][5:].sum() == 0 and batch["advantages"][5:].tolist() == [0] * (len(batch["tokens"]) - 5)
    for row, i in enumerate(order):
        p, c, lp = prompts[i], completions[i], logprobs[i]
        assert batch["tokens"][row, : len(p) - cut + len(c)].tolist() == p[cut:] + c
        learned = batch["loss_mask"][row] > 0
        scored = batch["loss_positions"][row][learned]
        assert batch["tokens"][row, scored + 1].tolist() == c  # logprob j scores token j + 1
        np.testing.assert_allclose(batch["old_logp"][row][learned], lp, rtol=1e-6)
    if min_shared_prefix:  # padded to a multiple of 64, so a step whose prompts share a token more does not recompile
        assert batch["prefix_tokens"].tolist() == [prompts[0][:20] + [0] * 44] and batch["prefix_lengths"].tolist() == [
            20
        ]
    else:
        assert not any(k.startswith("prefix_") for k in batch)


def test_packing_by_token_budget_keeps_every_row_once_in_bucketed_shapes():
    rng = np.random.RandomState(4)
    lengths = [3, 40, 7, 90, 12, 33, 5, 61, 18, 2, 77, 25]
    sequences = [
        LearnerSequence.completion(
            rng.randint(1, 100, 4).tolist(), rng.randint(1, 100, n).tolist(), (-rng.rand(n)).tolist(), float(i)
        )
        for i, n in enumerate(lengths)
    ]
    packed = pack_sequences(sequences, token_budget=256, row_multiple=2, min_shared_prefix=None)
    seen = []
    for mb in packed.micro_batches:
        rows, width = mb["tokens"].shape
        assert rows == micro_batch_rows(width, 256, 2) and rows % 2 == 0  # the shape follows from the width bucket
        assert rows * width <= 256 or rows == 2
        real = mb["loss_mask"].sum(axis=1) > 0
        seen += mb["advantages"][real].astype(int).tolist()
        assert all(4 + lengths[int(a)] <= width for a in mb["advantages"][real])
    assert sorted(seen) == list(range(len(lengths)))
    assert sum(mb["loss_mask"].sum() for mb in packed.micro_batches) == sum(lengths)
    widths = [mb["tokens"].shape[1] for mb in packed.micro_batches]
    assert widths == sorted(widths, reverse=True) and len(packed.micro_batches) > 2


def test_mixed_adapters_get_one_prefix_each_and_logprobs_equal_full_rows(tiny_checkpoints):
    path, _ = tiny_checkpoints["llama"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    fresh = lora.init_adapters(jax.random.key(1), cfg, lora.LoraSpec(rank=4, targets=("q", "v", "down")), 2)
    adapters = lora.Adapters(
        {
            t: {"a": w["a"], "b": 0.1 * jax.random.normal(jax.random.key(i), w["b"].shape)}
            for i, (t, w) in enumerate(sorted(fresh.weights.items()))
        },
        fresh.scale,
    )
    prompts, completions, logprobs = _rollouts(seed=1, n=6)
    adapter_idx = [0, 1, 1, -1, 0, 1]
    batch = _one(
        pack_sequences(
            _sequences(prompts, completions, logprobs, np.arange(6.0), adapter_idx),
            token_budget=96,
            min_shared_prefix=8,
        )
    )  # 6 rows of 16
    order = batch["advantages"][:6].astype(int)  # the row of each sequence, longest first
    adapter_idx = [adapter_idx[i] for i in order]
    prompts, completions = [prompts[i] for i in order], [completions[i] for i in order]
    assert batch["prefix_adapter"].tolist() == [-1, 0, 1]
    assert batch["prefix_adapter"][batch["prefix_of_row"]].tolist() == adapter_idx
    split = np.asarray(
        _logprobs(
            params, adapters, jnp.asarray(batch["tokens"]), jnp.asarray(batch["adapter_idx"]), cfg=cfg, **_prefix(batch)
        )
    )
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))  # full rows, right-padded (causal: exact)
    full_rows = [p + c + [0] * (width - len(p) - len(c)) for p, c in zip(prompts, completions)]
    full = np.asarray(_logprobs(params, adapters, jnp.asarray(full_rows), jnp.asarray(adapter_idx), cfg=cfg))
    for i, (p, c) in enumerate(zip(prompts, completions)):
        scored = batch["loss_positions"][i][batch["loss_mask"][i] > 0]
        np.testing.assert_allclose(split[i, scored], full[i, len(p) - 1 : len(p) + len(c) - 1], atol=1e-5)


def test_mismatched_inputs_are_rejected():
    prompts, completions, logprobs = _rollouts()
    with pytest.raises(ValueError, match="differ in length"):
        LearnerSequence([1, 2, 3], [0, 1, 1], [0.0, -1.0])
    with pytest.raises(ValueError, match="first token"):
        LearnerSequence([1, 2], [1, 1], [0.0, -1.0])
    with pytest.raises(ValueError, match="one logprob"):
        LearnerSequence.completion(prompts[0], completions[0], logprobs[0][:-1])
    with pytest.raises(ValueError, match="no sequence has a loss token"):
        pack_sequences([LearnerSequence([1, 2], [0, 0], [0.0, 0.0])], token_budget=64)


def test_sampler_logprobs_equal_learner_logprobs_of_the_built_batch(tiny_checkpoints):
    """At temperature 0.7 with a shared prefix on both sides, the sampler's completion logprobs are
    the learner's `old_logp` exactly: they agree with a fresh learner pass over the batch."""
    path, _ = tiny_checkpoints["qwen2"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    adapters = lora.init_adapters(jax.random.key(2), cfg, lora.LoraSpec(rank=4), 1)
    adapters = lora.Adapters(
        {
            t: {"a": w["a"], "b": 0.1 * jax.random.normal(jax.random.key(i), w["b"].shape)}
            for i, (t, w) in enumerate(sorted(adapters.weights.items()))
        },
        adapters.scale,
    )
    prompts, _, _ = _rollouts(seed=2, n=4, prefix_len=30)
    sampler = Sampler(cfg, params, adapters=adapters, min_shared_prefix=8)
    outs, _ = sampler.generate(prompts, key=jax.random.key(5), max_new_tokens=10, temperature=0.7, adapter_idx=0)
    batch = _one(
        pack_sequences(
            _sequences(prompts, [o.token_ids for o in outs], [o.logprobs for o in outs]),
            token_budget=64,
            min_shared_prefix=8,
        )
    )  # 4 rows of 16
    assert batch["prefix_lengths"].tolist() == [30]
    learner = np.asarray(
        _logprobs(
            params,
            adapters,
            jnp.asarray(batch["tokens"]),
            jnp.asarray(batch["adapter_idx"]),
            cfg=cfg,
            **_prefix(batch),
            temperature=0.7,
        )
    )
    learner = np.take_along_axis(learner, batch["loss_positions"], axis=1)  # the scored entries
    mask = batch["loss_mask"] > 0
    assert mask.sum() == sum(len(o.token_ids) for o in outs)
    np.testing.assert_allclose(learner[mask], batch["old_logp"][mask], atol=1e-5)
    plain = np.asarray(
        _logprobs(
            params, adapters, jnp.asarray(batch["tokens"]), jnp.asarray(batch["adapter_idx"]), cfg=cfg, **_prefix(batch)
        )
    )
    plain = np.take_along_axis(plain, batch["loss_positions"], axis=1)
    assert np.abs(plain[mask] - batch["old_logp"][mask]).max() > 1e-2  # the temperature matters
