"""Job metrics: TensorBoard reads what MetricsWriter writes; progress lines carry rate and ETA."""

import json
import logging

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trace_jax.metrics import MetricsWriter, Progress


def test_tensorboard_reads_the_scalars_and_jsonl_has_them_too(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(1, {"reward": 0.25, "loss": -1.5})
    writer.write(2, {"reward": 0.5})
    writer.close()
    MetricsWriter(tmp_path).close()  # reopening (a resumed run) keeps what was written
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, -1.5)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "reward": 0.25, "loss": -1.5}, {"step": 2, "reward": 0.5}]


def test_progress_logs_rate_and_eta(caplog, monkeypatch):
    clock = iter([0.0, 10.0, 20.0, 30.0])
    monkeypatch.setattr("trace_jax.metrics.time.monotonic", lambda: next(clock))
    progress = Progress(total=6, start=2, every_s=0.0)  # resumed at step 2
    with caplog.at_level(logging.INFO):
        progress.update(3, "reward 0.1")  # 10 s for one step, 3 to go
        progress.update(4)
    messages = [r.getMessage() for r in caplog.records]
    assert "step 3/6 (50%)  10.0 s/step  elapsed 10s  ETA 30s  reward 0.1" in messages[0]
    assert "step 4/6 (67%)  10.0 s/step  elapsed 20s  ETA 20s" in messages[1]
