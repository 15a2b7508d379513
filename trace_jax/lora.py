"""LoRA adapters kept apart from the frozen base: init, stacking, selection, merge, PEFT I/O.

N adapters are stacked on a leading axis: weights[target] = {"a": [N, L, in, r],
"b": [N, L, r, out]} and scale [N] (alpha / rank). Each batch row picks one by
index; `NO_ADAPTER` (-1) means the bare base model, which is also the reference
policy for KL terms. The pieces the decoder applies per row live in `trace_jax.models.adapters`; this module
re-exports them as the LoRA API (`lora.Adapters`, `lora.NO_ADAPTER`, ...).
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save

from trace_jax.files import read_json, write_if_changed
from trace_jax.models.adapters import ALL_TARGETS as ALL_TARGETS
from trace_jax.models.adapters import NO_ADAPTER as NO_ADAPTER
from trace_jax.models.adapters import Adapters as Adapters
from trace_jax.models.adapters import LoraSpec as LoraSpec
from trace_jax.models.adapters import for_rows as for_rows
from trace_jax.models.config import ModelConfig
from trace_jax.models.loading import iter_hf_tensors, write_hf_folder

_MODULE_OF = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection."""
    q, kv, d, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }


def init_adapters(
    key: jax.Array, cfg: ModelConfig, spec: LoraSpec, num_adapters: int = 1, dtype=jnp.float32
) -> Adapters:
    """Fresh adapters: A ~ U(-1/sqrt(in), 1/sqrt(in)) as in PEFT, B = 0 (so each starts as the base);
    A = 0 too in the layers below `spec.first_layer`."""
    if spec.first_layer >= cfg.num_layers:
        raise ValueError(f"LoRA first_layer {spec.first_layer} leaves none of the model's {cfg.num_layers} layers")
    shapes = projection_shapes(cfg)
    adapted = (jnp.arange(cfg.num_layers) >= spec.first_layer)[None, :, None, None]
    weights = {}
    for target, k in zip(spec.targets, jax.random.split(key, len(spec.targets))):
        fan_in, fan_out = shapes[target]
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(k, (num_adapters, cfg.num_layers, fan_in, spec.rank), dtype, -bound, bound) * adapted
        weights[target] = {"a": a, "b": jnp.zeros((num_adapters, cfg.num_layers, spec.rank, fan_out), dtype)}
    return Adapters(weights, jnp.full((num_adapters,), spec.scale, jnp.float32))


def stack_adapters(adapters: list[Adapters]) -> Adapters:
    """Concatenates adapter stacks; differing ranks are zero-padded and missing targets zero-filled (exact)."""
    targets = sorted({t for ad in adapters for t in ad.weights})
    rank = max(w["a"].shape[-1] for ad in adapters for w in ad.weights.values())
    weights = {}
    for target in targets:
        template = next(ad.weights[target] for ad in adapters if target in ad.weights)
        parts_a, parts_b = [], []
        for ad in adapters:
            n = ad.num_adapters
            if target in ad.weights:
                a, b = ad.weights[target]["a"], ad.weights[target]["b"]
            else:
                a = jnp.zeros((n, *template["a"].shape[1:]), template["a"].dtype)
                b = jnp.zeros((n, *template["b"].shape[1:]), template["b"].dtype)
            pad = rank - a.shape[-1]
            parts_a.append(jnp.pad(a, [(0, 0)] * 3 + [(0, pad)]))
            parts_b.append(jnp.pad(b, [(0, 0), (0, 0), (0, pad), (0, 0)]))
        weights[target] = {"a": jnp.concatenate(parts_a), "b": jnp.concatenate(parts_b)}
    return Adapters(weights, jnp.concatenate([ad.scale for ad in adapters]))


def _check_index(adapters: Adapters, index) -> None:
    """Rejects a concrete index outside 0 .. N-1 (NO_ADAPTER included), which would silently pick
    an empty slice or the last adapter; traced indices are left alone."""
    if isinstance(index, (int, np.integer)) and not 0 <= index < adapters.num_adapters:
        raise ValueError(f"adapter index {index} is out of range for a stack of {adapters.num_adapters}")


def select_adapter(adapters: Adapters, index: int) -> Adapters:
    """The single adapter at `index`, as a stack of one."""
    _check_index(adapters, index)
    return Adapters(jax.tree.map(lambda w: w[index : index + 1], adapters.weights), adapters.scale[index : index + 1])


def merge_peft_folder(
    base_dir: str | pathlib.Path, adapter_dir: str | pathlib.Path, out_dir: str | pathlib.Path
) -> None:
    """Writes to `out_dir` the HF folder of `base_dir`'s model with the PEFT LoRA adapter of `adapter_dir` folded
    in: W + scale * B @ A for each adapted projection, in float32 (for single-adapter serving, and the embedded
    agents). The product is formed in float64 with the rank summed in a fixed order, not by a BLAS whose
    summation order follows the CPU, so the same two folders give the same bytes on any machine. A projection
    whose delta is all zero keeps the base's bytes (adding 0.0 would turn its -0.0 weights into +0.0), so an
    adapter with zero layers merges as the same adapter with those layers left out does."""
    base_dir, adapter_dir = pathlib.Path(base_dir), pathlib.Path(adapter_dir)
    scale, _ = _peft_scale(adapter_dir)
    tensors = dict(iter_hf_tensors(base_dir))
    pairs = _peft_tensors(adapter_dir)
    for key in sorted(k for k in pairs if ".lora_A." in k):
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        if name not in tensors:
            raise ValueError(f"{adapter_dir}: adapter tensor {key!r} adapts {name!r}, which {base_dir} lacks")
        a, b = (pairs[key.replace("lora_A", ab)].astype(np.float64) for ab in ("lora_A", "lora_B"))
        delta = np.zeros((b.shape[0], a.shape[1]))
        for r in range(a.shape[0]):
            delta += np.multiply.outer(b[:, r], a[r])
        if delta.any():
            tensors[name] = (tensors[name].astype(np.float64) + scale * delta).astype(np.float32)
    write_hf_folder(tensors, base_dir, out_dir)


def _peft_key(layer: int, target: str, ab: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_MODULE_OF[target]}.{target}.lora_{ab}.weight"


def save_peft(adapters: Adapters, out_dir: str | pathlib.Path, *, index: int = 0, base_model: str = "") -> None:
    """Writes adapter `index` in PEFT's format (adapter_config.json + adapter_model.safetensors); files that
    already hold the same bytes are left as they are (`files.write_if_changed`)."""
    out_dir = pathlib.Path(out_dir)
    tensors = {}
    rank = None
    for target, w in adapters.weights.items():
        a, b = np.asarray(w["a"][index], np.float32), np.asarray(w["b"][index], np.float32)
        rank = a.shape[-1]
        for layer in range(a.shape[0]):
            tensors[_peft_key(layer, target, "A")] = np.ascontiguousarray(a[layer].T)  # [r, in]
            tensors[_peft_key(layer, target, "B")] = np.ascontiguousarray(b[layer].T)  # [out, r]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": float(adapters.scale[index]) * rank,
        "target_modules": sorted(adapters.weights),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    write_if_changed(out_dir / "adapter_config.json", json.dumps(config, indent=2).encode())
    write_if_changed(out_dir / "adapter_model.safetensors", save(tensors, metadata={"format": "pt"}))


def _peft_scale(adapter_dir: pathlib.Path) -> tuple[float, dict]:
    """The LoRA scale of a PEFT adapter folder and its adapter_config.json, which must describe a plain LoRA."""
    config = read_json(adapter_dir / "adapter_config.json")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {config.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out"):
        if config.get(key):
            raise ValueError(f"{adapter_dir}: adapter_config.json key {key!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{adapter_dir}: adapter_config.json key 'bias' must be 'none'")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    return (alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank), config


def _peft_tensors(adapter_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """A PEFT adapter folder's tensors by name, PEFT's ".default" infix dropped."""
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    return {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}


def load_peft(adapter_dir: str | pathlib.Path, cfg: ModelConfig, dtype=jnp.float32) -> Adapters:
    """Reads a PEFT LoRA adapter folder into a stack of one."""
    adapter_dir = pathlib.Path(adapter_dir)
    scale, config = _peft_scale(adapter_dir)
    rank = int(config["r"])
    tensors = _peft_tensors(adapter_dir)
    shapes = projection_shapes(cfg)
    layers = config.get("layers_to_transform")
    layers = range(cfg.num_layers) if layers is None else [layers] if isinstance(layers, int) else layers
    bad_layers = [layer for layer in layers if not 0 <= layer < cfg.num_layers]
    if bad_layers:
        raise ValueError(f"{adapter_dir}: layers_to_transform {bad_layers} outside the model's {cfg.num_layers} layers")

    def take(name: str, shape: tuple[int, int]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{adapter_dir}: adapter_model.safetensors is missing tensor {name!r}")
        value = tensors.pop(name)
        if value.shape != shape:
            raise ValueError(
                f"{adapter_dir}: tensor {name!r} has shape {value.shape}, expected {shape} "
                f"(r={rank} in adapter_config.json; is it for this model?)"
            )
        return value.T

    weights = {}
    for target in ALL_TARGETS:
        if not any(f".{target}.lora_A" in k for k in tensors):
            continue
        fan_in, fan_out = shapes[target]
        a = np.zeros((1, cfg.num_layers, fan_in, rank), np.float32)
        b = np.zeros((1, cfg.num_layers, rank, fan_out), np.float32)
        for layer in layers:
            a[0, layer] = take(_peft_key(layer, target, "A"), (rank, fan_in))
            b[0, layer] = take(_peft_key(layer, target, "B"), (fan_out, rank))
        weights[target] = {"a": jnp.asarray(a, dtype), "b": jnp.asarray(b, dtype)}
    if tensors or not weights:
        raise ValueError(f"{adapter_dir}: unsupported adapter tensors {sorted(tensors)[:5]}")
    return Adapters(weights, jnp.full((1,), scale, jnp.float32))
