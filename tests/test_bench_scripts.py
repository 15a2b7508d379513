"""The benchmark scripts keep their contracts (`launch.bench_rollouts`, `bench_sampler`, `bench_learner`): each
runs as a user runs it, on the tiny random model with SmolLM2's tokenizer and the smallest sizes, and prints the
JSON its docstring promises. Where a script compares two implementations, the two did the same work (the same
greedy tokens, the same initial loss); the speeds themselves are the scripts' to report, not a test's."""

import json
import subprocess
import sys

import pytest
from multiprocess import failure_report


def _bench(script: str, env: dict, *flags: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", f"launch.{script}", "--json", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, failure_report(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_rollout_benchmark_reports_the_engines_overhead_and_its_fused_policy_compiles_nothing_timed(
    tiny_chat_model, job_env
):
    episodes, turns, tokens = 4, 2, 8
    out = _bench(
        "bench_rollouts",
        job_env,
        f"--model={tiny_chat_model}",
        f"--episodes={episodes}",
        "--batch_size=2",
        f"--max_turns={turns}",
        f"--max_tokens_per_turn={tokens}",
        "--sampler_policy=fused",
    )
    assert out["sampler_policy"] == "fused" and out["backend"] == "cpu" and out["cpu"]
    assert out["episodes"] == episodes == sum(out["end_reasons"].values())
    assert 0 < out["generated_tokens"] <= episodes * turns * tokens and out["fed_tokens"] > 0
    assert out["programs_compiled_timed"] == 0 < out["programs_total"]  # every program made in the warm-up
    assert (
        not any(out["profile"]["new_programs_in_timed_run"].values()) and out["profile"]["compiled_in_timed_run"] == {}
    )
    ideal = out["ideal"]
    assert ideal["ideal_s"] == pytest.approx(ideal["prefill_s"] + ideal["decode_s"], abs=0.011)
    # priced where the run did the work: at the mean position of a prefilled token (the first episodes' system
    # prompts, the rest of each episode after the heads it copied) and of a generated one
    assert 0 < ideal["prefill_position"] == round(out["profile"]["prefill_position"]) < ideal["decode_position"]
    assert out["efficiency"] > 0 and out["ratio"] > 0 and out["episodes_per_min"] > 0
    assert out["decode_steps_per_call"] >= 1 and out["host_s"] >= 0
    assert out["profile"]["copied_rows"] >= 1  # a row starting a later episode copied the shared head


def test_the_sampler_benchmark_times_both_sides_on_the_same_greedy_tokens(tiny_chat_model, job_env):
    out = _bench(
        "bench_sampler", job_env, f"--models={tiny_chat_model}", "--batches=2", "--max_new_tokens=8", "--repeats=1"
    )
    timed = out["models"][str(tiny_chat_model)]
    assert timed["same_tokens_batch2"] == 2  # left-padded transformers rows and ours, token for token
    assert timed["tokens_per_s_ours_batch2"] > 0 and timed["tokens_per_s_transformers_batch2"] > 0
    assert timed["ratio_batch2"] == pytest.approx(
        timed["tokens_per_s_ours_batch2"] / timed["tokens_per_s_transformers_batch2"], rel=0.02
    )


def test_the_learner_benchmark_runs_the_same_step_as_peft(tiny_chat_model, job_env):
    out = _bench("bench_learner", job_env, f"--model={tiny_chat_model}", "--batch=2", "--seq_len=32", "--steps=1")
    assert out["initial_loss_ours"] == pytest.approx(out["initial_loss_pytorch"], rel=1e-5, abs=1e-7)
    assert out["seconds_per_step_ours"] > 0 and out["seconds_per_step_pytorch"] > 0
    assert out["tokens_per_s_ours"] == pytest.approx(2 * 32 / out["seconds_per_step_ours"], rel=0.05)
