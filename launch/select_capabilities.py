"""Selects the capabilities a base agent lacks from labelling runs (TRACE's stage 1 rule).

  python -m launch.select_capabilities --runs=DIR [--delta=0.2] [--coverage=0.1] [--min_runs=8] [--json]

Reads every `*.json` labelling run in DIR (the authors' interchange format, see
`trace_jax.trace.selection`; runs labelled elsewhere can be brought in), drops and names the
invalid ones, and prints per capability the mean and std of its failure coverage and contrastive
gap over runs, the runs it passes in and whether it is selected: a table, or with --json one
line `{"capabilities": [...], "dropped_runs": [...]}`, selected capabilities first, by coverage.
"""

from __future__ import annotations

import json

from absl import app, flags

from trace_jax.trace.selection import load_runs, select

_RUNS = flags.DEFINE_string("runs", None, "Folder of labelling runs (*.json).", required=True)
_DELTA = flags.DEFINE_float("delta", 0.2, "Least contrastive gap ER- - ER+ for a run to pass.")
_COVERAGE = flags.DEFINE_float("coverage", 0.1, "Least share of failed trajectories labelled LACKING.")
_MIN_RUNS = flags.DEFINE_integer("min_runs", 8, "Runs a capability must pass in to be selected.", lower_bound=1)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line instead of a table.")


def _table(rows: list[dict], runs: int) -> str:
    lines = [f"{'capability':40s} {'cov':>13s} {'delta':>13s} {'passed':>8s}  selected"]
    for row in rows:
        lines.append(
            f"{row['name']:40s} {row['mean_cov']:6.3f}±{row['std_cov']:.3f} "
            f"{row['mean_delta']:6.3f}±{row['std_delta']:.3f} {row['runs_passed']:>3d}/{runs:<4d}  "
            f"{'yes' if row['selected'] else 'no'}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    runs, dropped = load_runs(_RUNS.value)
    if not runs:
        raise app.UsageError(
            f"--runs={_RUNS.value}: no valid labelling run (*.json){': ' if dropped else ''}" + "; ".join(dropped)
        )
    rows = select(runs, delta=_DELTA.value, coverage=_COVERAGE.value, min_runs=_MIN_RUNS.value)
    if _JSON.value:
        print(json.dumps({"capabilities": rows, "dropped_runs": dropped}), flush=True)
    else:
        print(_table(rows, len(runs)))
        for reason in dropped:
            print(f"dropped {reason}")


if __name__ == "__main__":
    app.run(main)
