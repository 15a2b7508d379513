"""The learner on multi-turn sequences packed by a token budget (tiny Qwen2, rank-4 adapter): packing
changes neither gradients nor metrics, SFT's loss and gradient are the plain masked cross-entropy's, and
rows sampled with a hint (rescored before the update) are learned with the truncated importance weight
or, without a cap, as on-policy rows.

Each sequence is a multi-turn conversation as the rollout engine records it: a shared head, then
turns whose sampled spans are on the loss mask and whose observations are not.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import tree_rel

from trace_jax import lora
from trace_jax.models import decoder
from trace_jax.models.config import ModelConfig
from trace_jax.models.loading import load_params
from trace_jax.rl.batching import LearnerSequence, pack_sequences
from trace_jax.rl.learner import (
    frozen_inputs,
    make_grad_fn,
    make_rescore_fn,
    make_sequence_logprob_fn,
    token_logprobs,
)
from trace_jax.rl.losses import LossConfig

HEAD = 24
_LOGPROBS = jax.jit(token_logprobs, static_argnames="cfg")
LOSS = LossConfig(eps_low=0.2, eps_high=0.28)  # no KL here: test_grpo_learner covers it on equal shapes
HINT_LOSS = dataclasses.replace(LOSS, tis_cap=2.0)
HINTED = (1, 3, 6)  # the sequences marked hinted
# Every sequence in one micro-batch: where packing is not under test, one shape compiles once (a
# shape is a program: each costs seconds to compile here).
ONE_MICRO_BATCH = 1 << 16


@pytest.fixture(scope="module")
def setup(tiny_checkpoints):
    return _setup(tiny_checkpoints, "qwen2")


@pytest.fixture(scope="module")
def gemma_setup(tiny_checkpoints):
    """Gemma 3's local layer has a window of 5, shorter than the shared head and every turn."""
    return _setup(tiny_checkpoints, "gemma3")


def _setup(tiny_checkpoints, family: str):
    path, _ = tiny_checkpoints[family]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    fresh = lora.init_adapters(jax.random.key(0), cfg, lora.LoraSpec(rank=4, alpha=8.0), 1)
    adapters = lora.Adapters(
        {
            t: {"a": w["a"], "b": 0.05 * jax.random.normal(jax.random.key(i), w["b"].shape)}
            for i, (t, w) in enumerate(sorted(fresh.weights.items()))
        },
        fresh.scale,
    )
    rng = np.random.RandomState(0)
    head = rng.randint(1, cfg.vocab_size, HEAD).tolist()
    sequences = []
    for turns in [1, 3, 2, 5, 1, 4, 2, 3, 6]:
        tokens, mask = list(head), [0] * HEAD
        for _ in range(turns):
            observation, sampled = rng.randint(1, cfg.vocab_size, rng.randint(2, 9)), rng.randint(1, 12)
            tokens += observation.tolist() + rng.randint(1, cfg.vocab_size, sampled).tolist()
            mask += [0] * len(observation) + [1] * sampled
        logprobs = np.where(np.asarray(mask) > 0, -rng.rand(len(tokens)) * 3, 0.0).tolist()
        sequences.append(LearnerSequence(tokens, mask, logprobs, float(rng.randn()), 0))
    return cfg, params, adapters, sequences


def _grads(setup, objective, **pack):
    cfg, params, adapters, sequences = setup
    batch = pack_sequences(sequences, **pack)
    fn = make_grad_fn(cfg, LOSS if objective == "grpo" else None, objective=objective)
    return fn(params, adapters.weights, adapters.scale, batch), batch


def _full_logprobs(setup, s, adapter_idx: int = 0) -> np.ndarray:
    """Logprobs of a whole sequence under the adapter (or the base: NO_ADAPTER) (entry t scores token t + 1), one
    row of its own, padded at the end to the longest sequence's width (causal: the padding changes no entry before
    it; one width, one compiled program)."""
    cfg, params, adapters, sequences = setup
    width = max(len(x.tokens) for x in sequences)
    tokens = jnp.asarray([list(s.tokens) + [0] * (width - len(s.tokens))])
    row_adapter = jnp.full(1, adapter_idx, jnp.int32)
    return np.asarray(_LOGPROBS(params, adapters, tokens, row_adapter, cfg=cfg))[0, : len(s.tokens) - 1]


@pytest.mark.parametrize("objective", ["grpo", "sft"])
def test_token_budget_micro_batches_equal_the_full_batch(setup, objective):
    """Packed by 64 tokens (several micro-batches of different widths, the head run once) against one
    micro-batch of every row and against full rows with no shared head."""
    (full, full_metrics), full_batch = _grads(setup, objective, token_budget=ONE_MICRO_BATCH, min_shared_prefix=8)
    (packed, metrics), batch = _grads(setup, objective, token_budget=64, min_shared_prefix=8)
    (plain, _), plain_batch = _grads(setup, objective, token_budget=ONE_MICRO_BATCH, min_shared_prefix=None)
    widths = {mb["tokens"].shape[1] for mb in batch.micro_batches}
    assert len(full_batch.micro_batches) == 1 and len(batch.micro_batches) >= 4 and len(widths) >= 2
    assert batch.prefix.lengths.tolist() == [HEAD] and plain_batch.prefix is None
    err, err_plain = tree_rel(packed, full), tree_rel(plain, full)
    print(
        f"\n[packed learner] {objective}: {len(batch.micro_batches)} micro-batches, widths {sorted(widths)}: "
        f"grad rel diff {err:.2e}; without the shared head {err_plain:.2e}"
    )
    assert err <= 1e-6 and err_plain <= 1e-6
    for k, v in full_metrics.items():
        assert abs(float(metrics[k]) - float(v)) <= 1e-5 * max(1.0, abs(float(v))), k


@pytest.mark.parametrize("which", ["setup", "gemma_setup"])
def test_packed_logprobs_are_those_of_the_full_sequences(request, which):
    setup = request.getfixturevalue(which)
    cfg, params, adapters, sequences = setup
    batch = pack_sequences(sequences, token_budget=64, min_shared_prefix=8)
    found = {}
    for mb in batch.micro_batches:
        logp = np.asarray(
            _LOGPROBS(
                params,
                adapters,
                mb["tokens"],
                mb["adapter_idx"],
                cfg=cfg,
                prefix=batch.prefix,
                prefix_of_row=mb["prefix_of_row"],
            )
        )
        for row in np.flatnonzero(mb["loss_mask"].sum(axis=1)):
            scored = mb["loss_mask"][row] > 0
            found[round(float(mb["advantages"][row]), 5)] = (
                logp[row],
                mb["loss_positions"][row][scored],
                mb["old_logp"][row][scored],
            )
    assert len(found) == len(sequences)
    for s in sequences:
        logp, positions, old = found[round(s.advantage, 5)]
        full = _full_logprobs(setup, s)
        learned = np.flatnonzero(s.loss_mask) - 1  # logprob t scores token t + 1
        assert positions.tolist() == (learned - HEAD).tolist()  # exactly the sampled tokens
        np.testing.assert_allclose(logp[learned - HEAD], full[learned], atol=1e-5)
        np.testing.assert_allclose(old, np.asarray(s.logprobs)[learned + 1], rtol=1e-6)


def test_sft_loss_and_gradient_are_the_plain_masked_cross_entropy(setup):
    cfg, params, adapters, sequences = setup
    (g, metrics), _ = _grads(setup, "sft", token_budget=64, min_shared_prefix=8)
    width = max(len(s.tokens) for s in sequences)
    tokens = np.array([list(s.tokens) + [0] * (width - len(s.tokens)) for s in sequences], np.int32)
    mask = np.array([list(s.loss_mask[1:]) + [0] * (width - len(s.tokens)) for s in sequences], np.float64)
    idx = jnp.zeros(len(sequences), jnp.int32)

    def logits_of(weights):
        row_lora = lora.for_rows(lora.Adapters(weights, adapters.scale), idx)
        return decoder.forward(params, jnp.asarray(tokens[:, :-1]), cfg, row_lora=row_lora)[0]

    logits = np.asarray(logits_of(adapters.weights), np.float64)  # the NumPy reference on the model's logits
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(log_softmax, tokens[:, 1:, None], axis=-1)[..., 0]
    expected = float((nll * mask).sum() / mask.sum())
    assert abs(float(metrics["loss"]) - expected) <= 1e-5 * expected

    def plain_loss(weights):
        logp = jax.nn.log_softmax(logits_of(weights), axis=-1)
        picked = jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:, None]), axis=-1)[..., 0]
        return -jnp.sum(picked * mask) / mask.sum()

    err = tree_rel(g, jax.grad(plain_loss)(adapters.weights))
    print(f"\n[packed learner] SFT loss {float(metrics['loss']):.6f} (NumPy {expected:.6f}), grad rel diff {err:.2e}")
    assert err <= 1e-5


@pytest.mark.parametrize("which", ["setup", "gemma_setup"])
def test_remat_under_scan_gives_the_same_gradients(request, which):
    """`remat=True` runs the layers under `lax.scan`, each rematerialised (the memory plan for long agent
    heads); the gradients are those of the unrolled layers (Gemma 3: its local and global layers scanned alike)."""
    cfg, params, adapters, sequences = request.getfixturevalue(which)
    batch = pack_sequences(sequences, token_budget=ONE_MICRO_BATCH, min_shared_prefix=8)
    plain, _ = make_grad_fn(cfg, LOSS)(params, adapters.weights, adapters.scale, batch)
    scanned, _ = make_grad_fn(cfg, LOSS, remat=True)(params, adapters.weights, adapters.scale, batch)
    err = tree_rel(scanned, plain)
    print(f"\n[packed learner] remat under scan vs unrolled layers ({cfg.family}): grad rel diff {err:.2e}")
    assert err <= (1e-5 if cfg.family == "gemma3" else 1e-6)  # Gemma's scaled embeddings carry rounding further


def test_frozen_bottom_layers_give_the_same_gradients(setup):
    """An adapter from layer 1 on (`LoraSpec.first_layer`): the learner running layer 0 forward only
    (`frozen_layers=1`, the shared head included), or starting from layer 0's outputs computed once
    (`frozen_inputs`), gives the gradients of the whole pass, and layer 0's adapter gradients are
    exactly zero, so it never moves. With the KL term too: its base reference reuses layer 0's outputs."""
    cfg, params, _, sequences = setup
    fresh = lora.init_adapters(jax.random.key(3), cfg, lora.LoraSpec(rank=4, alpha=8.0, first_layer=1), 1)
    on_top = (jnp.arange(cfg.num_layers) >= 1)[None, :, None, None]
    adapters = lora.Adapters(
        {
            t: {"a": w["a"], "b": 0.05 * jax.random.normal(jax.random.key(i), w["b"].shape) * on_top}
            for i, (t, w) in enumerate(sorted(fresh.weights.items()))
        },
        fresh.scale,
    )
    assert all(float(jnp.abs(w["a"][:, 0]).max()) == 0 for w in adapters.weights.values())
    batch = pack_sequences(sequences, token_budget=ONE_MICRO_BATCH, min_shared_prefix=8)
    streams = frozen_inputs(params, cfg, 1, batch)
    assert streams.prefix.hidden.shape == (1, batch.prefix.tokens.shape[1], cfg.hidden_size)
    # GRPO's loss only: the frozen layers sit below the objective, which the SFT tests above cover.
    kl = dataclasses.replace(LOSS, kl_coef=0.5)
    whole, whole_metrics = make_grad_fn(cfg, kl)(params, adapters.weights, adapters.scale, batch)
    frozen_fn = make_grad_fn(cfg, kl, frozen_layers=1, remat=True)
    frozen, _ = frozen_fn(params, adapters.weights, adapters.scale, batch)
    cached, cached_metrics = frozen_fn(params, adapters.weights, adapters.scale, streams)
    assert float(whole_metrics["kl_ref"]) > 1e-6  # the adapters moved the policy off the base: the term counts
    np.testing.assert_allclose(float(cached_metrics["kl_ref"]), float(whole_metrics["kl_ref"]), rtol=1e-5)
    err, err_cached = tree_rel(frozen, whole), tree_rel(cached, whole)
    print(
        f"\n[packed learner] layer 0 frozen vs the whole pass: grad rel diff {err:.2e}; "
        f"from its outputs computed once {err_cached:.2e}"
    )
    assert err <= 1e-6 and err_cached <= 1e-6
    for g in jax.tree.leaves(jax.tree.map(lambda w: w[:, 0], (frozen, cached, whole))):
        assert float(jnp.abs(g).max()) == 0.0
    # The learner does run from the given streams: other streams give other gradients.
    shifted = dataclasses.replace(streams, prefix=streams.prefix.replace(hidden=streams.prefix.hidden + 1.0))
    assert tree_rel(frozen_fn(params, adapters.weights, adapters.scale, shifted)[0], whole) > 1e-3
    with pytest.raises(ValueError, match="frozen_layers > 0"):
        make_grad_fn(cfg, kl)(params, adapters.weights, adapters.scale, streams)


@pytest.fixture(scope="module")
def hinted(setup):
    """The sequences with HINTED marked hinted: their sampler logprobs those of another context, drawn around
    the policy's within +-1.5 nats (so the cap cuts some weights and not others)."""
    rng = np.random.RandomState(1)
    out = []
    for i, s in enumerate(setup[3]):
        if i in HINTED:
            at = np.flatnonzero(s.loss_mask)
            logprobs = np.zeros(len(s.tokens))
            logprobs[at] = _full_logprobs(setup, s)[at - 1] + rng.uniform(-1.5, 1.5, len(at))
            s = dataclasses.replace(s, logprobs=logprobs.tolist(), hinted=True)
        out.append(s)
    return out


def _rescored(setup, sequences, loss=HINT_LOSS):
    cfg, params, adapters, _ = setup
    batch = pack_sequences(sequences, token_budget=ONE_MICRO_BATCH, min_shared_prefix=8)
    rescore = make_rescore_fn(cfg, loss)
    return batch, *rescore(params, adapters.weights, adapters.scale, batch, [s.hinted for s in sequences])


def test_rescoring_gives_hinted_rows_the_policys_logprobs_and_leaves_the_others_bit_for_bit(setup, hinted):
    batch, rescored, metrics = _rescored(setup, hinted)
    weights, seen, decisions = [], set(), []
    for mb, before in zip(rescored.micro_batches, batch.micro_batches):
        assert before["sampler_logp"] is None and mb["sampler_logp"] is not None
        assert all(np.array_equal(mb[k], before[k]) for k in before if k not in ("old_logp", "sampler_logp", "hinted"))
        assert np.array_equal(mb["sampler_logp"], before["old_logp"])  # the sampler's, as packed
        assert before["hinted"] is None and mb["hinted"].tolist() == [
            index >= 0 and hinted[index].hinted for index in mb["sequence"]
        ]  # the rows marked for the loss
        for row, index in enumerate(mb["sequence"]):
            if index < 0:
                continue
            seen.add(int(index))
            s = hinted[index]
            if not s.hinted:  # old = sampler logprobs, as without hints
                assert np.array_equal(mb["old_logp"][row], before["old_logp"][row])
                continue
            learned = np.flatnonzero(s.loss_mask) - 1  # logprob t scores token t + 1
            full = _full_logprobs(setup, s)[learned]
            np.testing.assert_allclose(mb["old_logp"][row][mb["loss_mask"][row] > 0], full, atol=1e-5)
            weights += np.minimum(np.exp(full - np.asarray(s.logprobs)[learned + 1]), HINT_LOSS.tis_cap).tolist()
            if s.advantage > 0:  # the decision: the token the hint raised most, its logprob without the hint
                decisions.append(full[np.argmax(np.asarray(s.logprobs)[learned + 1] - full)])
    assert seen == set(range(len(hinted)))
    assert 0 < len(decisions) < len(HINTED)  # rows at or below their group's mean are left out
    assert abs(metrics["hinted_decision_logp"] - np.mean(decisions)) <= 1e-5
    print(
        f"\n[packed learner] hinted rows rescored: mean IS weight {metrics['hinted_is_weight']:.4f} "
        f"(NumPy {np.mean(weights):.4f}), capped {metrics['hinted_capped']:.2f}"
    )
    assert abs(metrics["hinted_is_weight"] - np.mean(weights)) <= 1e-5
    assert 0.0 < metrics["hinted_capped"] < 1.0


def test_the_loss_with_hints_is_the_clipped_surrogate_with_the_truncated_weight(setup, hinted):
    """The learner's loss on a rescored batch against NumPy (float64, from the model's logits): a hinted
    token's old logprob is the policy's own (ratio 1) and its weight min(exp(old - sampler), cap); an
    unhinted token's old logprob is the sampler's and its weight 1."""
    cfg, params, adapters, _ = setup
    _, batch, _ = _rescored(setup, hinted)
    _, metrics = make_grad_fn(cfg, HINT_LOSS)(params, adapters.weights, adapters.scale, batch)
    width = max(len(s.tokens) for s in hinted)
    tokens = np.array([list(s.tokens) + [0] * (width - len(s.tokens)) for s in hinted], np.int32)
    row_lora = lora.for_rows(adapters, jnp.zeros(len(hinted), jnp.int32))
    logits = np.asarray(decoder.forward(params, jnp.asarray(tokens[:, :-1]), cfg, row_lora=row_lora)[0], np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    policy = np.take_along_axis(log_softmax, tokens[:, 1:, None], axis=-1)[..., 0]
    row_losses, all_weights = [], []
    for b, s in enumerate(hinted):
        learned = np.flatnonzero(s.loss_mask)
        new, sampler = policy[b, learned - 1], np.asarray(s.logprobs, np.float64)[learned]
        old = new if s.hinted else sampler
        weight = np.minimum(np.exp(old - sampler), HINT_LOSS.tis_cap)
        ratio = np.exp(new - old)
        clipped = np.clip(ratio, 1 - HINT_LOSS.eps_low, 1 + HINT_LOSS.eps_high)
        row_losses.append(np.mean(-np.minimum(ratio * s.advantage, clipped * s.advantage) * weight))
        all_weights += weight.tolist()
    expected = float(np.mean(row_losses))
    print(f"\n[packed learner] loss with hints {float(metrics['loss']):.6f} (NumPy {expected:.6f})")
    assert abs(float(metrics["loss"]) - expected) <= 1e-5 * max(1.0, abs(expected))
    assert abs(float(metrics["tis_weight"]) - np.mean(all_weights)) <= 1e-5


def test_on_policy_hinted_rows_have_the_gradient_of_rows_sampled_without_the_hint(setup, hinted):
    """Without a cap a hinted row is learned as if the policy had sampled its tokens without the hint: the
    learner's gradient on the rescored batch equals the gradient of a reference loss written out on the
    unpacked rows (full forward, float32), where a hinted token's old logprob is the policy's own (ratio 1,
    weight 1) and an unhinted token's the sampler's."""
    cfg, params, adapters, _ = setup
    _, batch, metrics = _rescored(setup, hinted, loss=LOSS)
    assert set(metrics) == {"hinted_logp_gain", "hinted_decision_logp"}  # no importance weight without a cap
    grads, _ = make_grad_fn(cfg, LOSS)(params, adapters.weights, adapters.scale, batch)
    width = max(len(s.tokens) for s in hinted)
    tokens = jnp.asarray([list(s.tokens) + [0] * (width - len(s.tokens)) for s in hinted], jnp.int32)
    masks = np.array([list(s.loss_mask[1:]) + [0] * (width - len(s.tokens)) for s in hinted], np.float32)
    sampler = np.array([list(s.logprobs[1:]) + [0.0] * (width - len(s.tokens)) for s in hinted], np.float32)
    on_policy = np.array([s.hinted for s in hinted])
    advantages = jnp.asarray([s.advantage for s in hinted], jnp.float32)

    def reference(weights):
        row_lora = lora.for_rows(lora.Adapters(weights, adapters.scale), jnp.zeros(len(hinted), jnp.int32))
        logits = decoder.forward(params, tokens[:, :-1], cfg, row_lora=row_lora)[0]
        new = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, 1:, None], axis=-1)[..., 0]
        old = jnp.where(on_policy[:, None], jax.lax.stop_gradient(new), sampler)
        ratio = jnp.exp(new - old)
        clipped = jnp.clip(ratio, 1 - LOSS.eps_low, 1 + LOSS.eps_high)
        per_token = -jnp.minimum(ratio * advantages[:, None], clipped * advantages[:, None]) * masks
        return jnp.mean(per_token.sum(axis=1) / masks.sum(axis=1))

    expected = jax.grad(reference)(adapters.weights)
    relative = tree_rel(grads, expected)
    print(f"\n[packed learner] on-policy hinted rows: gradient relative error {relative:.2e}")
    assert relative <= 1e-4


def test_a_sequences_logprob_sums_its_learned_tokens_under_its_own_adapter(setup):
    """`make_sequence_logprob_fn` (the gold turns' likelihood, `rl.gold_likelihood`): the sequences alternately
    under the adapter and the base, packed into several micro-batches behind one shared head per adapter, against
    each sequence's own full forward pass."""
    cfg, params, adapters, sequences = setup
    mixed = [dataclasses.replace(s, adapter_idx=lora.NO_ADAPTER if i % 2 else 0) for i, s in enumerate(sequences)]
    batch = pack_sequences(mixed, token_budget=64, min_shared_prefix=8)
    assert len(batch.micro_batches) >= 2 and batch.prefix.adapter.tolist() == [lora.NO_ADAPTER, 0]
    got = make_sequence_logprob_fn(cfg)(params, adapters.weights, adapters.scale, batch, len(mixed))
    want = [
        _full_logprobs(setup, s, s.adapter_idx)[np.flatnonzero(s.loss_mask) - 1].sum(dtype=np.float64) for s in mixed
    ]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    base = [_full_logprobs(setup, s, lora.NO_ADAPTER)[np.flatnonzero(s.loss_mask) - 1].sum() for s in sequences[:1]]
    assert abs(got[0] - base[0]) > 1e-3  # the adapter changes the first sequence's: it was scored under it
