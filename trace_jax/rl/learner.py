"""The jitted GRPO learner step: adapter-only gradients, exact micro-batch accumulation.

The frozen base `params` is an argument that is never differentiated; gradients are
taken w.r.t. `Adapters.weights` only. The reference policy is the same base with
no adapter (no second copy of the model). Each micro-batch contributes gradients
of loss *sums* and their denominators, summed with `lax.scan` and divided once at
the end, so the update equals the full-batch gradient of sum / denominator. A shared
prefix (system prompt) runs forward once per step, not once per micro-batch: the
micro-batches sum their gradients w.r.t. its keys and values, and one backward pass
through the prefix turns that sum into adapter gradients.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from trace_jax import lora
from trace_jax.lora import NO_ADAPTER, Adapters
from trace_jax.models import decoder
from trace_jax.models.config import ModelConfig
from trace_jax.rl.losses import LossConfig, policy_loss
from trace_jax.sharding import ShardingPlan

# Per-row batch entries (split into micro-batches).
ROW_KEYS = ("tokens", "loss_mask", "advantages", "old_logp", "sampler_logp", "adapter_idx", "prefix_of_row")
# Shared prefixes, given whole to every micro-batch (see `token_logprobs`).
PREFIX_KEYS = ("prefix_tokens", "prefix_lengths", "prefix_adapter")
# Scalars passed through to the metrics.
PASS_THROUGH = ("dropped_fraction",)


@jax.custom_vjp
def _logprobs_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log p(target) [B, T] and the entropy of each next-token distribution [B, T] (a diagnostic:
    no gradient flows through it).

    One softmax serves the value, the entropy (lse - sum(p * logits)) and the gradient
    (onehot - p); written plainly, XLA:CPU computed the entropy in a separate pass over the
    [B, T, vocab] logits that cost 1.7 s of a 15 s learner step.
    """
    return _logprobs_and_entropy_fwd(logits, targets)[0]


def _logprobs_and_entropy_fwd(logits, targets):
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None])
    logp = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return (logp, entropy), (probs, targets)


def _logprobs_and_entropy_bwd(residuals, cotangents):
    probs, targets = residuals
    g = cotangents[0][..., None]
    onehot = jnp.arange(probs.shape[-1], dtype=targets.dtype) == targets[..., None]
    return g * (onehot - probs), None


_logprobs_and_entropy.defvjp(_logprobs_and_entropy_fwd, _logprobs_and_entropy_bwd)


def _prefix_kv(params, adapters, prefix, cfg, constrain, remat) -> tuple[tuple, tuple]:
    """Keys and values (one [G, KV, P, hd] array per layer) of the G shared prefixes, each run
    once under its own adapter (prefix_adapter[g])."""
    groups, prefix_len = prefix["prefix_tokens"].shape
    _, cache = decoder.forward_hidden(params, prefix["prefix_tokens"], cfg,
                                      cache=decoder.init_cache(cfg, groups, prefix_len, params["embed"].dtype),
                                      num_new=prefix["prefix_lengths"], remat=remat, constrain=constrain,
                                      row_lora=lora.for_rows(adapters, prefix["prefix_adapter"]))
    return cache.k, cache.v


def _final_hidden(params, adapters, tokens, adapter_idx, prefix, cfg, constrain, remat, prefix_kv=None):
    """Final hidden states of `tokens`, each row continuing its shared prefix when `prefix` is given.

    The prefixes' keys and values (`prefix_kv`, computed here when not given) become the
    prefix slots the rows attend to, so gradients still flow through the prefix: the result
    equals running every row's full sequence, at a fraction of the cost when many rows share
    a long system prompt.
    """
    row_lora = lora.for_rows(adapters, adapter_idx)
    if prefix is None:
        return decoder.forward_hidden(params, tokens, cfg, row_lora=row_lora, remat=remat, constrain=constrain)[0]
    if prefix_kv is None:
        prefix_kv = _prefix_kv(params, adapters, prefix, cfg, constrain, remat)
    prefix_k, prefix_v = prefix_kv
    cache = decoder.init_cache(cfg, tokens.shape[0], tokens.shape[1], params["embed"].dtype)
    cache = cache.replace(prefix_k=prefix_k, prefix_v=prefix_v, prefix_slot=prefix["prefix_of_row"],
                          prefix_len=jnp.take(prefix["prefix_lengths"], prefix["prefix_of_row"]))
    return decoder.forward_hidden(params, tokens, cfg, row_lora=row_lora, cache=cache, remat=remat,
                                  constrain=constrain)[0]


def _forward_logprobs(params, adapters, tokens, adapter_idx, prefix, cfg, constrain, remat, temperature,
                      prefix_kv=None):
    """Logprobs and entropies of tokens[:, 1:] under softmax(logits / temperature) (the last position
    predicts nothing, so it is not run)."""
    hidden = _final_hidden(params, adapters, tokens[:, :-1], adapter_idx, prefix, cfg, constrain, remat, prefix_kv)
    return _logprobs_and_entropy(decoder.logits_from_hidden(params, hidden, cfg) / temperature, tokens[:, 1:])


def token_logprobs(params: dict, adapters: Adapters | None, tokens: jax.Array, adapter_idx: jax.Array,
                   cfg: ModelConfig, *, prefix: dict | None = None, constrain: decoder.Constrain = decoder.no_constraint,
                   remat: bool = False, temperature: float = 1.0) -> jax.Array:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) [B, T-1] in fp32, row b under adapter adapter_idx[b].

    p is the policy sampled at `temperature`, softmax(logits / temperature), as the sampler
    reports it: a job sampling at temperature T trains that tempered policy.

    With `prefix` ({"prefix_tokens": [G, P], "prefix_lengths": [G], "prefix_adapter": [G],
    "prefix_of_row": [B]}), row b is the continuation of prefix prefix_of_row[b] (its first
    prefix_lengths[g] tokens, run under adapter prefix_adapter[g]); the prefix tokens are
    context only and the logprobs are still those of tokens[:, 1:].
    """
    return _forward_logprobs(params, adapters, tokens, adapter_idx, prefix, cfg, constrain, remat, temperature)[0]


def reference_logprobs(params: dict, tokens: jax.Array, cfg: ModelConfig, *, prefix: dict | None = None,
                       constrain: decoder.Constrain = decoder.no_constraint, remat: bool = False,
                       temperature: float = 1.0, prefix_kv: tuple | None = None) -> jax.Array:
    """Token logprobs of the frozen base (every row NO_ADAPTER, so no LoRA is computed): the KL reference.
    `prefix_kv`: the prefixes' keys and values under the base, when already computed."""
    idx = jnp.full(tokens.shape[:1], NO_ADAPTER, jnp.int32)
    return _forward_logprobs(params, None, tokens, idx, prefix, cfg, constrain, remat, temperature, prefix_kv)[0]


def make_optimizer(lr: float = 1e-5, weight_decay: float = 0.0, clip_norm: float = 1.0) -> optax.GradientTransformation:
    """AdamW after global-norm gradient clipping (the paper's settings by default)."""
    return optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(lr, weight_decay=weight_decay))


def _split_micro_batches(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...] with micro-batch m = rows m, m+n, m+2n, ...

    Strided rather than contiguous, so on a batch-sharded mesh each device keeps its own
    rows in every micro-batch (no resharding between micro-batches).
    """
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def make_grad_fn(cfg: ModelConfig, loss_cfg: LossConfig, *, micro_batches: int = 1, plan: ShardingPlan | None = None,
                 remat: bool = False, temperature: float = 1.0) -> Callable:
    """Jitted `grads(params, adapter_weights, scale, batch) -> (grads, metrics)`: the gradient of the
    batch loss (sum / denominator) w.r.t. the adapter weights, accumulated over micro-batches."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    constrain = plan.constrain if plan is not None else decoder.no_constraint

    def micro_loss(weights, prefix_kv, scale, params, mb, shared, ref_kv):
        prefix = {**shared, "prefix_of_row": mb["prefix_of_row"]} if shared else None
        logp, entropy = _forward_logprobs(params, Adapters(weights, scale), mb["tokens"], mb["adapter_idx"], prefix,
                                          cfg, constrain, remat, temperature, prefix_kv)
        ref_logp = None
        if loss_cfg.kl_coef > 0:
            ref_logp = jax.lax.stop_gradient(reference_logprobs(params, mb["tokens"], cfg, prefix=prefix,
                                                                constrain=constrain, remat=remat,
                                                                temperature=temperature, prefix_kv=ref_kv))
        mask = mb["loss_mask"].astype(jnp.float32)
        loss_sum, denom, diagnostics = policy_loss(logp, mb["old_logp"], mb["advantages"], mask, loss_cfg,
                                                   ref_logp=ref_logp, sampler_logp=mb.get("sampler_logp"))
        diagnostics["entropy"] = (jnp.sum(entropy * mask), jnp.sum(mask))
        return loss_sum, (loss_sum, denom, diagnostics)

    micro_grad = jax.grad(micro_loss, argnums=(0, 1), has_aux=True)

    def grads(params, weights, scale, batch):
        unknown = sorted(set(batch) - set(ROW_KEYS) - set(PREFIX_KEYS) - set(PASS_THROUGH))
        if unknown:
            raise ValueError(f"unknown batch entries {unknown}; expected {ROW_KEYS} (+ {PREFIX_KEYS}, {PASS_THROUGH})")
        shared = {k: batch[k] for k in PREFIX_KEYS if k in batch}
        if shared and (set(shared) != set(PREFIX_KEYS) or "prefix_of_row" not in batch):
            raise ValueError(f"a shared prefix needs all of {PREFIX_KEYS} and prefix_of_row")
        size = batch["tokens"].shape[0]
        if size % micro_batches:
            raise ValueError(f"batch of {size} rows does not split into {micro_batches} micro-batches")
        stacked = {k: _split_micro_batches(v, micro_batches) for k, v in batch.items() if k in ROW_KEYS}
        # The shared prefixes run forward once; every micro-batch adds its gradient w.r.t. their keys
        # and values, and one backward pass through the prefixes turns the sum into adapter gradients.
        prefix_kv, prefix_vjp, ref_kv = None, None, None
        if shared:
            prefix_kv, prefix_vjp = jax.vjp(
                lambda w: _prefix_kv(params, Adapters(w, scale), shared, cfg, constrain, remat), weights)
            if loss_cfg.kl_coef > 0:
                ref_kv = _prefix_kv(params, None, shared, cfg, constrain, remat)

        def body(acc, mb):
            if plan is not None:
                mb = {k: plan.constrain(v, "batch") for k, v in mb.items()}
            g, sums = micro_grad(weights, prefix_kv, scale, params, mb, shared, ref_kv)
            return jax.tree.map(jnp.add, acc, (g, sums)), None

        first = {k: v[0] for k, v in stacked.items()}
        sums_shape = jax.eval_shape(lambda mb: micro_loss(weights, prefix_kv, scale, params, mb, shared, ref_kv)[1],
                                    first)
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
        init = ((zeros(weights), zeros(prefix_kv)), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape))
        ((g_sum, g_prefix_kv), (loss_sum, denom, diagnostics)), _ = jax.lax.scan(body, init, stacked)
        if shared:
            g_sum = jax.tree.map(jnp.add, g_sum, prefix_vjp(g_prefix_kv)[0])
        denom = jnp.maximum(denom, 1.0)  # an all-padding batch has sums 0: loss and grads stay 0
        g = jax.tree.map(lambda x: x / denom, g_sum)
        metrics = {"loss": loss_sum / denom, "grad_norm": optax.tree.norm(g)}
        metrics.update({k: s / jnp.maximum(n, 1.0) for k, (s, n) in diagnostics.items()})
        metrics.update({k: batch[k] for k in PASS_THROUGH if k in batch})
        return g, metrics

    return jax.jit(grads)


def make_train_step(cfg: ModelConfig, loss_cfg: LossConfig, optimizer: optax.GradientTransformation, *,
                    micro_batches: int = 1, plan: ShardingPlan | None = None, remat: bool = False,
                    temperature: float = 1.0) -> Callable:
    """Jitted `step(params, adapter_weights, opt_state, scale, batch) -> (adapter_weights, opt_state, metrics)`.

    batch: tokens [B, T] int32, loss_mask [B, T-1], advantages [B], old_logp [B, T-1],
    adapter_idx [B] int32, optional sampler_logp [B, T-1], a scalar dropped_fraction and a
    shared prefix (`PREFIX_KEYS` + prefix_of_row [B], see `token_logprobs`).
    The adapter weights and optimizer state are donated (updated in place).
    """
    grad_fn = make_grad_fn(cfg, loss_cfg, micro_batches=micro_batches, plan=plan, remat=remat,
                           temperature=temperature)

    def step(params, weights, opt_state, scale, batch):
        g, metrics = grad_fn(params, weights, scale, batch)
        updates, opt_state = optimizer.update(g, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(1, 2))
