"""Loads HF safetensors checkpoints into the decoder's parameter tree, and writes them back.

One table maps HF tensor names to tree paths; linear weights are transposed from
HF's [out, in] to [in, out]; `params["layers"]` is a list with one dict per layer.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from trace_jax.files import read_json, write_file_if_changed, write_if_changed
from trace_jax.models.config import ModelConfig

# (HF name after "model.layers.{i}.", path in a layer's dict, is a linear weight [out, in]).
_LAYER_TENSORS = [
    ("input_layernorm.weight", ("attn_norm",), False),
    ("post_attention_layernorm.weight", ("mlp_norm",), False),
    ("self_attn.q_norm.weight", ("q_norm",), False),
    ("self_attn.k_norm.weight", ("k_norm",), False),
] + [
    (f"{module}.{proj}.{kind}", (proj, "kernel" if kind == "weight" else "bias"), kind == "weight")
    for module, projs in (
        ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
        ("mlp", ("gate_proj", "up_proj", "down_proj")),
    )
    for proj in projs
    for kind in ("weight", "bias")
]
# Gemma 3's norms around both blocks: post_attention_layernorm is the attention output's, the MLP's input norm is
# pre_feedforward_layernorm.
_SANDWICH_TENSORS = [
    ("post_attention_layernorm.weight", ("post_attn_norm",), False),
    ("pre_feedforward_layernorm.weight", ("mlp_norm",), False),
    ("post_feedforward_layernorm.weight", ("post_mlp_norm",), False),
]
_GLOBAL_TENSORS = [
    ("model.embed_tokens.weight", "embed", False),
    ("model.norm.weight", "final_norm", False),
    ("lm_head.weight", "lm_head", True),
]


def _layer_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], bool]]:
    if not cfg.sandwich_norms:
        return _LAYER_TENSORS
    return [t for t in _LAYER_TENSORS if t[0] != "post_attention_layernorm.weight"] + _SANDWICH_TENSORS


def _safetensors_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index)["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def iter_hf_tensors(model_dir: pathlib.Path) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors by HF name, as float32 NumPy arrays (bfloat16 files included)."""
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="flax") as f:
            for name in f.keys():
                yield name, np.asarray(f.get_tensor(name).astype(jnp.float32))


def load_params(model_dir: str | pathlib.Path, cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """Reads the checkpoint in `model_dir` into the parameter tree, cast to `dtype`."""
    model_dir = pathlib.Path(model_dir)
    tensors = dict(iter_hf_tensors(model_dir))
    params: dict = {}
    for hf_name, key, transpose in _GLOBAL_TENSORS:
        if hf_name in tensors:
            params[key] = tensors.pop(hf_name).T if transpose else tensors.pop(hf_name)
    if cfg.tie_word_embeddings:
        params.pop("lm_head", None)
    elif "lm_head" not in params:
        raise ValueError(f"{model_dir}: untied model without lm_head.weight")
    layers = []
    for i in range(cfg.num_layers):
        layer: dict = {}
        for suffix, path, transpose in _layer_tensors(cfg):
            name = f"model.layers.{i}.{suffix}"
            if name in tensors:
                node = layer
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = tensors.pop(name).T if transpose else tensors.pop(name)
        layers.append(layer)
    params["layers"] = layers
    leftover = [n for n in tensors if "rotary_emb" not in n]
    if leftover:
        raise ValueError(f"{model_dir}: unexpected tensors {leftover[:5]} (is config.json right?)")
    _check_shapes(params, cfg)
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


def _check_shapes(params: dict, cfg: ModelConfig) -> None:
    required = {"attn_norm", "mlp_norm", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    required |= {"q_norm", "k_norm"} if cfg.qk_norm else set()
    required |= {"post_attn_norm", "post_mlp_norm"} if cfg.sandwich_norms else set()
    for i, layer in enumerate(params["layers"]):
        if set(layer) != required:
            raise ValueError(f"layer {i} has tensors {sorted(layer)}, expected {sorted(required)}")
    q_out = params["layers"][0]["q_proj"]["kernel"].shape[-1]
    if params["embed"].shape != (cfg.vocab_size, cfg.hidden_size) or q_out != cfg.num_heads * cfg.head_dim:
        raise ValueError("checkpoint shapes do not match config.json")


def to_hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The parameter tree as HF-named fp32 numpy tensors (inverse of `load_params`)."""
    out: dict[str, np.ndarray] = {}
    for hf_name, key, transpose in _GLOBAL_TENSORS:
        if key in params:
            value = np.asarray(params[key], np.float32)
            out[hf_name] = np.ascontiguousarray(value.T if transpose else value)
    for i, layer in enumerate(params["layers"]):
        for suffix, path, transpose in _layer_tensors(cfg):
            node = layer
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None:
                value = np.asarray(node, np.float32)
                out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(value.T if transpose else value)
    return out


def save_hf_checkpoint(
    params: dict, cfg_dir: str | pathlib.Path, out_dir: str | pathlib.Path, cfg: ModelConfig
) -> None:
    """Writes `params` as an HF folder: config.json (and tokenizer files) copied from `cfg_dir`. Files that
    already hold the same bytes are left as they are (`files.write_file_if_changed`)."""
    write_hf_folder(to_hf_tensors(params, cfg), cfg_dir, out_dir)


def write_hf_folder(tensors: dict[str, np.ndarray], cfg_dir: str | pathlib.Path, out_dir: str | pathlib.Path) -> None:
    """Writes HF `tensors` as model.safetensors in `out_dir` with config.json and the tokenizer files of `cfg_dir`
    beside them; files that already hold the same bytes are left as they are (`files.write_file_if_changed`)."""
    cfg_dir, out_dir = pathlib.Path(cfg_dir), pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in cfg_dir.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.suffix in (".json", ".txt", ".model", ".jinja"):
            write_if_changed(out_dir / f.name, f.read_bytes())
    write_file_if_changed(
        out_dir / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"})
    )
