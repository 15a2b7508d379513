"""Rollout engine throughput on the embedded retail environment (the main job's workload), and
the sampler's on the same rows for scale.

  python -m launch.bench_rollouts --json [--episodes=32] [--batch_size=16]

Plays held-out tickets with the embedded base agent (greedy, fp32) through the batched engine,
once to warm up (compilation) and once timed. Then times `Sampler.generate` on the same rows:
the timed run's first `batch_size` first prompts, which share out the engine's generated tokens
(each row samples generated / rows tokens, no stop token; warmed up the same way). `ratio` is the engine's generated
tokens/s over the sampler's: what tool results, new episodes and rows idling between turns cost
against pure decoding. The final line is JSON with both rates, the ratio, episodes per minute,
the end reasons, the CPU, and a profile (where the time went, and the programs the timed run still
needed: compiled, or loaded from the persistent compilation cache that an earlier run filled).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time

import jax
from absl import app, flags, logging

from launch import agents
from trace_jax import runtime
from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine, rollout_profile
from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.models.model import load_model
from trace_jax.sampling import Sampler

_MODEL = flags.DEFINE_string("model", "smollm2-135m-retail-agent", "Embedded model or agent name, or HF folder.")
_EPISODES = flags.DEFINE_integer("episodes", 32, "Episodes in the timed run.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Sampler rows (episodes played at once).")
_TURNS = flags.DEFINE_integer("max_turns", 6, "Agent turns per episode.")
_TOKENS = flags.DEFINE_integer("max_tokens_per_turn", 128, "Tokens per turn.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute dtype (float32 on CPU; bfloat16 suits accelerators).")
_JSON = flags.DEFINE_bool("json", False, "Print the final result as one JSON line.")


def _time_sampler(sampler: Sampler, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for one `generate` of `new_tokens` per prompt (after a warm-up call of the same shapes)."""
    for key in (0, 1):
        start = time.perf_counter()
        outs, _ = sampler.generate(prompts, key=jax.random.key(key), max_new_tokens=new_tokens)
        seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return seconds


def _programs(sampler: Sampler) -> dict[str, int]:
    """How many programs each of the sampler's jitted functions has so far (compiled or loaded)."""
    return {f.name: getattr(sampler.programs, f.name)._cache_size() for f in dataclasses.fields(sampler.programs)}


def main(argv: list[str]) -> None:
    del argv
    agents.ensure_built(_MODEL.value)
    model = load_model(_MODEL.value, _DTYPE.value)
    sampler = Sampler(model.cfg, model.params, detokenize=model.tokenizer.decode)
    env = EmbeddedRetail(seed=0)
    config = RolloutConfig(
        batch_size=_BATCH.value, max_turns=_TURNS.value, max_tokens_per_turn=_TOKENS.value, temperature=0.0
    )
    engine = RolloutEngine(env, sampler=sampler, tokenizer=model.tokenizer, config=config)
    tasks = env.tasks("heldout", _BATCH.value + _EPISODES.value)
    engine.run([EpisodeSpec(task) for task in tasks[: _BATCH.value]], key=jax.random.key(0))  # warm-up: compiles
    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda name, **_: events.update([name]))
    programs, start = _programs(sampler), time.perf_counter()
    trajectories = engine.run([EpisodeSpec(task) for task in tasks[_BATCH.value :]], key=jax.random.key(1))
    seconds = time.perf_counter() - start
    new_programs = {name: count - programs[name] for name, count in _programs(sampler).items()}
    loaded = events["/jax/compilation_cache/cache_hits"]
    generated = sum(t.generated_tokens for t in trajectories)
    fed = sum(len(t.token_ids) for t in trajectories) - generated
    first_prompts = [
        t.token_ids[: t.loss_mask.index(1)] if 1 in t.loss_mask else t.token_ids for t in trajectories[: _BATCH.value]
    ]
    per_row = max(1, round(generated / len(first_prompts)))
    sampler_seconds = _time_sampler(sampler, first_prompts, per_row)
    engine_rate, sampler_rate = generated / seconds, len(first_prompts) * per_row / sampler_seconds
    result = {
        "model": _MODEL.value,
        "cpu": runtime.cpu_name(),
        "device": jax.devices()[0].device_kind,
        "dtype": _DTYPE.value,
        "episodes": len(trajectories),
        "seconds": round(seconds, 1),
        "episodes_per_min": round(60 * len(trajectories) / seconds, 2),
        "generated_tokens": generated,
        "generated_tokens_per_s": round(engine_rate, 1),
        "fed_tokens": fed,
        "mean_turns": round(sum(t.num_turns for t in trajectories) / len(trajectories), 2),
        "end_reasons": dict(collections.Counter(t.end_reason for t in trajectories)),
        "successes": sum(t.outcome.success for t in trajectories),
        "sampler": {
            "rows": len(first_prompts),
            "new_tokens_per_row": per_row,
            "seconds": round(sampler_seconds, 1),
            "generated_tokens_per_s": round(sampler_rate, 1),
        },
        "ratio": round(engine_rate / sampler_rate, 3),
        "profile": {
            **rollout_profile(engine.stats),
            "new_programs_in_timed_run": new_programs,
            "of_which_loaded_from_compilation_cache": loaded,
        },
        "batch_size": _BATCH.value,
        "max_turns": _TURNS.value,
        "max_tokens_per_turn": _TOKENS.value,
    }
    logging.info("rollouts: %s", result)
    if _JSON.value:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main)
