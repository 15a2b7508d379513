"""The analyst of TRACE's stage 1: proposes candidate capabilities, then labels every trajectory.

Two implementations share this interface: the programmatic analyst (the offline default:
a fixed dictionary with deterministic labellers) and the LLM analyst (any OpenAI-compatible
endpoint). A labelling gives, for every (capability, trajectory) pair, NA (not needed),
PRESENT (needed and exercised) or LACKING (needed, not exercised), with the evidence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from trace_jax.trace.selection import LabellingRun
from trace_jax.trace.trajectories import ScoredTrajectory

NA, PRESENT, LACKING = "NA", "PRESENT", "LACKING"
LABELS = (NA, PRESENT, LACKING)


class LabellingFailed(RuntimeError):
    """A labelling attempt the analyst could not complete (say, an LLM whose replies never formed a
    valid partition of the task ids); the analysis drops the attempt and counts it."""


@dataclasses.dataclass(frozen=True)
class CapabilityCard:
    """A candidate capability: a short snake_case name, what it is, and what LACKING it looks like."""

    name: str
    description: str
    lacking: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Label:
    """One (capability, trajectory) label and the evidence for it."""

    label: str
    evidence: str


# capability -> trajectory id -> label
Labelling = Mapping[str, Mapping[str, Label]]


class Analyst(Protocol):
    """Stage 1's analyst. `deterministic` analysts label once (the K-of-N runs are then bootstrap
    resamples of that labelling); others label `runs` times as independent samples."""

    deterministic: bool

    def discover(self, trajectories: Sequence[ScoredTrajectory]) -> list[CapabilityCard]:
        """The candidate capabilities these trajectories suggest."""

    def label(
        self, trajectories: Sequence[ScoredTrajectory], cards: Sequence[CapabilityCard], attempt: int
    ) -> Labelling:
        """Labelling number `attempt`: a label for every card and every trajectory."""


def labelling_to_json(labelling: Labelling) -> dict:
    return {
        name: {tid: [label.label, label.evidence] for tid, label in labels.items()}
        for name, labels in labelling.items()
    }


def labelling_from_json(data: Mapping) -> Labelling:
    return {name: {tid: Label(*pair) for tid, pair in labels.items()} for name, labels in data.items()}


def to_run(labelling: Labelling, trajectories: Sequence[ScoredTrajectory], attempt: int) -> LabellingRun:
    """The labelling in the authors' interchange format (six id lists per capability)."""
    outcome = {t.id: "passed" if t.success else "failed" for t in trajectories}
    labels = {}
    for name, by_id in labelling.items():
        cells: dict[str, list[str]] = {f"{label.lower()}_{o}": [] for label in LABELS for o in ("failed", "passed")}
        for tid in outcome:
            cells[f"{by_id[tid].label.lower()}_{outcome[tid]}"].append(tid)
        labels[name] = cells
    failed = sum(o == "failed" for o in outcome.values())
    return LabellingRun.from_json(
        {
            "attempt": attempt,
            "totals": {"total_failed": failed, "total_passed": len(outcome) - failed},
            "labels": labels,
        }
    )
