"""The SFT (behaviour cloning) job: an environment's gold agent, cloned token for token into one LoRA adapter.

The gold agent plays `data.num_tasks` tasks of the environment's `env.split` through the
rollout engine, which records each of its turns as the tokens the model would emit for it
(so what is learned is exactly what sampling gives later). Only successful episodes are
kept. Each step takes the next `data.trajectories_per_step` trajectories of a stream that
visits them in a fresh seeded order every epoch, packs them by `train.micro_batch_tokens`
and applies one update of the masked token cross-entropy (mean over the agent's tokens).

Same workdir layout and guarantees as the GRPO job: checkpoints/ (exact resume after any
kill: a step's data is a pure function of the seed and the step), tensorboard/,
metrics.jsonl, progress with ETA, summary.json; the adapter is written in PEFT's format to
adapter/ and, with `export.merged`, merged into the base as an HF folder in merged/. Run as
several processes (`launch.multihost`) every process plays the gold episodes and packs the same
steps; the learner runs on the mesh of all their devices and process 0 writes the files.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import ml_collections
import numpy as np
from absl import logging

from trace_jax import distributed, lora
from trace_jax.envs import check_environment, make_environment
from trace_jax.files import write_json_atomic
from trace_jax.metrics import MetricsWriter, Progress, logged_scalars
from trace_jax.rl.batching import LearnerSequence, learned_tokens, pack_sequences, padded_tokens
from trace_jax.rl.checkpoint import TrainState
from trace_jax.rl.gold_likelihood import gold_trajectories
from trace_jax.rl.job import (
    ADAPTER,
    SUMMARY,
    JobSettings,
    TrainSettings,
    export_adapter,
    start_run,
    unless_finished,
)
from trace_jax.rl.learner import frozen_inputs, make_train_step
from trace_jax.rl.learner_batch import LearnerBatch
from trace_jax.settings import REQUIRED, from_config, is_bool, is_dict, positive_int, setting
from trace_jax.workdirs import claimed


@dataclasses.dataclass(frozen=True, kw_only=True)
class SftDataSettings:
    """The `data` block: the gold trajectories cloned."""

    num_tasks: int = setting(REQUIRED, "a positive int (gold trajectories to clone)", positive_int)
    trajectories_per_step: int = setting(REQUIRED, "a positive int", positive_int)
    max_turns: int = setting(REQUIRED, "a positive int (the gold agent's turns per episode)", positive_int)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SftTrainSettings(TrainSettings):
    steps: int = setting(REQUIRED, "a positive int", positive_int)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SftExportSettings:
    merged: bool = setting(REQUIRED, "a bool (also write the merged HF folder)", is_bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SftSettings(JobSettings):
    """The SFT job's config, typed."""

    env: dict = setting(REQUIRED, "an environment block (`trace_jax.envs`)", is_dict)
    data: SftDataSettings
    train: SftTrainSettings
    export: SftExportSettings


def validate_config(config: ml_collections.ConfigDict) -> SftSettings:
    """The config, typed; fails at start, naming the key, on a missing or invalid setting."""
    settings = from_config(SftSettings, config, "")
    check_environment(settings.env, "env", split="the split the gold trajectories come from")
    return settings


def epoch_order(num: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch `epoch` visits `num` trajectories (a pure function of seed and epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num)


def step_items(num: int, per_step: int, seed: int, step: int) -> list[int]:
    """Indices of the trajectories of `step`: the next `per_step` of the epoch-shuffled stream."""
    start = step * per_step
    out = []
    for position in range(start, start + per_step):
        epoch, at = divmod(position, num)
        out.append(int(epoch_order(num, seed, epoch)[at]))
    return out


class FrozenStreams:
    """The residual streams entering the first adapted layer (`lora.first_layer`), of the shared head
    and of every sequence, computed once: they do not depend on the adapter, so each step then
    runs only the adapted layers (at first_layer 20 of SmolLM2's 30, a third of the forward pass
    and its backward instead of the whole)."""

    def __init__(
        self, run, sequences: list[LearnerSequence], frozen_layers: int, token_budget: int, pad_id: int, remat: bool
    ):
        batch = pack_sequences(sequences, token_budget=token_budget, row_multiple=run.row_multiple, pad_id=pad_id)
        self.prefix_length = 0 if batch.prefix is None else int(batch.prefix.lengths[0])
        batch = frozen_inputs(run.params, run.model.cfg, frozen_layers, batch, remat=remat)
        self.prefix_hidden = None if batch.prefix is None else batch.prefix.hidden
        self.rows: dict[int, np.ndarray] = {}
        for mb in batch.micro_batches:
            hidden = distributed.host_array(mb.frozen_hidden)
            for row, i in enumerate(mb.sequence):
                if i >= 0:  # a row runs tokens[prefix_length:last_learned + 1]; its streams, all but the last
                    self.rows[int(i)] = hidden[row, : sequences[i].last_learned() - self.prefix_length]

    def add_to(self, batch: LearnerBatch, items: list[int]) -> LearnerBatch:
        """`batch` (packed from the sequences `items`, cut at `prefix_length`) with their streams."""
        micro_batches = []
        for mb in batch.micro_batches:
            rows, width = mb.tokens.shape
            hidden = np.zeros((rows, width - 1, self.rows[items[0]].shape[-1]), np.float32)
            for row, i in enumerate(mb.sequence):
                if i >= 0:
                    stream = self.rows[items[i]]
                    hidden[row, : len(stream)] = stream
            micro_batches.append(mb.replace(frozen_hidden=hidden))
        prefix = batch.prefix if batch.prefix is None else batch.prefix.replace(hidden=self.prefix_hidden)
        return dataclasses.replace(batch, micro_batches=tuple(micro_batches), prefix=prefix)


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
    """Runs (or resumes) the job in `workdir`, which it holds meanwhile and resumes only with the same
    result-deciding settings (`workdirs.claimed`); returns the summary also written to summary.json. A finished
    run is not run again (`job.unless_finished`)."""
    settings = validate_config(config)
    with claimed(workdir, "sft", config.to_dict(), main=distributed.is_main()):
        return unless_finished(workdir, lambda: _train(settings, workdir))


def _train(settings: SftSettings, workdir: str | pathlib.Path) -> dict:
    start_time = time.monotonic()
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run = start_run(settings, workdir, cursor={})
    tokenizer = run.model.tokenizer
    env = make_environment(ml_collections.ConfigDict(settings.env))
    tasks = env.tasks(settings.env["split"], settings.data.num_tasks)
    played = gold_trajectories(env, tokenizer, tasks, settings.data.max_turns, ADAPTER)
    kept = [t for t in played if t.outcome.success]
    if not kept:
        raise ValueError(
            f"no gold episode of {settings.env['name']}/{settings.env['split']} succeeded: nothing to clone"
        )
    logging.info(
        "cloning %d gold trajectories (%d of %d played succeeded), %d agent tokens",
        len(kept),
        len(kept),
        len(played),
        sum(sum(t.loss_mask) for t in kept),
    )
    sequences = [LearnerSequence(t.token_ids, t.loss_mask, t.logprobs, 0.0, ADAPTER) for t in kept]
    train_step = make_train_step(
        run.model.cfg,
        None,
        run.optimizer,
        plan=run.plan,
        remat=settings.train.remat,
        objective="sft",
        frozen_layers=settings.lora.first_layer,
    )
    streams = None
    if settings.lora.first_layer and run.state.step < settings.train.steps:
        t0 = time.monotonic()
        streams = FrozenStreams(
            run,
            sequences,
            settings.lora.first_layer,
            settings.train.micro_batch_tokens,
            tokenizer.pad_token_id,
            settings.train.remat,
        )
        logging.info(
            "streams entering layer %d computed once in %.1f s", settings.lora.first_layer, time.monotonic() - t0
        )
    writer = MetricsWriter(workdir)
    progress = Progress(settings.train.steps, start=run.state.step, every_s=settings.log_every_s)
    state = run.state
    weights, opt_state = state.adapter_weights, state.opt_state
    metrics = {}
    for step in range(state.step, settings.train.steps):
        t0 = time.monotonic()
        items = step_items(len(sequences), settings.data.trajectories_per_step, settings.seed, step)
        batch = pack_sequences(
            [sequences[i] for i in items],
            token_budget=settings.train.micro_batch_tokens,
            row_multiple=run.row_multiple,
            pad_id=tokenizer.pad_token_id,
            prefix_length=streams.prefix_length if streams else None,
        )
        if streams:
            batch = streams.add_to(batch, items)
        weights, opt_state, learner_metrics = train_step(run.params, weights, opt_state, state.scale, batch)
        metrics = {f"learner/{k}": float(v) for k, v in learner_metrics.items()}
        metrics.update(
            {
                "learner/tokens": float(padded_tokens(batch)),
                "learner/loss_tokens": float(learned_tokens(batch)),
                "learner/micro_batches": float(len(batch.micro_batches)),
                "time/step_s": time.monotonic() - t0,
            }
        )
        state = TrainState(
            step=step + 1, adapter_weights=weights, scale=state.scale, opt_state=opt_state, rng=state.rng, cursor={}
        )
        writer.write(step + 1, metrics)  # before the checkpoint, as the GRPO job does
        run.checkpointer.save(state, force=step + 1 == settings.train.steps)
        progress.update(step + 1, f"loss {metrics['learner/loss']:.4f}")
    run.checkpointer.close()
    writer.close()
    run.state = state
    export_adapter(run, workdir / "adapter")
    if settings.export.merged and distributed.is_main():
        lora.merge_peft_folder(run.model.path, workdir / "adapter", workdir / "merged")
    summary = {
        "steps": int(state.step),
        "trajectories": len(kept),
        "gold_played": len(played),
        "final_loss": metrics.get("learner/loss", logged_scalars(workdir, state.step).get("learner/loss")),
        "seconds": round(time.monotonic() - start_time, 1),
    }
    distributed.on_main(lambda: write_json_atomic(workdir / SUMMARY, summary))
    return summary
