"""The comparison's scaling curve: which snapshot stands for a share of a run, TRACE's routing with every adapter
at that share, and the table and plot. (The points evaluated end to end: the tiny experiment,
tests/test_trace_pipeline.py; the snapshots equal the checkpoints: tests/test_grpo_env_job.py.)"""

import pathlib

import pytest

from trace_jax import lora
from trace_jax.baselines.scaling import plot_scaling, scaling_table, snapshot_folder, trace_routes
from trace_jax.rl.trainer import snapshot_step


@pytest.mark.parametrize(
    "fraction, steps, step",
    [(0.25, 8, 2), (0.75, 8, 6), (0.5, 3, 2), (0.25, 3, 1), (0.25, 1, 0), (0.5, 1, 1), (0.75, 2, 2)],
)
def test_a_share_of_a_run_is_its_nearest_step_rounded_half_up(fraction, steps, step):
    assert snapshot_step(fraction, steps) == step


def test_the_snapshot_of_a_step_is_none_at_zero_the_final_adapter_at_the_end_else_its_export():
    adapter = pathlib.Path("/runs/adapters/tool_calling/adapter")
    assert snapshot_folder(adapter, 0, 8) is None
    assert snapshot_folder(adapter, 8, 8) == adapter
    assert snapshot_folder(adapter, 2, 8) == pathlib.Path("/runs/adapters/tool_calling/snapshots/step_2")


def test_trace_at_a_share_routes_each_task_as_its_run_did_to_that_share_of_its_adapter():
    adapters = {"tool_calling": "/t/tool_calling/adapter", "precondition": "/t/precondition/adapter"}
    steps = {"tool_calling": 4, "precondition": 1}
    by_task = {"a": 0, "b": 1, "c": lora.NO_ADAPTER}
    early = trace_routes(0.25, adapters, steps, by_task)  # tool_calling at step 1, precondition still at step 0
    assert early.adapters == ("/t/tool_calling/snapshots/step_1",)
    assert early.by_task == {"a": 0, "b": lora.NO_ADAPTER, "c": lora.NO_ADAPTER}
    late = trace_routes(0.75, adapters, steps, by_task)  # step 3 of 4; precondition's one step done
    assert late.adapters == ("/t/tool_calling/snapshots/step_3", "/t/precondition/adapter")
    assert late.by_task == by_task
    assert trace_routes(0.1, adapters, steps, by_task) is None  # no adapter trained yet: the base agent


def test_the_curve_is_tabled_per_share_and_plotted(tmp_path):
    point = lambda f, r, s: {"fraction": f, "rollouts": r, "success": s, "ci_low": s - 0.1, "ci_high": s + 0.1}
    curves = {
        "TRACE": [point(0.0, 0, 0.4), point(0.5, 64, 0.45), point(1.0, 128, 0.5)],
        "GEPA": [point(0.0, 0, 0.4), point(1.0, 120, 0.42)],
    }
    lines = scaling_table(curves)
    assert lines[0] == "| arm | 0 of the budget | 0.5 of the budget | 1 of the budget |"
    assert (
        lines[2] == "| TRACE | 40.0% [30.0, 50.0], 0 rollouts | 45.0% [35.0, 55.0], 64 rollouts | "
        "50.0% [40.0, 60.0], 128 rollouts |"
    )
    assert lines[3] == "| GEPA | 40.0% [30.0, 50.0], 0 rollouts | - | 42.0% [32.0, 52.0], 120 rollouts |"
    plot_scaling(curves, tmp_path / "plots" / "scaling.png")
    assert (tmp_path / "plots" / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
