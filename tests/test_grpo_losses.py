"""GRPO advantages and policy losses against plain NumPy (float64) implementations."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rl.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from trace_jax.rl.losses import AGGREGATIONS, LossConfig, k3_kl, policy_loss

B, T, GROUP = 12, 20, 4
TOL = 1e-6


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- NumPy references (loops, float64, written from the formulas) ----


def np_advantages(name: str, rewards, groups) -> tuple[np.ndarray, np.ndarray, int]:
    adv, keep, dropped = np.zeros(len(rewards)), np.ones(len(rewards), bool), 0
    for g in sorted(set(groups)):
        idx = [i for i, gi in enumerate(groups) if gi == g]
        r = np.array([rewards[i] for i in idx], np.float64)
        if r.max() == r.min():
            dropped += 1
            keep[idx] = False
            continue
        for j, i in enumerate(idx):
            if name == "group_normalized":
                adv[i] = (r[j] - r.mean()) / (np.sqrt(np.mean((r - r.mean()) ** 2)) + 1e-6)
            elif name == "mean_only":
                adv[i] = r[j] - r.mean()
            else:
                adv[i] = r[j] - np.delete(r, j).mean()
    return adv, keep, dropped


def np_loss(new, old, adv, mask, cfg: LossConfig, ref=None, sampler=None, hinted=None):
    """(sum, denom), d(sum)/d(new) token by token, and the same sum over |token losses|."""
    total, scale, denom, grad, n_tokens = 0.0, 0.0, 0.0, np.zeros_like(new), mask.sum()
    for b in range(new.shape[0]):
        tok = np.flatnonzero(mask[b])
        if len(tok) == 0:
            continue
        row, row_abs, row_grad = 0.0, 0.0, np.zeros(new.shape[1])
        hinted_row = hinted is not None and hinted[b] and cfg.hinted_eps_high is not None
        upper = 1 + (cfg.hinted_eps_high if hinted_row else cfg.eps_high)
        a = adv[b] * cfg.negative_advantage_scale if adv[b] < 0 else adv[b]
        for t in tok:
            r = np.exp(new[b, t] - old[b, t])
            unclipped, clipped = r * a, np.clip(r, 1 - cfg.eps_low, upper) * a
            w = 1.0 if cfg.tis_cap is None else min(np.exp(old[b, t] - sampler[b, t]), cfg.tis_cap)
            loss, g = -min(unclipped, clipped) * w, (-r * a * w if unclipped <= clipped else 0.0)
            if cfg.kl_coef:
                d = ref[b, t] - new[b, t]
                loss += cfg.kl_coef * (np.exp(d) - d - 1)
                g += cfg.kl_coef * (1 - np.exp(d))
            if hinted is not None and hinted[b] and adv[b] > 0:  # a hinted success, imitated
                loss, g = loss - cfg.hinted_sft_coef * new[b, t], g - cfg.hinted_sft_coef
            row, row_abs, row_grad[t] = row + loss, row_abs + abs(loss), g
        if cfg.aggregation == "seq_mean_token_mean":
            norm, denom = len(tok), denom + 1
        elif cfg.aggregation == "token_mean":
            norm, denom = 1, n_tokens
        else:
            norm, denom = cfg.max_len, denom + 1
        total, scale, grad[b] = total + row / norm, scale + row_abs / norm, row_grad / norm
    return total, denom, grad, scale


# ---- random batches ----


def make_batch(seed: int, estimator: str = "group_normalized"):
    rng = np.random.RandomState(seed)
    groups = np.repeat(np.arange(B // GROUP), GROUP)
    rewards = rng.binomial(1, 0.5, B).astype(np.float64) + 0.1 * rng.randn(B)
    rewards[groups == 1] = 1.0  # one constant-reward group, dropped
    adv, keep, _ = compute_advantages(estimator, rewards, groups)
    mask = np.zeros((B, T), np.float32)
    for b in range(B):  # ragged: one or two assistant spans per row
        for _ in range(rng.randint(1, 3)):
            start = rng.randint(0, T - 1)
            mask[b, start : start + rng.randint(1, T - start + 1)] = 1
    mask[-1] = 0  # a padding row: counts in no denominator
    old = (-np.abs(rng.randn(B, T)) * 2).astype(np.float32)
    new = (old + 0.3 * rng.randn(B, T)).astype(np.float32)  # ratios on both sides of the clip range
    ref = (old + 0.2 * rng.randn(B, T)).astype(np.float32)
    sampler = (old + 0.3 * rng.randn(B, T)).astype(np.float32)
    hinted = rng.rand(B) < 0.5
    gaining = np.flatnonzero((adv > 0) & (mask.sum(axis=1) > 0))[0]  # a hinted token past the upper clip
    hinted[gaining] = True
    first = np.flatnonzero(mask[gaining])[0]
    new[gaining, first] = old[gaining, first] + 0.5
    return dict(new=new, old=old, adv=adv, mask=mask, ref=ref, sampler=sampler, hinted=hinted, keep=keep)


def jax_loss(cfg: LossConfig, d, sl=slice(None)):
    def value(new):
        s, n, diag = policy_loss(
            new,
            jnp.asarray(d["old"][sl]),
            jnp.asarray(d["adv"][sl]),
            jnp.asarray(d["mask"][sl]),
            cfg,
            ref_logp=jnp.asarray(d["ref"][sl]),
            sampler_logp=jnp.asarray(d["sampler"][sl]),
            hinted=jnp.asarray(d["hinted"][sl]),
        )
        return s, (n, diag)

    (s, (n, diag)), g = jax.value_and_grad(value, has_aux=True)(jnp.asarray(d["new"][sl]))
    return float(s), float(n), np.asarray(g), diag


CONFIGS = {
    "plain": {},
    "kl": dict(kl_coef=0.1),
    "kl_tis": dict(kl_coef=0.05, tis_cap=1.5),
    "hinted_clipped_higher": dict(hinted_eps_high=1.0),
    "hinted_unclipped_above": dict(hinted_eps_high=float("inf")),
    "hinted_imitated": dict(hinted_sft_coef=0.5),
    "failures_weighed_less": dict(negative_advantage_scale=0.25),
}


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_advantages_match_numpy(estimator):
    rng = np.random.RandomState(1)
    groups = np.array(["a", "b", "c", "d", "e"])[rng.randint(0, 5, 40)]
    rewards = rng.rand(40).round(1)
    rewards[groups == "c"] = 0.5  # constant group
    rewards[groups == "e"] = 0.0
    adv, keep, stats = compute_advantages(estimator, rewards, groups)
    ref_adv, ref_keep, dropped = np_advantages(estimator, rewards, list(groups))
    assert adv.dtype == np.float32 and keep.dtype == bool
    assert rel(adv, ref_adv) <= TOL, rel(adv, ref_adv)
    assert (keep == ref_keep).all() and not keep[groups == "c"].any() and dropped == 2
    assert stats == {"groups": 5.0, "dropped_groups": 2.0, "dropped_fraction": 0.4}


def test_rloo_is_scaled_mean_only_and_unknown_name():
    rewards, groups = np.array([1.0, 0.0, 0.0, 2.0, 3.0]), np.array([0, 0, 0, 1, 1])
    rloo, _, _ = compute_advantages("rloo", rewards, groups)
    mean_only, _, _ = compute_advantages("mean_only", rewards, groups)
    np.testing.assert_allclose(rloo, mean_only * np.array([1.5, 1.5, 1.5, 2, 2]), rtol=1e-6)
    with pytest.raises(ValueError, match="group_normalized.*mean_only.*rloo"):
        compute_advantages("grpo", rewards, groups)


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("terms", sorted(CONFIGS))
def test_loss_value_and_gradient_match_numpy(aggregation, estimator, terms):
    cfg = LossConfig(aggregation=aggregation, max_len=T + 4, **CONFIGS[terms])
    d = make_batch(seed=zlib.crc32(f"{aggregation}/{estimator}/{terms}".encode()) % 1000, estimator=estimator)
    assert not d["keep"].all()  # the batch has a dropped (zero-advantage) group
    f64 = {k: v if k == "hinted" else np.asarray(v, np.float64) for k, v in d.items()}
    ref_s, ref_n, ref_g, ref_scale = np_loss(
        f64["new"], f64["old"], f64["adv"], f64["mask"], cfg, f64["ref"], f64["sampler"], d["hinted"]
    )
    # fp32: advantages sum to ~0 within a group, so the loss is a sum of cancelling terms and
    # its fp32 error is relative to the sum of their magnitudes (the conditioning), not to the
    # (small) result; each gradient entry is one product, so it is plainly relative.
    s, n, g, _ = jax_loss(cfg, d)
    assert n == ref_n
    if cfg.hinted_eps_high is not None:  # the batch has hinted tokens past the common clip, which the setting moves
        assert rel(g, jax_loss(dataclasses.replace(cfg, hinted_eps_high=None), d)[2]) > 1e-3
    if cfg.hinted_sft_coef:  # the batch has hinted rows of positive advantage, which the term imitates
        assert rel(g, jax_loss(dataclasses.replace(cfg, hinted_sft_coef=0.0), d)[2]) > 1e-3
    if cfg.negative_advantage_scale != 1.0:  # the batch has rows worse than their group, which the scale moves
        assert rel(g, jax_loss(dataclasses.replace(cfg, negative_advantage_scale=1.0), d)[2]) > 1e-3
    assert abs(s - ref_s) / ref_scale <= TOL, abs(s - ref_s) / ref_scale
    assert rel(g / n, ref_g / ref_n) <= TOL, rel(g / n, ref_g / ref_n)
    # float64: the same function agrees plainly (to rounding), value and gradient.
    with jax.enable_x64(True):
        s64, n64, g64, _ = jax_loss(cfg, f64)
    assert rel(s64 / n64, ref_s / ref_n) <= 1e-12 and rel(g64, ref_g) <= 1e-12
    # The analytic NumPy gradient itself agrees with central differences (float64).
    rng, h = np.random.RandomState(0), 1e-6
    for b, t in zip(*np.nonzero(d["mask"])):
        if rng.rand() > 0.2:
            continue
        plus, minus = f64["new"].copy(), f64["new"].copy()
        plus[b, t] += h
        minus[b, t] -= h
        fd = (
            np_loss(plus, f64["old"], f64["adv"], f64["mask"], cfg, f64["ref"], f64["sampler"], d["hinted"])[0]
            - np_loss(minus, f64["old"], f64["adv"], f64["mask"], cfg, f64["ref"], f64["sampler"], d["hinted"])[0]
        ) / (2 * h)
        assert abs(fd - ref_g[b, t]) <= 1e-6 * max(1.0, abs(ref_g[b, t])), (b, t, fd, ref_g[b, t])


@pytest.mark.parametrize(
    "hinted_eps_high, hinted_gradient", [(None, 0.0), (0.4, 0.0), (1.0, -1.5), (float("inf"), -1.5)]
)
def test_a_hinted_token_gains_past_the_upper_clip_only_where_the_setting_says_and_falls_no_further(
    hinted_eps_high, hinted_gradient
):
    """A positive-advantage hinted token at ratio 1.5 (past 1 + eps_high) keeps its gradient only where
    1 + hinted_eps_high lies above 1.5 (an unhinted one's is 0 whatever the setting); below 1 - eps_low a
    negative-advantage hinted token is clipped as any other."""
    old = np.log(np.full((4, 1), 0.01, np.float32))
    new = old + np.log(np.array([[1.5], [1.5], [0.5], [0.5]], np.float32))  # ratios 1.5, 1.5, 0.5, 0.5
    adv, mask, hinted = (
        np.array([1.0, 1.0, -1.0, -1.0], np.float32),
        np.ones((4, 1), np.float32),
        np.array([1, 0, 1, 0], bool),
    )

    def grad(cfg):
        loss = lambda n: policy_loss(n, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg, hinted=hinted)[0]
        return np.asarray(jax.grad(loss)(jnp.asarray(new)))[:, 0]

    cfg = LossConfig(hinted_eps_high=hinted_eps_high)
    got = grad(cfg)
    np.testing.assert_allclose(got, [hinted_gradient, 0.0, 0.0, 0.0], rtol=1e-6)  # d(-ratio * adv)/d logp = -ratio
    np_grad = np_loss(*(np.asarray(a, np.float64) for a in (new, old, adv, mask)), cfg, hinted=hinted)[2]
    np.testing.assert_allclose(got, np_grad[:, 0], rtol=1e-6)


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_micro_batch_accumulation_is_exact(aggregation):
    cfg = LossConfig(aggregation=aggregation, max_len=T, kl_coef=0.1, tis_cap=2.0)
    d = make_batch(seed=5)
    s, n, _, diag = jax_loss(cfg, d)
    parts = [jax_loss(cfg, d, slice(a, b)) for a, b in [(0, 1), (1, 6), (6, 8), (8, B)]]
    acc_s, acc_n = sum(p[0] for p in parts), sum(p[1] for p in parts)
    assert acc_n == n
    assert rel(acc_s / acc_n, s / n) <= TOL
    for key, (ds, dn) in diag.items():
        acc = sum(float(p[3][key][0]) for p in parts) / sum(float(p[3][key][1]) for p in parts)
        assert rel(acc, float(ds) / float(dn)) <= TOL, key


def test_k3_kl_zero_at_reference_positive_elsewhere():
    rng = np.random.RandomState(2)
    logp = jnp.asarray(-np.abs(rng.randn(4, 8)), jnp.float32)
    assert float(jnp.abs(k3_kl(logp, logp)).max()) == 0.0
    other = logp + jnp.asarray(0.1 * rng.randn(4, 8), jnp.float32)
    assert float(k3_kl(logp, other).min()) > 0.0
    d = make_batch(seed=3)
    d["ref"] = d["new"]
    _, _, _, diag = jax_loss(LossConfig(kl_coef=1.0), d)
    assert float(diag["kl_ref"][0]) == 0.0
    d["ref"] = d["old"]
    _, _, _, diag = jax_loss(LossConfig(kl_coef=1.0), d)
    assert float(diag["kl_ref"][0]) > 0.0


def test_diagnostics_match_numpy():
    d = make_batch(seed=4)
    _, _, _, diag = jax_loss(LossConfig(tis_cap=1.2), d)
    m = d["mask"] > 0
    r = np.exp(d["new"].astype(np.float64) - d["old"])
    adv = np.broadcast_to(d["adv"][:, None], r.shape)
    clipped = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8))
    expected = {
        "clip_fraction": clipped[m].mean(),
        "approx_kl": (r - np.log(r) - 1)[m].mean(),
        "sampler_abs_diff": np.abs(d["old"].astype(np.float64) - d["sampler"])[m].mean(),
        "tis_weight": np.minimum(np.exp(d["old"].astype(np.float64) - d["sampler"]), 1.2)[m].mean(),
    }
    for key, value in expected.items():
        s, n = diag[key]
        assert rel(float(s) / float(n), value) <= 1e-5, (key, float(s) / float(n), value)
    assert 0.0 < expected["clip_fraction"] < 0.5


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(aggregation="sum"), "aggregation"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(tis_cap=0.0), "tis_cap"),
        (dict(hinted_eps_high=-0.5), "hinted_eps_high"),
        (dict(negative_advantage_scale=1.5), "negative_advantage_scale"),
        (dict(max_len=0), "max_len"),
        (dict(aggregation="seq_sum_fixed_len"), "max_len"),
    ],
)
def test_loss_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"LossConfig.{field}"):
        LossConfig(**kwargs)


def test_padding_outside_the_mask_is_ignored():
    cfg = LossConfig(kl_coef=0.1, tis_cap=2.0)
    d = make_batch(seed=7)
    s, n, g, _ = jax_loss(cfg, d)
    for key, junk in (("old", np.nan), ("ref", -np.inf), ("sampler", 1e30)):
        d[key] = np.where(d["mask"] > 0, d[key], junk).astype(np.float32)
    s2, n2, g2, diag = jax_loss(cfg, d)
    assert (s2, n2) == (s, n) and np.array_equal(g2, g)
    assert all(np.isfinite(float(a)) and np.isfinite(float(b)) for a, b in diag.values())


def test_missing_inputs_are_errors():
    d = make_batch(seed=6)
    args = [jnp.asarray(d[k]) for k in ("new", "old", "adv", "mask")]
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(*args, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="sampler_logp"):
        policy_loss(*args, LossConfig(tis_cap=2.0))
    with pytest.raises(ValueError, match="max_len is required"):
        LossConfig(aggregation="seq_sum_fixed_len")
