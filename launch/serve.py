"""An OpenAI-compatible server for a base model, its LoRA adapters and a TRACE run's router.

  python -m launch.serve --model=smollm2-135m-instruct --adapters=a=/path/to/peft_a,b=/path/to/peft_b
  python -m launch.serve --trace_run=runs/trace_embedded          # its base model, adapters and router

Requests name `model`: the base (--served_name), an adapter by its name, or `trace`, whose router picks the
adapter of each conversation from its opening messages (the response's `route` says which). Concurrent
requests share one continuously batched sampler (trace_jax/serve/engine.py). Prints one JSON line
{"url", "models"} once it listens.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket

import uvicorn
from absl import app, flags

from launch import agents
from launch.sampler_flags import SAMPLER_POLICY
from trace_jax import lora
from trace_jax.models.model import DTYPES, load_model
from trace_jax.sampling import Sampler
from trace_jax.serve.app import Server, build_app
from trace_jax.serve.engine import ServingEngine
from trace_jax.serve.models import Catalog, TraceRouter, trace_run_adapters, trace_run_model

_MODEL = flags.DEFINE_string(
    "model",
    None,
    "Embedded model name or HF checkpoint folder (default: the TRACE run's "
    "model with --trace_run, else smollm2-135m-instruct).",
)
_ADAPTERS = flags.DEFINE_list("adapters", [], "name=PEFT folder, ... : adapters served under those names.")
_TRACE_RUN = flags.DEFINE_string(
    "trace_run", None, "A finished TRACE run's workdir: its adapters and, as model 'trace', its router."
)
_SERVED_NAME = flags.DEFINE_string("served_name", None, "The base model's name in requests (default: --model's).")
_DTYPE = flags.DEFINE_enum("dtype", None, list(DTYPES), "Parameter dtype (default: the run's, else float32).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free one, printed).", lower_bound=0)
_BATCH = flags.DEFINE_integer(
    "batch", 16, "Rows of the shared batch: requests (choices) sampled at once.", lower_bound=1
)
_MAX_CONTEXT = flags.DEFINE_integer(
    "max_context", None, "Tokens per row, prompt and completion (default: the model's).", lower_bound=2
)
_MAX_TOKENS = flags.DEFINE_integer(
    "default_max_tokens", 512, "Completion tokens when a request sets no max_tokens.", lower_bound=1
)
_DECODE_CHUNK = flags.DEFINE_integer(
    "decode_chunk", 16, "Tokens per decode call at most (streaming granularity).", lower_bound=1
)
_SEED = flags.DEFINE_integer("seed", 0, "Key of every random draw; a request's `seed` picks its stream.")
_API_KEY = flags.DEFINE_string(
    "api_key",
    os.environ.get("TRACE_JAX_API_KEY", ""),
    "Requests must send 'Authorization: Bearer <key>' (default: $TRACE_JAX_API_KEY; empty: anyone who can reach "
    "the port is served).",
)
_MAX_BODY_MB = flags.DEFINE_float("max_body_mb", 8.0, "Largest request body taken (MB); larger: 413.", lower_bound=0)
_MAX_WAITING = flags.DEFINE_integer(
    "max_waiting", 256, "Requests queued beyond the running ones; more: 429 with Retry-After.", lower_bound=1
)


def named_adapters(specs: list[str]) -> dict[str, str]:
    """name -> folder from --adapters' `name=folder` items."""
    adapters = {}
    for spec in specs:
        name, _, folder = spec.partition("=")
        if not name or not folder:
            raise app.UsageError(f"--adapters: {spec!r} is not name=folder")
        if not pathlib.Path(folder, "adapter_config.json").is_file():
            raise app.UsageError(f"--adapters: {folder!r} is not a PEFT adapter folder (no adapter_config.json)")
        adapters[name] = folder
    return adapters


def build_server(
    model_name: str,
    dtype: str,
    adapters: dict[str, str],
    trace_run: str | None,
    served_name: str,
    *,
    batch: int,
    max_context: int | None,
    default_max_tokens: int,
    decode_chunk: int,
    seed: int,
    max_waiting: int = 256,
    api_key: str = "",
    max_body_bytes: int = 8 * 2**20,
    sampler_policy: str | None = None,
) -> Server:
    """The model, its adapter stack (--adapters, then the run's), the engine and the served names."""
    model = load_model(model_name, dtype)
    run_adapters = trace_run_adapters(trace_run) if trace_run else {}
    clash = set(adapters) & set(run_adapters)
    if clash:
        raise app.UsageError(f"--adapters names {sorted(clash)} are the TRACE run's adapters too")
    folders = {**adapters, **run_adapters}
    stack = (
        lora.stack_adapters([lora.load_peft(f, model.cfg, DTYPES[dtype]) for f in folders.values()])
        if folders
        else None
    )
    tokenizer = model.tokenizer
    sampler = Sampler(
        model.cfg,
        model.params,
        adapters=stack,
        max_context=max_context,
        decode_chunk=decode_chunk,
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        policy=sampler_policy,
        tokenize=tokenizer.encode,
    )
    engine = ServingEngine(sampler, sorted(tokenizer.eos_token_ids), batch=batch, seed=seed, max_waiting=max_waiting)
    router = TraceRouter(model, trace_run, {name: i for i, name in enumerate(folders)}) if trace_run else None
    catalog = Catalog(served_name, list(folders), router)
    return Server(engine, catalog, tokenizer, default_max_tokens, api_key=api_key, max_body_bytes=max_body_bytes)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    model_name, dtype = _MODEL.value, _DTYPE.value
    if _TRACE_RUN.value:
        run_model, run_dtype = trace_run_model(_TRACE_RUN.value)
        model_name, dtype = model_name or run_model, dtype or run_dtype
    model_name, dtype = model_name or "smollm2-135m-instruct", dtype or "float32"
    agents.ensure_built(model_name)
    served_name = _SERVED_NAME.value or pathlib.Path(model_name).name
    server = build_server(
        model_name,
        dtype,
        named_adapters(_ADAPTERS.value),
        _TRACE_RUN.value,
        served_name,
        batch=_BATCH.value,
        max_context=_MAX_CONTEXT.value,
        default_max_tokens=_MAX_TOKENS.value,
        decode_chunk=_DECODE_CHUNK.value,
        seed=_SEED.value,
        max_waiting=_MAX_WAITING.value,
        api_key=_API_KEY.value,
        max_body_bytes=int(_MAX_BODY_MB.value * 2**20),
        sampler_policy=SAMPLER_POLICY.value,
    )
    sock = socket.create_server((_HOST.value, _PORT.value))  # listening now: clients queue until uvicorn accepts
    host, port = sock.getsockname()[:2]
    print(json.dumps({"url": f"http://{host}:{port}/v1", "models": server.catalog.names()}), flush=True)
    try:
        uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning")).run(sockets=[sock])
    finally:
        server.engine.close()


if __name__ == "__main__":
    app.run(main)
