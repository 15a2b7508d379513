"""Stage 2's calibration gates: a capability environment is trained on only where the base agent sometimes
succeeds and its groups have reward variance, as the paper requires.

The base agent plays `seeds` training tasks `samples` times each at the rollout temperature
(paper: 20 x 8 at 1.0) through the evaluation job, so the episodes are resumable and
tabled like any evaluation. Gates (config keys; the paper's values by default): mean reward
in [min_mean, max_mean], reward std >= min_std, a share >= min_informative of groups whose
rewards are not all equal. pass@k is reported beside them. A generator walks its difficulty
knob a level at a time (up when too easy, down when too hard); where one level is too easy and
the next too hard, it tries the mix of the two halfway between (each task of either level:
`CapabilityEnvironment`), and halves again while the halves are at least `min_step` apart. An
environment that cannot pass is reported and dropped.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable

import ml_collections
import numpy as np

from trace_jax import distributed
from trace_jax.config_checks import Check, check_config, number, positive_int
from trace_jax.evaluation import evaluate, recorded_episodes
from trace_jax.files import read_json, write_json_atomic


def calibration_defaults() -> ml_collections.ConfigDict:
    """The paper's calibration (the authors' code is looser: mean in [0.2, 0.6], >= 50% informative)."""
    from trace_jax.envs.capability.environment import CUT_SHARE

    return ml_collections.ConfigDict({
        "seeds": 20, "samples": 8, "temperature": 1.0,
        "min_mean": 0.3, "max_mean": 0.6, "min_std": 0.2, "min_informative": 0.6,
        "start_difficulty": 0,
        "min_step": 0.5,  # the finest difficulty step between levels (0.5: one mix of two levels; 1: none)
        "policy": True,  # τ²'s retail policy in the system prompt, as the target has it
        "cut_share": CUT_SHARE,  # what an episode cut at a limit keeps of its reward (the environment's docstring)
    })


def _checks(config: ml_collections.ConfigDict) -> list[Check]:
    share = (lambda v: number(v) and 0 <= v <= 1, "a number in [0, 1]")
    return [("calibration.seeds", positive_int, "an int >= 1"),
            ("calibration.samples", lambda v: positive_int(v) and v >= 2, "an int >= 2 (a group needs two)"),
            ("calibration.temperature", lambda v: number(v) and v > 0, "a number > 0 (groups need sampling)"),
            ("calibration.min_mean", *share),
            ("calibration.max_mean", lambda v: number(v) and config.get("min_mean", 0) <= v <= 1,
             "a number in [calibration.min_mean, 1]"),
            ("calibration.min_std", lambda v: number(v) and v >= 0, "a number >= 0"),
            ("calibration.min_informative", *share),
            ("calibration.start_difficulty", lambda v: isinstance(v, int) and v >= 0, "an int >= 0"),
            ("calibration.min_step", lambda v: number(v) and 0 < v <= 1, "a number in (0, 1]"),
            ("calibration.policy", lambda v: isinstance(v, bool), "True or False"),
            ("calibration.cut_share", *share)]


def validate_calibration_config(config: ml_collections.ConfigDict) -> None:
    """Fails at start naming the key that is missing or wrong (`config` is the `calibration` block)."""
    check_config(ml_collections.ConfigDict({"calibration": config}), _checks(config))


def pass_at_k(successes: int, n: int, k: int) -> float:
    """The unbiased pass@k of one group: 1 - C(n - c, k) / C(n, k)."""
    return 1.0 - math.comb(n - successes, k) / math.comb(n, k)


def group_stats(rewards: np.ndarray, successes: np.ndarray) -> dict:
    """Gate statistics of [seeds, samples] rewards and successes, with pass@k for k = 1, 2, 4, ..."""
    n = rewards.shape[1]
    wins = successes.sum(axis=1)
    stats = {"episodes": int(rewards.size), "mean": float(rewards.mean()), "std": float(rewards.std()),
             "success": float(successes.mean()),
             "informative": float(np.mean(rewards.max(axis=1) > rewards.min(axis=1))),
             "all_success": float(np.mean(wins == n)), "all_zero": float(np.mean(rewards.max(axis=1) == 0))}
    for k in (2 ** i for i in range(int(math.log2(n)) + 1)):
        stats[f"pass@{k}"] = float(np.mean([pass_at_k(int(c), n, k) for c in wins]))
    return stats


def gate_failures(stats: dict, config: ml_collections.ConfigDict) -> list[str]:
    """Why `stats` fail the gates (empty: they pass)."""
    failures = []
    if not config.min_mean <= stats["mean"] <= config.max_mean:
        failures.append(f"mean reward {stats['mean']:.3f} outside [{config.min_mean}, {config.max_mean}]")
    if not stats["std"] >= config.min_std:
        failures.append(f"reward std {stats['std']:.3f} < {config.min_std}")
    if not stats["informative"] >= config.min_informative:
        failures.append(f"informative groups {stats['informative']:.2f} < {config.min_informative}")
    return failures


# difficulty -> ([seeds, samples] rewards, successes)
Measure = Callable[[float], tuple[np.ndarray, np.ndarray]]


def _side(mean: float, config: ml_collections.ConfigDict) -> int:
    """+1 where a mean says harder (too easy), -1 easier (too hard), 0 where it is inside the gates."""
    return 1 if mean > config.max_mean else -1 if mean < config.min_mean else 0


def next_difficulty(tries: list[dict], config: ml_collections.ConfigDict, max_difficulty: int) -> float | None:
    """Where the walk goes after its last try: a level further the way its mean points, or, where a try lies
    within that level the other side of the gates, halfway to the nearest such try (while that half is >=
    `min_step`); None where it may not move (the gates failed on spread, a bound, a try repeated)."""
    last = tries[-1]
    step = _side(last["mean"], config)
    ahead = [t for t in tries if 0 < (t["difficulty"] - last["difficulty"]) * step <= 1]
    if not ahead:
        after = last["difficulty"] + step
        return after if step and 0 <= after <= max_difficulty else None
    nearest = min(ahead, key=lambda t: abs(t["difficulty"] - last["difficulty"]))
    half = (nearest["difficulty"] - last["difficulty"]) / 2
    if _side(nearest["mean"], config) != -step or abs(half) < config.min_step:
        return None
    return last["difficulty"] + half


def calibrate(measure: Measure, config: ml_collections.ConfigDict, max_difficulty: int) -> dict:
    """Walks the difficulty knob from `start_difficulty` (`next_difficulty`) until the gates pass or it may not
    move; returns every try and the difficulty chosen (None: the environment is dropped)."""
    tries, difficulty = [], min(config.start_difficulty, max_difficulty)
    while difficulty is not None:
        stats = group_stats(*measure(difficulty))
        failures = gate_failures(stats, config)
        tries.append({"difficulty": difficulty, **stats, "failures": failures})
        if not failures:
            return {"calibrated": True, "difficulty": difficulty, "tries": tries}
        difficulty = next_difficulty(tries, config, max_difficulty)
    return {"calibrated": False, "difficulty": None, "tries": tries,
            "reason": "; ".join(tries[-1]["failures"]) + " at every difficulty it could move to"}


def calibration_feedback(result: dict, config: ml_collections.ConfigDict) -> str:
    """Why an environment could not be calibrated, in words for the LLM that wrote it (what to change)."""
    lines = [f"The module passed validation, but calibration against the agent to be trained failed: "
             f"{config.seeds} tasks x {config.samples} episodes at temperature {config.temperature} must give a "
             f"mean reward in [{config.min_mean}, {config.max_mean}], a reward std >= {config.min_std} and >= "
             f"{config.min_informative:.0%} of task groups with differing rewards."]
    lines += [f"difficulty {t['difficulty']}: mean reward {t['mean']:.3f}, std {t['std']:.3f}, informative "
              f"groups {t['informative']:.0%}, success {t['success']:.0%}: {'; '.join(t['failures'])}"
              for t in result["tries"]]
    mean = result["tries"][-1]["mean"]
    if mean > config.max_mean:
        lines.append("The tasks are too easy for the agent: make them harder (more to find, more steps, subtler "
                     "traps).")
    elif mean < config.min_mean:
        lines.append("The tasks are too hard for the agent: make them easier (fewer steps, more of the work "
                     "pre-filled, clearer tickets).")
    else:
        lines.append("Make the outcomes vary more between attempts at one task (reward levels the agent can reach).")
    return "\n".join(lines)


def environment_config(capability: str, difficulty: float, config: ml_collections.ConfigDict,
                       scenarios: str | None = None) -> dict:
    """The `env` block of a capability environment, built-in or (with `scenarios`, its exported tasks) written
    by the LLM (seed 0: calibration, training and the pipeline's examples all draw from its train split)."""
    env = dict(name="capability", capability=capability, seed=0, difficulty=difficulty, policy=config.policy,
               cut_share=config.cut_share)
    return {**env, "scenarios": scenarios} if scenarios else env


def rewards_by_group(records: list[dict], seeds: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """[seeds, samples] rewards and successes of an evaluation's records (tasks in order, trials in order)."""
    tasks = sorted({r["task_id"] for r in records}, key=lambda t: int(t.rsplit("/", 1)[1]))
    index = {t: i for i, t in enumerate(tasks)}
    rewards, successes = np.zeros((seeds, samples)), np.zeros((seeds, samples), bool)
    for r in records:
        rewards[index[r["task_id"]], r["trial"]] = r["reward"]
        successes[index[r["task_id"]], r["trial"]] = r["success"]
    return rewards, successes


def calibrate_capability(capability: str, max_difficulty: int, base_eval: ml_collections.ConfigDict,
                         config: ml_collections.ConfigDict, folder: pathlib.Path, agent: str = "model",
                         scenarios: str | None = None) -> dict:
    """Calibrates one capability environment (built-in, or written with its exported `scenarios`) against the
    base agent of `base_eval` (an evaluation job's config; `agent` as the evaluation job takes it); each
    difficulty's episodes go to `folder/difficulty_<d>/` and the result to `folder/calibration.json` (read
    back when it exists)."""
    validate_calibration_config(config)
    result_path = folder / "calibration.json"
    if result_path.exists():
        return read_json(result_path)

    def measure(difficulty: float) -> tuple[np.ndarray, np.ndarray]:
        run = ml_collections.ConfigDict(base_eval.to_dict())
        run.env = environment_config(capability, difficulty, config, scenarios)
        run.update(split="train", num_tasks=config.seeds, trials=config.samples)
        run.rollout.temperature = config.temperature
        workdir = folder / f"difficulty_{difficulty}"
        evaluate(run, workdir, agent=agent)
        return rewards_by_group(recorded_episodes(workdir / "episodes.jsonl"), config.seeds, config.samples)

    result = {"capability": capability, **calibrate(measure, config, max_difficulty)}
    distributed.on_main(lambda: write_json_atomic(result_path, result))  # every process computed the same
    return result


def calibration_table(results: list[dict]) -> str:
    """Every try of every environment: the gate statistics, pass@k and the verdict."""
    passes = sorted({k for r in results for t in r["tries"] for k in t if k.startswith("pass@")},
                    key=lambda k: int(k[5:]))
    lines = ["| capability | difficulty | episodes | mean | std | informative | all 0 | all 1 | "
             + " | ".join(passes) + " | verdict |", "|---" * (9 + len(passes)) + "|"]
    for result in results:
        for t in result["tries"]:
            verdict = "pass" if not t["failures"] else "; ".join(t["failures"])
            lines.append(f"| {result['capability']} | {t['difficulty']} | {t['episodes']} | {t['mean']:.3f} | "
                         f"{t['std']:.3f} | {t['informative']:.2f} | {t['all_zero']:.2f} | {t['all_success']:.2f} | "
                         + " | ".join(f"{t.get(k, float('nan')):.2f}" for k in passes) + f" | {verdict} |")
    return "\n".join(lines)
