"""PPO-clipped policy loss with registered aggregation modes, k3 KL and truncated IS; the SFT loss.

Every loss returns (sum, denominator): summing both over micro-batches and dividing
once at the end gives exactly the full-batch value, whatever the split. Rows whose
mask is all zero (padding rows) are not trajectories and count in no denominator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

SumDenom = tuple[jax.Array, jax.Array]
Aggregation = Callable[[jax.Array, jax.Array, "int | None"], SumDenom]


def _num_rows(mask: jax.Array) -> jax.Array:
    """How many rows have at least one loss token."""
    return jnp.sum(jnp.any(mask > 0, axis=-1).astype(mask.dtype))


def seq_mean_token_mean(values: jax.Array, mask: jax.Array, max_len: int | None) -> SumDenom:
    """GRPO (the paper's): token mean within each trajectory, then mean over trajectories."""
    del max_len
    tokens = jnp.sum(mask, axis=-1)
    row_means = jnp.sum(values * mask, axis=-1) / jnp.maximum(tokens, 1.0)
    return jnp.sum(row_means), _num_rows(mask)


def token_mean(values: jax.Array, mask: jax.Array, max_len: int | None) -> SumDenom:
    """DAPO: every token of the batch weighs the same."""
    del max_len
    return jnp.sum(values * mask), jnp.sum(mask)


def seq_sum_fixed_len(values: jax.Array, mask: jax.Array, max_len: int | None) -> SumDenom:
    """Dr.GRPO: each trajectory's token sum over a fixed length, then mean over trajectories."""
    return jnp.sum(values * mask) / max_len, _num_rows(mask)


AGGREGATIONS: dict[str, Aggregation] = {
    "seq_mean_token_mean": seq_mean_token_mean,
    "token_mean": token_mean,
    "seq_sum_fixed_len": seq_sum_fixed_len,
}


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings. Ratios are clipped to [1 - eps_low, 1 + eps_high]; `kl_coef` weighs
    a k3 KL to the reference; `tis_cap` turns on truncated importance sampling against the
    sampler's logprobs; `max_len` is Dr.GRPO's fixed length (required by seq_sum_fixed_len).

    `hinted_eps_high` sets the upper clip of a hinted row's tokens (rows sampled under a hint they are learned
    without) apart: 1 + hinted_eps_high (None: as every row, 1 + eps_high; `inf`: not clipped above). The clip
    keeps the policy near the one that sampled a token; a hinted token was sampled by the hinted policy, and the
    tokens only the hint made likely (a tool the agent never calls) gain at most a factor 1 + eps_high a step
    under the common clip. Off-policy guidance is learned with a looser bound, as in LUFFY (Yan et al., 2025);
    with none, the gradient of a hinted token grows with its ratio, so a step's updates all go to the hinted
    calls and the policy moves far from the one that sampled. The lower clip stays: a hinted failure is pushed
    down as any other row.

    `hinted_sft_coef` adds that weight times the negative log-likelihood of the tokens of each hinted row whose
    advantage is positive (a hinted episode better than its group), under the unhinted context: the hinted
    successes are imitated as a warm start's SFT imitates its demonstrations. The clipped surrogate stops
    raising a hinted token once its ratio passes the clip, whatever it still lacks; the imitation term does not,
    so a tool the agent gives almost no mass after its look-ups can become the one it calls unhinted.

    `negative_advantage_scale` multiplies every advantage below zero (1: GRPO's surrogate; 0: only the rows better
    than their group are learned, as rejection-sampling fine-tuning learns its kept samples; between: failures
    pushed down less than successes are pulled up). The negative gradient spreads the mass it takes from a
    failure's tokens over every other token, the successes' and those no row showed alike; a smaller scale keeps
    the update on what the group did well."""

    aggregation: str = "seq_mean_token_mean"
    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_coef: float = 0.0
    tis_cap: float | None = None
    max_len: int | None = None
    hinted_eps_high: float | None = None
    hinted_sft_coef: float = 0.0
    negative_advantage_scale: float = 1.0

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"LossConfig.aggregation {self.aggregation!r} is unknown; choose from {sorted(AGGREGATIONS)}"
            )
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0.0:
            raise ValueError(f"LossConfig.eps_high must be >= 0, got {self.eps_high}")
        if self.hinted_eps_high is not None and not self.hinted_eps_high >= 0.0:
            raise ValueError(f"LossConfig.hinted_eps_high must be None or >= 0, got {self.hinted_eps_high}")
        if not self.hinted_sft_coef >= 0.0:
            raise ValueError(f"LossConfig.hinted_sft_coef must be >= 0, got {self.hinted_sft_coef}")
        if not 0.0 <= self.negative_advantage_scale <= 1.0:
            raise ValueError(
                f"LossConfig.negative_advantage_scale must be in [0, 1], got {self.negative_advantage_scale}"
            )
        if not self.kl_coef >= 0.0:
            raise ValueError(f"LossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.tis_cap is not None and not self.tis_cap > 0.0:
            raise ValueError(f"LossConfig.tis_cap must be None or > 0, got {self.tis_cap}")
        if self.max_len is not None and (
            isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len <= 0
        ):
            raise ValueError(f"LossConfig.max_len must be None or a positive int, got {self.max_len!r}")
        if self.aggregation == "seq_sum_fixed_len" and self.max_len is None:
            raise ValueError("LossConfig.max_len is required when aggregation is 'seq_sum_fixed_len'")


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Per-token k3 estimate of KL(policy || ref) on policy samples: exp(ref - p) - (ref - p) - 1 >= 0.

    Unlike k1 (p - ref), its gradient is not zero in expectation on-policy, so it works as a loss.
    Written as expm1(d) - d, which stays accurate and non-negative in fp32 for tiny d.
    """
    log_ratio = ref_logp - logp
    return jnp.expm1(log_ratio) - log_ratio


def tis_weight(logp_old: jax.Array, sampler_logp: jax.Array, cap: float) -> jax.Array:
    """The truncated importance weight of each token, min(exp(logp_old - sampler_logp), cap): it corrects
    for tokens the sampler drew from another policy than the old one (a hinted context, numerics)."""
    return jnp.minimum(jnp.exp(logp_old - sampler_logp), cap)


def policy_loss(
    logp_new: jax.Array,
    logp_old: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    *,
    ref_logp: jax.Array | None = None,
    sampler_logp: jax.Array | None = None,
    hinted: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, SumDenom]]:
    """(loss sum, denominator, diagnostics) of the clipped surrogate (+ kl_coef * k3 KL).

    logp_new, logp_old, mask, ref_logp, sampler_logp: [B, T]; advantages, hinted (rows sampled under a hint;
    None: none): [B]. Diagnostics are (sum, denominator) pairs too, so they accumulate over micro-batches the
    same way.
    """
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("LossConfig.kl_coef > 0 needs ref_logp")
    if cfg.tis_cap is not None and sampler_logp is None:
        raise ValueError("LossConfig.tis_cap is set but no sampler_logp was given")
    aggregate = AGGREGATIONS[cfg.aggregation]
    mask = mask.astype(logp_new.dtype)
    # Outside the mask, stored logprobs may be padding (0, -inf, nan): keep every term finite there.
    filler = jax.lax.stop_gradient(logp_new)
    logp_old, ref_logp, sampler_logp = (
        None if x is None else jnp.where(mask > 0, x, filler) for x in (logp_old, ref_logp, sampler_logp)
    )
    adv = advantages[:, None].astype(logp_new.dtype)
    if cfg.negative_advantage_scale != 1.0:
        adv = jnp.where(adv < 0, cfg.negative_advantage_scale * adv, adv)
    log_ratio = logp_new - logp_old
    ratio = jnp.exp(log_ratio)
    unclipped = ratio * adv
    upper = jnp.asarray(1.0 + cfg.eps_high, logp_new.dtype)
    if hinted is not None and cfg.hinted_eps_high is not None:
        upper = jnp.where(hinted[:, None], jnp.asarray(1.0 + cfg.hinted_eps_high, logp_new.dtype), upper)
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, upper) * adv
    pg = -jnp.minimum(unclipped, clipped)
    tokens = jnp.sum(mask)
    diagnostics = {
        "clip_fraction": (jnp.sum((clipped < unclipped) * mask), tokens),
        # KL(old || new) by k3 on the old policy's samples.
        "approx_kl": (jnp.sum(jax.lax.stop_gradient(k3_kl(logp_old, logp_new)) * mask), tokens),
    }
    if sampler_logp is not None:
        diagnostics["sampler_abs_diff"] = (jnp.sum(jnp.abs(logp_old - sampler_logp) * mask), tokens)
    if cfg.tis_cap is not None:
        is_weight = jax.lax.stop_gradient(tis_weight(logp_old, sampler_logp, cfg.tis_cap))
        pg = pg * is_weight
        diagnostics["tis_weight"] = (jnp.sum(is_weight * mask), tokens)
    diagnostics["policy_loss"] = aggregate(jax.lax.stop_gradient(pg), mask, cfg.max_len)
    per_token = pg
    if ref_logp is not None:
        kl = k3_kl(logp_new, ref_logp)
        diagnostics["kl_ref"] = aggregate(jax.lax.stop_gradient(kl), mask, cfg.max_len)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    if hinted is not None and cfg.hinted_sft_coef > 0:
        imitated = mask * (hinted & (advantages > 0))[:, None].astype(mask.dtype)
        nll = -logp_new * imitated
        diagnostics["hinted_sft_nll"] = (jnp.sum(jax.lax.stop_gradient(nll)), jnp.sum(imitated))
        per_token = per_token + cfg.hinted_sft_coef * nll
    loss_sum, denom = aggregate(per_token, mask, cfg.max_len)
    return loss_sum, denom, diagnostics


def sft_loss(logp: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, SumDenom]]:
    """(loss sum, denominator, diagnostics) of behaviour cloning: the masked token cross-entropy,
    -log p of every loss token, averaged over all loss tokens of the batch (DAPO's token mean)."""
    mask = mask.astype(logp.dtype)
    nll_sum, tokens = token_mean(-logp, mask, None)
    return nll_sum, tokens, {"nll": (jax.lax.stop_gradient(nll_sum), tokens)}
