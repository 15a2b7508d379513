"""The evaluation job resumes a killed run from its episodes, and starts afresh for another config."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("tau2")

from configs import embedded_retail  # noqa: E402
from trace_jax.evaluation import evaluate  # noqa: E402


def _records(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "episodes.jsonl").read_text().splitlines()]


def test_a_killed_evaluation_resumes_and_another_config_starts_afresh(tmp_path):
    config = embedded_retail.get_config()
    config.num_tasks, config.log_every_s = 14, 0.0
    full = evaluate(config, tmp_path, agent="gold")
    records = _records(tmp_path)
    assert full["num_episodes"] == 14 and full["play_seconds"] == records[-1]["elapsed_s"]
    # A kill after five episodes, in the middle of writing the sixth.
    lines = (tmp_path / "episodes.jsonl").read_text().splitlines()
    (tmp_path / "episodes.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:40])
    resumed = evaluate(config, tmp_path, agent="gold")
    again = _records(tmp_path)
    assert again[:5] == records[:5]  # kept as written, not played again
    assert sorted(r["task_id"] for r in again) == sorted(r["task_id"] for r in records)
    assert {r["task_id"]: r["reward"] for r in again} == {r["task_id"]: r["reward"] for r in records}
    assert min(r["elapsed_s"] for r in again[5:]) >= records[4]["elapsed_s"]
    assert {k: resumed[k] for k in ("num_episodes", "success", "families")} == \
        {k: full[k] for k in ("num_episodes", "success", "families")}
    config.num_tasks = 7
    assert evaluate(config, tmp_path, agent="gold")["num_episodes"] == 7 and len(_records(tmp_path)) == 7
    assert evaluate(config, tmp_path, agent="noop")["success"] == 0.0  # another agent: not gold's episodes
