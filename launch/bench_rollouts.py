"""Rollout engine throughput on the embedded retail environment (the main job's workload).

  python -m launch.bench_rollouts --json [--episodes=32] [--batch_size=16]

Plays held-out tasks with the embedded SmolLM2-135M-Instruct (greedy, fp32) through the
batched engine, once to warm up (compilation) and once timed. The final line is JSON
with episodes per minute, generated tokens per second and the end reasons.
"""

from __future__ import annotations

import collections
import json
import time

import jax
from absl import app, flags, logging

from trace_jax.agent.rollout import Job, RolloutConfig, RolloutEngine
from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.models.model import load_model
from trace_jax.sampling import Sampler

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Embedded model name or HF checkpoint folder.")
_EPISODES = flags.DEFINE_integer("episodes", 32, "Episodes in the timed run.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Sampler rows (episodes played at once).")
_TURNS = flags.DEFINE_integer("max_turns", 6, "Agent turns per episode.")
_TOKENS = flags.DEFINE_integer("max_tokens_per_turn", 128, "Tokens per turn.")
_JSON = flags.DEFINE_bool("json", False, "Print the final result as one JSON line.")


def main(argv: list[str]) -> None:
    del argv
    model = load_model(_MODEL.value, "float32")
    sampler = Sampler(model.cfg, model.params, detokenize=model.tokenizer.decode)
    env = EmbeddedRetail(seed=0)
    config = RolloutConfig(batch_size=_BATCH.value, max_turns=_TURNS.value,
                           max_tokens_per_turn=_TOKENS.value, temperature=0.0)
    engine = RolloutEngine(env, sampler=sampler, tokenizer=model.tokenizer, config=config)
    tasks = env.tasks("heldout", _BATCH.value + _EPISODES.value)
    engine.run([Job(task) for task in tasks[: _BATCH.value]], key=jax.random.key(0))  # warm-up: compiles
    start = time.perf_counter()
    trajectories = engine.run([Job(task) for task in tasks[_BATCH.value :]], key=jax.random.key(1))
    seconds = time.perf_counter() - start
    generated = sum(t.generated_tokens for t in trajectories)
    result = {"episodes": len(trajectories), "seconds": round(seconds, 1),
              "episodes_per_min": round(60 * len(trajectories) / seconds, 2),
              "generated_tokens_per_s": round(generated / seconds, 1), "generated_tokens": generated,
              "mean_turns": round(sum(t.num_turns for t in trajectories) / len(trajectories), 2),
              "end_reasons": dict(collections.Counter(t.end_reason for t in trajectories)),
              "batch_size": _BATCH.value, "max_turns": _TURNS.value, "max_tokens_per_turn": _TOKENS.value}
    logging.info("rollouts: %s", result)
    if _JSON.value:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main)
