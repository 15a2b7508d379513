"""Load test of `launch.serve` on the loopback address: many concurrent OpenAI clients, mixed models and lengths.

  python -m launch.bench_serve --random_adapters=2 --json            # starts a server on the embedded model
  python -m launch.bench_serve --base_url=http://127.0.0.1:8000/v1 --json   # or loads a running one

`--requests` chat requests (greedy, `max_tokens` cycling through `--max_tokens`, prompts of different lengths,
`model` cycling through every served name) from `--clients` concurrent clients, stopped after `--duration_s`.
The last line is JSON: requests done and failed, requests/s, completion tokens/s and p50/p99 latency.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import httpx
import jax
import numpy as np
import openai
from absl import app, flags

from launch import agents
from trace_jax import lora, runtime
from trace_jax.models.model import load_model

_BASE_URL = flags.DEFINE_string("base_url", None, "A running server's /v1 URL (default: start one).")
_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "The started server's --model.")
_ADAPTERS = flags.DEFINE_list("adapters", [], "The started server's --adapters (name=folder, ...).")
_RANDOM_ADAPTERS = flags.DEFINE_integer(
    "random_adapters",
    0,
    "Also serve this many random adapters (rank 16 on q, k, v, o): their speed is a trained one's.",
    lower_bound=0,
)
_BATCH = flags.DEFINE_integer("batch", 16, "The started server's --batch.", lower_bound=1)
_CLIENTS = flags.DEFINE_integer("clients", 64, "Concurrent clients.", lower_bound=1)
_REQUESTS = flags.DEFINE_integer("requests", 128, "Requests in all.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_list("max_tokens", ["16", "64"], "Completion lengths, cycled through.")
_DURATION = flags.DEFINE_float("duration_s", 600.0, "No request starts after this many seconds.")
_JSON = flags.DEFINE_bool("json", False, "Print only the result's JSON line.")

_ASKS = [
    "Where is my order?",
    "Please cancel order #W2378156 because I no longer need it.",
    "I want to return the hiking boots from my last order and get the refund on my gift card. "
    "My e-mail is mei.kim@example.com and my zip code is 80217.",
    "Can you change the shipping address of my pending order to 445 Maple Drive, Suite 394, Fort Worth, "
    "TX 76165? I moved last week and the order has not shipped. Also tell me how much I paid for it.",
]


def random_adapters(model_name: str, count: int, folder: pathlib.Path) -> list[str]:
    """`count` PEFT adapters with random weights for `model_name`, as --adapters items."""
    cfg = load_model(model_name).cfg
    items = []
    for i in range(count):
        spec = lora.LoraSpec(rank=16, alpha=16)
        stack = lora.init_adapters(jax.random.key(i), cfg, spec)
        weights = {
            t: {"a": w["a"], "b": jax.random.normal(jax.random.key(100 + i), w["b"].shape) * 0.01}
            for t, w in stack.weights.items()
        }
        lora.save_peft(lora.Adapters(weights, stack.scale), folder / f"random_{i}")
        items.append(f"random_{i}={folder / f'random_{i}'}")
    return items


def start_server(flags: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`launch.serve` with `flags` on a free loopback port; (process, its /v1 URL) once it listens."""
    process = subprocess.Popen(
        [sys.executable, "-m", "launch.serve", "--port=0", *flags], stdout=subprocess.PIPE, text=True, env=env
    )
    for line in process.stdout:
        if line.startswith("{"):
            return process, json.loads(line)["url"]
    raise RuntimeError(f"launch.serve exited ({process.wait()}) before it listened")


async def load(
    base_url: str, clients: int, requests: int, lengths: list[int], duration_s: float, api_key: str = "unused"
) -> dict:
    """Plays the load on `base_url` (with the server's `api_key`, where it has one); the measurements."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)
    models = [m.id for m in (await client.models.list()).data]
    gate, start = asyncio.Semaphore(clients), time.perf_counter()
    latencies, tokens, errors = [], [0], []

    async def one(i: int) -> None:
        async with gate:
            if time.perf_counter() - start > duration_s:
                return
            sent = time.perf_counter()
            try:
                reply = await client.chat.completions.create(
                    model=models[i % len(models)],
                    messages=[{"role": "user", "content": _ASKS[i % len(_ASKS)]}],
                    max_tokens=lengths[i % len(lengths)],
                    temperature=0,
                )
            except openai.OpenAIError as error:
                errors.append(f"{type(error).__name__}: {error}")
                return
            latencies.append(time.perf_counter() - sent)
            tokens[0] += reply.usage.completion_tokens

    await asyncio.gather(*(one(i) for i in range(requests)))
    seconds = time.perf_counter() - start
    await client.close()
    auth = {"authorization": f"Bearer {api_key}"}
    stats = httpx.get(base_url.removesuffix("/v1") + "/stats", headers=auth).json()
    return {
        "cpu": runtime.cpu_name(),
        "models": models,
        "clients": clients,
        "requests": len(latencies),
        "errors": len(errors),
        "first_errors": errors[:3],
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(latencies) / seconds, 3),
        "tokens_per_s": round(tokens[0] / seconds, 1),
        "completion_tokens": tokens[0],
        "latency_p50_s": round(float(np.percentile(latencies, 50)), 3) if latencies else None,
        "latency_p99_s": round(float(np.percentile(latencies, 99)), 3) if latencies else None,
        "server": stats,
    }


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    agents.ensure_built(_MODEL.value)
    scratch = tempfile.TemporaryDirectory()
    adapters = _ADAPTERS.value + random_adapters(_MODEL.value, _RANDOM_ADAPTERS.value, pathlib.Path(scratch.name))
    flags = [f"--model={_MODEL.value}", f"--batch={_BATCH.value}"] + (
        [f"--adapters={','.join(adapters)}"] if adapters else []
    )
    process, url = (None, _BASE_URL.value) if _BASE_URL.value else start_server(flags)
    try:
        result = asyncio.run(
            load(url, _CLIENTS.value, _REQUESTS.value, [int(n) for n in _MAX_TOKENS.value], _DURATION.value)
        )
    finally:
        if process is not None:
            process.terminate()
            process.wait()
        scratch.cleanup()
    if not _JSON.value:
        print(
            f"{result['requests']} requests ({result['errors']} failed) in {result['seconds']} s: "
            f"{result['requests_per_s']} requests/s, {result['tokens_per_s']} tokens/s, latency p50 "
            f"{result['latency_p50_s']} s, p99 {result['latency_p99_s']} s"
        )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main)
