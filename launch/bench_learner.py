"""Learner speed: one GRPO + LoRA training step, trace-jax against transformers + PEFT.

  python -m launch.bench_learner --json

The embedded SmolLM2-135M-Instruct by default, fp32, LoRA rank 16 (alpha 16) on all seven
linear projections, batch 8 x 256 random token ids. Both sides run the same step on the same
data: a forward over tokens[:, :-1], token logprobs of tokens[:, 1:] (gather - logsumexp),
the PPO-clipped GRPO loss (seq-mean of token-means, eps 0.2 / 0.28) on random advantages,
backward to the LoRA weights only, global-norm clipping at 1.0 and an AdamW update.
Ours is `make_train_step` (one jitted call); the reference is transformers
`AutoModelForCausalLM` wrapped by `peft.get_peft_model`, with `torch.optim.AdamW`.

Each side runs one warm-up step (compilation for ours; its loss is the initial loss, which
should agree between the sides since every LoRA B starts at zero), then `--steps` timed steps,
alternating ours and PyTorch so that both meet the same machine conditions (this shared
2-core VM drifts by 10-20% over minutes); each side's best step time is kept. Five timed
steps by default: after the warm-up the process heap (shared by both sides) still grows for
a step or two, and a step that page-faults fresh memory takes 1.5-2.5x as long. Tokens/s =
batch * seq_len / seconds per step. The final line is JSON with both rates and the ratio
ours / pytorch.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from launch import agents
from trace_jax import runtime
from trace_jax.lora import ALL_TARGETS, LoraSpec, init_adapters
from trace_jax.models.model import load_model
from trace_jax.rl.learner import make_optimizer, make_train_step
from trace_jax.rl.learner_batch import LearnerBatch, MicroBatch
from trace_jax.rl.losses import LossConfig

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Embedded model name or HF checkpoint folder.")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows per training step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Tokens per row.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per side (the best is kept).")
_MICRO = flags.DEFINE_integer("micro_batches", 1, "Micro-batches per step (ours).")
_REMAT = flags.DEFINE_bool("remat", False, "Recompute each layer's activations in the backward pass (ours).")
_JSON = flags.DEFINE_bool("json", False, "Print the final result as one JSON line.")

_RANK = 16
_ALPHA = 16
_LOSS = LossConfig()  # seq_mean_token_mean, eps_low 0.2, eps_high 0.28, no KL, no TIS
_LR = 1e-5
_CLIP_NORM = 1.0


def _make_batch(vocab: int, batch: int, seq_len: int) -> dict[str, np.ndarray]:
    """Random tokens, a prompt quarter excluded from the loss, random advantages and old logprobs.

    old_logp is drawn near log(1 / vocab) so the ratios vary and the loss depends on the model
    (with old_logp equal to the current logprobs every ratio is 1 and the loss is -mean(adv)).
    """
    rng = np.random.default_rng(0)
    prompt = seq_len // 4
    return {
        "tokens": rng.integers(0, vocab, (batch, seq_len), dtype=np.int32),
        "loss_mask": np.broadcast_to(np.arange(seq_len - 1) >= prompt - 1, (batch, seq_len - 1)).astype(np.float32),
        "advantages": rng.standard_normal(batch).astype(np.float32),
        "old_logp": rng.normal(np.log(1.0 / vocab), 1.0, (batch, seq_len - 1)).astype(np.float32),
        "adapter_idx": np.zeros(batch, np.int32),
    }


def _time_steps(steps: int, **sides) -> dict[str, tuple[float, float]]:
    """{side: (loss of its warm-up step, best seconds over `steps` timed steps)}, the sides'
    timed steps interleaved; each side is a `step()` that returns its loss."""
    initial = {name: step() for name, step in sides.items()}
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(steps):
        for name, step in sides.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: (initial[name], best[name]) for name in sides}


def _ours(model, data, micro_batches: int, remat: bool):
    """trace-jax's training step on `data`, as a `step()` that returns the loss."""
    spec = LoraSpec(rank=_RANK, alpha=_ALPHA, targets=ALL_TARGETS)
    adapters = init_adapters(jax.random.key(0), model.cfg, spec, 1)
    optimizer = make_optimizer(lr=_LR, clip_norm=_CLIP_NORM)
    train_step = make_train_step(model.cfg, _LOSS, optimizer, remat=remat)
    batch = LearnerBatch.strided(MicroBatch(**{k: jnp.asarray(v) for k, v in data.items()}), micro_batches)
    state = {"weights": adapters.weights, "opt": optimizer.init(adapters.weights)}

    def step() -> float:
        state["weights"], state["opt"], metrics = train_step(
            model.params, state["weights"], state["opt"], adapters.scale, batch
        )
        jax.block_until_ready((state["weights"], state["opt"]))
        return float(metrics["loss"])

    return step


def _grpo_loss_torch(logp, old_logp, advantages, mask):
    """`policy_loss` with LossConfig() defaults, in torch: clipped surrogate, token mean per row, row mean."""
    import torch

    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    clipped = torch.clamp(ratio, 1.0 - _LOSS.eps_low, 1.0 + _LOSS.eps_high) * adv
    per_token = -torch.minimum(ratio * adv, clipped)
    row_means = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return row_means.sum() / (mask.sum(-1) > 0).sum().clamp(min=1)


def _pytorch(model, data):
    """The transformers + PEFT reference step on `data`, as a `step()` that returns the loss."""
    import peft  # benchmark-only dependencies (the project's test extra)
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    hf = peft.get_peft_model(
        hf, peft.LoraConfig(r=_RANK, lora_alpha=_ALPHA, target_modules=list(ALL_TARGETS), lora_dropout=0.0)
    )
    hf.train()
    trainable = [p for p in hf.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=_LR, weight_decay=0.0)
    tokens = torch.from_numpy(data["tokens"]).long()
    mask, advantages, old_logp = (torch.from_numpy(data[k]) for k in ("loss_mask", "advantages", "old_logp"))

    def step() -> float:
        logits = hf(input_ids=tokens[:, :-1]).logits.float()
        targets = tokens[:, 1:]
        # As TRL's selective_log_softmax does in fp32: gather the target logit, subtract the logsumexp.
        logp = logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
        loss = _grpo_loss_torch(logp, old_logp, advantages, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, _CLIP_NORM)
        optimizer.step()
        return loss.item()

    return step


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import torch

    agents.ensure_built(_MODEL.value)
    model = load_model(_MODEL.value)
    batch, seq_len, steps = _BATCH.value, _SEQ_LEN.value, _STEPS.value
    data = _make_batch(model.cfg.vocab_size, batch, seq_len)
    timed = _time_steps(steps, ours=_ours(model, data, _MICRO.value, _REMAT.value), pytorch=_pytorch(model, data))
    (loss_ours, seconds_ours), (loss_torch, seconds_torch) = timed["ours"], timed["pytorch"]
    tokens = batch * seq_len
    ours, theirs = tokens / seconds_ours, tokens / seconds_torch
    result = {
        "model": _MODEL.value,
        "batch": batch,
        "seq_len": seq_len,
        "dtype": "float32",
        "lora_rank": _RANK,
        "targets": list(ALL_TARGETS),
        "tokens_per_s_ours": round(ours, 1),
        "tokens_per_s_pytorch": round(theirs, 1),
        "ratio": round(ours / theirs, 3),
        "micro_batches": _MICRO.value,
        "remat": _REMAT.value,
        "seconds_per_step_ours": round(seconds_ours, 3),
        "seconds_per_step_pytorch": round(seconds_torch, 3),
        "timing": f"best of {steps} steps after 1 warm-up, the sides alternating",
        "initial_loss_ours": loss_ours,
        "initial_loss_pytorch": loss_torch,
        "jax_backend": jax.default_backend(),
        "torch_threads": torch.get_num_threads(),
        "torch_blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "cpu": runtime.cpu_name(),
    }
    if not _JSON.value:
        print(
            f"trace-jax {ours:.1f} tok/s, pytorch {theirs:.1f} tok/s, ratio {ours / theirs:.2f} "
            f"(initial loss {loss_ours:.6f} vs {loss_torch:.6f})"
        )
    print(json.dumps(result) if _JSON.value else result)


if __name__ == "__main__":
    app.run(main)
