"""The learner step (GRPO or SFT): adapter-only gradients, exact micro-batch accumulation.

The frozen base `params` is an argument that is never differentiated; gradients are
taken w.r.t. `Adapters.weights` only. The reference policy is the same base with
no adapter (no second copy of the model). Each micro-batch (its own jitted call, so
micro-batches of different shapes, packed by a token budget, share one step)
contributes gradients of loss *sums* and their denominators, summed and divided once at
the end, so the update equals the full-batch gradient of sum / denominator. A shared
prefix (system prompt) runs forward once per step, not once per micro-batch: the
micro-batches sum their gradients w.r.t. its keys and values, and one backward pass
through the prefix turns that sum into adapter gradients.

Rows sampled with a hint their tokens lack (`LearnerSequence.hinted`) are rescored before the
update (`make_rescore_fn`): their old logprobs become the policy's own on the unhinted tokens,
and the sampler's (hinted) logprobs go to sampler_logp, so the loss's truncated importance
weight corrects for the context they were sampled in.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trace_jax import lora
from trace_jax.distributed import host_array
from trace_jax.lora import NO_ADAPTER, Adapters
from trace_jax.models import decoder
from trace_jax.models.config import ModelConfig
from trace_jax.rl.learner_batch import LearnerBatch, MicroBatch, SharedPrefix
from trace_jax.rl.losses import LossConfig, policy_loss, sft_loss, tis_weight
from trace_jax.sharding import ShardingPlan


@dataclasses.dataclass(frozen=True)
class _Forward:
    """How the learner runs the model: its config, the mesh's sharding constraint, whether layers are
    rematerialised, how many bottom layers run forward only (`_run_layers`), and the temperature the
    logprobs are taken at."""

    cfg: ModelConfig
    constrain: decoder.Constrain = decoder.no_constraint
    remat: bool = False
    frozen: int = 0
    temperature: float = 1.0


@jax.custom_vjp
def _logprobs_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log p(target) [B, T] and the entropy of each next-token distribution [B, T] (a diagnostic:
    no gradient flows through it).

    One softmax serves the value, the entropy (lse - sum(p * logits)) and the gradient
    (onehot - p); written plainly, XLA:CPU computed the entropy in a separate pass over the
    [B, T, vocab] logits.
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


def _run_layers(params, tokens, row_lora, cache, num_new, how: _Forward, hidden=None):
    """`decoder.forward_hidden` with its first `frozen` layers, which carry no adapter, run forward
    only: nothing of theirs depends on the adapters, so they need no backward pass (the cache's
    prefix slots of those layers are constants too). frozen = 0 runs every layer as one pass.
    `hidden`: the residual stream entering layer `frozen`, when already computed (`frozen_inputs`)."""
    cfg, frozen = how.cfg, how.frozen
    kwargs = dict(cache=cache, num_new=num_new, remat=how.remat, constrain=how.constrain)
    if not frozen:
        return decoder.forward_hidden(params, tokens, cfg, row_lora=row_lora, **kwargs)
    if hidden is None:
        if cache is not None:
            const = lambda kv: tuple(jax.lax.stop_gradient(x) if i < frozen else x for i, x in enumerate(kv))
            kwargs["cache"] = cache.replace(prefix_k=const(cache.prefix_k), prefix_v=const(cache.prefix_v))
        hidden, kwargs["cache"] = decoder.forward_hidden(params, tokens, cfg, stop_layer=frozen, **kwargs)
    return decoder.forward_hidden(
        params, tokens, cfg, row_lora=row_lora, start_layer=frozen, hidden=jax.lax.stop_gradient(hidden), **kwargs
    )


def _prefix_kv(params, adapters, prefix: SharedPrefix, how: _Forward) -> tuple[tuple, tuple]:
    """Keys and values (one [G, KV, P, hd] array per layer) of the G shared prefixes, each run
    once under its own adapter (prefix.adapter[g])."""
    groups, prefix_len = prefix.tokens.shape
    _, cache = _run_layers(
        params,
        prefix.tokens,
        lora.for_rows(adapters, prefix.adapter),
        decoder.init_cache(how.cfg, groups, prefix_len, params["embed"].dtype),
        prefix.lengths,
        how,
        prefix.hidden,
    )
    return cache.k, cache.v


def _final_hidden(params, adapters, rows: MicroBatch, prefix: SharedPrefix | None, how: _Forward, prefix_kv=None):
    """Final hidden states of `rows.tokens[:, :-1]` (the last position predicts nothing), each row continuing
    its shared prefix (`rows.prefix_of_row`) when `prefix` is given; `rows.frozen_hidden`: the residual stream
    entering the first adapted layer, when already computed.

    The prefixes' keys and values (`prefix_kv`, computed here when not given) become the
    prefix slots the rows attend to, so gradients still flow through the prefix: the result
    equals running every row's full sequence, at a fraction of the cost when many rows share
    a long system prompt.
    """
    tokens, hidden = rows.tokens[:, :-1], rows.frozen_hidden
    row_lora = lora.for_rows(adapters, rows.adapter_idx)
    if prefix is None:
        return _run_layers(params, tokens, row_lora, None, None, how, hidden)[0]
    if prefix_kv is None:
        prefix_kv = _prefix_kv(params, adapters, prefix, how)
    cache = _rows_cache(params, tokens, how.cfg, prefix_kv, rows.prefix_of_row, prefix.lengths)
    return _run_layers(params, tokens, row_lora, cache, None, how, hidden)[0]


def _rows_cache(params, tokens, cfg, prefix_kv, prefix_of_row, prefix_lengths) -> decoder.KVCache:
    """An empty cache for `tokens` whose row b continues prefix prefix_of_row[b] (keys and values
    `prefix_kv`, one array per layer run)."""
    cache = decoder.init_cache(cfg, tokens.shape[0], tokens.shape[1], params["embed"].dtype)
    return cache.replace(
        prefix_k=prefix_kv[0],
        prefix_v=prefix_kv[1],
        prefix_slot=prefix_of_row,
        prefix_len=jnp.take(prefix_lengths, prefix_of_row),
    )


def _forward_logprobs(params, adapters, rows: MicroBatch, prefix: SharedPrefix | None, how: _Forward, prefix_kv=None):
    """Logprobs and entropies of rows.tokens[:, 1:] under softmax(logits / temperature); with
    `rows.loss_positions` [B, K], only of those entries (the vocabulary projection, a large part of a step, runs
    on them alone)."""
    hidden = _final_hidden(params, adapters, rows, prefix, how, prefix_kv)
    targets, positions = rows.tokens[:, 1:], rows.loss_positions
    if positions is not None:
        hidden = jnp.take_along_axis(hidden, positions[..., None], axis=1)
        targets = jnp.take_along_axis(targets, positions, axis=1)
    return _logprobs_and_entropy(decoder.logits_from_hidden(params, hidden, how.cfg) / how.temperature, targets)


def token_logprobs(
    params: dict,
    adapters: Adapters | None,
    tokens: jax.Array,
    adapter_idx: jax.Array,
    cfg: ModelConfig,
    *,
    prefix: SharedPrefix | None = None,
    prefix_of_row: jax.Array | None = None,
    constrain: decoder.Constrain = decoder.no_constraint,
    remat: bool = False,
    temperature: float = 1.0,
) -> jax.Array:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) [B, T-1] in fp32, row b under adapter adapter_idx[b].

    p is the policy sampled at `temperature`, softmax(logits / temperature), as the sampler
    reports it: a job sampling at temperature T trains that tempered policy.

    With `prefix`, row b is the continuation of prefix prefix_of_row[b] (its first prefix.lengths[g]
    tokens, run under adapter prefix.adapter[g]); the prefix tokens are context only and the logprobs
    are still those of tokens[:, 1:].
    """
    how = _Forward(cfg, constrain, remat, temperature=temperature)
    rows = MicroBatch(tokens=tokens, adapter_idx=adapter_idx, prefix_of_row=prefix_of_row)
    return _forward_logprobs(params, adapters, rows, prefix, how)[0]


def _reference_logprobs(
    params: dict, rows: MicroBatch, prefix: SharedPrefix | None, how: _Forward, prefix_kv: tuple | None
) -> jax.Array:
    """Token logprobs of `rows` under the frozen base (every row NO_ADAPTER, so no LoRA is computed): the KL
    reference. `prefix_kv`: the prefixes' keys and values under the base. The layers below the first adapted one
    are the base's under either, so their outputs (`rows.frozen_hidden`, the prefix's hidden) serve both."""
    base_rows = rows.replace(adapter_idx=jnp.full(rows.tokens.shape[:1], NO_ADAPTER, jnp.int32))
    return _forward_logprobs(params, None, base_rows, prefix, how, prefix_kv)[0]


@functools.partial(jax.jit, static_argnames=("cfg", "frozen", "scan"))
def _frozen_prefix(params, prefix_tokens, prefix_lengths, cfg, frozen, scan):
    groups, prefix_len = prefix_tokens.shape
    hidden, cache = decoder.forward_hidden(
        params,
        prefix_tokens,
        cfg,
        stop_layer=frozen,
        num_new=prefix_lengths,
        cache=decoder.init_cache(cfg, groups, prefix_len, params["embed"].dtype),
        remat=scan,
    )
    return hidden, cache.k[:frozen], cache.v[:frozen]


@functools.partial(jax.jit, static_argnames=("cfg", "frozen", "scan"))
def _frozen_rows(params, tokens, prefix_kv, prefix_of_row, prefix_lengths, cfg, frozen, scan):
    if prefix_kv is None:
        return decoder.forward_hidden(params, tokens, cfg, stop_layer=frozen, remat=scan)[0]
    cache = _rows_cache(params, tokens, cfg, prefix_kv, prefix_of_row, prefix_lengths)
    return decoder.forward_hidden(params, tokens, cfg, cache=cache, stop_layer=frozen, remat=scan)[0]


def frozen_inputs(
    params: dict, cfg: ModelConfig, frozen_layers: int, batch: LearnerBatch, *, remat: bool = False
) -> LearnerBatch:
    """`batch` with the residual streams entering layer `frozen_layers` added: the prefix's `hidden` [G, P, D]
    and each micro-batch's `frozen_hidden` [R, W-1, D] (for tokens[:, :-1]). Below the first adapted layer
    nothing depends on the adapters, so a job that trains on the same sequences again and again computes these
    once and its learner runs only the adapted layers. A position's stream depends only on the tokens up to it,
    not on where the shared prefix was cut. `remat`: run the layers under `lax.scan` (one layer compiled, not
    all)."""
    prefix, prefix_kv = batch.prefix, None
    if prefix is not None:
        hidden, *prefix_kv = _frozen_prefix(params, prefix.tokens, prefix.lengths, cfg, frozen_layers, remat)
        prefix = prefix.replace(hidden=hidden)
    lengths = None if prefix is None else prefix.lengths
    micro_batches = tuple(
        mb.replace(
            frozen_hidden=_frozen_rows(
                params, mb.tokens[:, :-1], prefix_kv, mb.prefix_of_row, lengths, cfg, frozen_layers, remat
            )
        )
        for mb in batch.micro_batches
    )
    return dataclasses.replace(batch, prefix=prefix, micro_batches=micro_batches)


def make_optimizer(lr: float = 1e-5, weight_decay: float = 0.0, clip_norm: float = 1.0) -> optax.GradientTransformation:
    """AdamW after global-norm gradient clipping (the paper's settings by default)."""
    return optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(lr, weight_decay=weight_decay))


def _decision_logprobs(mb: MicroBatch, learned: np.ndarray) -> list[float]:
    """For each row of `mb` with learned tokens in `learned` (hinted rows) and a positive advantage, the policy's
    logprob (old_logp) of the token whose logprob the hint raised most (sampler_logp - old_logp)."""
    out = []
    for row in np.flatnonzero(learned.any(axis=1)):
        if mb.advantages is not None and mb.advantages[row] <= 0:
            continue
        at = np.flatnonzero(learned[row])
        out.append(float(mb.old_logp[row, at[np.argmax(mb.sampler_logp[row, at] - mb.old_logp[row, at])]]))
    return out


def _policy_logprobs_fn(
    cfg: ModelConfig, plan: ShardingPlan | None, remat: bool, temperature: float, frozen: int = 0
) -> Callable:
    """`forward(params, weights, scale, micro_batches, prefix) -> [np.ndarray [R, K]]`: the policy's logprobs of
    each packed micro-batch's learned entries (`mb.loss_positions`), each row under its own adapter, on the host.
    The shared prefix runs once for all of them. `frozen`: the micro-batches and the prefix carry the residual
    streams entering that layer (`frozen_inputs`), so only the layers from it on run."""
    constrain = plan.constrain if plan is not None else decoder.no_constraint
    how = _Forward(cfg, constrain, remat, frozen=frozen, temperature=temperature)

    @jax.jit
    def prefix_keys_values(params, weights, scale, prefix: SharedPrefix):
        return _prefix_kv(params, Adapters(weights, scale), prefix, how)

    @jax.jit
    def run(params, weights, scale, rows: MicroBatch, prefix: SharedPrefix | None, prefix_kv):
        if plan is not None:
            rows = jax.tree.map(lambda v: plan.constrain(v, "batch"), rows)
        return _forward_logprobs(params, Adapters(weights, scale), rows, prefix, how, prefix_kv)[0]

    def forward(params, weights, scale, micro_batches, prefix: SharedPrefix | None) -> list[np.ndarray]:
        prefix_kv = None if prefix is None else prefix_keys_values(params, weights, scale, prefix)
        out = []
        for mb in micro_batches:
            inputs = MicroBatch(
                tokens=mb.tokens,
                adapter_idx=mb.adapter_idx,
                loss_positions=mb.loss_positions,
                prefix_of_row=mb.prefix_of_row,
                frozen_hidden=mb.frozen_hidden if frozen else None,
            )
            out.append(host_array(run(params, weights, scale, inputs, prefix, prefix_kv)))
        return out

    return forward


def make_sequence_logprob_fn(
    cfg: ModelConfig,
    *,
    plan: ShardingPlan | None = None,
    remat: bool = False,
    temperature: float = 1.0,
    frozen_layers: int = 0,
) -> Callable:
    """`logprob(params, adapter_weights, scale, batch, num) -> np.ndarray [num]`: for each of the `num` sequences
    packed in `batch` (`batching.pack_sequences`, indexed as they were given), the policy's log-probability of
    its learned tokens, summed: how likely the policy (each row under its own adapter) finds those turns in their
    context. Sequences the packing left out (no learned token) get 0. `frozen_layers` > 0: `batch` carries the
    streams entering that layer (`frozen_inputs`; computed once for sequences scored again and again)."""
    forward = _policy_logprobs_fn(cfg, plan, remat, temperature, frozen_layers)

    def logprob(params, weights, scale, batch: LearnerBatch, num: int) -> np.ndarray:
        out = np.zeros((num,), np.float64)
        for mb, logp in zip(batch.micro_batches, forward(params, weights, scale, batch.micro_batches, batch.prefix)):
            sums = (logp * mb.loss_mask).sum(axis=1)
            rows = mb.sequence >= 0
            out[mb.sequence[rows]] = sums[rows]
        return out

    return logprob


def make_rescore_fn(
    cfg: ModelConfig,
    loss_cfg: LossConfig,
    *,
    plan: ShardingPlan | None = None,
    remat: bool = False,
    temperature: float = 1.0,
) -> Callable:
    """`rescore(params, adapter_weights, scale, batch, hinted) -> (batch, metrics)`: a packed GRPO batch
    (`batching.pack_sequences`) whose hinted rows are made ready for the update.

    Every micro-batch gets "sampler_logp", the sampler's logprobs (packed as its old_logp). The rows
    of the sequences `hinted` marks (indexed as the packed sequences are, `MicroBatch.sequence`) were sampled
    under a hinted context their tokens lack: their old_logp becomes the current policy's logprobs on
    their own tokens, from one forward pass of their micro-batches (ratio 1 at the update); every other
    row keeps old_logp = sampler_logp. How the loss then weighs a hinted token is `loss_cfg.tis_cap`'s:
    None learns it as an on-policy token (weight 1, as the TRACE authors' code does: the tokens a hint made
    possible count in full); a cap weighs it min(exp(old - sampler), cap), truncated importance sampling.
    The micro-batches mark those rows (`hinted`), for `loss_cfg.hinted_eps_high`.
    metrics, where there are hinted rows: how much likelier the hint made their tokens (mean sampler - old
    logprob, "hinted_logp_gain") and, with a cap, the mean weight ("hinted_is_weight") and the share the cap
    cut ("hinted_capped"). Where hinted rows beat their group (advantage > 0), "hinted_decision_logp": the mean,
    over those rows, of the policy's unhinted logprob of the row's token the hint raised most (sampler - old),
    the decision the hint made (typically the name of a tool the agent does not call on its own). Each step's
    tasks are new, so its rise over steps measures whether the policy learns those decisions without the hint.
    """
    forward = _policy_logprobs_fn(cfg, plan, remat, temperature)

    def rescore(params, weights, scale, batch: LearnerBatch, hinted):
        marked = np.flatnonzero(np.asarray(hinted, bool))
        hinted_rows = [np.isin(mb.sequence, marked) for mb in batch.micro_batches]
        rescored = [mb for mb, rows in zip(batch.micro_batches, hinted_rows) if rows.any()]
        policy = iter(forward(params, weights, scale, rescored, batch.prefix) if rescored else ())
        parts, old, sampled, decisions = [], [], [], []
        for mb, rows in zip(batch.micro_batches, hinted_rows):
            mb = mb.replace(sampler_logp=mb.old_logp, hinted=rows)
            if rows.any():
                logp = next(policy)  # the micro-batches with hinted rows, in order
                mb = mb.replace(old_logp=np.where(rows[:, None], logp, mb.sampler_logp))
                learned = (mb.loss_mask > 0) & rows[:, None]
                old.append(mb.old_logp[learned])
                sampled.append(mb.sampler_logp[learned])
                decisions.extend(_decision_logprobs(mb, learned))
            parts.append(mb)
        metrics = {}
        if old:
            old, sampled = np.concatenate(old), np.concatenate(sampled)
            metrics["hinted_logp_gain"] = float(np.mean(sampled - old))
            if decisions:
                metrics["hinted_decision_logp"] = float(np.mean(decisions))
            if loss_cfg.tis_cap is not None:
                is_weights = np.asarray(tis_weight(old, sampled, loss_cfg.tis_cap))
                metrics.update(
                    hinted_is_weight=float(is_weights.mean()),
                    hinted_capped=float(np.mean(is_weights >= np.float32(loss_cfg.tis_cap))),
                )
        return dataclasses.replace(batch, micro_batches=tuple(parts)), metrics

    return rescore


OBJECTIVES = ("grpo", "sft")


def make_grad_fn(
    cfg: ModelConfig,
    loss_cfg: LossConfig | None,
    *,
    plan: ShardingPlan | None = None,
    remat: bool = False,
    temperature: float = 1.0,
    objective: str = "grpo",
    frozen_layers: int = 0,
) -> Callable:
    """`grads(params, adapter_weights, scale, batch) -> (grads, metrics)`: the gradient of the batch
    loss (sum / denominator) w.r.t. the adapter weights, accumulated over the micro-batches of the
    `LearnerBatch` (any shapes, e.g. packed by a token budget: `batching.pack_sequences`). Each micro-batch
    shape compiles once; the shared prefix runs forward once per step.

    objective "grpo": `policy_loss` under `loss_cfg`; "sft": masked token cross-entropy, the
    mean over loss tokens (`sft_loss`; rows need only tokens, loss_mask, adapter_idx).

    `frozen_layers`: the adapters are zero in the first frozen_layers layers (`LoraSpec.
    first_layer`), which then run forward only; the gradient is the same (those layers'
    adapter gradients are exactly zero), at a fraction of the backward pass's cost.
    """
    if not 0 <= frozen_layers < cfg.num_layers:
        raise ValueError(f"frozen_layers must be in [0, {cfg.num_layers}), got {frozen_layers}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is unknown; choose from {OBJECTIVES}")
    if objective == "grpo" and loss_cfg is None:
        raise ValueError("objective 'grpo' needs a LossConfig")
    how = _Forward(
        cfg, plan.constrain if plan is not None else decoder.no_constraint, remat, frozen_layers, temperature
    )
    use_kl = objective == "grpo" and loss_cfg.kl_coef > 0

    def micro_loss(weights, prefix_kv, scale, params, mb: MicroBatch, prefix: SharedPrefix | None, ref_kv):
        if plan is not None:
            mb = jax.tree.map(lambda v: plan.constrain(v, "batch"), mb)
        logp, entropy = _forward_logprobs(params, Adapters(weights, scale), mb, prefix, how, prefix_kv)
        mask = mb.loss_mask.astype(jnp.float32)
        if objective == "sft":
            loss_sum, denom, diagnostics = sft_loss(logp, mask)
        else:
            ref_logp = None
            if use_kl:
                ref_logp = jax.lax.stop_gradient(_reference_logprobs(params, mb, prefix, how, ref_kv))
            loss_sum, denom, diagnostics = policy_loss(
                logp,
                mb.old_logp,
                mb.advantages,
                mask,
                loss_cfg,
                ref_logp=ref_logp,
                sampler_logp=mb.sampler_logp,
                hinted=mb.hinted,
            )
        diagnostics["entropy"] = (jnp.sum(entropy * mask), jnp.sum(mask))
        return loss_sum, (loss_sum, denom, diagnostics)

    micro_grad = jax.jit(jax.grad(micro_loss, argnums=(0, 1), has_aux=True))

    @jax.jit
    def prefix_forward(params, weights, scale, prefix: SharedPrefix):
        """The prefixes' keys and values, the pullback from their cotangents to adapter gradients, and
        (for the KL term) their keys and values under the base."""
        prefix_kv, pullback = jax.vjp(lambda w: _prefix_kv(params, Adapters(w, scale), prefix, how), weights)
        ref_kv = _prefix_kv(params, None, prefix, how) if use_kl else None
        return prefix_kv, pullback, ref_kv

    @jax.jit
    def finish(g_sum, g_prefix_kv, pullback, sums, passed):
        loss_sum, denom, diagnostics = sums
        if pullback is not None:
            g_sum = jax.tree.map(jnp.add, g_sum, pullback(g_prefix_kv)[0])
        denom = jnp.maximum(denom, 1.0)  # an all-padding batch has sums 0: loss and grads stay 0
        g = jax.tree.map(lambda x: x / denom, g_sum)
        metrics = {"loss": loss_sum / denom, "grad_norm": optax.tree.norm(g)}
        metrics.update({k: s / jnp.maximum(n, 1.0) for k, (s, n) in diagnostics.items()})
        return g, {**metrics, **passed}

    accumulate = jax.jit(lambda acc, new: jax.tree.map(jnp.add, acc, new), donate_argnums=0)

    def grads(params, weights, scale, batch: LearnerBatch):
        if not batch.micro_batches:
            raise ValueError("the batch has no micro-batches")
        prefix = batch.prefix
        for mb in batch.micro_batches:
            mb.check()
            if (prefix is None) != (mb.prefix_of_row is None):
                raise ValueError("a shared prefix needs prefix_of_row in every micro-batch, and only a prefix does")
        frozen = (prefix is not None and prefix.hidden is not None) or any(
            mb.frozen_hidden is not None for mb in batch.micro_batches
        )
        if frozen and not frozen_layers:
            raise ValueError("frozen inputs (frozen_hidden, prefix hidden) are for a learner with frozen_layers > 0")
        prefix_kv, pullback, ref_kv = prefix_forward(params, weights, scale, prefix) if prefix else (None,) * 3
        # Every micro-batch adds its gradient w.r.t. the adapters and the prefixes' keys and values;
        # one backward pass through the prefixes turns the latter sum into adapter gradients.
        acc = None
        for mb in batch.micro_batches:
            out = micro_grad(weights, prefix_kv, scale, params, mb, prefix, ref_kv)
            acc = out if acc is None else accumulate(acc, out)
        (g_sum, g_prefix_kv), sums = acc
        passed = {} if batch.dropped_fraction is None else {"dropped_fraction": jnp.float32(batch.dropped_fraction)}
        return finish(g_sum, g_prefix_kv, pullback, sums, passed)

    return grads


def make_train_step(
    cfg: ModelConfig,
    loss_cfg: LossConfig | None,
    optimizer: optax.GradientTransformation,
    *,
    plan: ShardingPlan | None = None,
    remat: bool = False,
    temperature: float = 1.0,
    objective: str = "grpo",
    frozen_layers: int = 0,
    updates: int = 1,
    target_kl: float | None = None,
) -> Callable:
    """`step(params, adapter_weights, opt_state, scale, batch) -> (adapter_weights, opt_state, metrics)`.

    `batch`: a `LearnerBatch` (see `make_grad_fn`). The adapter weights and optimizer state are donated to
    the update (updated in place).

    `updates` > 1 (PPO's mini-batches): the batch's micro-batches are dealt into that many
    mini-batches (micro-batch i into mini-batch i mod updates; fewer when there are fewer micro-batches),
    each its own loss and optimizer update, in turn. Every mini-batch keeps the batch's old_logp, so
    from the second on the clipped ratio holds the policy near the one that sampled: more learning per
    episode played at the same gradient cost. metrics are the mean over the updates applied, with
    `updates` their count (and, after an early stop, `stop_approx_kl`: the approx KL that stopped it).

    `target_kl` (PPO's early stop): a mini-batch whose approx KL (old policy to the current one, measured
    with its gradient) is above it ends the step's updates unapplied, so a step cannot move the policy far
    from the one that sampled whatever the learning rate; the first mini-batch, at the old policy, always applies.
    """
    if updates < 1:
        raise ValueError(f"updates must be >= 1, got {updates}")
    if target_kl is not None and not target_kl > 0:
        raise ValueError(f"target_kl must be None or > 0, got {target_kl}")
    grad_fn = make_grad_fn(
        cfg,
        loss_cfg,
        plan=plan,
        remat=remat,
        temperature=temperature,
        objective=objective,
        frozen_layers=frozen_layers,
    )

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def apply(weights, opt_state, g):
        deltas, opt_state = optimizer.update(g, opt_state, weights)
        return optax.apply_updates(weights, deltas), opt_state

    def step(params, weights, opt_state, scale, batch: LearnerBatch):
        parts = batch.micro_batches
        mini_batches = [
            dataclasses.replace(batch, micro_batches=parts[i::updates]) for i in range(min(updates, len(parts)))
        ]
        history, stopped = [], {}
        for mini_batch in mini_batches:
            g, metrics = grad_fn(params, weights, scale, mini_batch)
            if history and target_kl is not None:
                kl = float(metrics["approx_kl"])  # how far the applied updates have gone
                if kl > target_kl:
                    stopped = {"stop_approx_kl": kl}
                    break
            weights, opt_state = apply(weights, opt_state, g)
            history.append(metrics)
        metrics = history[0] if len(history) == 1 else {k: np.mean([float(m[k]) for m in history]) for k in history[0]}
        return weights, opt_state, {**metrics, "updates": float(len(history)), **stopped}

    return step
