"""TRACE stage 1 as a resumable step: candidates, labelling runs, selection, `capabilities.json` and a report.

Everything goes under `<workdir>/analysis/`: `candidates.json` (the analyst's dictionary),
`labellings/NN.json` (each labelling with its evidence), `runs/NN.json` (the K-of-N runs in
the authors' interchange format, so `launch.select_capabilities --runs=.../runs` gives the
same selection), `capabilities.json` and `analysis.md`. A file that exists is read back, so
a killed analysis resumes where it stopped and a finished one is not redone.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections import Counter
from collections.abc import Sequence

import numpy as np

from trace_jax.files import read_json, write_json_atomic
from trace_jax.llm.client import ChatClient, LlmSettings
from trace_jax.settings import Invalid, is_int, number, positive_int, setting, share
from trace_jax.trace import selection
from trace_jax.trace.analyst import (
    LACKING,
    Analyst,
    CapabilityCard,
    Labelling,
    LabellingFailed,
    labelling_from_json,
    labelling_to_json,
    to_run,
)
from trace_jax.trace.llm_analyst import LLMAnalyst
from trace_jax.trace.programmatic_analyst import ProgrammaticAnalyst
from trace_jax.trace.trajectories import ScoredTrajectory

EXAMPLES = 3  # failed trajectories quoted per selected capability in the report
ANALYSTS = ("programmatic", "llm")


@dataclasses.dataclass(frozen=True)
class AnalysisSettings:
    """The `analysis` block: stage 1's settings (the paper's where it gives them)."""

    # "programmatic" or "llm": trace_jax.trace.programmatic_analyst / llm_analyst
    analyst: str = setting("programmatic", f"one of {ANALYSTS}", lambda v: v in ANALYSTS)
    runs: int = setting(10, "an int >= 1", positive_int)  # labelling runs N (the authors' code: 10)
    min_runs: int = setting(8, "an int >= 1", positive_int)  # K: runs a capability must pass in
    delta: float = setting(0.2, "a number in [-1, 1]", lambda v: number(v) and -1 <= v <= 1)  # least ER- - ER+
    coverage: float = setting(0.1, "a number in [0, 1]", share)  # least share of failures labelled LACKING
    seed: int = setting(0, "an int", is_int)  # bootstrap resamples (runs and intervals)
    interval_resamples: int = setting(1000, "an int >= 1", positive_int)
    # the LLM analyst's (the endpoint is the pipeline's `llm` block): trajectories shown at discovery, in tokens
    discovery_tokens: int = setting(12000, "an int >= 1", positive_int)
    # each message's content cut to this many characters (the authors' ~300)
    message_chars: int = setting(300, "an int >= 1", positive_int)
    max_candidates: int = setting(10, "an int >= 1", positive_int)
    label_batch: int = setting(10, "an int >= 1", positive_int)  # trajectories per labelling request

    def __post_init__(self):
        if self.min_runs > self.runs:
            raise Invalid("min_runs", f"an int in [1, analysis.runs = {self.runs}]")


def make_analyst(settings: AnalysisSettings, llm: LlmSettings | None, env, workdir: str | pathlib.Path) -> Analyst:
    """The analyst `settings.analyst` names; the LLM one talks to `llm`'s endpoint and caches its replies under
    `<workdir>/analysis/llm_cache`, the programmatic one reads `env`'s τ² domain."""
    if settings.analyst == "llm":
        if llm is None:
            raise ValueError("config.analysis.analyst = 'llm' needs the config's `llm` block")
        return LLMAnalyst(
            ChatClient(llm, pathlib.Path(workdir) / "analysis" / "llm_cache"),
            discovery_tokens=settings.discovery_tokens,
            message_chars=settings.message_chars,
            max_candidates=settings.max_candidates,
            label_batch=settings.label_batch,
        )
    state = getattr(env, "state", None)
    if state is None:
        raise ValueError(
            f"config.analysis.analyst = 'programmatic' labels τ² retail-style trajectories; environment "
            f"{env.name!r} has no τ² domain: use analyst='llm'"
        )
    return ProgrammaticAnalyst(state.write_tools, state.tool_schemas)


def _candidates(analyst: Analyst, trajectories, folder: pathlib.Path) -> list[CapabilityCard]:
    path = folder / "candidates.json"
    if not path.exists():
        write_json_atomic(path, [card.to_json() for card in analyst.discover(trajectories)])
    return [CapabilityCard(**card) for card in read_json(path)]


def _labellings(analyst: Analyst, trajectories, cards, runs: int, folder: pathlib.Path) -> tuple[list, list]:
    """The analyst's labellings (one if it is deterministic) and the attempts it had to drop."""
    labellings, dropped = [], []
    for attempt in range(1 if analyst.deterministic else runs):
        path = folder / "labellings" / f"{attempt:02d}.json"
        if not path.exists():
            try:
                labelling = analyst.label(trajectories, cards, attempt)
            except LabellingFailed as error:
                labelling = {"dropped": str(error)}
            else:
                labelling = {"labels": labelling_to_json(labelling)}
            write_json_atomic(path, labelling)
        data = read_json(path)
        if "dropped" in data:
            dropped.append(f"labelling {attempt}: {data['dropped']}")
        else:
            labellings.append(labelling_from_json(data["labels"]))
    return labellings, dropped


def analyze(
    trajectories: Sequence[ScoredTrajectory],
    analyst: Analyst,
    settings: AnalysisSettings,
    workdir: str | pathlib.Path,
) -> dict:
    """Runs (or resumes) stage 1 and returns `capabilities.json`'s content."""
    folder = pathlib.Path(workdir) / "analysis"
    if (folder / "capabilities.json").exists():
        return read_json(folder / "capabilities.json")
    cards = _candidates(analyst, trajectories, folder)
    labellings, dropped = _labellings(analyst, trajectories, cards, settings.runs, folder)
    if not labellings:
        raise RuntimeError(f"every labelling run was dropped: {dropped}")
    full = [to_run(labelling, trajectories, i) for i, labelling in enumerate(labellings)]
    if analyst.deterministic:
        rng = np.random.default_rng(settings.seed)
        runs = [selection.resample(full[0], rng, i) for i in range(settings.runs)]
    else:
        runs = full
    for i, run in enumerate(runs):
        write_json_atomic(folder / "runs" / f"{i:02d}.json", run.to_json())
    rows = selection.select(runs, delta=settings.delta, coverage=settings.coverage, min_runs=settings.min_runs)
    spans = selection.intervals(full, num=settings.interval_resamples, seed=settings.seed)
    by_name = {card.name: card for card in cards}
    for row in rows:
        row.update(
            delta_interval=spans[row["name"]]["delta"],
            cov_interval=spans[row["name"]]["cov"],
            **by_name[row["name"]].to_json(),
        )
        row["examples"] = _examples(labellings[0], trajectories, row["name"])
        row["lacking_families"] = _lacking_families(labellings[0], trajectories, row["name"])
    result = {
        "selected": [row["name"] for row in rows if row["selected"]],
        "candidates": rows,
        "failed": sum(not t.success for t in trajectories),
        "passed": sum(t.success for t in trajectories),
        "runs": len(runs),
        "dropped_labellings": dropped,
        "settings": dataclasses.asdict(settings),
    }
    (folder / "analysis.md").write_text(report(result), encoding="utf-8")
    write_json_atomic(folder / "capabilities.json", result)
    return result


def _examples(labelling: Labelling, trajectories: Sequence[ScoredTrajectory], name: str) -> list[dict]:
    """The first failed trajectories labelled LACKING, with the evidence."""
    lacking = [t for t in trajectories if not t.success and labelling[name][t.id].label == LACKING]
    return [{"id": t.id, "family": t.family, "evidence": labelling[name][t.id].evidence} for t in lacking[:EXAMPLES]]


def _lacking_families(labelling: Labelling, trajectories: Sequence[ScoredTrajectory], name: str) -> dict[str, int]:
    """How many failed trajectories of each task family lack the capability: the families it is meant to fix."""
    counts = Counter(t.family for t in trajectories if not t.success and labelling[name][t.id].label == LACKING)
    return dict(counts.most_common())


def report(result: dict) -> str:
    """`analysis.md`: every candidate's numbers, then the evidence behind each selected one."""
    lines = [
        f"# Capability analysis\n\n{result['failed']} failed and {result['passed']} successful trajectories, "
        f"{result['runs']} labelling runs; kept when Delta >= {result['settings']['delta']} and "
        f"Cov >= {result['settings']['coverage']} in >= {result['settings']['min_runs']} runs.\n",
        "| capability | Cov (mean ± std) | Cov 95% CI | Delta (mean ± std) | Delta 95% CI | runs passed | selected |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["candidates"]:
        lo, hi = row["cov_interval"]
        dlo, dhi = row["delta_interval"]
        lines.append(
            f"| {row['name']} | {row['mean_cov']:.3f} ± {row['std_cov']:.3f} | [{lo:.3f}, {hi:.3f}] | "
            f"{row['mean_delta']:.3f} ± {row['std_delta']:.3f} | [{dlo:.3f}, {dhi:.3f}] | "
            f"{row['runs_passed']}/{row['runs_total']} | {'yes' if row['selected'] else 'no'} |"
        )
    for reason in result["dropped_labellings"]:
        lines.append(f"\nDropped {reason}")
    for row in result["candidates"]:
        if row["name"] in result["selected"]:
            lines += [f"\n## {row['name']}\n", row["description"], f"\nLacking: {row['lacking']}\n"]
            lines += [f"- `{e['id']}` ({e['family']}): {e['evidence']}" for e in row["examples"]]
    return "\n".join(lines) + "\n"
