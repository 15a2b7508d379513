"""The evaluation job resumes a killed run from its episodes, keeps them for a rerun that plays the same episodes
(other logging or batching), refuses a workdir of other episodes or one another process holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it

from configs import embedded_retail
from trace_jax.agent.episodes import run_marker
from trace_jax.evaluation import evaluate, evaluate_together
from trace_jax.workdirs import WorkdirInUse, WorkdirMismatch


def _records(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "episodes.jsonl").read_text().splitlines()]


def _tensorboard_success(workdir) -> list[tuple[int, float]]:
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    return [(e.step, round(e.value, 6)) for e in events.Scalars("eval/success")]


def test_a_killed_evaluation_resumes_and_a_rerun_keeps_its_episodes_or_refuses_other_ones(tmp_path):
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
    assert {k: resumed[k] for k in ("num_episodes", "success", "families")} == {
        k: full[k] for k in ("num_episodes", "success", "families")
    }
    config.log_every_s, config.rollout.batch_size = 5.0, 3  # how it runs, not what it plays
    kept = (tmp_path / "episodes.jsonl").read_text()
    assert evaluate(config, tmp_path, agent="gold")["num_episodes"] == 14
    assert (tmp_path / "episodes.jsonl").read_text() == kept  # nothing played again, nothing deleted
    config.num_tasks = 7
    with pytest.raises(WorkdirMismatch, match="num_tasks = 14 there, 7 here.*--fresh"):
        evaluate(config, tmp_path, agent="gold")
    config.num_tasks = 14
    with pytest.raises(WorkdirMismatch, match='agent = "gold" there, "noop" here'):
        evaluate(config, tmp_path, agent="noop")
    assert (tmp_path / "episodes.jsonl").read_text() == kept
    # TensorBoard: each finished run's success once, at step = its episodes (the resumed run's equals the first's).
    assert _tensorboard_success(tmp_path) == [(14, round(full["success"], 6))]


def test_an_evaluation_hands_its_freed_heap_back_when_it_ends(tmp_path, monkeypatch):
    """Under `retain_freed_memory` nothing goes back to the OS unless asked: a job of many evaluations (each
    calibration try) would keep the largest one's heap for the rest of the process. (The rollout engine's own
    upkeep while it plays is left out here: the next test.)"""
    released = []
    monkeypatch.setattr("trace_jax.runtime.release_freed_memory", lambda: released.append(1))
    monkeypatch.setattr("trace_jax.runtime.Upkeep", lambda every_s=None: lambda: False)
    config = embedded_retail.get_config()
    config.num_tasks, config.log_every_s = 2, 0.0
    evaluate(config, tmp_path, agent="gold")
    assert released == [1]


def test_a_long_evaluation_hands_its_freed_heap_back_while_it_plays(tmp_path, monkeypatch):
    """The retained heap fragments over hundreds of episodes; the rollout engine releases it as it goes
    (`runtime.UPKEEP_EVERY_S`, here 0: every pass of its loop) and the evaluation once more at the end."""
    released = []
    monkeypatch.setattr("trace_jax.runtime.release_freed_memory", lambda: released.append(1))
    monkeypatch.setattr("trace_jax.runtime.UPKEEP_EVERY_S", 0.0)
    config = embedded_retail.get_config()
    config.num_tasks, config.log_every_s = 3, 0.0
    evaluate(config, tmp_path, agent="gold")
    assert len(released) >= 2  # from the engine's loop (scripted agents: a pass or more), and at the end


def test_a_second_evaluation_on_a_held_workdir_refuses_at_start_naming_the_holder(tmp_path):
    config = embedded_retail.get_config()
    config.num_tasks, config.log_every_s = 2, 0.0
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env={**os.environ}
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirInUse, match=f"in use by pid {holder.pid} on "):
            evaluate(config, tmp_path, agent="gold")
        assert not (tmp_path / "episodes.jsonl").exists() and not (tmp_path / "run.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert evaluate(config, tmp_path, agent="gold")["num_episodes"] == 2  # free once its holder ended


HOLD = """import sys, time
from trace_jax.workdirs import locked
with locked(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_the_episodes_a_killed_multiprocess_run_left_per_process_are_merged_and_not_played_again(tmp_path):
    """A run of several processes records each process's episodes in its own file (merged at the end); after a
    kill, the next run, with any number of processes, merges them first and plays only the rest."""
    config = embedded_retail.get_config()
    config.num_tasks, config.log_every_s = 6, 0.0
    evaluate(config, tmp_path, agent="gold")
    records = _records(tmp_path)
    line = lambda record: json.dumps(record) + "\n"
    (tmp_path / "episodes.jsonl").write_text(line(records[0]))  # an earlier evaluation's, merged
    (tmp_path / "episodes.jsonl.process0").write_text(line(records[1]) + line(records[3]))
    (tmp_path / "episodes.jsonl.process1").write_text(line(records[2]) + line(records[4])[:30])  # cut by the kill
    resumed = evaluate(config, tmp_path, agent="gold")
    again = _records(tmp_path)
    assert again[:4] == [records[0], records[1], records[3], records[2]]  # kept as written, not played again
    assert sorted(r["task_id"] for r in again) == sorted(r["task_id"] for r in records)
    assert resumed["num_episodes"] == 6 and not list(tmp_path.glob("episodes.jsonl.process*"))


def test_evaluations_played_together_write_what_each_alone_writes_and_resume(tmp_path):
    """Two splits in one batch (the pipeline's base evaluations): each workdir gets its own episodes and
    summary, equal to its evaluation alone; a kill in one resumes only its missing episodes."""
    heldout = embedded_retail.get_config()
    heldout.num_tasks, heldout.log_every_s = 7, 0.0
    train = embedded_retail.get_config()
    train.update(split="train", num_tasks=5, log_every_s=0.0)
    runs = [(train, tmp_path / "train"), (heldout, tmp_path / "heldout")]
    together = evaluate_together(runs, agent="gold")
    alone = [evaluate(config, tmp_path / f"alone_{n}", agent="gold") for n, (config, _) in enumerate(runs)]
    for summary, single in zip(together, alone):
        assert {k: summary[k] for k in ("num_episodes", "success", "families")} == {
            k: single[k] for k in ("num_episodes", "success", "families")
        }
    assert {r["split"] for r in _records(tmp_path / "train")} == {"train"}
    assert {r["split"] for r in _records(tmp_path / "heldout")} == {"heldout"}
    lines = (tmp_path / "heldout" / "episodes.jsonl").read_text().splitlines()
    (tmp_path / "heldout" / "episodes.jsonl").write_text("\n".join(lines[:3]) + "\n")
    train_before = _records(tmp_path / "train")
    evaluate_together(runs, agent="gold")
    assert _records(tmp_path / "train") == train_before  # nothing of the finished run played again
    assert _records(tmp_path / "heldout")[:3] == [json.loads(line) for line in lines[:3]]
    assert len(_records(tmp_path / "heldout")) == 7
    other = embedded_retail.get_config()
    other.rollout.max_turns = 3
    with pytest.raises(ValueError, match="rollout"):
        evaluate_together([(heldout, tmp_path / "a"), (other, tmp_path / "b")], agent="gold")


def test_grpo_reads_the_base_agents_episodes_from_an_evaluation_run(tmp_path, smollm2):
    """`eval.base_run`: a GRPO job on the environment takes the base agent's held-out episodes from an
    evaluation job's workdir of the same agent, tasks and limits, and fails at start naming the key
    where they differ."""
    from configs import grpo_target_embedded
    from trace_jax import lora
    from trace_jax.rl.environment_rollouts import EnvironmentRollouts
    from trace_jax.rl.trainer import validate_config as grpo_settings
    from trace_jax.sampling import Sampler

    evaluation = embedded_retail.get_config()
    evaluation.model = "smollm2-135m-instruct"  # the bare model: the test builds no agent
    evaluation.num_tasks, evaluation.log_every_s = 4, 0.0
    base = tmp_path / "base"
    evaluate(evaluation, base, agent="gold")
    config = grpo_target_embedded.get_config()
    config.model = evaluation.model
    config.eval.num_tasks, config.eval.base_run, config.log_every_s = 3, str(base), 0.0
    with pytest.raises(ValueError, match="config.eval.base_run: its run has agent = 'gold'"):
        EnvironmentRollouts(grpo_settings(config), smollm2.tokenizer, 4, tmp_path)
    # The gold run's episodes stand in for a model evaluation's (the same files; playing the model here is slow).
    (base / "run.json").write_text(json.dumps({**run_marker(evaluation, "model"), "weights": "another model"}))
    with pytest.raises(ValueError, match="its run has weights = 'another model'"):
        EnvironmentRollouts(grpo_settings(config), smollm2.tokenizer, 4, tmp_path)
    (base / "run.json").write_text(json.dumps(run_marker(evaluation, "model")))
    rollouts = EnvironmentRollouts(grpo_settings(config), smollm2.tokenizer, 4, tmp_path)
    sampler = Sampler(smollm2.cfg, smollm2.params, detokenize=smollm2.tokenizer.decode)
    metrics = rollouts.evaluate(sampler, lora.NO_ADAPTER, 0)
    seeded = [json.loads(line) for line in (tmp_path / "eval" / "step_0.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in seeded) == sorted(t.task_id for t in rollouts.heldout)
    assert all(r in _records(base) for r in seeded)  # the evaluation's episodes, none played again
    assert len(seeded) == 3 and metrics["eval/success"] == 1.0
    for key, value, message in [
        ("rollout.max_errors", 3, "rollout.max_errors = 4"),
        ("eval.num_tasks", 5, "num_tasks = 4, fewer than this job's 5"),
    ]:
        changed = grpo_target_embedded.get_config()
        changed.model, changed.eval.base_run = evaluation.model, str(base)
        section, name = key.split(".")
        changed[section][name] = value
        with pytest.raises(ValueError, match=message):
            EnvironmentRollouts(grpo_settings(changed), smollm2.tokenizer, 4, tmp_path)


def test_a_sampler_sharded_over_devices_plays_the_episodes_of_one_device(tmp_path, tiny_chat_model):
    """`config.tensor = 2`: the model's weights split over two of this process's (8 fake) devices and the rows
    over the rest, for a model one device cannot hold; the episodes are those of one device, and the marker (what
    a resumed run or a base run is checked against) is the same."""
    config = embedded_retail.get_config()
    config.update(model=str(tiny_chat_model), num_tasks=2, log_every_s=0.0)
    config.rollout.update(max_turns=2, max_tokens_per_turn=16)
    evaluate(config, tmp_path / "one")
    sharded = embedded_retail.get_config()
    sharded.update(config.to_dict())
    sharded.tensor = 2
    evaluate(sharded, tmp_path / "two")
    played = lambda run: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in _records(tmp_path / run)]
    assert played("one") == played("two") and len(played("one")) == 2
    assert run_marker(sharded, "model") == run_marker(config, "model")
    sharded.tensor = 3
    with pytest.raises(ValueError, match="config.tensor = 3 is invalid; it must be a positive int that divides"):
        evaluate(sharded, tmp_path / "three")


def test_an_evaluation_takes_the_episodes_of_the_same_policies_from_earlier_ones(tmp_path, tiny_chat_model):
    """`reuse`: a routed evaluation given the base agent's and one adapter's evaluations takes their episodes
    for the tasks it routes to them (under its own adapter index), plays only the other adapter's, and records
    what it records when it plays every task itself; an evaluation under other rollout limits takes nothing."""
    import jax

    from trace_jax import lora
    from trace_jax.agent.episodes import Routes
    from trace_jax.models.model import load_model

    cfg = load_model(tiny_chat_model).cfg
    folders = []
    for seed in range(2):  # random adapters with non-zero B: each changes what the agent writes
        stack = lora.init_adapters(jax.random.key(seed), cfg, lora.LoraSpec(rank=4, alpha=8, targets=("q_proj",)))
        weights = {
            t: {"a": w["a"], "b": jax.random.normal(jax.random.key(10 + seed), w["b"].shape)}
            for t, w in stack.weights.items()
        }
        folders.append(str(tmp_path / f"adapter_{seed}"))
        lora.save_peft(lora.Adapters(weights, stack.scale), folders[-1])
    config = embedded_retail.get_config()
    config.update(model=str(tiny_chat_model), num_tasks=3, log_every_s=0.0)
    config.rollout.update(max_turns=2, max_tokens_per_turn=8, temperature=1.0)
    evaluate(config, tmp_path / "base")
    alone = embedded_retail.get_config()
    alone.update(config.to_dict())
    alone.adapter = folders[0]
    evaluate(alone, tmp_path / "alone")
    tasks = [r["task_id"] for r in _records(tmp_path / "base")]
    played = lambda run: {
        r["task_id"]: {k: v for k, v in r.items() if k not in ("elapsed_s", "reused_from")}
        for r in _records(tmp_path / run)
    }
    assert played("alone") != {t: {**r, "adapter_idx": 0} for t, r in played("base").items()}  # adapters matter
    # -1, 0, 1: the base model, the adapter not evaluated alone, the one that was (there at index 0)
    routes = Routes((folders[1], folders[0]), {t: i % 3 - 1 for i, t in enumerate(sorted(tasks))})
    whole = evaluate(config, tmp_path / "whole", routes=routes)
    taken = evaluate(config, tmp_path / "taken", routes=routes, reuse=[tmp_path / "base", tmp_path / "alone"])
    assert whole["reused_episodes"] == 0 and taken["reused_episodes"] == 2
    assert played("taken") == played("whole") and len(_records(tmp_path / "taken")) == 3
    assert {r["task_id"] for r in _records(tmp_path / "taken") if "reused_from" in r} == {
        t for t, i in routes.by_task.items() if i != 0
    }
    other = embedded_retail.get_config()
    other.update(config.to_dict())
    other.rollout.max_turns = 1
    assert evaluate(other, tmp_path / "other", reuse=[tmp_path / "base"])["reused_episodes"] == 0
