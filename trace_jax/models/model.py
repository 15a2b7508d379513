"""One call from a model name or HF folder to everything needed to run it."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib

import jax.numpy as jnp

from trace_jax.files import write_text_atomic
from trace_jax.models.config import ModelConfig
from trace_jax.models.embedded import resolve_model_dir
from trace_jax.models.loading import load_params
from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.runtime import default_cache_dir

_MARKER_PREFIX = "trace_jax_"  # the project's markers in a model folder (how it was built), not its weights
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
    """A short id of what a model or adapter folder holds (its files' names and contents, the project's own
    `trace_jax_*` bookkeeping markers left out): the same weights give the same id on any machine, so results
    recorded for them (a calibration try, an evaluation's episodes) are found again after the folder is rebuilt
    or copied, and never taken for other weights. The content hash is read once per file listing (names, sizes,
    modification times) and remembered under the cache dir's `fingerprints/`."""
    folder = pathlib.Path(folder).resolve()
    files = sorted(f for f in folder.iterdir() if f.is_file() and not f.name.startswith(_MARKER_PREFIX))
    listing = [str(folder)] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    memo = default_cache_dir() / "fingerprints" / hashlib.sha256(repr(listing).encode()).hexdigest()[:32]
    try:
        return memo.read_text(encoding="utf-8").strip()
    except OSError:
        pass
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as stream:
            digest.update(f"{f.name}\0{hashlib.file_digest(stream, 'sha256').hexdigest()}\0".encode())
    fingerprint = digest.hexdigest()[:16]
    write_text_atomic(memo, fingerprint)
    return fingerprint
