"""The GRPO learner step on the tiny Qwen3 checkpoint with rank-4 adapters."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batches import as_batch
from numerics import tree_rel

from trace_jax import lora
from trace_jax.lora import Adapters, LoraSpec
from trace_jax.models.config import ModelConfig
from trace_jax.models.loading import load_params
from trace_jax.rl.learner import make_grad_fn, make_optimizer, make_train_step, token_logprobs
from trace_jax.rl.learner_batch import LearnerBatch
from trace_jax.rl.losses import LossConfig
from trace_jax.sharding import ShardingPlan, make_mesh

B, T = 8, 12
LOSS = LossConfig(kl_coef=0.1, tis_cap=2.0)


@pytest.fixture(scope="module")
def setup(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    key = jax.random.key(0)
    k_ad, k_b, k_batch = jax.random.split(key, 3)
    fresh = lora.init_adapters(k_ad, cfg, LoraSpec(rank=4, alpha=8.0), 2)  # two adapters trained side by side
    random_b = {
        t: {"a": w["a"], "b": 0.05 * jax.random.normal(jax.random.fold_in(k_b, i), w["b"].shape)}
        for i, (t, w) in enumerate(sorted(fresh.weights.items()))
    }
    adapters = Adapters(random_b, fresh.scale)
    return cfg, params, fresh, adapters, make_batch(k_batch, cfg, params, adapters)


def make_batch(key, cfg, params, adapters):
    """Ragged assistant masks, one padding row, old logprobs a little off the current policy."""
    k_tok, k_len, k_old, k_samp, k_adv = jax.random.split(key, 5)
    tokens = jax.random.randint(k_tok, (B, T), 0, cfg.vocab_size, jnp.int32)
    adapter_idx = jnp.array([0, 1] * (B // 2), jnp.int32)
    start = jax.random.randint(k_len, (B, 1), 0, T // 2)
    steps = jnp.arange(T - 1)[None, :]
    loss_mask = ((steps >= start) & (steps < start + 2 + jnp.arange(B)[:, None] % 5)).astype(jnp.float32)
    loss_mask = loss_mask.at[3].set(0.0)
    current = jax.jit(token_logprobs, static_argnums=4)(params, adapters, tokens, adapter_idx, cfg)
    old_logp = current + 0.2 * jax.random.normal(k_old, current.shape)
    return {
        "tokens": tokens,
        "adapter_idx": adapter_idx,
        "loss_mask": loss_mask,
        "advantages": jax.random.normal(k_adv, (B,)),
        "old_logp": old_logp,
        "sampler_logp": old_logp + 0.1 * jax.random.normal(k_samp, current.shape),
        "dropped_fraction": jnp.float32(0.25),
    }


@functools.cache
def _grads(cfg, loss_cfg, plan=None):
    return make_grad_fn(cfg, loss_cfg, plan=plan)


def grad_fn(cfg, loss_cfg, micro_batches, plan=None):
    """The learner's gradient of a flat test batch (`batches.as_batch`) split into `micro_batches`."""
    grads = _grads(cfg, loss_cfg, plan)
    return lambda params, weights, scale, flat: grads(params, weights, scale, as_batch(flat, micro_batches))


@functools.cache
def train_step(cfg, loss_cfg):
    """(optimizer, step of a flat test batch) with lr 1e-2, so that one update visibly moves the policy."""
    optimizer = make_optimizer(lr=1e-2)
    step = make_train_step(cfg, loss_cfg, optimizer)
    return optimizer, lambda params, weights, opt_state, scale, flat: step(
        params, weights, opt_state, scale, as_batch(flat)
    )


def test_micro_batches_equal_full_batch(setup):
    cfg, params, _, adapters, batch = setup
    full, metrics = grad_fn(cfg, LOSS, 1)(params, adapters.weights, adapters.scale, batch)
    micro, micro_metrics = grad_fn(cfg, LOSS, 4)(params, adapters.weights, adapters.scale, batch)
    err = tree_rel(micro, full)
    print(
        f"\n[learner] 4 micro-batches vs full batch: grad rel diff {err:.2e}; metrics "
        + ", ".join(f"{k}={float(v):.4g}" for k, v in sorted(metrics.items()))
    )
    assert err <= 1e-6
    assert float(metrics["grad_norm"]) > 0 and 0 < float(metrics["clip_fraction"]) < 1
    assert float(metrics["dropped_fraction"]) == 0.25 and float(metrics["sampler_abs_diff"]) > 0
    for k, v in metrics.items():
        assert abs(float(micro_metrics[k]) - float(v)) <= 1e-6 * max(1.0, abs(float(v))), k


def test_updates_per_step_take_one_optimizer_update_per_dealt_mini_batch(setup):
    cfg, params, _, adapters, batch = setup
    optimizer = make_optimizer(lr=1e-2)
    one, two = (make_train_step(cfg, LOSS, optimizer, updates=n) for n in (1, 2))
    whole_rows = as_batch(batch).micro_batches[0]
    rows = [whole_rows.take(slice(i, i + 2)) for i in range(0, B, 2)]
    packed = lambda parts: LearnerBatch(tuple(parts), dropped_fraction=float(batch["dropped_fraction"]))
    copy = lambda: jax.tree.map(jnp.copy, adapters.weights)  # every step donates its weights
    # Two updates: micro-batches 0 and 2, then 1 and 3, each its own mean loss and AdamW step.
    weights, opt_state = copy(), optimizer.init(adapters.weights)
    weights, opt_state, first = one(params, weights, opt_state, adapters.scale, packed(rows[0::2]))
    after_first = jax.tree.map(jnp.copy, weights)
    expected, _, second = one(params, weights, opt_state, adapters.scale, packed(rows[1::2]))
    got, _, metrics = two(params, copy(), optimizer.init(adapters.weights), adapters.scale, packed(rows))
    assert tree_rel(got, expected) <= 1e-6
    assert metrics["updates"] == 2.0 and first["updates"] == second["updates"] == 1.0
    for k in set(metrics) - {"updates"}:
        assert float(metrics[k]) == pytest.approx((float(first[k]) + float(second[k])) / 2, rel=1e-6, abs=1e-9), k
    # ... which is not the one update over the whole batch.
    whole, _, _ = one(params, copy(), optimizer.init(adapters.weights), adapters.scale, packed(rows))
    assert tree_rel(got, whole) > 1e-3
    # PPO's early stop: the second mini-batch, measured after the first update, is past a tiny target and is
    # not applied; a target it stays under changes nothing.
    second_kl = float(second["approx_kl"])
    assert second_kl > 0
    for target, want, applied in ((second_kl / 2, after_first, 1.0), (second_kl * 2, expected, 2.0)):
        stopping = make_train_step(cfg, LOSS, optimizer, updates=2, target_kl=target)
        got, _, metrics = stopping(params, copy(), optimizer.init(adapters.weights), adapters.scale, packed(rows))
        assert tree_rel(got, want) <= 1e-6 and metrics["updates"] == applied
        assert metrics.get("stop_approx_kl", 0.0) == (pytest.approx(second_kl, rel=1e-5) if applied == 1.0 else 0.0)
    with pytest.raises(ValueError, match="updates must be >= 1"):
        make_train_step(cfg, LOSS, optimizer, updates=0)
    with pytest.raises(ValueError, match="target_kl must be None or > 0"):
        make_train_step(cfg, LOSS, optimizer, updates=2, target_kl=0.0)


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["rows", "shared_prefix"])
def test_sharded_gradients_equal_single_device(setup, shared_prefix):
    cfg, params, _, adapters, batch = setup
    if shared_prefix:
        batch = _with_shared_prefixes(cfg, batch)[1]
    full, _ = grad_fn(cfg, LOSS, 1)(params, adapters.weights, adapters.scale, batch)
    plan = ShardingPlan(make_mesh(data=2, fsdp=2, tensor=2))
    put = lambda v: jax.device_put(v, plan.activation_sharding("batch", v.shape))
    split = as_batch(batch, 2)
    split = dataclasses.replace(split, micro_batches=tuple(jax.tree.map(put, mb) for mb in split.micro_batches))
    sharded, _ = _grads(cfg, LOSS, plan)(
        plan.shard_params(params), plan.shard_params(adapters.weights), adapters.scale, split
    )
    err = tree_rel(sharded, full)
    print(
        f"\n[learner] data=2 fsdp=2 tensor=2 vs one device ({'shared prefix' if shared_prefix else 'rows'}): "
        f"grad rel diff {err:.2e}"
    )
    assert err <= 1e-6


def test_kl_zero_at_base_positive_after_update_and_matches_finite_differences(setup):
    cfg, params, fresh, adapters, batch = setup
    fn = grad_fn(cfg, LOSS, 1)
    # A fresh adapter (B = 0) is the base: the reference KL is zero (exactly on the CPU; 3e-14 on an H100,
    # whose kernels sum the policy's and the reference's passes in different orders).
    _, metrics = fn(params, fresh.weights, fresh.scale, batch)
    assert abs(float(metrics["kl_ref"])) <= 1e-12
    # One AdamW step moves the policy off the base.
    optimizer, step = train_step(cfg, LOSS)
    weights = jax.tree.map(jnp.copy, fresh.weights)  # the step donates (consumes) its weights
    weights, _, _ = step(params, weights, optimizer.init(weights), fresh.scale, batch)
    _, metrics = fn(params, weights, fresh.scale, batch)
    assert float(metrics["kl_ref"]) > 0.0
    # The KL term's gradient along a random unit direction in adapter space vs central differences.
    # Zero advantages leave only 0.1 * KL in the loss. In fp32 the loss carries ~1e-7 relative
    # rounding noise (forward pass + sums), so the difference quotient has noise ~1e-7 * |L| / h and
    # truncation O(h^2 |L'''|); with |d| = 1 and h = 1e-2 both are ~1e-4 of the directional
    # derivative here, so 2e-3 relative leaves a 10x margin while a wrong gradient (a missing
    # factor, the k1 estimator, a sign) is off by O(1).
    kl_batch = {**batch, "advantages": jnp.zeros(B)}
    g, metrics = fn(params, adapters.weights, adapters.scale, kl_batch)
    leaves, treedef = jax.tree.flatten(adapters.weights)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    direction = [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    norm = sum(float(jnp.sum(d**2)) for d in direction) ** 0.5
    direction = jax.tree.unflatten(treedef, [d / norm for d in direction])
    h = 1e-2

    def loss_at(s: float) -> float:
        moved = jax.tree.map(lambda w, d: w + s * d, adapters.weights, direction)
        return float(fn(params, moved, adapters.scale, kl_batch)[1]["loss"])

    fd = (loss_at(h) - loss_at(-h)) / (2 * h)
    analytic = sum(float(jnp.sum(a * b)) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(direction)))
    print(f"\n[learner] KL {float(metrics['kl_ref']):.3g}; directional derivative {analytic:.6g} vs FD {fd:.6g}")
    assert float(metrics["loss"]) > 0 and abs(analytic) > 1e-4
    assert abs(fd - analytic) <= 2e-3 * abs(analytic), (fd, analytic)


def _eqn_shapes(jaxpr):
    """Output shapes of every equation, sub-jaxprs (scan, jit, custom_vjp) included."""
    for eqn in jaxpr.eqns:
        yield from (tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqn_shapes(sub)


def test_base_params_are_never_differentiated_nor_changed(setup):
    cfg, params, _, adapters, batch = setup
    optimizer, step = train_step(cfg, LOSS)
    weights = jax.tree.map(jnp.copy, adapters.weights)
    opt_state = optimizer.init(weights)
    # No equation of the step makes a value shaped like a base weight matrix (a base gradient
    # would), while the same check does find them in a gradient w.r.t. the base params.
    matrix_shapes = {tuple(x.shape) for x in jax.tree.leaves(params) if x.ndim == 2}
    step_shapes = set(_eqn_shapes(jax.make_jaxpr(step)(params, weights, opt_state, adapters.scale, batch).jaxpr))
    assert not step_shapes & matrix_shapes
    no_adapter = jnp.full((B,), lora.NO_ADAPTER, jnp.int32)
    base_grad = jax.grad(lambda p: token_logprobs(p, None, batch["tokens"], no_adapter, cfg).sum())
    assert matrix_shapes <= set(_eqn_shapes(jax.make_jaxpr(base_grad)(params).jaxpr))
    # The optimizer state only holds adapter-shaped slots; the base is bitwise unchanged.
    adapter_shapes = {x.shape for x in jax.tree.leaves(weights)}
    assert {x.shape for x in jax.tree.leaves(opt_state) if x.ndim} <= adapter_shapes
    before = jax.tree.map(np.array, params)
    new_weights, _, _ = step(params, weights, opt_state, adapters.scale, batch)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params)))
    assert tree_rel(new_weights, adapters.weights) > 0


def test_bad_batches_are_errors(setup):
    cfg, params, _, adapters, batch = setup
    with pytest.raises(ValueError, match="does not split into 3 micro-batches"):
        grad_fn(cfg, LOSS, 3)(params, adapters.weights, adapters.scale, batch)
    with pytest.raises(ValueError, match=r"MicroBatch.old_logp has shape \(8, 10\), expected \(8, 11\)"):
        grad_fn(cfg, LOSS, 1)(params, adapters.weights, adapters.scale, {**batch, "old_logp": batch["old_logp"][:, 1:]})
    with pytest.raises(ValueError, match="no micro-batches"):
        _grads(cfg, LOSS)(params, adapters.weights, adapters.scale, LearnerBatch(()))


def _with_shared_prefixes(cfg, batch) -> tuple[dict, dict, list[int]]:
    """(full_batch, split_batch, prefix length of each row): the batch's rows continuing one of two
    random prefixes of different lengths and adapters, written out in full and as a shared-prefix batch."""
    rng = np.random.RandomState(3)
    prefixes = [rng.randint(0, cfg.vocab_size, 7), rng.randint(0, cfg.vocab_size, 5)]
    prefix_of_row = np.array([0, 1, 1, 0, 0, 1, 0, 1], np.int32)
    prefix_adapter = np.array([0, 1], np.int32)
    adapter_idx = prefix_adapter[prefix_of_row]
    # The full rows: prefix, then the batch's tokens; padding after the shorter prefix's rows.
    width = 7 + T
    full_tokens = np.zeros((B, width), np.int32)
    per_token = [k for k in ("loss_mask", "old_logp", "sampler_logp") if k in batch]  # [B, T-1] entries
    full = {k: np.zeros((B, width - 1), np.float32) for k in per_token}
    for b, g in enumerate(prefix_of_row):
        p = len(prefixes[g])
        full_tokens[b, :p], full_tokens[b, p : p + T] = prefixes[g], batch["tokens"][b]
        for k in per_token:
            full[k][b, p : p + T - 1] = batch[k][b]
    full_batch = {"tokens": full_tokens, **full, "advantages": batch["advantages"], "adapter_idx": adapter_idx}
    split_batch = {
        "tokens": batch["tokens"],
        **{k: batch[k] for k in per_token},
        "advantages": batch["advantages"],
        "adapter_idx": adapter_idx,
        "prefix_of_row": prefix_of_row,
        "prefix_tokens": np.stack([prefixes[0], np.pad(prefixes[1], (0, 2))]).astype(np.int32),
        "prefix_lengths": np.array([7, 5], np.int32),
        "prefix_adapter": prefix_adapter,
    }
    return full_batch, split_batch, [len(prefixes[g]) for g in prefix_of_row]


def test_shared_prefix_equals_full_sequences(setup):
    """Rows continuing one of two prefixes (run once each) give the same logprobs and gradients
    as the same rows written out in full; the prefixes have different lengths and adapters, and
    the two micro-batches share the prefixes' one forward and backward pass."""
    cfg, params, _, adapters, batch = setup
    full_batch, split_batch, prefix_lengths = _with_shared_prefixes(cfg, batch)
    loss = LossConfig(kl_coef=0.1)
    full_g, full_metrics = grad_fn(cfg, loss, 1)(params, adapters.weights, adapters.scale, full_batch)
    split_g, split_metrics = grad_fn(cfg, loss, 2)(params, adapters.weights, adapters.scale, split_batch)
    err = tree_rel(split_g, full_g)
    print(f"\n[learner] shared prefixes vs full rows: grad rel diff {err:.2e}")
    assert err <= 1e-6
    for k in ("loss", "kl_ref", "clip_fraction", "entropy"):
        assert abs(float(split_metrics[k]) - float(full_metrics[k])) <= 1e-5 * max(1.0, abs(float(full_metrics[k]))), k
    prefix, prefix_of_row = as_batch(split_batch).prefix, split_batch["prefix_of_row"]
    adapter_idx = split_batch["adapter_idx"]
    logprobs = jax.jit(token_logprobs, static_argnames="cfg")
    split_logp = logprobs(
        params, adapters, jnp.asarray(batch["tokens"]), adapter_idx, cfg=cfg, prefix=prefix, prefix_of_row=prefix_of_row
    )
    whole_logp = logprobs(params, adapters, jnp.asarray(full_batch["tokens"]), adapter_idx, cfg=cfg)
    for b, p in enumerate(prefix_lengths):
        assert np.abs(np.asarray(split_logp[b]) - np.asarray(whole_logp[b, p : p + T - 1])).max() <= 1e-5


def test_incomplete_shared_prefix_is_rejected(setup):
    cfg, params, _, adapters, batch = setup
    full_batch, split_batch, _ = _with_shared_prefixes(cfg, batch)
    with pytest.raises(ValueError, match="a shared prefix needs prefix_of_row in every micro-batch"):
        grad_fn(cfg, LOSS, 1)(
            params, adapters.weights, adapters.scale, {k: v for k, v in split_batch.items() if k != "prefix_of_row"}
        )
    with pytest.raises(ValueError, match="a shared prefix needs prefix_of_row"):  # rows of a prefix, and none
        grad_fn(cfg, LOSS, 1)(params, adapters.weights, adapters.scale, {**full_batch, "prefix_of_row": np.zeros(B)})


def test_fused_logprobs_and_entropy_match_the_plain_formulas():
    """The one-softmax custom VJP gives log p(target), the entropy and d log p / d logits of the textbook forms."""
    from trace_jax.rl.learner import _logprobs_and_entropy

    logits = 3.0 * jax.random.normal(jax.random.key(1), (3, 5, 50))
    targets = jax.random.randint(jax.random.key(2), (3, 5), 0, 50)
    weights = jax.random.normal(jax.random.key(3), (3, 5))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    plain_logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    logp, entropy = _logprobs_and_entropy(logits, targets)
    np.testing.assert_allclose(logp, plain_logp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(entropy, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1), rtol=1e-5, atol=1e-6)
    plain = jax.grad(
        lambda x: jnp.sum(
            weights * jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), targets[..., None], axis=-1)[..., 0]
        )
    )(logits)
    fused = jax.grad(lambda x: jnp.sum(weights * _logprobs_and_entropy(x, targets)[0]))(logits)
    np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-6)
