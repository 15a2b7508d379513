"""The GRPO training job, for single-turn task sets and multi-turn environments: sample groups, score,
update one LoRA adapter.

One step: take the next `tasks_per_step` training tasks, play each `group_size` times with
the current adapter (single-turn completions of `config.task`, or episodes of `config.env`
through the rollout engine), score them, turn rewards into group advantages, and apply
`train.updates_per_step` learner updates (1: one over the whole batch; more: PPO's mini-batches, each over
its share of the micro-batches, `learner.make_train_step`; `train.target_kl` stops them early, as PPO does, once a
mini-batch's approx KL to the sampling policy passes it) over micro-batches packed by
`train.micro_batch_tokens` (the sampler's logprobs are the old policy's; the policy trained is the one sampled,
softmax(logits / rollout.temperature)). `train.steps`, or `train.rollout_budget` (training
episodes in all: steps = budget / (tasks_per_step x group_size), rounded up), sets the length.
Held-out tasks are evaluated greedily before training (the base reward), every `eval.every`
steps and at the end (see the rollout sources for what they report); `eval.num_tasks = 0` skips
held-out evaluation (a stage that evaluates its adapters elsewhere saves the time).

Hints (environments that offer them): `rollout.hint_share` of each group's episodes are played with
the task's hint in the system prompt and learned from without it. Sampled from another context than
the one trained, those rows take the policy's own logprobs on the unhinted tokens as old logprobs
(one forward pass before the update). `loss.tis_cap` None learns them as on-policy rows (weight 1:
what a hint made possible, the missing tool's name, counts in full); a cap weighs each hinted token
min(exp(old - sampler), cap), truncated importance sampling (`learner.make_rescore_fn`). With
`loss.hinted_eps_high` their ratios are clipped above at 1 + that instead of 1 + eps_high, so a step can raise
the tokens only a hint made likely by more than the common clip allows (`losses.LossConfig`);
`loss.hinted_sft_coef` adds an imitation term (negative log-likelihood) on the hinted rows better than their
group. The other rows are learned exactly as without hints. `loss.negative_advantage_scale` < 1 weighs the
rows worse than their group less (0: only the better ones are learned).

Constant groups (all rewards equal, no gradient) may be re-sampled: with `rollout.resamples` > 0 they are
replaced by groups of the next training tasks, up to that many rounds a step, until at least
`rollout.min_informative` (default 0.5) of the step's groups vary (`trace_jax.rl.resampling`). Every episode
played counts: `summary["rollouts"]` and `train.rollout_budget`, which then may end the run before its last
planned step.

With `curriculum.patience` > 0, a capability environment (or each part of a mix) moves a level harder once
its training reward has stayed above `curriculum.upper` for that many steps (`trace_jax.rl.curriculum`);
held-out evaluation keeps the starting level's tasks.

Everything a resumed run needs is in the checkpoint (adapter, optimizer state, step,
RNG key, task cursor, wall time so far), and step k's sampling key is folded from the run key and k, so a
run killed after any checkpoint and restarted on the same workdir continues exactly as if
it had never stopped; a step's metrics are logged before its evaluation, and an evaluation a kill
interrupted is made on resume (an environment's plays only the episodes it lacks). A finished run (its summary.json
written) is not run again, checkpoints or none (`job.unless_finished`). Files in the
workdir: checkpoints/, tensorboard/, metrics.jsonl, base_eval.json, summary.json (and, for
environments, eval/ and rollouts/step_<k>.jsonl: every training episode of step k, messages and
reward components, as the evaluation job records them), adapter/ (PEFT) at the end, and snapshots/step_<k>/
(PEFT) at each of `train.snapshot_fractions` of the run's steps (a scaling curve's points along one run). With
`eval.keep_best`, adapter/ is the evaluated step's with the highest held-out reward (step 0 included), kept in
best/ as the run goes (`trace_jax.rl.best_adapter`), and the summary's final metrics are that step's; with
`eval.ties = "gold_logp"` every evaluation also logs how likely the policy finds the held-out tasks' gold turns
(`trace_jax.rl.gold_likelihood`), which decides between steps of the same held-out reward.

Run as several processes (`launch.multihost`), each plays its share of a step's episodes and of an evaluation
on its own devices, all gather them and apply the same update on the mesh of every process's devices, orbax
saves and restores the checkpoints together, and process 0 alone writes the other files (`trace_jax.distributed`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging

from trace_jax import distributed, lora
from trace_jax.envs import check_environment
from trace_jax.files import read_json, write_json_atomic, write_jsonl_atomic
from trace_jax.metrics import MetricsWriter, Progress, logged_lines, scalars_by_step
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batching import pack_sequences, padded_tokens
from trace_jax.rl.best_adapter import BestAdapter
from trace_jax.rl.checkpoint import TrainState
from trace_jax.rl.curriculum import env_parts
from trace_jax.rl.environment_rollouts import EnvironmentRollouts, hinted_per_group
from trace_jax.rl.gold_likelihood import GoldLikelihood
from trace_jax.rl.grpo_settings import CompletionGrpoSettings, EpisodeGrpoSettings, GrpoSettings
from trace_jax.rl.job import ADAPTER, SUMMARY, export_adapter, start_run, unless_finished
from trace_jax.rl.learner import make_rescore_fn, make_train_step
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.resampling import sample_informative
from trace_jax.rl.single_turn import TaskSetRollouts
from trace_jax.runtime import bound_memory_maps, peak_memory_gb, release_freed_memory
from trace_jax.sampling import Sampler
from trace_jax.settings import (
    dotted,
    from_config,
)
from trace_jax.workdirs import claimed


def validate_config(config: ml_collections.ConfigDict, key: str = "") -> GrpoSettings:
    """The config (the block at `key` of a config that holds one, as the pipeline's `training`), typed; fails at
    start, naming the key, on a missing or invalid setting."""
    at = functools.partial(dotted, key)
    if ("env" in config) == ("task" in config):
        raise ValueError(
            f"config needs exactly one of config.{at('task')} (a single-turn task set) and config.{at('env')} (an "
            "environment)"
        )
    if "task" in config:
        settings = from_config(CompletionGrpoSettings, config, key)
    else:
        check_environment(config.env, at("env"), split="the environment's training split")
        settings = from_config(EpisodeGrpoSettings, config, key)
    if (settings.train.steps is None) == (settings.train.rollout_budget is None):
        raise ValueError(
            f"config.{at('train.steps')} and config.{at('train.rollout_budget')}: set exactly one (the other None)"
        )
    rollout = settings.rollout
    if _hints(settings) and not hinted_per_group(rollout):  # a share of hinted episodes must make one a group
        raise ValueError(
            f"config.{at('rollout.hint_share')} = {rollout.hint_share} is invalid: it hints no episode of a group of "
            f"{rollout.group_size} (rounded); set it to 0.0 or at least {0.5 / rollout.group_size:g}"
        )
    if isinstance(settings, EpisodeGrpoSettings) and settings.curriculum.patience:
        try:
            env_parts(settings.env_config)
        except ValueError:
            raise ValueError(
                f"config.{at('curriculum.patience')} = {settings.curriculum.patience} is invalid; it must be 0 "
                f"unless config.{at('env')} is a capability environment or a mix of them, not "
                f"{settings.env.get('name')!r}"
            ) from None
    return settings


def _hints(settings: GrpoSettings) -> bool:
    """Whether the job plays some episodes with the environment's hint."""
    return isinstance(settings, EpisodeGrpoSettings) and settings.rollout.hint_share > 0


def _episodes(state: TrainState, settings: GrpoSettings) -> int:
    """Episodes played up to the checkpointed step, re-sampled ones included."""
    default = state.step * settings.rollout.tasks_per_step * settings.rollout.group_size  # a run without re-sampling
    return int(state.cursor.get("episodes", default))


def budget_spent(settings: GrpoSettings, episodes: int) -> bool:
    """Whether `episodes` played reach `train.rollout_budget` (never with a fixed `train.steps`)."""
    return settings.train.rollout_budget is not None and episodes >= settings.train.rollout_budget


def num_steps(settings: GrpoSettings) -> int:
    """`train.steps`, or the steps `train.rollout_budget` episodes make (the last step may overshoot it)."""
    if settings.train.steps is not None:
        return settings.train.steps
    return math.ceil(settings.train.rollout_budget / (settings.rollout.tasks_per_step * settings.rollout.group_size))


def snapshot_step(fraction: float, steps: int) -> int:
    """The step whose adapter stands for `fraction` of a run of `steps` steps (rounded half up)."""
    return math.floor(fraction * steps + 0.5)


def _snapshot_steps(settings: GrpoSettings, steps: int) -> set[int]:
    """The steps, strictly inside the run, at which the adapter is exported to snapshots/step_<k>."""
    return {k for k in (snapshot_step(f, steps) for f in settings.train.snapshot_fractions) if 0 < k < steps}


def _loss_config(settings: GrpoSettings) -> LossConfig:
    """The policy loss; with hints and `loss.tis_cap`, truncated importance sampling (the module docstring)."""
    max_len = settings.rollout.max_new_tokens if isinstance(settings, CompletionGrpoSettings) else None
    return LossConfig(
        aggregation=settings.loss.aggregation,
        eps_low=settings.loss.eps_low,
        eps_high=settings.loss.eps_high,
        kl_coef=settings.loss.kl_coef,
        negative_advantage_scale=settings.loss.negative_advantage_scale,
        max_len=max_len,
        tis_cap=settings.loss.tis_cap if _hints(settings) else None,
        hinted_eps_high=settings.loss.hinted_eps_high if _hints(settings) else None,
        hinted_sft_coef=settings.loss.hinted_sft_coef if _hints(settings) else 0.0,
    )


GOLD_METRIC = "eval/gold_logp"


def _gold_likelihood(settings: EpisodeGrpoSettings, source: EnvironmentRollouts, run) -> GoldLikelihood | None:
    """The held-out tasks' gold-turn likelihood, where `eval.ties` breaks ties with it (else None)."""
    if not (settings.eval.keep_best and settings.eval.ties == "gold_logp"):
        return None
    return GoldLikelihood(
        source.eval_env,
        run.model.tokenizer,
        source.heldout,
        run.params,
        run.model.cfg,
        token_budget=settings.train.micro_batch_tokens,
        frozen_layers=settings.lora.first_layer,
        row_multiple=run.row_multiple,
        min_shared_prefix=settings.rollout.min_shared_prefix,
        plan=run.plan,
        remat=settings.train.remat,
    )


def _measure_gold_where_missing(
    logged: dict[int, dict[str, float]], resume_step: int, measure: Callable[[int], float], writer: MetricsWriter
) -> None:
    """For a run resumed from before `eval/gold_logp` was logged: the base's (step 0) and the resumed step's gold
    turns' likelihood, `measure(adapter_idx)`, where their evaluation is logged without it; added to `logged` and
    written to the log."""
    for step, adapter_idx in ({0: lora.NO_ADAPTER} | ({resume_step: ADAPTER} if resume_step else {})).items():
        scalars = logged.get(step, {})
        if "eval/reward" in scalars and GOLD_METRIC not in scalars:
            scalars[GOLD_METRIC] = measure(adapter_idx)
            writer.write(step, {GOLD_METRIC: scalars[GOLD_METRIC]})


def _base_eval(workdir: pathlib.Path, evaluate: Callable[[int, int], dict[str, float]]) -> dict[str, float]:
    """The base model's held-out metrics, computed once per workdir (a resumed run reads them back)."""
    path = workdir / "base_eval.json"
    if path.is_file():
        return read_json(path)
    metrics = evaluate(lora.NO_ADAPTER, 0)
    if distributed.is_main():
        write_json_atomic(path, metrics)
    return metrics


def _eval_due(step: int, settings: GrpoSettings) -> bool:
    """Whether the adapter after `step` is evaluated: every `eval.every` steps and at the end (never
    with `eval.num_tasks` 0)."""
    return settings.eval.num_tasks > 0 and (step % settings.eval.every == 0 or step == num_steps(settings))


def _resumed_eval(
    logged: dict[int, dict[str, float]],
    step: int,
    evaluate: Callable[[int, int], dict[str, float]],
    writer: MetricsWriter,
    settings: GrpoSettings,
    last: bool,
) -> dict[str, float] | None:
    """The held-out metrics of the checkpointed `step` a run resumes from (`last`: the run's last, its budget
    spent): read back from `logged` (the run's scalars by step), and evaluated now when a kill interrupted that
    evaluation (an environment's resumes from its episodes)."""
    if not (_eval_due(step, settings) or (last and settings.eval.num_tasks > 0)):
        return None
    scalars = {k: v for k, v in logged.get(step, {}).items() if k.startswith("eval/")}
    if "eval/reward" in scalars:
        return scalars
    metrics = evaluate(ADAPTER, step)
    writer.write(step, metrics)
    return metrics


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict[str, float]:
    """Runs (or resumes) the job in `workdir`, which it holds meanwhile and resumes only with the same
    result-deciding settings (`workdirs.claimed`); returns the summary also written to summary.json. A finished
    run is not run again (`job.unless_finished`)."""
    settings = validate_config(config)
    with claimed(workdir, "grpo", config.to_dict(), main=distributed.is_main()):
        return unless_finished(workdir, lambda: _train(settings, workdir))


def _train(settings: EpisodeGrpoSettings | CompletionGrpoSettings, workdir: str | pathlib.Path) -> dict[str, float]:
    episodes = isinstance(settings, EpisodeGrpoSettings)
    start_time = time.monotonic()
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run = start_run(settings, workdir, cursor={"next_task": 0})
    tokenizer = run.model.tokenizer
    steps = num_steps(settings)
    num_train_tasks = steps * settings.rollout.tasks_per_step * (1 + settings.rollout.resamples)  # room for re-sampling
    source = (
        EnvironmentRollouts(settings, tokenizer, num_train_tasks, workdir)
        if episodes
        else TaskSetRollouts(settings, tokenizer, num_train_tasks)
    )
    state = run.state
    if episodes:
        source.restore(state.cursor)
    elapsed = lambda: state.cursor.get("elapsed_s", 0.0) + time.monotonic() - start_time
    sampler = Sampler(
        run.model.cfg,
        run.sampler_params,
        adapters=run.sampler_adapters(),
        plan=run.sampler_plan,
        detokenize=tokenizer.decode,
        min_shared_prefix=settings.rollout.min_shared_prefix,
        policy=settings.rollout.sampler_policy,
        tokenize=tokenizer.encode,
    )
    gold = _gold_likelihood(settings, source, run) if episodes else None

    def evaluate(adapter_idx: int, step: int) -> dict[str, float]:
        """The held-out metrics of the base (NO_ADAPTER) or of the adapter the sampler and the state now hold."""
        metrics = source.evaluate(sampler, adapter_idx, step)
        if gold is not None:
            metrics[GOLD_METRIC] = gold(run.params, state.adapter_weights, state.scale, adapter_idx)
        return metrics

    writer = MetricsWriter(workdir)
    base = _base_eval(workdir, evaluate) if settings.eval.num_tasks else None
    if base is not None:
        logging.info("base held-out reward %.3f", base["eval/reward"])
        if state.step == 0:
            writer.write(0, base)
    loss_cfg = _loss_config(settings)
    train_step = make_train_step(
        run.model.cfg,
        loss_cfg,
        run.optimizer,
        plan=run.plan,
        remat=settings.train.remat,
        temperature=settings.rollout.temperature,
        frozen_layers=settings.lora.first_layer,
        updates=settings.train.updates_per_step,
        target_kl=settings.train.target_kl,
    )
    rescore = (
        make_rescore_fn(
            run.model.cfg, loss_cfg, plan=run.plan, remat=settings.train.remat, temperature=settings.rollout.temperature
        )
        if _hints(settings)
        else None
    )

    # The run's log as process 0 holds it, given to every process: whether a step is evaluated again, measured
    # or exported must be the same choice on all of them (each takes part in those computations).
    logged = distributed.on_main(lambda: scalars_by_step(logged_lines(workdir)))
    latest_eval = (
        base
        if state.step == 0
        else _resumed_eval(
            logged, state.step, evaluate, writer, settings, budget_spent(settings, _episodes(state, settings))
        )
    )
    if gold is not None:
        _measure_gold_where_missing(
            logged, state.step, lambda idx: gold(run.params, state.adapter_weights, state.scale, idx), writer
        )
        if latest_eval is not None and GOLD_METRIC in logged.get(state.step, {}):
            latest_eval = {**latest_eval, GOLD_METRIC: logged[state.step][GOLD_METRIC]}
    tie_break = GOLD_METRIC if gold is not None else None
    best = BestAdapter(workdir, logged, state.step, tie_break) if settings.eval.keep_best else None
    if best is not None and latest_eval is not None:  # step 0's base, or the step resumed from
        best.offer(state.step, latest_eval, functools.partial(export_adapter, run, weights=state.adapter_weights))
    progress = Progress(steps, start=state.step, every_s=settings.log_every_s)
    snapshots = _snapshot_steps(settings, steps)
    weights, opt_state = state.adapter_weights, state.opt_state
    for step in range(state.step, steps):
        if budget_spent(settings, _episodes(state, settings)):  # a run that re-sampled spent it before its last step
            break
        t0 = time.monotonic()
        cursor = state.cursor["next_task"]
        step_key = jax.random.fold_in(state.rng, step)
        draw = lambda offset, num, attempt: source.sample(  # called within this step only
            sampler,
            cursor + offset,  # noqa: B023
            step_key if attempt == 0 else jax.random.fold_in(step_key, attempt),  # noqa: B023
            ADAPTER,
            num_tasks=num,
        )
        rollouts, tasks_used, played = sample_informative(
            draw, settings.rollout.tasks_per_step, settings.rollout.resamples, settings.rollout.min_informative
        )
        climbed = source.follow(rollouts) if episodes else {}  # the curriculum, after the step's rollouts
        release_freed_memory()  # the rollouts' freed arenas, before the learner's (see runtime.py)
        t_sampled = time.monotonic()
        advantages, keep, advantage_stats = compute_advantages(settings.advantage, rollouts.rewards, rollouts.group_ids)
        metrics = {**rollouts.metrics, **climbed, **{f"advantage/{k}": v for k, v in advantage_stats.items()}}
        kept = [
            dataclasses.replace(rollouts.sequences[i], advantage=float(advantages[i]))
            for i in np.flatnonzero(keep)
            if rollouts.sequences[i].last_learned() >= 0
        ]
        if kept:  # a batch of only constant-reward groups carries no signal: no update
            batch = pack_sequences(
                kept,
                token_budget=settings.train.micro_batch_tokens,
                row_multiple=run.row_multiple,
                min_shared_prefix=settings.rollout.min_shared_prefix,
                pad_id=tokenizer.pad_token_id,
            )
            batch = dataclasses.replace(batch, dropped_fraction=float(advantage_stats["dropped_fraction"]))
            if rescore is not None:  # before the update: the old policy is the current adapter
                batch, hint_stats = rescore(run.params, weights, state.scale, batch, [s.hinted for s in kept])
                metrics.update({f"learner/{k}": v for k, v in hint_stats.items()})
            weights, opt_state, learner_metrics = train_step(run.params, weights, opt_state, state.scale, batch)
            sampler.set_adapters(run.sampler_adapters(weights))
            metrics.update({f"learner/{k}": float(v) for k, v in learner_metrics.items()})
            metrics["learner/tokens"] = float(padded_tokens(batch))
            metrics["learner/micro_batches"] = float(len(batch.micro_batches))
        t_learned = time.monotonic()
        rss_gb = release_freed_memory()
        bound_memory_maps()  # the learner's programs, as the rollout engine does for the sampler's
        if rss_gb is not None:
            metrics.update({"memory/rss_gb": rss_gb, "memory/peak_rss_gb": peak_memory_gb()})
        metrics.update(
            {
                "time/sample_s": t_sampled - t0,
                "time/learn_s": t_learned - t_sampled,
                "time/step_s": t_learned - t0,
                "rollout/rows": float(len(rollouts.sequences)),
            }
        )
        state = TrainState(
            step=step + 1,
            adapter_weights=weights,
            scale=state.scale,
            opt_state=opt_state,
            rng=state.rng,
            cursor={
                "next_task": cursor + tasks_used,
                "episodes": _episodes(state, settings) + played,
                **({"curriculum": source.curriculum_state} if getattr(source, "curriculum_state", None) else {}),
                "elapsed_s": round(elapsed(), 1),
            },
        )
        start_time = time.monotonic()  # the cursor now holds the time so far
        if rollouts.records and distributed.is_main():  # what the agent did, for reading a run after the fact
            write_jsonl_atomic(workdir / "rollouts" / f"step_{step + 1}.jsonl", rollouts.records)
        if step + 1 in snapshots:  # before the checkpoint: a step redone after a kill exports the same again
            export_adapter(run, workdir / "snapshots" / f"step_{step + 1}", weights)
        # The step's metrics before its checkpoint, so a kill never loses them (one between the two makes the
        # resumed run log the step again, the same), and before the evaluation, which a kill may interrupt.
        writer.write(step + 1, metrics)
        last = step + 1 == steps or budget_spent(settings, _episodes(state, settings))
        run.checkpointer.save(state, force=last)
        held_out = ""
        if _eval_due(step + 1, settings) or (last and settings.eval.num_tasks > 0):
            latest_eval = evaluate(ADAPTER, step + 1)
            if best is not None:  # before the evaluation is logged (`best_adapter`)
                best.offer(step + 1, latest_eval, functools.partial(export_adapter, run, weights=weights))
                latest_eval["eval/best_step"] = float(best.step)
            writer.write(step + 1, latest_eval)
            held_out = f"  held-out {latest_eval['eval/reward']:.3f}"
        moved = f"  approx KL {metrics['learner/approx_kl']:.4f}" if "learner/approx_kl" in metrics else ""
        progress.update(step + 1, f"reward {metrics['rollout/reward']:.3f}{moved}{held_out}")
        if last:
            break
    run.checkpointer.close()
    run.state = state
    writer.close()
    if best is None:
        export_adapter(run, workdir / "adapter")
    else:
        best.copy_to(workdir / "adapter")
        latest_eval = best.metrics
    summary = {
        **(source.summary(base, latest_eval) if base is not None else {}),
        **({"best_step": best.step} if best is not None else {}),
        "steps": int(state.step),
        "rollouts": _episodes(state, settings),
        "seconds": round(elapsed(), 1),
    }  # over every process of the run, less work lost to a kill
    distributed.on_main(lambda: write_json_atomic(workdir / SUMMARY, summary))
    return summary
