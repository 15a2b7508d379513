"""Test-session setup: 8 fake CPU devices (for the sharding tests), offline hubs, fp32."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pathlib  # noqa: E402

from trace_jax.runtime import retain_freed_memory  # noqa: E402

retain_freed_memory()  # as every launch entry point does (see launch/__init__.py)

import pytest  # noqa: E402

from hf_checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, tuple[pathlib.Path, object]]:
    """family -> (HF folder, torch model) for tiny random Llama, Qwen2 and Qwen3 models."""
    root = tmp_path_factory.mktemp("tiny")
    return {fam: (root / fam, make_checkpoint(fam, root / fam)) for fam in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache), fp32."""
    from trace_jax.models.model import load_model

    return load_model("smollm2-135m-instruct")
