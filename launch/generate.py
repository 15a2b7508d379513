"""Generates text from a base model (optionally with a PEFT LoRA adapter).

  python -m launch.generate --prompt="What is the capital of France?" --chat --json

With --json it prints one JSON line: token_ids, text, finish_reason, logprobs,
prompt_token_ids, seconds. Without --chat the prompt is tokenized raw (the
tokenizer's default special tokens, no chat template).
"""

from __future__ import annotations

import json
import time

import jax
from absl import app, flags

from launch import agents
from launch.sampler_flags import SAMPLER_POLICY
from trace_jax import lora
from trace_jax.models.model import DTYPES, load_model
from trace_jax.sampling import Sampler

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Embedded model name or HF checkpoint folder.")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text.", required=True)
_CHAT = flags.DEFINE_bool("chat", False, "Wrap the prompt as a user turn with the model's chat template.")
_SYSTEM = flags.DEFINE_string("system", None, "System message (with --chat).")
_ADAPTER = flags.DEFINE_string("adapter", None, "PEFT LoRA adapter folder.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 means greedy.", lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.", lower_bound=0.0, upper_bound=1.0)
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k sampling (0: off).", lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed for sampling.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(DTYPES), "Parameter dtype.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line instead of the text.")


def main(argv):
    del argv
    agents.ensure_built(_MODEL.value)
    model = load_model(_MODEL.value, _DTYPE.value)
    tok = model.tokenizer
    if _CHAT.value:
        messages = [{"role": "system", "content": _SYSTEM.value}] if _SYSTEM.value else []
        prompt_ids = tok.apply_chat(messages + [{"role": "user", "content": _PROMPT.value}])
    else:
        prompt_ids = tok.encode(_PROMPT.value, add_special_tokens=True)
    adapters = lora.load_peft(_ADAPTER.value, model.cfg, DTYPES[_DTYPE.value]) if _ADAPTER.value else None
    sampler = Sampler(
        model.cfg,
        model.params,
        adapters=adapters,
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
        policy=SAMPLER_POLICY.value,
        tokenize=tok.encode,
    )
    start = time.time()
    (out,), _ = sampler.generate(
        [prompt_ids],
        key=jax.random.key(_SEED.value),
        max_new_tokens=_MAX_NEW.value,
        temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value,
        top_k=_TOP_K.value,
        adapter_idx=0 if adapters is not None else lora.NO_ADAPTER,
        stop_token_ids=sorted(tok.eos_token_ids),
    )
    seconds = time.time() - start
    if _JSON.value:
        print(
            json.dumps(
                {
                    "model": str(_MODEL.value),
                    "prompt_token_ids": prompt_ids,
                    "token_ids": out.token_ids,
                    "text": out.text,
                    "finish_reason": out.finish_reason,
                    "logprobs": out.logprobs,
                    "seconds": round(seconds, 3),
                }
            )
        )
    else:
        print(out.text)


if __name__ == "__main__":
    app.run(main)
