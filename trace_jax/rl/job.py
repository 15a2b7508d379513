"""What the adapter-training jobs (GRPO, SFT) share: the settings every one's config holds, the model on its
mesh, one LoRA adapter with its optimizer state (fresh or restored from the workdir), the end of a run (PEFT export
of the adapter) and a finished run's summary, returned instead of a second run."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import optax
from absl import logging

from trace_jax import distributed, lora
from trace_jax.files import read_json
from trace_jax.models.model import DTYPES, Model, load_model
from trace_jax.rl.checkpoint import Checkpointer, TrainState
from trace_jax.rl.learner import make_optimizer
from trace_jax.settings import (
    REQUIRED,
    is_bool,
    is_int,
    non_negative_int,
    non_negative_number,
    nonempty_str,
    positive_int,
    positive_number,
    setting,
)
from trace_jax.sharding import ShardingPlan, make_mesh

ADAPTER = 0  # the one adapter a job trains


def _known_targets(value: Any) -> bool:
    return isinstance(value, tuple) and set(value) <= set(lora.ALL_TARGETS) | {t[:-5] for t in lora.ALL_TARGETS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """The `lora` block: the adapter a job trains."""

    rank: int = setting(REQUIRED, "a positive int", positive_int)
    alpha: float = setting(REQUIRED, "> 0", positive_number)
    targets: tuple[str, ...] = setting(REQUIRED, f"names from {list(lora.ALL_TARGETS)}", _known_targets)
    first_layer: int = setting(
        REQUIRED, "an int >= 0 (layers below it get no adapter and run forward only in the learner)", non_negative_int
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """The `optimizer` block (AdamW with gradient clipping: `rl.learner.make_optimizer`)."""

    lr: float = setting(REQUIRED, "> 0", positive_number)
    weight_decay: float = setting(REQUIRED, ">= 0", non_negative_number)
    clip_norm: float = setting(REQUIRED, "> 0", positive_number)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSettings:
    """The `mesh` block: the learner's device mesh (`sharding.make_mesh`)."""

    data: int = setting(REQUIRED, "-1 (all devices left) or >= 1", lambda v: isinstance(v, int) and (v == -1 or v >= 1))
    fsdp: int = setting(REQUIRED, "a positive int", positive_int)
    tensor: int = setting(REQUIRED, "a positive int", positive_int)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """The `train` block's keys every training job reads."""

    micro_batch_tokens: int = setting(
        REQUIRED, "a positive int (tokens per micro-batch, padding included)", positive_int
    )
    remat: bool = setting(REQUIRED, "a bool", is_bool)
    checkpoint_every: int = setting(REQUIRED, "a positive int", positive_int)
    keep_checkpoints: int = setting(REQUIRED, "a positive int", positive_int)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSettings:
    """What every training job's config holds; each job's settings class adds its own blocks."""

    model: str = setting(REQUIRED, "an embedded model name or an HF checkpoint folder", nonempty_str)
    dtype: str = setting(REQUIRED, f"one of {sorted(DTYPES)}", lambda v: v in DTYPES)
    seed: int = setting(REQUIRED, "an int", is_int)
    lora: LoraSettings
    optimizer: OptimizerSettings
    train: TrainSettings
    mesh: MeshSettings
    log_every_s: float = setting(REQUIRED, ">= 0", non_negative_number)


@dataclasses.dataclass
class TrainingRun:
    """A job's model on its mesh, its optimizer, its (fresh or resumed) state and its checkpointer."""

    model: Model
    params: dict
    plan: ShardingPlan | None
    optimizer: optax.GradientTransformation
    state: TrainState
    checkpointer: Checkpointer
    sampler_params: dict  # the sampler's copy: `params` unless other processes share the mesh (distributed.py)
    sampler_plan: ShardingPlan | None

    @property
    def row_multiple(self) -> int:
        """Rows of a micro-batch must be a multiple of this (the mesh's data-parallel size)."""
        return self.plan.batch_multiple if self.plan else 1

    def adapters(self, weights=None) -> lora.Adapters:
        """The trained adapter as a stack of one (`weights`: the current ones, default the state's)."""
        return lora.Adapters(self.state.adapter_weights if weights is None else weights, self.state.scale)

    def sampler_adapters(self, weights=None) -> lora.Adapters:
        """`adapters(weights)` as this process's sampler holds them."""
        return distributed.local_copy(self.adapters(weights))


def start_run(config: ml_collections.ConfigDict, workdir: pathlib.Path, cursor: dict) -> TrainingRun:
    """Loads the model onto the mesh and makes a fresh adapter state (`cursor`: the data position of
    step 0), or restores the workdir's latest checkpoint."""
    model = load_model(config.model, config.dtype)
    mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    plan = ShardingPlan(mesh) if mesh.size > 1 else None
    params = plan.shard_params(model.params) if plan else model.params
    local = distributed.local_mesh(mesh)
    sampler_plan = plan if local is mesh else (ShardingPlan(local) if local.size > 1 else None)
    sampler_params = (
        params if local is mesh else (sampler_plan.shard_params(model.params) if sampler_plan else model.params)
    )
    init_key, run_key = jax.random.split(jax.random.key(config.seed))
    spec = lora.LoraSpec(
        rank=config.lora.rank,
        alpha=config.lora.alpha,
        targets=tuple(config.lora.targets),
        first_layer=config.lora.first_layer,
    )
    adapters = lora.init_adapters(init_key, model.cfg, spec, 1, params["embed"].dtype)
    optimizer = make_optimizer(config.optimizer.lr, config.optimizer.weight_decay, config.optimizer.clip_norm)
    fresh = (adapters.weights, adapters.scale, optimizer.init(adapters.weights))
    weights, scale, opt_state = plan.shard_params(fresh) if plan else fresh  # on the mesh of every process
    state = TrainState(step=0, adapter_weights=weights, scale=scale, opt_state=opt_state, rng=run_key, cursor=cursor)
    checkpointer = Checkpointer(
        workdir / "checkpoints", keep=config.train.keep_checkpoints, save_every=config.train.checkpoint_every
    )
    restored = checkpointer.restore_newest_readable(state)
    if restored is not None:
        state = restored
        logging.info("resumed from step %d in %s", state.step, workdir)
    return TrainingRun(model, params, plan, optimizer, state, checkpointer, sampler_params, sampler_plan)


def export_adapter(run: TrainingRun, out: pathlib.Path, weights=None) -> pathlib.Path:
    """Writes the adapter (`weights`, default the state's) in PEFT's format to `out` (files overwritten; process 0
    writes)."""
    adapters = run.sampler_adapters(weights)
    # every process may load it next (an evaluation of it)
    distributed.on_main(lambda: lora.save_peft(adapters, out, index=ADAPTER, base_model=str(run.model.path)))
    return out


SUMMARY = "summary.json"  # written last of all when a job's run ends


def unless_finished(workdir: str | pathlib.Path, run: Callable[[], dict]) -> dict:
    """`run()`, unless the job in `workdir` has finished: then the summary it wrote last, as it is. A finished
    job's workdir may lack its checkpoints (a result committed without them, or copied to another machine), and
    resuming from no checkpoint would train again from the first step; its adapter/ and logs are kept as they are.
    Every process of a multi-process job takes process 0's answer."""
    path = pathlib.Path(workdir) / SUMMARY
    summary = distributed.on_main(lambda: read_json(path) if path.is_file() else None)
    if summary is None:
        return run()
    logging.info("the run in %s finished before: its summary is returned, nothing is run again", workdir)
    return summary
