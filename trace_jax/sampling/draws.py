"""Drawing tokens: per-row temperature, exact top-k / top-p cut-offs without a vocabulary sort, and the random key
each row draws a token with (its stream and position), so that an episode samples the same in any batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BISECTION_STEPS = 32  # shrinks a logit range of ~1e2 to ~1e-8


def truncate_logits(scaled, top_p, top_k):
    """Masks to -inf the tokens outside each row's top-k (k > 0) and top-p nucleus (p < 1).

    A token stays in the nucleus when the probability of the tokens more likely than
    it is below top_p, so the most likely token always stays. Both cut-offs are found
    by bisection on the logit value: exact up to ties closer than ~1e-8, and no sort
    (a full-vocabulary sort is very slow on CPU).
    """
    finite_min = jnp.min(jnp.where(jnp.isfinite(scaled), scaled, jnp.inf), axis=-1)
    x = jnp.maximum(scaled, finite_min[:, None])
    probs = jax.nn.softmax(scaled, axis=-1)
    k = jnp.where(top_k > 0, top_k, scaled.shape[-1])

    def step(_, bounds):
        # Invariants: count(x >= k_lo) > k >= count(x >= k_hi); mass(x > p_lo) >= top_p > mass(x > p_hi).
        k_lo, k_hi, p_lo, p_hi = bounds
        k_mid, p_mid = (k_lo + k_hi) / 2, (p_lo + p_hi) / 2
        too_many = jnp.sum(x >= k_mid[:, None], axis=-1) > k
        too_much = jnp.sum(jnp.where(x > p_mid[:, None], probs, 0.0), axis=-1) >= top_p
        return (
            jnp.where(too_many, k_mid, k_lo),
            jnp.where(too_many, k_hi, k_mid),
            jnp.where(too_much, p_mid, p_lo),
            jnp.where(too_much, p_hi, p_mid),
        )

    lo, hi = finite_min - 1.0, jnp.max(x, axis=-1)
    _, k_hi, p_lo, _ = jax.lax.fori_loop(0, _BISECTION_STEPS, step, (lo, hi, lo, hi))
    keep = (x >= k_hi[:, None]) & (x > p_lo[:, None])
    return jnp.where(keep, scaled, -jnp.inf)


def sample_from_logits(logits, keys, temperature, top_p, top_k):
    """Draws one token per row, row b with its own key `keys[b]`. Returns (tokens [B], logprobs [B]).

    Rows with temperature <= 0 are greedy and report the plain log-softmax of their
    token; other rows report the log-probability under the distribution they were
    drawn from (temperature-scaled, truncated by top-k / top-p, renormalised).
    """
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    needs_truncation = jnp.any(~greedy & ((top_p < 1.0) | (top_k > 0)))
    scaled = jax.lax.cond(needs_truncation, lambda s: truncate_logits(s, top_p, top_k), lambda s: s, scaled)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    tokens = jax.lax.cond(
        jnp.all(greedy),
        lambda: jnp.argmax(logits, axis=-1),
        lambda: jnp.where(greedy, jnp.argmax(logits, axis=-1), jax.vmap(jax.random.categorical)(keys, scaled)),
    )
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def row_keys(key: jax.Array, streams: jax.Array, positions: jax.Array) -> jax.Array:
    """Each row's key for the token it samples at `positions` (absolute, in its sequence): `key` folded with the
    row's stream, then the position. A row's draws thus depend on its stream and positions only, not on the
    batch around it or when it was fed, so an episode samples the same wherever it is played."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(key, s), p))(streams, positions)
