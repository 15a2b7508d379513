"""Stage 2's calibration gates: a capability environment is trained on only where the base agent's groups
give GRPO something to learn from, as the paper requires.

The base agent plays `seeds` training tasks `samples` times each at the rollout temperature
(paper: 20 x 8 at 1.0) through the evaluation job, so the episodes are resumable and tabled like
any evaluation; the first `hint_share` of each task's samples carry the task's hint, as training's
groups do. Gates (`gates`, `GATES`): "paper" (the default), "released_code" (the authors' looser
ones) or "none" (smoke runs): mean reward in a band, reward std, the share of informative groups
and, for the released code, success in a band and few all-success or all-zero groups. A group is
informative when its rewards differ across the success threshold (some succeed, some do not) or
by at least `INFORMATIVE_SPREAD`: a group of 0 and 0.2 teaches nothing. Gates apply per variant:
a level mixing kinds of task passes only if each kind does, as GRPO's groups are one task each.
pass@k is reported beside them.

The walk moves the difficulty a level at a time, up when too easy and down when too hard (a level of several
variants: the way those outside the mean band point), below 0
into the environment's scaffolded levels (pre-filled turns, exact hints, opened and written calls); where
one level is too easy and the next too hard, it tries the mix of the two halfway between, halving again
while the halves are at least `min_step` apart. An environment is dropped only when it cannot pass anywhere, with the
reason: too hard even at its most scaffolded level, too easy at its top level, too uniform, or its
variants pulling opposite ways (too easy for one kind of task where too hard for another). A
capability whose variants are separate kinds of work (`Capability.families`) is calibrated per
family, and trained on the families that pass, mixed; `families` ("capability/family") narrows the walk to the
families named, for a run that targets one kind of work.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import shutil
from collections.abc import Callable

import ml_collections
import numpy as np
from absl import logging

from trace_jax import distributed
from trace_jax.agent.episodes import jsonable, recorded_episodes, run_marker, same_episodes
from trace_jax.envs.capability.environment import CUT_SHARE, HINTED_SCAFFOLDS
from trace_jax.envs.hints import hinted_trials
from trace_jax.evaluation import evaluate
from trace_jax.files import read_json, write_json_atomic
from trace_jax.report import pass_at_k
from trace_jax.settings import is_bool, is_int, is_str, number, positive_int, positive_number, setting, share

GROUPS = "groups.json"  # a try's [seeds, samples] rewards and successes and each seed's variant: a small file that
# lets a walk resume from committed results without the episodes
INFORMATIVE_SPREAD = 0.5  # a group whose rewards differ by this much is informative without a success
# The gate values: the paper's (mean 0.3-0.6, std > 0.2, > 60% informative groups) and the authors' released
# code's (mean reward and success in [0.2, 0.6], >= 50% informative, all-success and all-zero groups <= 20% each).
GATES = {
    "paper": dict(
        min_mean=0.3,
        max_mean=0.6,
        min_std=0.2,
        min_informative=0.6,
        min_success=0.0,
        max_success=1.0,
        max_all_success=1.0,
        max_all_zero=1.0,
    ),
    "released_code": dict(
        min_mean=0.2,
        max_mean=0.6,
        min_std=0.0,
        min_informative=0.5,
        min_success=0.2,
        max_success=0.6,
        max_all_success=0.2,
        max_all_zero=0.2,
    ),
    # every level passes: smoke runs of the pipeline whose agent is not meant to learn (configs/trace_tiny.py)
    "none": dict(
        min_mean=0.0,
        max_mean=1.0,
        min_std=0.0,
        min_informative=0.0,
        min_success=0.0,
        max_success=1.0,
        max_all_success=1.0,
        max_all_zero=1.0,
    ),
}


@dataclasses.dataclass(frozen=True)
class CalibrationSettings:
    """The `calibration` block: the paper's calibration, with half of each group hinted."""

    seeds: int = setting(20, "an int >= 1", positive_int)  # tasks of a try
    samples: int = setting(8, "an int >= 2 (a group needs two)", lambda v: positive_int(v) and v >= 2)
    temperature: float = setting(1.0, "a number > 0 (groups need sampling)", positive_number)
    gates: str = setting("paper", " or ".join(f'"{g}"' for g in GATES), lambda v: v in GATES)  # `GATES`
    # of each task's samples played with its hint (training's rollout.hint_share)
    hint_share: float = setting(0.5, "a number in [0, 1]", share)
    start_difficulty: int = setting(0, "an int (below 0: a scaffolded level)", is_int)
    # the finest difficulty step between levels (0.5: one mix of two levels; 1: none)
    min_step: float = setting(0.5, "a number in (0, 1]", lambda v: number(v) and 0 < v <= 1)
    # a too-hard try that no episode solved, hinted ones included, sends the walk straight to the most scaffolded
    # level (then up as usual) instead of one level down (`next_difficulty`)
    jump_unsolved: bool = setting(True, "True or False", is_bool)
    policy: bool = setting(True, "True or False", is_bool)  # τ²'s retail policy in the prompt
    # what an episode cut at a limit keeps of its reward (`trace_jax.envs.capability.environment`)
    cut_share: float = setting(CUT_SHARE, "a number in [0, 1]", share)
    # "capability/family" entries: the only families walked of the capabilities they name (others: all)
    families: tuple[str, ...] = setting(
        (),
        'a tuple of built-in capability families, from the "capability/family" names of '
        "trace_jax.envs.capability.CAPABILITIES",
        lambda v: isinstance(v, tuple) and all(e in _family_names() for e in v),
    )
    # a calibration workdir (`launch.calibrate`'s) whose tries a walk takes where they played the same episodes
    resume_from: str = setting("", 'a folder, or "" for none', is_str)


def _family_names() -> tuple[str, ...]:
    """Every built-in capability family as "capability/family"."""
    from trace_jax.envs.capability import CAPABILITIES

    return tuple(f"{c.name}/{f}" for c in CAPABILITIES.values() for f in c.families)


def selected_families(capability: str, families: tuple[str, ...], config: CalibrationSettings) -> tuple:
    """The families of `capability` (its `families`) to walk: those `config.families` names for it, in the
    capability's order, or all of them where it names none."""
    named = {e.split("/", 1)[1] for e in config.families if e.split("/", 1)[0] == capability}
    return tuple(f for f in families if f in named) if named else tuple(families)


def gates(config: CalibrationSettings) -> dict:
    """The gate values `config.gates` names."""
    return GATES[config.gates]


def informative_groups(rewards: np.ndarray, successes: np.ndarray) -> np.ndarray:
    """Per group (row): whether its rewards differ across the success threshold or by >= INFORMATIVE_SPREAD."""
    mixed = successes.any(axis=1) & ~successes.all(axis=1)
    return mixed | (rewards.max(axis=1) - rewards.min(axis=1) >= INFORMATIVE_SPREAD - 1e-9)


def group_stats(rewards: np.ndarray, successes: np.ndarray, hinted: int = 0) -> dict:
    """Gate statistics of [seeds, samples] rewards and successes, with pass@k for k = 1, 2, 4, ... and, where the
    first `hinted` samples of each group carried the hint, the success of hinted and unhinted samples apart."""
    n = rewards.shape[1]
    wins = successes.sum(axis=1)
    stats = {
        "episodes": int(rewards.size),
        "mean": float(rewards.mean()),
        "std": float(rewards.std()),
        "success": float(successes.mean()),
        "informative": float(np.mean(informative_groups(rewards, successes))),
        "all_success": float(np.mean(wins == n)),
        "all_zero": float(np.mean(rewards.max(axis=1) == 0)),
    }
    for k in (2**i for i in range(int(math.log2(n)) + 1)):
        stats[f"pass@{k}"] = float(np.mean([pass_at_k(int(c), n, k) for c in wins]))
    if 0 < hinted < n:
        stats.update(
            hinted_success=float(successes[:, :hinted].mean()), unhinted_success=float(successes[:, hinted:].mean())
        )
    return stats


def level_stats(rewards: np.ndarray, successes: np.ndarray, variants: list[str], hinted: int = 0) -> dict:
    """`group_stats` of a level's groups, and per variant (`variants[i]`: group i's) where they differ."""
    stats = group_stats(rewards, successes, hinted)
    kinds = sorted(set(variants))
    if len(kinds) > 1:
        rows = np.array(variants)
        stats["variants"] = {v: group_stats(rewards[rows == v], successes[rows == v], hinted) for v in kinds}
    return stats


def gate_failures(stats: dict, config: CalibrationSettings) -> list[str]:
    """Why `stats` fail the gates (empty: they pass); a level of several variants fails where any variant does."""
    if "variants" in stats:
        return [
            f"{variant}: {failure}"
            for variant, part in stats["variants"].items()
            for failure in gate_failures(part, config)
        ]
    g, failures = gates(config), []
    if not g["min_mean"] <= stats["mean"] <= g["max_mean"]:
        failures.append(f"mean reward {stats['mean']:.3f} outside [{g['min_mean']}, {g['max_mean']}]")
    if not g["min_success"] <= stats["success"] <= g["max_success"]:
        failures.append(f"success {stats['success']:.3f} outside [{g['min_success']}, {g['max_success']}]")
    if not stats["std"] >= g["min_std"]:
        failures.append(f"reward std {stats['std']:.3f} < {g['min_std']}")
    if not stats["informative"] >= g["min_informative"]:
        failures.append(f"informative groups {stats['informative']:.2f} < {g['min_informative']}")
    if stats["all_success"] > g["max_all_success"]:
        failures.append(f"all-success groups {stats['all_success']:.2f} > {g['max_all_success']}")
    if stats["all_zero"] > g["max_all_zero"]:
        failures.append(f"all-zero groups {stats['all_zero']:.2f} > {g['max_all_zero']}")
    return failures


# difficulty -> ([seeds, samples] rewards, successes, each seed's variant)
Measure = Callable[[float], tuple[np.ndarray, np.ndarray, list[str]]]


def _side(stats: dict, config: CalibrationSettings) -> int | None:
    """Which way a try's mean reward points: +1 harder (too easy), -1 easier (too hard), 0 inside the gates. A try of
    several variants points where each variant outside the gates points, and nowhere (None) where they point both
    ways: a level that is too easy for one kind of task and too hard for another has no level that serves both."""
    g = gates(config)
    parts = list(stats.get("variants", {}).values()) or [stats]
    sides = {1 if p["mean"] > g["max_mean"] else -1 if p["mean"] < g["min_mean"] else 0 for p in parts} - {0}
    return None if len(sides) > 1 else sides.pop() if sides else 0


def next_difficulty(tries: list[dict], config: CalibrationSettings, bounds: tuple[int, int]) -> float | None:
    """Where the walk goes after its last try: a level further the way its mean points (within `bounds`, the most
    scaffolded and the top level), or, where a try lies within that level the other side of the gates, halfway to
    the nearest such try (while that half is >= `min_step`); None where it may not move (the gates failed on
    spread, its variants point opposite ways, a bound, a try repeated).

    With `jump_unsolved`, a too-hard try in which no episode succeeded, hinted ones included, goes straight to the
    most scaffolded level where no try has been: the levels between scaffold less, so they rarely do better (on the
    embedded agent every level between a 0-of-128 try and the written call was 0 of 128 too), and each costs a try.
    From there the walk goes up as usual while a level is too easy."""
    last = tries[-1]
    step = _side(last, config)
    if step is None:
        return None
    bottom_untried = all(t["difficulty"] != bounds[0] for t in tries)
    if config.jump_unsolved and step < 0 and last["success"] == 0 and bottom_untried:
        return bounds[0]
    ahead = [t for t in tries if 0 < (t["difficulty"] - last["difficulty"]) * step <= 1]
    if not ahead:
        after = last["difficulty"] + step
        return after if step and bounds[0] <= after <= bounds[1] else None
    nearest = min(ahead, key=lambda t: abs(t["difficulty"] - last["difficulty"]))
    half = (nearest["difficulty"] - last["difficulty"]) / 2
    if _side(nearest, config) != -step or abs(half) < config.min_step:
        return None
    return last["difficulty"] + half


def _drop_reason(tries: list[dict], config: CalibrationSettings, bounds: tuple[int, int]) -> str:
    """Why the walk ended without a pass, from its last try."""
    last = tries[-1]
    where = {
        -1: f"too hard even at its most scaffolded level ({bounds[0]})"
        if last["difficulty"] == bounds[0]
        else "too hard",
        1: f"too easy even at its top level ({bounds[1]})" if last["difficulty"] == bounds[1] else "too easy",
        0: "inside the mean band but too uniform",
        None: "its variants pull opposite ways",
    }[_side(last, config)]
    return f"{where}: " + "; ".join(last["failures"]) + f" at difficulty {last['difficulty']}"


def calibrate(measure: Measure, config: CalibrationSettings, bounds: tuple[int, int]) -> dict:
    """Walks the difficulty knob from `start_difficulty` (`next_difficulty`) until the gates pass or it may not
    move; returns every try and the difficulty chosen (None: the environment is dropped, with the reason)."""
    tries, difficulty = [], min(max(config.start_difficulty, bounds[0]), bounds[1])
    while difficulty is not None:
        stats = level_stats(*measure(difficulty), hinted=hinted_trials(config.hint_share, config.samples))
        failures = gate_failures(stats, config)
        tries.append({"difficulty": difficulty, **stats, "failures": failures})
        if not failures:
            return {"calibrated": True, "difficulty": difficulty, "tries": tries}
        difficulty = next_difficulty(tries, config, bounds)
    return {"calibrated": False, "difficulty": None, "tries": tries, "reason": _drop_reason(tries, config, bounds)}


def walk_bounds(scaffolds: tuple[str, ...], max_difficulty: int, hint_share: float) -> tuple[int, int]:
    """The levels a walk may visit: every scaffolded one (those that change only hinted episodes only where some
    samples are hinted) up to `max_difficulty`."""
    usable = [s for s in scaffolds if hint_share > 0 or s not in HINTED_SCAFFOLDS]
    return -len(usable), max_difficulty


def calibration_feedback(result: dict, config: CalibrationSettings) -> str:
    """Why an environment could not be calibrated, in words for the LLM that wrote it (what to change)."""
    g = gates(config)
    lines = [
        f"The module passed validation, but calibration against the agent to be trained failed: "
        f"{config.seeds} tasks x {config.samples} episodes at temperature {config.temperature} must give a "
        f"mean reward in [{g['min_mean']}, {g['max_mean']}], a reward std >= {g['min_std']} and >= "
        f"{g['min_informative']:.0%} of task groups whose rewards differ across success or by >= "
        f"{INFORMATIVE_SPREAD}."
    ]
    lines += [
        f"difficulty {t['difficulty']}: mean reward {t['mean']:.3f}, std {t['std']:.3f}, informative "
        f"groups {t['informative']:.0%}, success {t['success']:.0%}: {'; '.join(t['failures'])}"
        for t in result["tries"]
    ]
    mean = result["tries"][-1]["mean"]
    if mean > g["max_mean"]:
        lines.append(
            "The tasks are too easy for the agent: make them harder (more to find, more steps, subtler traps)."
        )
    elif mean < g["min_mean"]:
        lines.append(
            "The tasks are too hard for the agent: make them easier (fewer steps, more of the work "
            "pre-filled, clearer tickets)."
        )
    else:
        lines.append("Make the outcomes vary more between attempts at one task (reward levels the agent can reach).")
    return "\n".join(lines)


def environment_config(
    capability: str,
    difficulty: float,
    config: CalibrationSettings,
    scenarios: str | None = None,
    variant: str | None = None,
) -> dict:
    """The `env` block of a capability environment, built-in (of one `variant`, or every kind) or (with
    `scenarios`, its exported tasks) written by the LLM (seed 0: calibration, training and the pipeline's examples
    all draw from its train split)."""
    env = dict(
        name="capability",
        capability=capability,
        seed=0,
        difficulty=difficulty,
        policy=config.policy,
        cut_share=config.cut_share,
    )
    if variant is not None:
        env["variant"] = variant
    return {**env, "scenarios": scenarios} if scenarios else env


def rewards_by_group(records: list[dict], seeds: int, samples: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """[seeds, samples] rewards and successes of an evaluation's records (tasks in order, trials in order), and
    each task's variant (its family)."""
    tasks = sorted({r["task_id"] for r in records}, key=lambda t: int(t.rsplit("/", 1)[1]))
    index = {t: i for i, t in enumerate(tasks)}
    rewards, successes = np.zeros((seeds, samples)), np.zeros((seeds, samples), bool)
    variants = [""] * seeds
    for r in records:
        rewards[index[r["task_id"]], r["trial"]] = r["reward"]
        successes[index[r["task_id"]], r["trial"]] = r["success"]
        variants[index[r["task_id"]]] = r["family"]
    return rewards, successes, variants


def calibrate_capability(
    capability: str,
    bounds: tuple[int, int],
    base_eval: ml_collections.ConfigDict,
    config: CalibrationSettings,
    folder: pathlib.Path,
    agent: str = "model",
    scenarios: str | None = None,
    families: tuple[str, ...] = (),
) -> dict:
    """Calibrates one capability environment (built-in, or written with its exported `scenarios`) against the
    base agent of `base_eval` (an evaluation job's config; `agent` as the evaluation job takes it) between the
    levels `bounds` (`walk_bounds`); with `families`, each variant on its own in `folder/<variant>/`. Each
    difficulty's episodes go to `folder/difficulty_<d>/` with their groups' rewards (`GROUPS`, read back instead of
    playing the try again), and the result to `folder/calibration.json` (read back when it exists and was walked
    between the same bounds): the tries, and `env`, the environment config to train on (None: dropped)."""
    if families:
        return _calibrate_families(capability, bounds, base_eval, config, folder, agent, families)
    return _calibrate_walk(capability, bounds, base_eval, config, folder, agent, scenarios)


def calibrate_builtin(
    name: str,
    base_eval: ml_collections.ConfigDict,
    config: CalibrationSettings,
    folder: pathlib.Path,
    agent: str = "model",
) -> dict:
    """`calibrate_capability` of the built-in capability `name`: every level it has, per family where it has
    them (those `config.families` selects)."""
    from trace_jax.envs.capability import CAPABILITIES

    capability = CAPABILITIES[name]
    bounds = walk_bounds(capability.scaffolds, capability.max_difficulty, config.hint_share)
    families = selected_families(name, capability.families, config)
    return calibrate_capability(name, bounds, base_eval, config, folder, agent, families=families)


def _calibrate_walk(
    capability: str,
    bounds: tuple[int, int],
    base_eval: ml_collections.ConfigDict,
    config: CalibrationSettings,
    folder: pathlib.Path,
    agent: str,
    scenarios: str | None = None,
    variant: str | None = None,
) -> dict:
    """One environment's walk (`calibrate_capability`), of one `variant` or every kind."""
    result_path = folder / "calibration.json"
    if (stored := _stored_result(result_path, bounds)) is not None:
        return stored

    def measure(difficulty: float) -> tuple[np.ndarray, np.ndarray, list[str]]:
        workdir = folder / f"difficulty_{difficulty}"
        run = ml_collections.ConfigDict(base_eval.to_dict())
        run.env = environment_config(capability, difficulty, config, scenarios, variant)
        run.update(split="train", num_tasks=config.seeds, trials=config.samples, hint_share=config.hint_share)
        run.rollout.temperature = config.temperature
        if config.resume_from and not (workdir / GROUPS).exists():
            tried = pathlib.Path(config.resume_from, capability, variant or "", workdir.name)
            distributed.on_main(lambda: _take_try(tried, workdir, run_marker(run, agent)))
            distributed.barrier("calibration try taken")
        if (workdir / GROUPS).exists():  # measured before: its groups are all the walk needs
            groups = read_json(workdir / GROUPS)
            return np.array(groups["rewards"]), np.array(groups["successes"], bool), groups["variants"]
        evaluate(run, workdir, agent=agent)
        rewards, successes, variants = rewards_by_group(
            recorded_episodes(workdir / "episodes.jsonl"), config.seeds, config.samples
        )
        groups = {"rewards": rewards.tolist(), "successes": successes.tolist(), "variants": variants}
        distributed.on_main(lambda: write_json_atomic(workdir / GROUPS, groups))
        return rewards, successes, variants

    walked = calibrate(measure, config, bounds)
    chosen = walked["difficulty"]
    result = {
        "capability": capability,
        **walked,
        "bounds": list(bounds),
        "env": None if chosen is None else environment_config(capability, chosen, config, scenarios, variant),
        "episodes_dir": None if chosen is None else str(folder / f"difficulty_{chosen}"),
    }
    distributed.on_main(lambda: write_json_atomic(result_path, result))  # every process computed the same
    return result


def _calibrate_families(
    capability: str,
    bounds: tuple[int, int],
    base_eval: ml_collections.ConfigDict,
    config: CalibrationSettings,
    folder: pathlib.Path,
    agent: str,
    families: tuple[str, ...],
) -> dict:
    """Each family of `capability` calibrated on its own (its levels end at 0: `CapabilityEnvironment`); the
    environment to train on mixes the families that passed, each at its own level (`folder/calibration.json`)."""
    result_path = folder / "calibration.json"
    stored = _stored_result(result_path, bounds)
    if stored is not None and list(stored.get("families", ())) == list(families):  # else walked again from its groups
        return stored
    parts = {}
    for variant in families:
        parts[variant] = _calibrate_walk(
            capability, (bounds[0], 0), base_eval, config, folder / variant, agent, variant=variant
        )
    passed = [p for p in parts.values() if p["calibrated"]]
    env = (
        None
        if not passed
        else passed[0]["env"]
        if len(passed) == 1
        else {"name": "mixed", "parts": [p["env"] for p in passed]}
    )
    result = {
        "capability": capability,
        "calibrated": bool(passed),
        "difficulty": None,
        "bounds": list(bounds),
        "env": env,
        "families": {v: p["difficulty"] for v, p in parts.items()},
        "episodes_dir": passed[0]["episodes_dir"] if passed else None,
        "tries": [{**t, "variant": v} for v, p in parts.items() for t in p["tries"]],
    }
    if not passed:
        result["reason"] = "; ".join(f"{v}: {p['reason']}" for v, p in parts.items())
    distributed.on_main(lambda: write_json_atomic(result_path, result))
    return result


TRY_FILES = (GROUPS, "run.json", "summary.json", "table.md", "episodes.jsonl")  # what a taken try brings


def _take_try(tried: pathlib.Path, workdir: pathlib.Path, marker: dict) -> None:
    """Copies the try in `tried` (another calibration's difficulty folder) into `workdir` if its episodes are
    those this try would play (its run.json against `marker`); its episodes come along where it kept them."""
    if not (tried / GROUPS).is_file() or not (tried / "run.json").is_file():
        return
    if not same_episodes(read_json(tried / "run.json"), jsonable(marker)):
        logging.info("%s was played with other settings: not taken", tried)
        return
    workdir.mkdir(parents=True, exist_ok=True)
    for name in TRY_FILES:
        if (tried / name).is_file():
            shutil.copyfile(tried / name, workdir / name)
    logging.info("calibration try taken from %s", tried)


def _stored_result(path: pathlib.Path, bounds: tuple[int, int]) -> dict | None:
    """The result a walk between `bounds` stored at `path`, or None: none is there, or it was walked between other
    levels (its capability has gained a scaffold since), and is walked again from its tries' groups."""
    if not path.exists():
        return None
    stored = read_json(path)
    return stored if stored.get("bounds") == list(bounds) else None


def calibration_table(results: list[dict]) -> str:
    """Every try of every environment (a family's as capability[variant]): the gate statistics, pass@k and the
    verdict."""
    passes = sorted(
        {k for r in results for t in r["tries"] for k in t if k.startswith("pass@")}, key=lambda k: int(k[5:])
    )
    lines = [
        "| capability | difficulty | episodes | mean | std | success (hinted / not) | informative | all 0 | "
        "all 1 | " + " | ".join(passes) + " | verdict |",
        "|---" * (10 + len(passes)) + "|",
    ]
    for result in results:
        for t in result["tries"]:
            name = result["capability"] + (f"[{t['variant']}]" if "variant" in t else "")
            verdict = "pass" if not t["failures"] else "; ".join(t["failures"])
            split = f" ({t['hinted_success']:.2f} / {t['unhinted_success']:.2f})" if "hinted_success" in t else ""
            lines.append(
                f"| {name} | {t['difficulty']} | {t['episodes']} | {t['mean']:.3f} | {t['std']:.3f} | "
                f"{t['success']:.2f}{split} | {t['informative']:.2f} | {t['all_zero']:.2f} | "
                f"{t['all_success']:.2f} | "
                + " | ".join(f"{t.get(k, float('nan')):.2f}" for k in passes)
                + f" | {verdict} |"
            )
    return "\n".join(lines)
