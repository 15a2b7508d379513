"""Runs of several processes (TPU pod workers, GPU hosts, local CPU processes) on JAX's own multi-host runtime.

`initialize` starts `jax.distributed` when this process is one of many. Rollouts are data-parallel: each
process plays its share of a step's episodes (`share`: every process_count-th, so long and short tasks
spread) and `gather` gives every process all of them in their original order, so all processes compute
the same advantages and the same update (each episode draws from its own random stream, so it samples
the same whichever process plays it). The learner runs on the mesh of all processes' devices; the sampler
on each process's own devices (`local_mesh`), with the adapter as every process holds it (`local_copy`).
Only process 0 writes files other than checkpoints (`is_main`), which orbax writes together.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from trace_jax.runtime import computes_on_cpu
from trace_jax.sharding import make_mesh

T = TypeVar("T")

# Launchers that start JAX's cluster detection (`jax.distributed.initialize()` with no arguments): a TPU pod
# slice's workers list every host; Slurm and Open MPI say how many tasks they started.
_CLUSTERS = (
    ("TPU_WORKER_HOSTNAMES", lambda v: len(v.split(",")) > 1),
    ("SLURM_NTASKS", lambda v: int(v) > 1),
    ("OMPI_COMM_WORLD_SIZE", lambda v: int(v) > 1),
)


def cluster_detected(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher JAX detects by itself started this process as one of several."""
    environ = os.environ if environ is None else environ
    return any(name in environ and more(environ[name]) for name, more in _CLUSTERS)


def initialize(
    coordinator_address: str = "",
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Starts `jax.distributed` when this process is one of many; returns whether it did.

    The coordinator's address, the process count and this process's id come from the arguments (the
    launchers' flags), else from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`; with
    none of them, JAX's own cluster detection runs where a TPU pod, Slurm or Open MPI started the process,
    and a lone process stays alone. On the CPU the processes exchange arrays through gloo."""
    environ = os.environ if environ is None else environ
    coordinator_address = coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS", "")
    if num_processes is None and environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(environ["JAX_NUM_PROCESSES"])
    if process_id is None and environ.get("JAX_PROCESS_ID"):
        process_id = int(environ["JAX_PROCESS_ID"])
    given = [bool(coordinator_address), num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError(
            "a process of a multi-process run needs the coordinator's address, the process count and "
            "its id (--coordinator_address, --num_processes, --process_id, or JAX_COORDINATOR_ADDRESS, "
            "JAX_NUM_PROCESSES, JAX_PROCESS_ID); got only some of them"
        )
    if not any(given) and not cluster_detected(environ):
        return False
    if any(given) and not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process_id = {process_id} is invalid; it must be in [0, --num_processes = {num_processes})"
        )
    if computes_on_cpu(environ):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if any(given):
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    else:
        jax.distributed.initialize()
    return True


def is_main() -> bool:
    """Whether this process writes the run's files (metrics, episodes, reports, exports, logs)."""
    return jax.process_index() == 0


def share(items: Sequence[T]) -> list[T]:
    """This process's part of `items`: every process_count-th one, starting at its index."""
    return list(items[jax.process_index() :: jax.process_count()])


def gather(mine: Sequence[T], total: int) -> list[T]:
    """Every process's `share` of a sequence of `total` items, as that sequence (on every process)."""
    if jax.process_count() == 1:
        return list(mine)
    out: list[Any] = [None] * total
    for index, part in enumerate(allgather_objects(list(mine))):
        out[index :: jax.process_count()] = part
    return out


def run_shared(run: Callable[[list[T]], list], items: Sequence[T]) -> list:
    """`run(items)` with each process running its share, the results gathered back in `items`' order."""
    return gather(run(share(items)), len(items))


def on_main(run: Callable[[], T]) -> T:
    """`run()` on process 0 alone (work that writes files or asks an LLM once for the run), its (picklable)
    result given to every process; every process returns once it is done, so the others may read its files next."""
    if jax.process_count() == 1:
        return run()
    return allgather_objects(run() if is_main() else None)[0]


def allgather_objects(value: Any) -> list[Any]:
    """Every process's (picklable) `value`, indexed by process."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(pickle.dumps(value), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [pickle.loads(row[:size].tobytes()) for row, size in zip(rows, sizes)]


def barrier(name: str) -> None:
    """Waits until every process got here (for files process 0 writes and the others then read)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def local_mesh(mesh: Mesh) -> Mesh:
    """The sampler's mesh: `mesh` itself in a single-process run; else this process's devices, with `mesh`'s
    tensor axis where they hold it whole (data-parallel otherwise)."""
    if jax.process_count() == 1:
        return mesh
    devices = jax.local_devices()
    tensor = mesh.shape["tensor"] if len(devices) % mesh.shape["tensor"] == 0 else 1
    return make_mesh(data=-1, fsdp=1, tensor=tensor, devices=devices)


def host_array(x: jax.Array) -> np.ndarray:
    """The whole of `x` on the host, gathered from every process where the run's mesh spreads it over them."""
    return np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True))


def local_copy(tree: Any) -> Any:
    """A tree of arrays replicated over all processes' devices, as this process's copy on one of its devices (the
    sampler's adapter); a single process's tree as it is."""
    if jax.process_count() == 1:
        return tree

    def local(x):
        if not x.sharding.is_fully_replicated:
            raise ValueError(f"an array of shape {x.shape} is not replicated ({x.sharding}): no process holds it whole")
        return x.addressable_data(0)

    return jax.tree.map(local, tree)
