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
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from trace_jax.files import UnreadableJson, read_json

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
    def from_json(cls, data: Mapping, source: str = "run") -> LabellingRun:
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
                    raise InvalidRun(
                        f"{source}: capability {name!r}: its {outcome} lists hold {len(ids)} ids "
                        f"({len(set(ids))} distinct), totals say {total}"
                    )
                if groups.setdefault(outcome, set(ids)) != set(ids):
                    raise InvalidRun(
                        f"{source}: capability {name!r}: its {outcome} ids differ from another capability's"
                    )
        return cls(int(data.get("attempt", 0)), total_failed, total_passed, cells)

    def to_json(self) -> dict:
        return {
            "attempt": self.attempt,
            "totals": {"total_failed": self.total_failed, "total_passed": self.total_passed},
            "labels": {name: {key: list(ids) for key, ids in lists.items()} for name, lists in self.labels.items()},
        }


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
    return {
        "er_plus": er_plus,
        "er_minus": er_minus,
        "delta": er_minus - er_plus,
        "cov": _rate(n["lacking_failed"], run.total_failed),
    }


def select(runs: Sequence[LabellingRun], *, delta: float = 0.2, coverage: float = 0.1, min_runs: int = 8) -> list[dict]:
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
        rows.append(
            {
                "name": name,
                "mean_cov": float(cov.mean()),
                "std_cov": float(cov.std()),
                "mean_delta": float(gap.mean()),
                "std_delta": float(gap.std()),
                "runs_passed": passed,
                "runs_total": len(runs),
                "selected": passed >= min_runs,
            }
        )
    return sorted(rows, key=lambda row: (not row["selected"], -row["mean_cov"], row["name"]))


_CODES = {"na": 0, "present": 1, "lacking": 2}


def _ids(run: LabellingRun, outcome: str) -> list[str]:
    """The run's failed or passed trajectory ids, sorted (every capability's lists hold the same ones)."""
    lists = next(iter(run.labels.values()))
    return sorted(i for label in _CODES for i in lists[f"{label}_{outcome}"])


def _codes(run: LabellingRun, capability: str, outcome: str) -> np.ndarray:
    """Each failed (or passed) trajectory's label on `capability`: 0 NA, 1 PRESENT, 2 LACKING (NA if unlabelled)."""
    cells = run.labels.get(capability, {})
    code = {i: c for label, c in _CODES.items() for i in cells.get(f"{label}_{outcome}", ())}
    return np.array([code.get(i, 0) for i in _ids(run, outcome)], dtype=np.int8)


def resample(run: LabellingRun, rng: np.random.Generator, attempt: int) -> LabellingRun:
    """A bootstrap resample of the run's trajectories, failed and passed ones apart (so |D-| and |D+|
    stay); the k-th draw of id `x` becomes `x#k`, so the lists still partition distinct ids."""
    draws = {}
    for outcome in ("failed", "passed"):
        ids = _ids(run, outcome)
        draws[outcome] = [ids[j] for j in rng.integers(0, max(len(ids), 1), len(ids))]
    labels = {}
    for name, cells in run.labels.items():
        key = {i: k for k, ids in cells.items() for i in ids}
        lists: dict[str, list[str]] = {k: [] for k in LISTS}
        for ids in draws.values():
            for k, i in enumerate(ids):
                lists[key[i]].append(f"{i}#{k}")
        labels[name] = lists
    return LabellingRun.from_json(
        {
            "attempt": attempt,
            "totals": {"total_failed": run.total_failed, "total_passed": run.total_passed},
            "labels": labels,
        }
    )


def _gap_and_coverage(failed: np.ndarray, passed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Delta and Cov of label codes with trajectories on the last axis (rates with a zero denominator are 0)."""

    def rate(numerator, denominator):
        return np.where(denominator > 0, numerator / np.maximum(denominator, 1), 0.0)

    lf, pf = (failed == 2).sum(-1), (failed == 1).sum(-1)
    lp, pp = (passed == 2).sum(-1), (passed == 1).sum(-1)
    return rate(lf, lf + pf) - rate(lp, lp + pp), rate(lf, np.full_like(lf, failed.shape[-1]))


def intervals(
    runs: Sequence[LabellingRun], num: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, dict[str, list[float]]]:
    """Bootstrap intervals of Delta and Cov per capability (beyond the paper): `num` resamples of the
    trajectories, failed and passed apart, taken from the runs in turn; the central `level` share."""
    rng = np.random.default_rng(seed)
    shares = [num // len(runs) + (r < num % len(runs)) for r in range(len(runs))]
    names = sorted({name for run in runs for name in run.labels})
    samples: dict[str, tuple[list, list]] = {name: ([], []) for name in names}
    for run, count in zip(runs, shares):
        sizes = {o: len(_ids(run, o)) for o in ("failed", "passed")}
        draws = {o: rng.integers(0, max(n, 1), (count, n)) for o, n in sizes.items()}
        for name in names:
            gap, cov = _gap_and_coverage(
                _codes(run, name, "failed")[draws["failed"]], _codes(run, name, "passed")[draws["passed"]]
            )
            samples[name][0].append(gap)
            samples[name][1].append(cov)
    tails = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    return {
        name: {
            "delta": np.percentile(np.concatenate(gaps), tails).tolist(),
            "cov": np.percentile(np.concatenate(covs), tails).tolist(),
        }
        for name, (gaps, covs) in samples.items()
    }


def load_runs(folder: str | pathlib.Path) -> tuple[list[LabellingRun], list[str]]:
    """The valid runs among `folder`'s *.json files (by name), and a reason for each one dropped."""
    runs, dropped = [], []
    for path in sorted(pathlib.Path(folder).glob("*.json")):
        try:
            runs.append(LabellingRun.from_json(read_json(path), source=path.name))
        except UnreadableJson as error:
            dropped.append(f"{path.name}: invalid JSON ({error})")
        except InvalidRun as error:
            dropped.append(str(error))
    return runs, dropped
