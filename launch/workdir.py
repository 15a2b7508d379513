"""The `--fresh` flag the jobs share, and the workdir a job runs in (`trace_jax.workdirs`)."""

from __future__ import annotations

import pathlib

import ml_collections
from absl import flags, logging

from trace_jax import distributed
from trace_jax.workdirs import check_marker, decisive_settings, fresh_workdir

FRESH = flags.DEFINE_bool(
    "fresh",
    False,
    "When --workdir holds a run made with other result-deciding settings, start this run in the next free folder "
    "beside it (<workdir>-2, -3, ...) instead of refusing; nothing is deleted.",
)


def job_workdir(workdir: str, job: str, config: ml_collections.ConfigDict | dict) -> str:
    """--workdir, checked before anything is built (WorkdirMismatch when it holds another run); with --fresh, the
    first folder beside it that is free or holds this very run (logged), as the main process finds it: every
    process of a multi-process job runs in that one folder, whatever the others see on their own disks."""
    settings = decisive_settings(config.to_dict() if isinstance(config, ml_collections.ConfigDict) else config)
    if not FRESH.value:
        check_marker(pathlib.Path(workdir), job, settings, write=False)
        return workdir
    folder = distributed.on_main(lambda: str(fresh_workdir(workdir, job, settings)))
    if folder != workdir:
        logging.warning("--fresh: %s holds a %s run with other settings; this run goes to %s", workdir, job, folder)
    return folder
