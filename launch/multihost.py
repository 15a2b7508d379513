"""The flags with which a launch entry point runs as one process of many (`trace_jax.distributed`).

  python -m launch.grpo --config=... --workdir=... --coordinator_address=10.0.0.1:1234 --num_processes=2 \
      --process_id=0   # and --process_id=1 on the other host

TPU pod workers, Slurm and Open MPI need none of them: JAX detects the cluster itself.
"""

from __future__ import annotations

from absl import app, flags
from absl import logging as absl_logging

from trace_jax import distributed
from trace_jax.metrics import not_orbax_info

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    "",
    "host:port of process 0, which coordinates a run of "
    "several processes (else $JAX_COORDINATOR_ADDRESS; unset: one process)",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run (else $JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index in [0, num_processes) (else $JAX_PROCESS_ID)."
)


def initialize() -> None:
    """Starts `jax.distributed` from the flags or the environment when this process is one of many; processes
    other than 0 then log warnings only."""
    if not distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value):
        return
    if not distributed.is_main():
        absl_logging.set_verbosity(absl_logging.WARNING)


def start(argv: list[str]) -> None:
    """What every job's `main` does first: refuses stray arguments, starts `jax.distributed` (`initialize`) and
    keeps orbax's per-save info lines out of the log."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    initialize()
    absl_logging.get_absl_handler().addFilter(not_orbax_info)
