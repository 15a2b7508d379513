"""Metrics for long jobs: TensorBoard event files plus a JSON-lines copy, and a progress log line.

`MetricsWriter` writes every scalar both to TensorBoard (tensorboardX, which needs no
TensorFlow) and to `metrics.jsonl`, which is easy to turn into tables and plots.
`Progress` logs "step k/n", the rate and the ETA at most every `every_s` seconds.
"""

from __future__ import annotations

import json
import logging as std_logging
import math
import pathlib
import time
from collections.abc import Mapping

from absl import logging
from tensorboardX import SummaryWriter

from trace_jax import distributed


class MetricsWriter:
    """Scalars per step into `<workdir>/tensorboard` and `<workdir>/metrics.jsonl` (appended, so a
    resumed run continues the same files). In a run of several processes only process 0 writes (the others
    compute the same scalars)."""

    def __init__(self, workdir: str | pathlib.Path):
        self._writes = distributed.is_main()
        if not self._writes:
            return
        workdir = pathlib.Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        # A unique suffix: event files are named by the second they were opened in, and a
        # resumed run opening one in the same second would otherwise truncate the old one.
        self._tensorboard = SummaryWriter(str(workdir / "tensorboard"), filename_suffix=f".{time.time_ns()}")
        self._jsonl = open(workdir / "metrics.jsonl", "a", encoding="utf-8")

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self._writes:
            return
        values = {name: float(value) for name, value in scalars.items()}
        for name, value in values.items():
            self._tensorboard.add_scalar(name, value, step)
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        self._tensorboard.flush()

    def close(self) -> None:
        if not self._writes:
            return
        self._tensorboard.close()
        self._jsonl.close()


def logged_lines(workdir: str | pathlib.Path) -> list[dict]:
    """The lines of `<workdir>/metrics.jsonl` as MetricsWriter wrote them ([] before it wrote one)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


def scalars_by_step(lines: list[dict]) -> dict[int, dict[str, float]]:
    """`logged_lines`' scalars joined per step, in step order (a step's metrics may span lines: a resumed run
    adds what it measures later)."""
    steps: dict[int, dict[str, float]] = {}
    for line in lines:
        steps.setdefault(line["step"], {}).update((name, value) for name, value in line.items() if name != "step")
    return dict(sorted(steps.items()))


def logged_scalars(workdir: str | pathlib.Path, step: int) -> dict[str, float]:
    """Every scalar `<workdir>/metrics.jsonl` holds for `step` (a resumed run reads back what an earlier
    process of it logged)."""
    return scalars_by_step(logged_lines(workdir)).get(step, {})


def _duration(seconds: float) -> str:
    """'1h02m', '3m05s' or '42s'."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


class Progress:
    """Logs progress through `total` steps, starting at `start` (a resumed run), with rate and ETA."""

    def __init__(self, total: int, start: int = 0, every_s: float = 10.0, name: str = "step"):
        self.total, self.start, self.every_s, self.name = total, start, every_s, name
        self._t0 = time.monotonic()
        self._last_log = -math.inf

    def update(self, done: int, extra: str = "") -> None:
        """Reports that `done` of `total` steps are finished (logged when due, and always at the end)."""
        now = time.monotonic()
        if now - self._last_log < self.every_s and done < self.total:
            return
        self._last_log = now
        per_step = (now - self._t0) / max(done - self.start, 1)
        eta = per_step * (self.total - done)
        logging.info(
            "%s %d/%d (%.0f%%)  %.1f s/%s  elapsed %s  ETA %s  %s",
            self.name,
            done,
            self.total,
            100.0 * done / max(self.total, 1),
            per_step,
            self.name,
            _duration(now - self._t0),
            _duration(eta),
            extra,
        )


def not_orbax_info(record: std_logging.LogRecord) -> bool:
    """A log filter that drops orbax's per-save INFO chatter (a dozen lines per checkpoint), keeping its warnings."""
    return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname
