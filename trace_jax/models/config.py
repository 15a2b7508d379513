"""Decoder configuration read from a Hugging Face `config.json`.

One dataclass covers the Llama, Qwen2, Qwen3 and Gemma 3 families; the differences (q/k/v biases, q/k RMSNorm,
rope scaling, tied embeddings; Gemma 3's (1 + weight) norms around both blocks, scaled embeddings, GeGLU, its
attention scale, and local sliding-window layers with their own rope base between global ones) are plain fields.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from trace_jax.files import read_json

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and variant flags of a decoder-only transformer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    family: str = "llama"
    # Gemma 3
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), in fp32
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too, before the residual adds
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    sliding_window: int | None = None  # how many positions a local layer attends to, itself included
    local_layers: tuple[bool, ...] = ()  # per layer: a local (sliding-window) layer; () for none
    local_rope_theta: float | None = None  # the local layers' rope base

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.local_layers and (len(self.local_layers) != self.num_layers or not self.sliding_window):
            raise ValueError("local_layers needs one entry per layer and a sliding_window")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported activation {self.activation!r}: silu or gelu_tanh")

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def has_local_layers(self) -> bool:
        return any(self.local_layers)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from the contents of an HF `config.json`."""
        archs = hf.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r}: trace-jax supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        gemma = family == "gemma3"
        if gemma and (hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping")):
            raise ValueError("logit soft-capping (Gemma 2) is not implemented")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "gemma3"),
            family=family,
            **(_gemma3(hf, head_dim) if gemma else {}),
        )

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> ModelConfig:
        """Reads `<path>/config.json`."""
        config_file = pathlib.Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        return cls.from_hf_dict(read_json(config_file))


def _gemma3(hf: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Gemma 3's fields: its layer types (or the older sliding-window pattern: every n-th layer global)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(layers)
    ]
    params = hf.get("rope_parameters") or {}
    local = params.get("sliding_attention", {}).get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0
    return dict(
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=float(hf["hidden_size"]) ** 0.5,
        activation="gelu_tanh",
        query_scale=float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        sliding_window=int(hf["sliding_window"]),
        local_layers=tuple(t == "sliding_attention" for t in types),
        local_rope_theta=float(local),
    )


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters` (Gemma 3: one per layer type, the global layers' read here);
    older files use `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return params.get("full_attention", params)


def _rope_theta(hf: dict[str, Any]) -> float:
    return float(hf.get("rope_theta") or _rope_parameters(hf).get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    params = _rope_parameters(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling {rope_type!r}: only 'llama3' is implemented")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
