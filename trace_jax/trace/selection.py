"""Stage 1's selection: which labelled capabilities the base agent lacks (TRACE's exact rule).

A labelling run labels every (trajectory, capability) pair NA / PRESENT / LACKING and is stored
in the authors' interchange format: `{"attempt": i, "totals": {"total_failed": F,
"total_passed": P}, "labels": {capability: {"lacking_failed": [ids], "present_failed": [...],
"na_failed": [...], "lacking_passed": [...], "present_passed": [...], "na_passed": [...]}}}`,
where each capability's six lists partition the run's task ids. Per run and capability, with L/P
for LACKING/PRESENT and F/S for failed/passed trajectories:

  ER- = LF / (LF + PF),  ER+ = LS / (LS + PS),  Delta = ER- - ER+,  Cov = LF / |failed|

(a rate with a zero denominator is 0). A run passes a capability when Delta >= delta and
Cov >= coverage; a capability is selected when it passes in at least `min_runs` runs, and
selected ones are ranked by mean coverage.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

LISTS = ("lacking_failed", "present_failed", "na_failed", "lacking_passed", "present_passed", "na_passed")


class InvalidRun(ValueError):
    """A labelling run that is not the interchange format or not a partition of its tasks."""


@dataclasses.dataclass(frozen=True)
class LabellingRun:
    """One labelling run: per capability, the task ids of each (label, outcome) cell."""

    attempt: int
    total_failed: int
    total_passed: int
    labels: Mapping[str, Mapping[str, tuple[str, ...]]]

    @classmethod
    def from_json(cls, data: Mapping, source: str = "run") -> "LabellingRun":
        """Parses and validates one run: each capability's lists must partition the same failed
        and passed ids, as many as `totals` says."""
        try:
            totals, labels = data["totals"], data["labels"]
            total_failed, total_passed = int(totals["total_failed"]), int(totals["total_passed"])
            cells = {name: {key: tuple(str(i) for i in lists[key]) for key in LISTS} for name, lists in labels.items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise InvalidRun(f"{source}: not a labelling run ({type(error).__name__}: {error})") from None
        if not cells:
            raise InvalidRun(f"{source}: labels no capability")
        groups = {}
        for name, lists in cells.items():
            for outcome, total in (("failed", total_failed), ("passed", total_passed)):
                ids = [i for label in ("lacking", "present", "na") for i in lists[f"{label}_{outcome}"]]
                if len(ids) != len(set(ids)) or len(ids) != total:
                    raise InvalidRun(f"{source}: capability {name!r}: its {outcome} lists hold {len(ids)} ids "
                                     f"({len(set(ids))} distinct), totals say {total}")
                if groups.setdefault(outcome, set(ids)) != set(ids):
                    raise InvalidRun(f"{source}: capability {name!r}: its {outcome} ids differ from another "
                                     "capability's")
        return cls(int(data.get("attempt", 0)), total_failed, total_passed, cells)

    def to_json(self) -> dict:
        return {"attempt": self.attempt, "totals": {"total_failed": self.total_failed,
                                                    "total_passed": self.total_passed},
                "labels": {name: {key: list(ids) for key, ids in lists.items()} for name, lists in self.labels.items()}}


def _rate(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0


def scores(run: LabellingRun, capability: str) -> dict[str, float]:
    """ER+, ER-, Delta and Cov of one capability in one run (all 0 if the run does not label it)."""
    cells = run.labels.get(capability)
    if cells is None:
        return {"er_plus": 0.0, "er_minus": 0.0, "delta": 0.0, "cov": 0.0}
    n = {key: len(ids) for key, ids in cells.items()}
    er_minus = _rate(n["lacking_failed"], n["lacking_failed"] + n["present_failed"])
    er_plus = _rate(n["lacking_passed"], n["lacking_passed"] + n["present_passed"])
    return {"er_plus": er_plus, "er_minus": er_minus, "delta": er_minus - er_plus,
            "cov": _rate(n["lacking_failed"], run.total_failed)}


def select(runs: Sequence[LabellingRun], *, delta: float = 0.2, coverage: float = 0.1,
           min_runs: int = 8) -> list[dict]:
    """Every capability any run labels, with mean and std (over runs) of Cov and Delta, the runs it
    passes in and whether it is selected; selected ones first, each group by mean coverage."""
    if not runs:
        raise ValueError("no labelling runs to select from")
    names = sorted({name for run in runs for name in run.labels})
    rows = []
    for name in names:
        per_run = [scores(run, name) for run in runs]
        cov, gap = np.array([s["cov"] for s in per_run]), np.array([s["delta"] for s in per_run])
        passed = int(np.sum((gap >= delta) & (cov >= coverage)))
        rows.append({"name": name, "mean_cov": float(cov.mean()), "std_cov": float(cov.std()),
                     "mean_delta": float(gap.mean()), "std_delta": float(gap.std()), "runs_passed": passed,
                     "runs_total": len(runs), "selected": passed >= min_runs})
    return sorted(rows, key=lambda row: (not row["selected"], -row["mean_cov"], row["name"]))


def load_runs(folder: str | pathlib.Path) -> tuple[list[LabellingRun], list[str]]:
    """The valid runs among `folder`'s *.json files (by name), and a reason for each one dropped."""
    runs, dropped = [], []
    for path in sorted(pathlib.Path(folder).glob("*.json")):
        try:
            runs.append(LabellingRun.from_json(json.loads(path.read_text()), source=path.name))
        except json.JSONDecodeError as error:
            dropped.append(f"{path.name}: invalid JSON ({error})")
        except InvalidRun as error:
            dropped.append(str(error))
    return runs, dropped
