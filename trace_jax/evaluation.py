"""An evaluation: an environment's tasks played by the model (or a scripted agent) and reported; the library
entry point of the evaluation job (`launch.evaluate`) and of every stage that plays a config's episodes.

Writes to the workdir: `episodes.jsonl` (one line per episode: messages, end reason, reward and its
components), `summary.json` and `table.md` (per family: success with a 95% interval, pass^1, pass^k), and the
summary's scalars for TensorBoard (`tensorboard/`, `metrics.jsonl`: "eval/..." at step = episodes). Resume and
reuse of episodes are `trace_jax.agent.episodes`'. The user simulator, where a task has one, is the base model
with no adapter for `agent="model"`, and a scripted user for the scripted agents (so gold and noop runs need no
model at all): it states the request, makes the task's user-side gold calls for the gold agent (telecom), and
stops after the agent's next text turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from collections import Counter
from collections.abc import Callable, Sequence

import jax
import ml_collections

from trace_jax import distributed, lora, runtime
from trace_jax.agent.episodes import (
    Routes,
    jsonable,
    keep_episodes_of_same_run,
    log_summary,
    play_together,
    run_marker,
    summarize_run,
    take_reused,
)
from trace_jax.agent.rollout import MODEL, EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs import check_environment, make_environment
from trace_jax.envs.hints import hinted_trials, offers_hint
from trace_jax.envs.scripted import GoldAgent, NoopAgent, ScriptedUser
from trace_jax.files import write_json_atomic
from trace_jax.models.model import DTYPES, load_model
from trace_jax.sampling import Sampler
from trace_jax.settings import (
    Invalid,
    dotted,
    from_config,
    is_dict,
    is_int,
    is_str,
    non_negative_number,
    none_or,
    nonempty_str,
    positive_int,
    setting,
    share,
)
from trace_jax.sharding import ShardingPlan, make_mesh
from trace_jax.workdirs import locked

AGENTS = ("model", "gold", "noop")


@dataclasses.dataclass(frozen=True)
class EvaluationSettings:
    """An evaluation job's config, typed (its `env` block is the environment's: `trace_jax.envs`)."""

    rollout: RolloutConfig
    model: str = setting("", "an embedded model name or an HF checkpoint folder", nonempty_str)
    dtype: str = setting("float32", f"one of {sorted(DTYPES)}", lambda v: v in DTYPES)
    adapter: str = setting("", '"" (no adapter) or a PEFT adapter folder', is_str)
    seed: int = setting(0, "an int", is_int)
    env: dict | None = setting(None, "an environment block (`trace_jax.envs`)", is_dict)
    split: str = setting("", "a split name of the environment", nonempty_str)
    num_tasks: int | None = setting(None, "None (all tasks) or a positive int", none_or(positive_int))
    trials: int = setting(1, "a positive int (episodes per task, for pass^k)", positive_int)
    log_every_s: float = setting(30.0, ">= 0", non_negative_number)
    families: tuple[str, ...] = setting(
        (),
        "a tuple of family names (empty: all)",
        lambda v: isinstance(v, tuple) and all(isinstance(f, str) for f in v),
        optional=True,
    )
    per_family: int | None = setting(None, "None (all) or a positive int", none_or(positive_int), optional=True)
    # calibration plays hinted trials as training does
    hint_share: float = setting(
        0.0,
        "a number in [0, 1]: the share of each task's trials played with the task's hint (0: none)",
        share,
        optional=True,
    )
    # > 1: the sampler's weights sharded over that many of this process's devices (`sampler_plan`)
    tensor: int = setting(1, "a positive int that divides this process's devices", positive_int, optional=True)

    def __post_init__(self):
        if jax.local_device_count() % self.tensor:
            raise Invalid("tensor", f"a positive int that divides this process's {jax.local_device_count()} devices")


def validate_config(config: ml_collections.ConfigDict, key: str = "") -> EvaluationSettings:
    """The config (the block at `key` of a config that holds one), typed; fails at start, naming the key, on a
    missing or invalid setting."""
    settings = from_config(EvaluationSettings, config, key)
    check_environment(settings.env, dotted(key, "env"))
    return settings


def sampler_plan(tensor: int) -> ShardingPlan | None:
    """Where the sampler holds the model: with `tensor` > 1, its weights sharded over that many of this process's
    devices and its rows over the rest (a model one device cannot hold); else one device."""
    return ShardingPlan(make_mesh(data=-1, tensor=tensor, devices=jax.local_devices())) if tensor > 1 else None


def _adapter_of(config: EvaluationSettings, agent: str, routes: Routes | None) -> Callable[[str], int]:
    """Each task's adapter index in the engine `_engine` builds."""
    if agent != "model":
        return lambda task_id: lora.NO_ADAPTER
    if routes:
        return lambda task_id: routes.by_task.get(task_id, lora.NO_ADAPTER)
    return lambda task_id: 0 if config.adapter else lora.NO_ADAPTER


def _engine(config: EvaluationSettings, env, agent: str, routes: Routes | None) -> RolloutEngine:
    """The rollout engine for `agent` (with `routes`, every routed adapter stacked in their order)."""
    rollout = config.rollout
    if agent != "model":
        gold = agent == "gold"
        scripted, user = (GoldAgent() if gold else NoopAgent()), ScriptedUser(user_actions=gold)
        return RolloutEngine(env, agent=scripted, user=user, config=rollout)
    model = load_model(config.model, config.dtype)
    folders = routes.adapters if routes else (config.adapter,) if config.adapter else ()
    adapters = lora.stack_adapters([lora.load_peft(f, model.cfg) for f in folders]) if folders else None
    plan = sampler_plan(config.tensor)
    params, adapters = plan.shard_params((model.params, adapters)) if plan else (model.params, adapters)
    sampler = Sampler(
        model.cfg,
        params,
        adapters=adapters,
        plan=plan,
        detokenize=model.tokenizer.decode,
        policy=rollout.sampler_policy,
        tokenize=model.tokenizer.encode,
    )
    return RolloutEngine(env, agent=MODEL, user=MODEL, sampler=sampler, tokenizer=model.tokenizer, config=rollout)


def evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | pathlib.Path,
    agent: str = "model",
    routes: Routes | None = None,
    reuse: Sequence[str | pathlib.Path] = (),
) -> dict:
    """Runs the evaluation into `workdir` (with `routes`, each task under its own adapter, in place
    of `config.adapter`; with `reuse`, other evaluations' workdirs, taking the episodes they hold of the same
    policies instead of playing them again); returns the summary also written to summary.json."""
    return evaluate_together([(config, workdir)], agent=agent, routes=routes, reuse=reuse)[0]


def _of_families(tasks: list, config: EvaluationSettings):
    """`tasks` of the families `config.families` names (every task when empty), the first `config.per_family`
    of each."""
    families, per_family = config.families, config.per_family
    taken: Counter = Counter()
    for task in tasks:
        if (not families or task.family in families) and (per_family is None or taken[task.family] < per_family):
            taken[task.family] += 1
            yield task


TOGETHER_KEYS = ("split", "num_tasks")  # what evaluations played in one batch may differ in


def evaluate_together(
    runs: list[tuple[ml_collections.ConfigDict, str | pathlib.Path]],
    agent: str = "model",
    routes: Routes | None = None,
    reuse: Sequence[str | pathlib.Path] = (),
) -> list[dict]:
    """Evaluations that differ only in split and task count, played in one batch with one model (each
    writes its workdir, resumes and reuses as `evaluate` does); returns their summaries. Each workdir is held
    (`workdirs.locked`) while they play: a second evaluation started on one of them fails at start."""
    with contextlib.ExitStack() as held:
        for _, workdir in runs:
            held.enter_context(locked(workdir, main=distributed.is_main()))
        return _evaluate_together(runs, agent, routes, reuse)


def _evaluate_together(
    runs: list[tuple[ml_collections.ConfigDict, str | pathlib.Path]],
    agent: str,
    routes: Routes | None,
    reuse: Sequence[str | pathlib.Path],
) -> list[dict]:
    if agent not in AGENTS:
        raise ValueError(f"agent {agent!r} is invalid; it must be one of {', '.join(AGENTS)}")
    settings = [validate_config(run) for run, _ in runs]
    config = settings[0]
    for other in settings:
        mismatch = sorted(
            f.name
            for f in dataclasses.fields(other)
            if f.name not in TOGETHER_KEYS and getattr(other, f.name) != getattr(config, f.name)
        )
        if mismatch:
            raise ValueError(f"evaluations played together differ only in {TOGETHER_KEYS}, not in {mismatch}")
    if routes and config.adapter:
        raise ValueError("config.adapter must be '' when the tasks are routed among adapters")
    start = time.monotonic()
    workdirs = [pathlib.Path(workdir) for _, workdir in runs]
    env = make_environment(ml_collections.ConfigDict(config.env))
    adapter_of = _adapter_of(config, agent, routes)
    plays = []
    for (block, _), run, workdir in zip(runs, settings, workdirs):
        workdir.mkdir(parents=True, exist_ok=True)
        marker = run_marker(block, agent, routes)
        keep_episodes_of_same_run(workdir, marker)
        # A task's trials adjacent: the later ones find its opening held by a row (`Session` copies it).
        hinted = hinted_trials(run.hint_share, run.trials)
        specs = [
            EpisodeSpec(task, trial, adapter_of(task.task_id), hint=trial < hinted and offers_hint(env, task))
            for task in _of_families(env.tasks(run.split, run.num_tasks), run)
            for trial in range(run.trials)
        ]
        if reuse:
            take_reused(specs, run.split, workdir, jsonable(marker), reuse)
        plays.append((specs, workdir / "episodes.jsonl"))
    played = play_together(
        lambda: _engine(config, env, agent, routes),
        plays,
        key=jax.random.key(config.seed),
        log_every_s=config.log_every_s,
    )
    # The engine's heap goes back to the OS: a job of many evaluations (calibration's tries, each adapter's) would
    # otherwise keep the largest one's, fragments included, for the rest of the process (runtime.py).
    runtime.release_freed_memory()
    summaries, tables = [], []
    for records in played:
        summary, table = summarize_run(records, config.trials)
        summaries.append(
            {
                **summary,
                "agent": agent,
                "seconds": round(time.monotonic() - start, 1),
                "play_seconds": max((r["elapsed_s"] for r in records), default=0.0),
            }
        )
        tables.append(table)

    def write() -> None:
        for workdir, summary, table in zip(workdirs, summaries, tables):
            (workdir / "table.md").write_text(table + "\n", encoding="utf-8")
            write_json_atomic(workdir / "summary.json", summary)
            log_summary(workdir, summary)

    distributed.on_main(write)  # what comes next may read the summaries
    return summaries
