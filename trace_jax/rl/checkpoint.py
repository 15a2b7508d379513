"""Resumable learner checkpoints on orbax-checkpoint.

A checkpoint holds everything needed to continue GRPO training exactly where it
stopped: the LoRA adapter weights, their `scale`, the optax state, the step, the
RNG key and a JSON cursor into the data / rollout stream. The frozen base model
is not saved (it is reloaded from its own files).

Each step is one orbax step directory `<directory>/<step>/` with two items:
"arrays" (a pytree written with StandardSave: weights, scale, opt_state, key
data) and "meta" (JSON: step, cursor, RNG implementation).

Atomicity: orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it
to `<step>` only after every file is written, and it only lists renamed
(finalized) step directories. A process killed mid-save therefore leaves the
earlier checkpoints intact plus an ignored tmp directory (removed by orbax when
that step is saved again), never a half-written step that `latest_step` or
`restore` would pick. Rotation (`keep`) deletes the oldest step only after the
new one is finalized, so a kill during deletion leaves at worst a half-deleted
*oldest* step, which the next rotation removes. This is safety against the
process dying; orbax does not fsync, so a power loss is not covered.

`save` is synchronous: when it returns True the step is finalized on disk.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging


@dataclasses.dataclass
class TrainState:
    """The learner's full resumable state.

    adapter_weights: `Adapters.weights`; scale: `Adapters.scale`; opt_state: the optax
    state of `adapter_weights`; rng: a typed `jax.random.key`; cursor: a JSON-serialisable
    position in the data / rollout stream, e.g. {"epoch": 0, "next_prompt": 17}.
    """

    step: int
    adapter_weights: Any
    scale: jax.Array
    opt_state: Any
    rng: jax.Array
    cursor: dict


def _arrays(state: TrainState) -> dict:
    """The array part of a state, as one pytree (the typed key as its raw uint32 data, on the host: every process
    of a multi-process run holds the same key, and orbax writes a host array once)."""
    return {
        "adapter_weights": state.adapter_weights,
        "scale": state.scale,
        "opt_state": state.opt_state,
        "rng_data": np.asarray(jax.random.key_data(state.rng)),
    }


def _abstract(tree: Any) -> Any:
    """Shape/dtype/sharding of every array leaf: the restore target, so the restored tree has the
    template's structure (optax namedtuples included) and lands on the template's devices."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    """Keeps the last `keep` training states under `directory`, one every `save_every` steps.

    Usable as a context manager (closes on exit). Several readers may share a directory,
    but only one process should save into it.
    """

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 3, save_every: int = 1):
        if keep < 1 or save_every < 1:
            raise ValueError(f"keep and save_every must be >= 1, got keep={keep}, save_every={save_every}")
        self.directory = pathlib.Path(directory).absolute()
        self.save_every = save_every
        self._name_format = ocp.path.step.standard_name_format()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, step_name_format=self._name_format
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("arrays", "meta"))

    def save(self, state: TrainState, *, force: bool = False) -> bool:
        """Writes `state` if its step is a multiple of `save_every` (or `force`); True if it was written.

        Blocks until the checkpoint is finalized, then deletes the oldest beyond `keep`.
        A step that is already on disk is not rewritten (returns False).
        """
        step = int(state.step)
        if not (force or step % self.save_every == 0) or step in self._manager.all_steps():
            return False
        meta = {"step": step, "cursor": state.cursor, "rng_impl": str(jax.random.key_impl(state.rng))}
        args = ocp.args.Composite(arrays=ocp.args.StandardSave(_arrays(state)), meta=ocp.args.JsonSave(meta))
        saved = self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()
        return saved

    def latest_step(self) -> int | None:
        """The newest finalized step on disk.

        Read from the directory names on each call (no step metadata is opened), so it also sees, and
        is safe against, saves and deletions by another process.
        """
        latest = ocp.path.step.latest_step_metadata(self.directory, self._name_format)
        return None if latest is None else latest.step

    def restore(self, template: TrainState, step: int | None = None) -> TrainState:
        """The state saved at `step` (default: the latest), shaped, typed and placed like `template`.

        `template` is a freshly initialised state (e.g. `optimizer.init(weights)` for opt_state);
        only its structure, shapes, dtypes and shardings are used.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no finished checkpoint in {self.directory} to restore from")
        else:
            try:
                self._name_format.find_step(self.directory, step)
            except ValueError:
                raise FileNotFoundError(f"no finished checkpoint for step {step} in {self.directory}") from None
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        template_impl = str(jax.random.key_impl(template.rng))
        if meta["rng_impl"] != template_impl:
            raise ValueError(
                f"checkpoint step {step} holds a {meta['rng_impl']!r} RNG key, the template a {template_impl!r} one"
            )
        target = ocp.args.StandardRestore(_abstract(_arrays(template)))
        arrays = self._manager.restore(step, args=ocp.args.Composite(arrays=target))["arrays"]
        rng = jax.random.wrap_key_data(arrays["rng_data"], impl=template_impl)
        return TrainState(
            step=meta["step"],
            adapter_weights=arrays["adapter_weights"],
            scale=arrays["scale"],
            opt_state=arrays["opt_state"],
            rng=rng,
            cursor=meta["cursor"],
        )

    def restore_newest_readable(self, template: TrainState) -> TrainState | None:
        """The newest checkpoint that restores (as `restore`), going back one step, with a warning, past any that
        fails to (a file corrupted after it was finalized); None when there is none. A corrupt newest step costs
        the steps since the previous one, never the run."""
        steps = sorted(self._manager.all_steps(), reverse=True)
        for step in steps:
            try:
                return self.restore(template, step)
            except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many kinds on a corrupt step
                logging.warning(
                    "checkpoint step %d in %s does not restore (%s: %s); trying the previous one",
                    step,
                    self.directory,
                    type(error).__name__,
                    str(error)[:300],
                )
        if steps:
            raise RuntimeError(
                f"no checkpoint in {self.directory} restores (steps {steps}): remove the folder to start afresh"
            )
        return None

    def close(self) -> None:
        """Waits for any pending work and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
