"""Episodes as files: playing them with resume, per-process files and their merge, the run marker that says
which episodes a workdir holds, reusing other runs' episodes of the same policy, and summaries of played episodes.

An episode file (`episodes.jsonl`) holds one record per finished episode (`Trajectory.record`). A killed run
resumes from it: its episodes are not played again. `run.json` beside it (`run_marker`) names the config, agent,
weights and adapters whose episodes the file holds; a workdir reused for another run starts afresh, and a run
given other workdirs (`take_reused`) copies the episodes they hold of the same policy on the same task and
trial under the same settings (an episode plays the same in any batch: per-episode random streams).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import time
from collections import Counter
from collections.abc import Callable, Sequence

import jax
import ml_collections
from absl import logging

from trace_jax import distributed, lora
from trace_jax.agent.rollout import EpisodeSpec, RolloutEngine, Trajectory, rollout_profile
from trace_jax.files import read_json, write_jsonl_atomic, write_text_atomic
from trace_jax.metrics import MetricsWriter, Progress, logged_lines
from trace_jax.models.embedded import resolve_model_dir
from trace_jax.models.model import weights_fingerprint
from trace_jax.report import format_table, summarize
from trace_jax.workdirs import WorkdirMismatch, differences
from trace_jax.workdirs import mismatch as workdir_mismatch


@dataclasses.dataclass(frozen=True)
class Routes:
    """Per-task adapters (TRACE's Select & Adapt): PEFT folders, and each task's index among them
    (lora.NO_ADAPTER, the default, for the base model); the tasks run mixed in one batch."""

    adapters: tuple[str, ...]
    by_task: dict[str, int]

    def __post_init__(self):
        bad = {t: i for t, i in self.by_task.items() if not lora.NO_ADAPTER <= i < len(self.adapters)}
        if bad:
            shown = dict(list(bad.items())[:3])
            raise ValueError(f"routes name adapters outside [-1, {len(self.adapters) - 1}]: {shown}")


def play(
    engine: RolloutEngine,
    specs: list[EpisodeSpec],
    *,
    key: jax.Array,
    episodes_path: pathlib.Path,
    log_every_s: float = 10.0,
) -> list[dict]:
    """Plays the episodes of `specs`, writing each episode's record to `episodes_path` as it ends (progress with ETA);
    returns the records in the order the episodes ended.

    Resumable: the episodes a killed run already wrote there are kept and not played again (a
    line cut off by the kill is dropped). Each record's `elapsed_s` counts the playing time of
    all runs so far, so the last one is the evaluation's wall time however often it resumed.
    """
    return play_together(lambda: engine, [(specs, episodes_path)], key=key, log_every_s=log_every_s)[0]


def play_together(
    make_engine: Callable[[], RolloutEngine],
    runs: list[tuple[list[EpisodeSpec], pathlib.Path]],
    *,
    key: jax.Array,
    log_every_s: float = 10.0,
) -> list[list[dict]]:
    """`play` for several runs' episodes in one batch, each run's records in its own episodes file (a batch lasts
    as long as its slowest episode, so runs played one after the other each wait for theirs); the engine is made
    only when there is an episode to play.

    In a run of several processes each plays its share of the episodes (`distributed.share`) and records them in
    its own file beside the run's (`<episodes>.process<k>`); at the end every process has every record and
    process 0 merges them into the run's file. A killed run's per-process files are merged first, by any
    number of processes, so it resumes as a single-process run does."""
    paths = [path for _, path in runs]
    if len(set(paths)) != len(paths):
        raise ValueError(f"two runs write the same episodes file: {paths}")
    records = [_merged_episodes(path) for path in paths]
    run_of, todo = {}, []
    for run, ((specs, _), done) in enumerate(zip(runs, records)):
        played = {_record_id(r) for r in done}
        for spec in specs:
            if _episode_id(spec.task.task_id, spec.trial, spec.adapter_idx) not in played:
                run_of[id(spec)] = run
                todo.append(spec)
    total, resumed = sum(len(specs) for specs, _ in runs), sum(len(done) for done in records)
    if resumed:
        logging.info("resuming: %d of %d episodes already in %s", total - len(todo), total, ", ".join(map(str, paths)))
    alone = jax.process_count() == 1
    mine, resumed_counts = distributed.share(todo), [len(done) for done in records]
    progress = Progress(
        total - len(todo) + len(mine), start=total - len(todo), every_s=log_every_s, name="episode"
    )  # this process's episodes
    offset = max((r.get("elapsed_s", 0.0) for done in records for r in done), default=0.0)
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        log_paths = [path if alone else _process_file(path, jax.process_index()) for path in paths]
        logs = [stack.enter_context(open(path, "w", encoding="utf-8")) for path in log_paths]
        if alone:
            for log, done in zip(logs, records):
                log.writelines(json.dumps(r) + "\n" for r in done)

        def on_done(trajectory: Trajectory) -> None:
            run = run_of[id(trajectory.spec)]
            record = {**trajectory.record(), "elapsed_s": round(offset + time.monotonic() - start, 1)}
            records[run].append(record)
            logs[run].write(json.dumps(record) + "\n")
            logs[run].flush()
            ended = [r for done in records for r in done]
            progress.update(len(ended), f"success {sum(r['success'] for r in ended)}/{len(ended)}")

        engine = make_engine() if mine else None
        if engine:
            engine.run(mine, key=key, on_done=on_done)
    if not alone:
        played = distributed.allgather_objects([done[n:] for done, n in zip(records, resumed_counts)])
        records = [
            done[:n] + [r for process in played for r in process[run]]
            for run, (done, n) in enumerate(zip(records, resumed_counts))
        ]
        _write_merged(paths, records)
    if engine and engine.stats["decode_steps"]:  # the model played: where its time went
        logging.info("rollouts in %.0f s: %s", engine.stats["run_s"], rollout_profile(engine.stats))
    return records


def _episode_id(task_id: str, trial: int, adapter_idx: int) -> tuple:
    return task_id, trial, adapter_idx


def _record_id(record: dict) -> tuple:
    """The `_episode_id` of the episode a record holds."""
    return _episode_id(record["task_id"], record["trial"], record["adapter_idx"])


def _process_file(episodes_path: pathlib.Path, process: int | str) -> pathlib.Path:
    """Where process `process` of a multi-process run records the episodes it plays."""
    return episodes_path.with_name(f"{episodes_path.name}.process{process}")


def _merged_episodes(episodes_path: pathlib.Path) -> list[dict]:
    """The episodes recorded for `episodes_path`: its own and any a killed multi-process run left in per-process
    files, which are then merged into it (by process 0, once every process has read them)."""
    records = recorded_episodes(episodes_path)
    parts = sorted(episodes_path.parent.glob(_process_file(episodes_path, "*").name))
    seen = {_record_id(r) for r in records}
    for part in parts:
        for record in recorded_episodes(part):
            if (episode := _record_id(record)) not in seen:
                seen.add(episode)
                records.append(record)
    distributed.barrier("episodes read")  # before any process starts its own file: all found the same files
    if parts:
        _write_merged([episodes_path], [records])
    return records


def _write_merged(paths: list[pathlib.Path], records: list[list[dict]]) -> None:
    """Process 0 writes each run's records to its episodes file and removes the per-process files; every process
    waits for it."""

    def write() -> None:
        for path, done in zip(paths, records):
            write_jsonl_atomic(path, done)
            for part in path.parent.glob(_process_file(path, "*").name):
                part.unlink()

    distributed.on_main(write)


def recorded_episodes(episodes_path: pathlib.Path) -> list[dict]:
    """The episode records in `episodes_path` up to the first incomplete line ([] if there is no file)."""
    records = []
    try:
        with open(episodes_path, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    break
    except FileNotFoundError:
        pass
    return records


def run_marker(config: ml_collections.ConfigDict, agent: str, routes: Routes | None = None) -> dict:
    """What identifies an evaluation's episodes: its config, the agent, and for the model the
    fingerprints of its weights and adapter(s) (a rebuilt embedded agent keeps its name) and the routes."""
    marker = {"config": {k: v for k, v in config.to_dict().items() if k != "tensor"}, "agent": agent}  # not played
    if agent == "model":
        marker["weights"] = weights_fingerprint(resolve_model_dir(config.model))
        marker["adapter"] = weights_fingerprint(config.adapter) if config.adapter else ""
        if routes:
            marker["routes"] = {
                "adapters": [weights_fingerprint(f) for f in routes.adapters],
                "by_task": dict(sorted(routes.by_task.items())),
            }
    return marker


EPISODE_LIMITS = ("max_turns", "max_tokens_per_turn", "max_errors", "temperature", "top_p", "user_temperature")


def check_base_run(folder: pathlib.Path, config: ml_collections.ConfigDict, key: str) -> None:
    """Fails naming config `key` unless `folder` is a finished evaluation whose episodes are those `config` (an
    evaluation job's config) would play: the model's agent with the same weights, dtype and adapter, the same
    environment, split and trials, the same rollout limits (the seed too where sampling is not greedy), and
    at least as many tasks."""
    if not (folder / "run.json").exists() or not (folder / "summary.json").exists():
        raise ValueError(
            f"config.{key} = {str(folder)!r} is not a finished evaluation's workdir (run.json and summary.json)"
        )
    found, wanted = read_json(folder / "run.json"), jsonable(run_marker(config, "model"))
    ran, runs = found["config"], wanted["config"]
    pairs = {
        "agent": (found["agent"], "model"),
        "weights": (found.get("weights"), wanted["weights"]),
        "adapter": (found.get("adapter"), wanted["adapter"]),
        **{k: (ran.get(k), runs[k]) for k in ("model", "dtype", "env", "split", "trials")},
        **{f"rollout.{k}": (ran["rollout"].get(k), runs["rollout"][k]) for k in EPISODE_LIMITS},
    }
    if runs["rollout"]["temperature"] > 0:
        pairs["seed"] = (ran.get("seed"), runs["seed"])
    for name, (got, want) in pairs.items():
        if got != want:
            raise ValueError(f"config.{key}: its run has {name} = {got!r}, this job needs {want!r}")
    if ran["num_tasks"] is not None and (runs["num_tasks"] is None or ran["num_tasks"] < runs["num_tasks"]):
        raise ValueError(
            f"config.{key}: its run has num_tasks = {ran['num_tasks']}, fewer than this job's {runs['num_tasks']}"
        )


def jsonable(value):
    """`value` as run.json gives it back (tuples become lists)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def keep_episodes_of_same_run(workdir: pathlib.Path, run: dict) -> None:
    """Lets `play` resume the workdir's episodes only where they come from a run that plays the same episodes
    (`same_episodes`: its batch size, logging and the like may differ); a workdir holding another run's
    episodes is refused (WorkdirMismatch, naming what differs), never emptied. run.json then records this run's
    marker, written atomically."""
    marker, episodes = workdir / "run.json", workdir / "episodes.jsonl"
    played = [p for p in (episodes, *workdir.glob(_process_file(episodes, "*").name)) if p.exists()]
    if played:
        if not marker.exists():
            raise WorkdirMismatch(
                f"{workdir} holds episodes but no run.json saying which run played them: use another workdir"
            )
        found = differences(episode_identity(read_json(marker)), episode_identity(jsonable(run)), prefix="")
        if found:
            raise workdir_mismatch(workdir, "evaluation", found)
    distributed.on_main(lambda: write_text_atomic(marker, json.dumps(run, sort_keys=True, default=str)))


def _episode_setting(marker: dict) -> str:
    """What decides an episode besides its policy and task, from a `run_marker`: the agent, the base weights,
    dtype, environment, seed and `EPISODE_LIMITS` (not the batch size, which changes no episode)."""
    config = marker["config"]
    return json.dumps(
        {
            "agent": marker["agent"],
            "weights": marker.get("weights"),
            **{k: config[k] for k in ("model", "dtype", "env", "seed")},
            "rollout": {k: config["rollout"].get(k) for k in EPISODE_LIMITS},
        },
        sort_keys=True,
    )


PLAYED_KEYS = ("split", "num_tasks", "trials", "hint_share", "families", "per_family")  # which episodes a run plays


def episode_identity(marker: dict) -> dict:
    """What decides a run's episodes, by key, from a `run_marker` (as run.json holds it): the settings of
    `_episode_setting`, the policy (adapter or routes) and which tasks and trials it plays."""
    config = marker["config"]
    return {
        "agent": marker["agent"],
        "weights": marker.get("weights"),
        "adapter": marker.get("adapter", ""),
        "routes": marker.get("routes"),
        **{k: config.get(k) for k in ("model", "dtype", "env", "seed", *PLAYED_KEYS)},
        **{f"rollout.{k}": config["rollout"].get(k) for k in EPISODE_LIMITS},
    }


def same_episodes(marker: dict, other: dict) -> bool:
    """Whether runs of the run markers `marker` and `other` (as run.json holds them) play the same episodes:
    the same policy and settings on the same tasks and trials (`episode_identity`), whatever else differs (batch
    size, logging)."""
    return episode_identity(marker) == episode_identity(other)


def _policy(marker: dict, adapter_idx: int) -> str:
    """The fingerprint of the adapter an episode of the run `marker` played under ("" for the base model)."""
    if "routes" in marker:
        return "" if adapter_idx == lora.NO_ADAPTER else marker["routes"]["adapters"][adapter_idx]
    return marker.get("adapter", "")


def _reusable(folders: Sequence[str | pathlib.Path], marker: dict) -> dict[tuple, dict]:
    """(policy, split, task id, trial) -> an episode recorded in `folders` (evaluation workdirs, finished or not)
    that a run of `marker` would play the same, tagged with the folder it came from."""
    library, setting = {}, _episode_setting(marker)
    for folder in map(pathlib.Path, folders):
        if not (folder / "run.json").is_file():
            continue
        found = read_json(folder / "run.json")
        if _episode_setting(found) != setting:
            continue
        for record in recorded_episodes(folder / "episodes.jsonl"):
            key = (_policy(found, record["adapter_idx"]), record["split"], record["task_id"], record["trial"])
            library.setdefault(key, {**record, "reused_from": record.get("reused_from", str(folder))})
    return library


def take_reused(
    specs: list[EpisodeSpec], split: str, workdir: pathlib.Path, marker: dict, reuse: Sequence[str | pathlib.Path]
) -> None:
    """Writes into `workdir`'s episodes the specs' episodes that `reuse` holds (see `_reusable`), each under this
    run's adapter index and with no playing time, so that `play` resumes past them."""
    episodes = workdir / "episodes.jsonl"
    others = [f for f in reuse if pathlib.Path(f).resolve() != workdir.resolve()]

    def take() -> None:
        records = recorded_episodes(episodes)
        played, library = {_record_id(r) for r in records}, _reusable(others, marker)
        taken = [
            {**found, "adapter_idx": spec.adapter_idx, "elapsed_s": 0.0}
            for spec in specs
            if _episode_id(spec.task.task_id, spec.trial, spec.adapter_idx) not in played
            and (found := library.get((_policy(marker, spec.adapter_idx), split, spec.task.task_id, spec.trial)))
        ]
        if taken:
            logging.info(
                "%s: %d of %d episodes taken from earlier evaluations of the same policies",
                workdir,
                len(taken),
                len(specs),
            )
            write_jsonl_atomic(episodes, records + taken)

    distributed.on_main(take)


def summarize_run(records: list[dict], trials: int) -> tuple[dict, str]:
    """The summary of played episodes (overall and per-family success with 95% intervals, pass^1,
    pass^k, end reasons) and its per-family table."""
    rows = summarize(records, k=trials)
    overall = rows[-1]
    summary = {
        "num_episodes": overall["episodes"],
        "mean_reward": overall["mean_reward"],
        "pass1": overall["pass1"],
        "pass_k": overall["pass_k"],
        "k": overall["k"],
        "success": overall["success"],
        "ci_low": overall["ci_low"],
        "ci_high": overall["ci_high"],
        "needs_judge": sorted({r["task_id"] for r in records if r["info"].get("needs_judge")}),
        "end_reasons": dict(sorted(Counter(r["end_reason"] for r in records).items())),
        "reused_episodes": sum("reused_from" in r for r in records),
        "families": rows[:-1],
    }
    return summary, format_table(rows)


def summary_scalars(summary: dict) -> dict[str, float]:
    """An evaluation summary's scalars: mean reward, success with its 95% interval, and success per family."""
    scalars = {
        "eval/reward": summary["mean_reward"],
        "eval/success": summary["success"],
        "eval/success_ci_low": summary["ci_low"],
        "eval/success_ci_high": summary["ci_high"],
    }
    for row in summary["families"]:
        scalars[f"eval/{row['family']}/success"] = row["success"]
    return scalars


def log_summary(workdir: pathlib.Path, summary: dict) -> None:
    """The summary's scalars in the workdir's TensorBoard log at step = its episodes, unless its last point already
    holds them (a finished evaluation run again adds none)."""
    point = {"step": summary["num_episodes"], **summary_scalars(summary)}
    lines = logged_lines(workdir)
    if lines and lines[-1] == point:
        return
    writer = MetricsWriter(workdir)
    writer.write(point.pop("step"), point)
    writer.close()
