"""One call from a model name or HF folder to everything needed to run it."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib

import jax.numpy as jnp

from trace_jax.models.config import ModelConfig
from trace_jax.models.embedded import resolve_model_dir
from trace_jax.models.loading import load_params
from trace_jax.models.tokenizer import ChatTokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Model:
    """A frozen base model: config, parameter tree, tokenizer and the folder they came from."""

    cfg: ModelConfig
    params: dict
    tokenizer: ChatTokenizer
    path: pathlib.Path


def load_model(name_or_path: str | os.PathLike, dtype: str = "float32") -> Model:
    """Loads an embedded model by name (e.g. "smollm2-135m-instruct") or an HF checkpoint folder."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = resolve_model_dir(name_or_path)
    cfg = ModelConfig.from_dir(path)
    return Model(cfg, load_params(path, cfg, DTYPES[dtype]), ChatTokenizer.from_dir(path), path)


def weights_fingerprint(folder: str | os.PathLike) -> str:
    """A short id of the files in a model or adapter folder (names, sizes, modification times):
    it changes when the folder is rebuilt (an embedded agent from another warm-start config), so
    results recorded for one set of weights are not taken for another's. Cheap for any model size."""
    files = sorted(f for f in pathlib.Path(folder).iterdir() if f.is_file())
    listing = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha256(repr(listing).encode()).hexdigest()[:16]
