"""The GRPO training job for single-turn verifiable tasks: sample groups, score, update one LoRA adapter.

One step: take the next `tasks_per_step` training tasks, sample `group_size` completions
of each with the current adapter, score them, turn rewards into group advantages, and
apply one learner update (on-policy: the sampler's logprobs are the old policy's; the
policy trained is the one sampled, softmax(logits / rollout.temperature)).
Held-out tasks are evaluated greedily before training (the base reward), every
`eval.every` steps and at the end, on each split of `eval.splits`: the first is the one
the summary reports (metrics "eval/..."), the others are logged as "eval_<split>/...".

Everything a resumed run needs is in the checkpoint (adapter, optimizer state, step,
RNG key, task cursor, learner row width), and step k's sampling key is folded from the
run key and k, so a run killed after any checkpoint and restarted on the same workdir
continues exactly as if it had never stopped. Files in the workdir: checkpoints/,
tensorboard/, metrics.jsonl, base_eval.json, summary.json.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging

from trace_jax import lora
from trace_jax.config_checks import Check, check_config, positive_int
from trace_jax.metrics import MetricsWriter, Progress
from trace_jax.models.model import DTYPES, load_model
from trace_jax.rl.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from trace_jax.rl.batching import build_learner_batch
from trace_jax.rl.checkpoint import Checkpointer, TrainState
from trace_jax.rl.learner import make_optimizer, make_train_step
from trace_jax.rl.losses import AGGREGATIONS, LossConfig
from trace_jax.rl.single_turn import rollout
from trace_jax.sampling import Sampler
from trace_jax.sharding import ShardingPlan, make_mesh
from trace_jax.tasks import TASK_SETS

ADAPTER = 0  # the one adapter this job trains


def _checks() -> list[Check]:
    """(config key, predicate, what it must be) for every setting the job reads."""
    in_unit = lambda v: isinstance(v, (int, float)) and 0.0 < v <= 1.0
    return [
        ("model", lambda v: isinstance(v, str) and bool(v), "an embedded model name or an HF checkpoint folder"),
        ("dtype", lambda v: v in DTYPES, f"one of {sorted(DTYPES)}"),
        ("seed", lambda v: isinstance(v, int), "an int"),
        ("task", lambda v: v in TASK_SETS, f"one of {sorted(TASK_SETS)}"),
        ("lora.rank", positive_int, "a positive int"),
        ("lora.alpha", lambda v: isinstance(v, (int, float)) and v > 0, "> 0"),
        ("lora.targets", lambda v: set(v) <= set(lora.ALL_TARGETS) | {t[:-5] for t in lora.ALL_TARGETS},
         f"names from {list(lora.ALL_TARGETS)}"),
        ("rollout.tasks_per_step", positive_int, "a positive int"),
        ("rollout.group_size", lambda v: positive_int(v) and v >= 2, "an int >= 2 (advantages compare a group)"),
        ("rollout.temperature", lambda v: isinstance(v, (int, float)) and v > 0,
         "> 0 (the learner trains the policy at this temperature)"),
        ("rollout.top_p", lambda v: v == 1.0,
         "1.0: the sampler's logprobs serve as the old policy's, and truncation would make them differ"),
        ("rollout.max_new_tokens", positive_int, "a positive int"),
        ("rollout.batch_size", positive_int, "a positive int (rows sampled at once)"),
        ("rollout.min_shared_prefix", lambda v: v is None or (isinstance(v, int) and v >= 1), "None or an int >= 1"),
        ("advantage", lambda v: v in ADVANTAGE_ESTIMATORS, f"one of {sorted(ADVANTAGE_ESTIMATORS)}"),
        ("loss.aggregation", lambda v: v in AGGREGATIONS, f"one of {sorted(AGGREGATIONS)}"),
        ("optimizer.lr", lambda v: isinstance(v, (int, float)) and v > 0, "> 0"),
        ("optimizer.weight_decay", lambda v: isinstance(v, (int, float)) and v >= 0, ">= 0"),
        ("optimizer.clip_norm", lambda v: isinstance(v, (int, float)) and v > 0, "> 0"),
        ("train.steps", positive_int, "a positive int"),
        ("train.micro_batches", positive_int, "a positive int"),
        ("train.remat", lambda v: isinstance(v, bool), "a bool"),
        ("train.checkpoint_every", positive_int, "a positive int"),
        ("train.keep_checkpoints", positive_int, "a positive int"),
        ("eval.splits", lambda v: isinstance(v, (tuple, list)) and len(v) >= 1 and all(isinstance(x, str) for x in v),
         "a non-empty tuple of the task set's held-out split names"),
        ("eval.num_tasks", positive_int, "a positive int"),
        ("eval.every", positive_int, "a positive int"),
        ("eval.batch_size", positive_int, "a positive int"),
        ("eval.max_new_tokens", positive_int, "a positive int"),
        ("mesh.data", lambda v: isinstance(v, int) and (v == -1 or v >= 1), "-1 (all devices left) or >= 1"),
        ("mesh.fsdp", positive_int, "a positive int"),
        ("mesh.tensor", positive_int, "a positive int"),
        ("log_every_s", lambda v: isinstance(v, (int, float)) and v >= 0, ">= 0"),
        ("loss.eps_low", lambda v: isinstance(v, (int, float)) and 0 <= v < 1, "in [0, 1)"),
        ("loss.eps_high", in_unit, "in (0, 1]"),
        ("loss.kl_coef", lambda v: isinstance(v, (int, float)) and v >= 0, ">= 0"),
    ]


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Fails at start, naming the key, on a missing or invalid setting."""
    check_config(config, _checks())


def _loss_config(config: ml_collections.ConfigDict) -> LossConfig:
    return LossConfig(aggregation=config.loss.aggregation, eps_low=config.loss.eps_low,
                      eps_high=config.loss.eps_high, kl_coef=config.loss.kl_coef,
                      max_len=config.rollout.max_new_tokens)


def _evaluate(sampler, tokenizer, task_set, heldout: dict[str, list], config, adapter_idx: int) -> dict[str, float]:
    """Metrics of one greedy completion per held-out task, for each split of `heldout`."""
    metrics = {}
    for index, (split, tasks) in enumerate(heldout.items()):
        scored = rollout(sampler, tokenizer, task_set, tasks, key=jax.random.key(0), adapter_idx=adapter_idx,
                         temperature=0.0, max_new_tokens=config.eval.max_new_tokens, batch_size=config.eval.batch_size)
        metrics.update(scored.summary("eval" if index == 0 else f"eval_{split}"))
    return metrics


def _base_eval(workdir: pathlib.Path, evaluate: Callable[[int], dict[str, float]]) -> dict[str, float]:
    """The base model's held-out metrics, computed once per workdir (a resumed run reads them back)."""
    path = workdir / "base_eval.json"
    if path.is_file():
        return json.loads(path.read_text())
    metrics = evaluate(lora.NO_ADAPTER)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(metrics))
    tmp.replace(path)
    return metrics


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict[str, float]:
    """Runs (or resumes) the job in `workdir`; returns the summary also written to summary.json."""
    validate_config(config)
    start_time = time.monotonic()
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = load_model(config.model, config.dtype)
    cfg, tokenizer = model.cfg, model.tokenizer
    mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    plan = ShardingPlan(mesh) if mesh.size > 1 else None
    params = plan.shard_params(model.params) if plan else model.params
    task_set = TASK_SETS[config.task]
    num_rows = config.rollout.tasks_per_step * config.rollout.group_size
    row_multiple = config.train.micro_batches * (plan.batch_multiple if plan else 1)

    init_key, run_key = jax.random.split(jax.random.key(config.seed))
    spec = lora.LoraSpec(rank=config.lora.rank, alpha=config.lora.alpha, targets=tuple(config.lora.targets))
    adapters = lora.init_adapters(init_key, cfg, spec, 1, params["embed"].dtype)
    weights = plan.shard_params(adapters.weights) if plan else adapters.weights
    optimizer = make_optimizer(config.optimizer.lr, config.optimizer.weight_decay, config.optimizer.clip_norm)
    state = TrainState(step=0, adapter_weights=weights, scale=adapters.scale, opt_state=optimizer.init(weights),
                       rng=run_key, cursor={"next_task": 0, "learner_width": 0})
    checkpointer = Checkpointer(workdir / "checkpoints", keep=config.train.keep_checkpoints,
                                save_every=config.train.checkpoint_every)
    if checkpointer.latest_step() is not None:
        state = checkpointer.restore(state)
        logging.info("resumed from step %d in %s", state.step, workdir)

    train_tasks = task_set.make_tasks("train", config.train.steps * config.rollout.tasks_per_step, config.seed)
    heldout = {split: task_set.make_tasks(split, config.eval.num_tasks, config.seed) for split in config.eval.splits}
    sampler = Sampler(cfg, params, adapters=lora.Adapters(state.adapter_weights, state.scale), plan=plan,
                      detokenize=tokenizer.decode, min_shared_prefix=config.rollout.min_shared_prefix)
    evaluate = lambda adapter_idx: _evaluate(sampler, tokenizer, task_set, heldout, config, adapter_idx)
    writer = MetricsWriter(workdir)
    base = _base_eval(workdir, evaluate)
    logging.info("base held-out reward %.3f", base["eval/reward"])
    if state.step == 0:
        writer.write(0, base)
    train_step = make_train_step(cfg, _loss_config(config), optimizer, micro_batches=config.train.micro_batches,
                                 plan=plan, remat=config.train.remat, temperature=config.rollout.temperature)

    latest_eval = base if state.step == 0 else None
    progress = Progress(config.train.steps, start=state.step, every_s=config.log_every_s)
    weights, opt_state = state.adapter_weights, state.opt_state
    for step in range(state.step, config.train.steps):
        t0 = time.monotonic()
        cursor, width = state.cursor["next_task"], state.cursor["learner_width"]
        tasks = train_tasks[cursor : cursor + config.rollout.tasks_per_step]
        rollouts = rollout(sampler, tokenizer, task_set, tasks, key=jax.random.fold_in(state.rng, step),
                           group_size=config.rollout.group_size, adapter_idx=ADAPTER,
                           temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                           max_new_tokens=config.rollout.max_new_tokens, batch_size=config.rollout.batch_size)
        t_sampled = time.monotonic()
        advantages, keep, advantage_stats = compute_advantages(config.advantage, rollouts.rewards, rollouts.group_ids)
        metrics = {**rollouts.summary("rollout"), **{f"advantage/{k}": v for k, v in advantage_stats.items()}}
        kept = np.flatnonzero(keep)
        if kept.size:  # a batch of only constant-reward groups carries no signal: no update
            batch = build_learner_batch(
                [rollouts.prompts[i] for i in kept], [rollouts.completions[i].token_ids for i in kept],
                [rollouts.completions[i].logprobs for i in kept], advantages[kept], [ADAPTER] * kept.size,
                num_rows=num_rows, row_multiple=row_multiple, completion_budget=config.rollout.max_new_tokens,
                min_width=width, min_shared_prefix=config.rollout.min_shared_prefix, pad_id=tokenizer.pad_token_id)
            width = batch["tokens"].shape[1]  # rows never get narrower: no recompiling for a shorter batch
            batch["dropped_fraction"] = np.float32(advantage_stats["dropped_fraction"])
            weights, opt_state, learner_metrics = train_step(params, weights, opt_state, state.scale, batch)
            sampler.set_adapters(lora.Adapters(weights, state.scale))
            metrics.update({f"learner/{k}": float(v) for k, v in learner_metrics.items()})
            metrics["learner/tokens"] = float(batch["tokens"].size)
        t_learned = time.monotonic()
        metrics.update({"time/sample_s": t_sampled - t0, "time/learn_s": t_learned - t_sampled,
                        "time/step_s": t_learned - t0, "rollout/rows": float(num_rows)})
        state = TrainState(step=step + 1, adapter_weights=weights, scale=state.scale, opt_state=opt_state,
                           rng=state.rng, cursor={"next_task": cursor + len(tasks), "learner_width": width})
        checkpointer.save(state, force=step + 1 == config.train.steps)
        if (step + 1) % config.eval.every == 0 or step + 1 == config.train.steps:
            latest_eval = evaluate(ADAPTER)
            metrics.update(latest_eval)
        writer.write(step + 1, metrics)
        progress.update(step + 1, f"reward {metrics['rollout/reward']:.3f}"
                        + (f"  held-out {metrics['eval/reward']:.3f}" if "eval/reward" in metrics else ""))
    checkpointer.close()
    if latest_eval is None:  # resumed after the last step: evaluate the final adapter again
        latest_eval = evaluate(ADAPTER)
    writer.close()
    summary = {"base_reward": base["eval/reward"], "final_reward": latest_eval["eval/reward"],
               "steps": int(state.step), "seconds": round(time.monotonic() - start_time, 1)}
    for split in config.eval.splits[1:]:  # the other held-out splits, reported beside the main one
        summary[f"base_reward_{split}"] = base[f"eval_{split}/reward"]
        summary[f"final_reward_{split}"] = latest_eval[f"eval_{split}/reward"]
    (workdir / "summary.json").write_text(json.dumps(summary))
    return summary
