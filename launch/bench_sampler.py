"""Sampling speed: trace-jax against transformers `generate` on the same prompts.

  python -m launch.bench_sampler --json [--models=smollm2-135m-instruct,gemma-3-270m]

Greedy, fp32, each model in `--models` (embedded names or HF checkpoint folders; the
embedded SmolLM2-135M-Instruct by default, Gemma 3 270M with the `gemma` extra); batch 1 and batch 32,
128 new tokens, every row forced to run the full 128 tokens (no stop tokens) so both
sides generate exactly the same number. Compilation is excluded (one warm-up call).
The final line is JSON: per model, tokens_per_s for each side and the ratios ours / theirs,
all measured in one process on one machine, so the models compare with each other too, and
`same_tokens_batch<n>`: the rows both sides decoded to the same tokens (the same work, timed).
"""

from __future__ import annotations

import json
import time

import jax
from absl import app, flags, logging

from launch import agents
from trace_jax.models.model import load_model
from trace_jax.runtime import cpu_name
from trace_jax.sampling import Sampler

_MODELS = flags.DEFINE_list(
    "models", ["smollm2-135m-instruct"], "Embedded model names or HF checkpoint folders, timed one after another."
)
_BATCHES = flags.DEFINE_list("batches", ["1", "32"], "Batch sizes to time.")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per row.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed runs per setting (the best is kept).")
_JSON = flags.DEFINE_bool("json", False, "Print the final result as one JSON line.")

_QUESTIONS = [
    "How do I cancel an order that has not shipped yet?",
    "Summarise the return policy in two sentences.",
    "What information do you need to change my delivery address?",
    "Write a short apology to a customer whose package is late.",
]


def _prompts(tok, batch: int) -> list[list[int]]:
    return [tok.apply_chat([{"role": "user", "content": _QUESTIONS[i % len(_QUESTIONS)]}]) for i in range(batch)]


def _best_time(fn, repeats: int) -> tuple[float, list[list[int]]]:
    """The best of `repeats` timed calls of `fn` after a warm-up one, and the tokens `fn` returned."""
    tokens = fn()  # warm-up (compilation for ours)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        best = min(best, time.perf_counter() - start)
    return best, tokens


def _time_ours(model, prompts, new_tokens, repeats) -> tuple[float, list[list[int]]]:
    sampler = Sampler(model.cfg, model.params)

    def run():
        outs, _ = sampler.generate(prompts, key=jax.random.key(0), max_new_tokens=new_tokens)
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return [list(o.token_ids) for o in outs]

    return _best_time(run, repeats)


def _time_transformers(model, prompts, new_tokens, repeats) -> tuple[float, list[list[int]]]:
    import torch  # benchmark-only dependency (the project's test extra)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    pad = model.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding, as generate expects
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run():
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
        assert out.shape[1] == width + new_tokens
        return out[:, width:].tolist()

    return _best_time(run, repeats)


def _bench_model(name: str) -> dict:
    """Tokens per second of ours and of transformers for each batch size, on model `name`, and how many rows
    both decoded greedily to the same tokens (fp32: all, but where a near-tie flips a token)."""
    model = load_model(name)
    result = {}
    for batch in map(int, _BATCHES.value):
        prompts = _prompts(model.tokenizer, batch)
        tokens = batch * _NEW.value
        ours_s, ours_tokens = _time_ours(model, prompts, _NEW.value, _REPEATS.value)
        theirs_s, theirs_tokens = _time_transformers(model, prompts, _NEW.value, _REPEATS.value)
        ours, theirs = tokens / ours_s, tokens / theirs_s
        result[f"tokens_per_s_ours_batch{batch}"] = round(ours, 1)
        result[f"tokens_per_s_transformers_batch{batch}"] = round(theirs, 1)
        result[f"ratio_batch{batch}"] = round(ours / theirs, 2)
        result[f"same_tokens_batch{batch}"] = sum(a == b for a, b in zip(ours_tokens, theirs_tokens))
        if not _JSON.value:
            print(
                f"{name} batch {batch}: trace-jax {ours:.1f} tok/s, transformers {theirs:.1f} tok/s, "
                f"ratio {ours / theirs:.2f}"
            )
    return result


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    agents.ensure_built(*_MODELS.value)
    import torch

    result = {
        "max_new_tokens": _NEW.value,
        "dtype": "float32",
        "jax_backend": jax.default_backend(),
        "cpu": cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "models": {name: _bench_model(name) for name in _MODELS.value},
    }
    print(json.dumps(result) if _JSON.value else result)


if __name__ == "__main__":
    app.run(main)
