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

`efficiency` measures the engine's own overhead rather than its workload: `ideal_s` / the engine's wall time,
where `ideal_s` is what the sampler's jitted calls take, timed in the same run after a warm-up, to do the same
token work with no host work and no compiles: the tokens the timed run prefilled (its rows' own and its shared
system prompts'; not the openings it copied from rows holding them) prefilled in full-batch rows (the run's own
tokens, cut into `batch_size` equal rows) and its generated tokens decoded at the engine's mean busy rows per
decode step. Beside it: `programs_compiled_timed` (XLA compiles during the timed run, each a program the
engine did not have after its warm-up), `programs_total`, `decode_steps_per_call`, `host_s`, the backend and
the device.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time

import jax
from absl import app, flags, logging

from launch import agents
from launch.sampler_flags import SAMPLER_POLICY
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


def _ideal_seconds(
    sampler: Sampler, tokens: list[int], fed: int, generated: int, rows: int, busy_rows: float
) -> dict[str, float]:
    """The sampler's own time for the token work of a run (see the module docstring): `fed` tokens prefilled in
    `rows` rows of equal length (cut from `tokens`, cycled; in rounds where a row would overflow the context),
    and `generated` tokens decoded at `busy_rows` rows."""
    length = max(1, math.ceil(fed / rows))
    rounds = math.ceil(length / (sampler.max_context - 2))
    length = math.ceil(length / rounds)
    stream = (tokens * math.ceil(rows * length / len(tokens)))[: rows * length]
    prompts = [stream[i * length : (i + 1) * length] for i in range(rows)]
    prefill_s = rounds * _time_sampler(sampler, prompts, 1)
    busy = max(1, round(busy_rows))
    short = [stream[i * 16 : (i + 1) * 16] for i in range(busy)]
    steps = max(1, round(generated / busy))
    decode_s = max(0.0, _time_sampler(sampler, short, steps + 1) - _time_sampler(sampler, short, 1))
    return {"prefill_s": round(prefill_s, 2), "decode_s": round(decode_s, 2), "ideal_s": round(prefill_s + decode_s, 2)}


def _programs(sampler: Sampler) -> dict[str, int]:
    """How many programs each of the sampler's jitted functions has so far (compiled or loaded)."""
    return {f.name: getattr(sampler.programs, f.name)._cache_size() for f in dataclasses.fields(sampler.programs)}


def main(argv: list[str]) -> None:
    del argv
    agents.ensure_built(_MODEL.value)
    model = load_model(_MODEL.value, _DTYPE.value)
    sampler = Sampler(model.cfg, model.params, detokenize=model.tokenizer.decode, policy=SAMPLER_POLICY.value)
    env = EmbeddedRetail(seed=0)
    config = RolloutConfig(
        batch_size=_BATCH.value, max_turns=_TURNS.value, max_tokens_per_turn=_TOKENS.value, temperature=0.0
    )
    engine = RolloutEngine(env, sampler=sampler, tokenizer=model.tokenizer, config=config)
    tasks = env.tasks("heldout", _BATCH.value + _EPISODES.value)
    engine.run([EpisodeSpec(task) for task in tasks[: _BATCH.value]], key=jax.random.key(0))  # warm-up: compiles
    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda name, **_: events.update([name]))
    jax.monitoring.register_event_duration_secs_listener(lambda name, _, **__: events.update([name]))
    programs, start = _programs(sampler), time.perf_counter()
    trajectories = engine.run([EpisodeSpec(task) for task in tasks[_BATCH.value :]], key=jax.random.key(1))
    seconds = time.perf_counter() - start
    new_programs = {name: count - programs[name] for name, count in _programs(sampler).items()}
    loaded = events["/jax/compilation_cache/cache_hits"]
    compiled = events["/jax/core/compile/backend_compile_duration"]
    programs_total = sum(_programs(sampler).values())  # the engine's, before the timings below add theirs
    generated = sum(t.generated_tokens for t in trajectories)
    fed = sum(len(t.token_ids) for t in trajectories) - generated
    first_prompts = [
        t.token_ids[: t.loss_mask.index(1)] if 1 in t.loss_mask else t.token_ids for t in trajectories[: _BATCH.value]
    ]
    per_row = max(1, round(generated / len(first_prompts)))
    sampler_seconds = _time_sampler(sampler, first_prompts, per_row)
    engine_rate, sampler_rate = generated / seconds, len(first_prompts) * per_row / sampler_seconds
    profile = rollout_profile(engine.stats)
    ideal = _ideal_seconds(
        sampler,
        [token for t in trajectories for token in t.token_ids],
        profile["prefill_tokens"] + profile["prefix_tokens"],
        generated,
        _BATCH.value,
        profile["rows_per_decode_step"],
    )
    result = {
        "model": _MODEL.value,
        "cpu": runtime.cpu_name(),
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "dtype": _DTYPE.value,
        "sampler_policy": sampler.policy,
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
        "efficiency": round(ideal["ideal_s"] / seconds, 3),
        "ideal": ideal,
        "programs_compiled_timed": compiled,
        "programs_total": programs_total,
        "decode_steps_per_call": round(profile["decode_steps"] / max(profile["decode_calls"], 1), 2),
        "host_s": profile["host_s"],
        "profile": {
            **profile,
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
