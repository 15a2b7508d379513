"""Builds tiny random HF checkpoints with transformers (torch is a test-only dependency)."""

from __future__ import annotations

import json
import pathlib
import shutil

import torch
import transformers

# Small but with every variant feature: GQA, explicit head_dim, biases, q/k norm, rope scaling.
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

FAMILIES = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            head_dim=16,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
        ),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    # a local (sliding-window) layer, then a global one; the window far shorter than the tests' sequences, an
    # attention scale other than head_dim's, rope bases of their own
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
}


def make_checkpoint(family: str, out_dir: pathlib.Path, seed: int = 0) -> transformers.PreTrainedModel:
    """Saves a random-initialised tiny model of `family` to `out_dir` (fp32) and returns it."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**TINY, **extra)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():  # Random non-trivial norms and biases so every parameter matters.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def make_chat_checkpoint(tokenizer_dir: pathlib.Path, out_dir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A random two-layer Llama with the vocabulary and chat tokenizer of `tokenizer_dir` (weights wide enough
    for its outputs to depend on the context): a model a job loads, samples and trains in seconds, for tests
    of mechanics (stages, artifacts, resumes, logprob bookkeeping) rather than of what a model learns."""
    hf = json.loads((tokenizer_dir / "config.json").read_text())
    torch.manual_seed(seed)
    shape = {**TINY, "vocab_size": hf["vocab_size"], "max_position_embeddings": hf["max_position_embeddings"]}
    config = transformers.LlamaConfig(
        **shape,
        tie_word_embeddings=True,
        initializer_range=0.3,
        bos_token_id=hf["bos_token_id"],
        eos_token_id=hf["eos_token_id"],
        pad_token_id=hf["pad_token_id"],
    )
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir
