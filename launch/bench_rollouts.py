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
token work with no host work and no compiles. Prefill: the tokens the timed run prefilled (its rows' own and its
shared system prompts'; not the openings it copied from rows holding them) appended in full-batch chunks of
`prefill_chunk` tokens to `batch_size` rows by the sampler's `prefill` program, in place, each call's chunk at
the mean position of a token the run prefilled (`rollout_profile`'s `prefill_position`). Decode: its generated
tokens decoded at the engine's mean busy rows per decode step in rows of the run's own conversations (which share
their system prompt, as the run's rows do), at the mean position of a generated token. A token attends to every
position before it (one after the 3.4k-token system prompt costs about twice one near the start), so an ideal of
short prompts would count the workload's attention as the engine's overhead. Beside it: `programs_compiled_timed`
(programs XLA compiled during the timed run, each one the engine did not have after its warm-up; by name in
`profile.compiled_in_timed_run`, and those loaded from the persistent compilation cache apart),
`programs_total`, `decode_steps_per_call`, `host_s`, the backend and the device.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time

import jax
import numpy as np
from absl import app, flags, logging

from launch import agents
from launch.sampler_flags import SAMPLER_POLICY
from trace_jax import runtime
from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine, rollout_profile
from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.lora import NO_ADAPTER
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
    """Seconds for one `generate` of `new_tokens` per prompt (after a warm-up call of the same shapes). The freed
    heap goes back to the OS after each call, outside the timing: calls of many cache sizes fragment the retained
    heap, and the full benchmark's sixteen rows of several thousand tokens outgrew 24 GB without it."""
    for key in (0, 1):
        start = time.perf_counter()
        outs = sampler.generate(prompts, key=jax.random.key(key), max_new_tokens=new_tokens)[0]  # the cache goes
        seconds = time.perf_counter() - start
        runtime.release_freed_memory()
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return seconds


def _conversations(conversations: list[list[int]], rows: int, length: int) -> list[list[int]]:
    """`rows` prompts of `length` tokens: the run's conversations from their start (so that rows share the system
    prompt as the run's episodes do), each continued where it is shorter by the run's other tokens."""
    stream = [token for ids in conversations for token in ids]
    prompts = []
    for row in range(rows):
        ids = conversations[row % len(conversations)][:length]
        offset = row * length % len(stream)
        while len(ids) < length:
            ids = ids + stream[offset : offset + length - len(ids)]
            offset = 0
        prompts.append(ids)
    return prompts


def _prefill_seconds(sampler: Sampler, rows: int, tokens: int, position: float) -> float:
    """The sampler's own time to prefill `tokens` tokens in full-batch chunks at mean position `position`: calls
    of its `prefill` program appending `prefill_chunk` tokens to each of `rows` rows, in place, to a cache of
    exactly the positions the call reaches, the chunk centred on `position`; the median of three calls after a
    warm-up call, times the calls `tokens` fill. An attention's cost grows linearly with its position, so a call at
    the mean position costs the mean call. The positions before the chunk hold zeros: values do not change
    the arithmetic."""
    chunk = sampler.prefill_chunk
    head = min(max(0, round(position - chunk / 2)), sampler.max_context - chunk)
    cache = sampler.new_cache(rows, head + chunk)
    batch = cache.batch
    put = lambda values: sampler.put(np.asarray(values, np.int32), "batch")
    ids, lengths = put(np.ones((batch, chunk))), np.full((batch,), head)
    num_new, adapter = put(np.full((batch,), chunk)), put(np.full((batch,), NO_ADAPTER))
    times = []
    for _ in range(4):
        cache = cache.replace(lengths=put(lengths))
        start = time.perf_counter()
        logits, cache = sampler.programs.prefill(sampler.params, sampler.adapters, cache, ids, num_new, adapter)
        logits.block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:])) * tokens / (batch * chunk)


def _ideal_seconds(
    sampler: Sampler,
    conversations: list[list[int]],
    fed: int,
    fed_position: float,
    generated: int,
    generated_position: float,
    rows: int,
    busy_rows: float,
) -> dict[str, float]:
    """The sampler's own time for the token work of a run (see the module docstring): `fed` tokens prefilled at
    mean position `fed_position` in full-batch chunks of `rows` rows (`_prefill_seconds`), and `generated` tokens
    decoded at `busy_rows` rows whose mean position is `generated_position` (rows of the run's `conversations`,
    which share their system prompt: `_conversations`), in rounds where a row would overflow the context."""
    prefill_s = _prefill_seconds(sampler, rows, fed, fed_position)
    room = sampler.max_context - 2
    busy = max(1, round(busy_rows))
    steps = max(1, round(generated / busy))
    rounds = math.ceil(steps / max(1, room - 1))
    steps = math.ceil(steps / rounds)
    start = min(max(1, round(generated_position - steps / 2)), room - steps)
    prompts = _conversations(conversations, busy, start)
    decode_s = rounds * max(0.0, _time_sampler(sampler, prompts, steps + 1) - _time_sampler(sampler, prompts, 1))
    return {
        "prefill_s": round(prefill_s, 2),
        "decode_s": round(decode_s, 2),
        "ideal_s": round(prefill_s + decode_s, 2),
        "prefill_position": round(fed_position),
        "decode_position": round(generated_position),
    }


def _mean_generated_position(trajectories) -> float:
    """The mean position in its conversation of a generated token, over `trajectories`."""
    positions = [p for t in trajectories for p, generated in enumerate(t.loss_mask) if generated]
    return sum(positions) / max(len(positions), 1)


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
    programs, start = _programs(sampler), time.perf_counter()
    with runtime.ProgramLog() as built:
        trajectories = engine.run([EpisodeSpec(task) for task in tasks[_BATCH.value :]], key=jax.random.key(1))
    seconds = time.perf_counter() - start
    new_programs = {name: count - programs[name] for name, count in _programs(sampler).items()}
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
        [t.token_ids for t in trajectories],
        profile["prefill_tokens"] + profile["prefix_tokens"],
        profile["prefill_position"],
        generated,
        _mean_generated_position(trajectories),
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
        "programs_compiled_timed": built.compiled.total(),
        "programs_total": programs_total,
        "decode_steps_per_call": round(profile["decode_steps"] / max(profile["decode_calls"], 1), 2),
        "host_s": profile["host_s"],
        "profile": {
            **profile,
            "new_programs_in_timed_run": new_programs,
            "compiled_in_timed_run": dict(built.compiled),
            "loaded_in_timed_run": dict(built.loaded),  # from the persistent compilation cache: not compiled
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
