"""The TRACE pipeline end to end, as a user runs it (`configs/trace_tiny.py`: tiny budgets, open gates; on
the tiny random model with SmolLM2's tokenizer, as the stages' mechanics are under test), through the
LLM path (analyst, environment writer) against a scripted OpenAI-compatible server: every stage's
artifacts are written, each GRPO job evaluates its adapter through the evaluation job's path before and
after training, the routed final evaluation runs each task under the adapter the router chose,
the report and its plots exist, the JSON line carries the summary, and a rerun finds every stage done
and repeats nothing. The comparison job (`launch.experiment`, configs/experiment_tiny.py) then runs every
baseline on that same run, so the pipeline runs once for both; the TRACE-stages and evaluation notebooks read it
back; `launch.serve` routes conversations with its router; and the pipeline as two processes is compared with
it."""

import importlib
import json
import math
import pathlib
import re
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import openai
import pytest
from multiprocess import failure_report, run_processes
from notebooks import printed, run_notebook
from scripted_llm_server import ScriptedLLMServer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from configs import experiment_tiny, trace_tiny
from launch.bench_serve import start_server
from trace_jax.agent.episodes import recorded_episodes, run_marker
from trace_jax.baselines.experiment import Experiment, scalar_name
from trace_jax.baselines.experiment import validate_config as validate_experiment_config
from trace_jax.baselines.gepa import joined_guidance
from trace_jax.envs import make_environment
from trace_jax.envs.capability import example_airline, example_retail
from trace_jax.models.model import weights_fingerprint
from trace_jax.rl.trainer import snapshot_step
from trace_jax.trace.calibration import calibrate_builtin, environment_config
from trace_jax.trace.pipeline import (
    STAGES,
    Pipeline,
    StageClock,
    calibrate_in_order,
    calibration_evaluation,
    grpo_config,
    heldout_evaluation,
    target_domain,
    training_config,
    validate_config,
)
from trace_jax.trace.trace_report import _adapter_logs, _heldout_curves, _training_curves, _variant_table, oracle_routes

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = trace_tiny.get_config()
LLM_OVERRIDES = {
    "analysis.analyst": "llm",
    "environments.source": "auto",
    "environments.max_trained": 2,
    "llm.model": "scripted",
    "llm.max_retries": 0,
    "env_writer.seeds": 10,
    "env_writer.export_tasks": 8,
}
LLM_PATH = [f"--config.{key}={value}" for key, value in LLM_OVERRIDES.items()]
_FENCED_EXAMPLE = f"```python\n{pathlib.Path(example_retail.__file__).read_text()}```"


def _run(workdir, env, *overrides, config="configs/trace_tiny.py"):
    command = [sys.executable, "-m", "launch.trace", f"--config={config}", f"--workdir={workdir}", *overrides]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, failure_report(out)
    return json.loads(out.stdout.strip().splitlines()[-1]), out


def _scripted_llm(request):
    """The pipeline's LLM roles over the real OpenAI protocol: discovery names a built-in capability and one the
    writer must write; labelling marks both LACKING on failures and PRESENT on successes; the writer first
    answers prose (no code: a failed attempt, sent back), then the example module."""
    messages = request["messages"]
    if messages[0]["content"].startswith("You are an expert Python engineer"):  # the environment writer
        return _FENCED_EXAMPLE if len(messages) > 2 else "I would write an environment about order facts."
    prompt = messages[1]["content"]
    if prompt.startswith("Below are"):  # discovery
        return (
            "```json\n"
            + json.dumps(
                {
                    "capabilities": [
                        {
                            "name": "tool_calling",
                            "description": "Makes the write call with exact arguments.",
                            "lacking": "Wrong tool or arguments.",
                        },
                        {
                            "name": "order_facts",
                            "description": "Reads the order asked about and states the facts asked for.",
                            "lacking": "Answers without reading the order.",
                        },
                    ]
                }
            )
            + "\n```"
        )
    views = [json.loads(line) for line in prompt.split("Trajectories:\n", 1)[1].splitlines()]
    return json.dumps(
        {
            "labels": {
                name: {
                    v["id"]: {"label": "LACKING" if v["reward"] < 1 else "PRESENT", "evidence": "seen"} for v in views
                }
                for name in ("tool_calling", "order_facts")
            }
        }
    )


def _airline_llm(request):
    """The LLM roles on τ² airline: discovery names one capability, labelling marks it LACKING on failures and
    PRESENT on successes, the writer answers with the airline example module."""
    messages = request["messages"]
    if messages[0]["content"].startswith("You are an expert Python engineer"):
        return f"```python\n{pathlib.Path(example_airline.__file__).read_text()}```"
    prompt = messages[1]["content"]
    if prompt.startswith("Below are"):
        return json.dumps(
            {
                "capabilities": [
                    {
                        "name": "reservation_facts",
                        "description": "Reads the reservation asked about and states the facts.",
                        "lacking": "Answers unread.",
                    }
                ]
            }
        )
    views = [json.loads(line) for line in prompt.split("Trajectories:\n", 1)[1].splitlines()]
    return json.dumps(
        {
            "labels": {
                "reservation_facts": {
                    v["id"]: {"label": "LACKING" if v["reward"] < 1 else "PRESENT", "evidence": "seen"} for v in views
                }
            }
        }
    )


def test_an_airline_target_gets_its_environments_written_against_the_airline_api(tiny_chat_model, job_env, tmp_path):
    """configs/trace_tiny_airline.py: the base model plays τ²'s airline tasks (as the agent and the user), the LLM
    writes the selected capability's environment in the airline domain, and it is calibrated, trained and routed."""
    with ScriptedLLMServer(_airline_llm) as server:
        summary, _ = _run(
            tmp_path,
            job_env,
            f"--config.llm.base_url={server.base_url}",
            "--config.llm.model=scripted",
            "--config.env_writer.seeds=10",
            "--config.env_writer.export_tasks=8",
            *_model(tiny_chat_model),
            config="configs/trace_tiny_airline.py",
        )
        writer = [r["messages"] for r in server.requests if "expert Python" in r["messages"][0]["content"]]
    assert summary["capabilities"] == summary["trained"] == ["reservation_facts"]
    assert summary["episodes"] == {"base": 4, "trace": 4}
    assert {r["family"] for r in _records(tmp_path / "heldout" / "base")} == {"airline"}
    assert len(writer) == 1 and "agents of an airline" in writer[0][0]["content"]
    assert "DOMAIN = 'airline'" in writer[0][1]["content"]
    written = tmp_path / "environments" / "reservation_facts" / "written"
    assert json.loads((written / "scenarios.json").read_text())["domain"] == "airline"
    episode = _records(written / "calibration_1" / "difficulty_0")[0]
    assert episode["messages"][0]["content"].startswith("You are a customer service agent of an airline")
    assert (tmp_path / "adapters" / "reservation_facts" / "adapter" / "adapter_config.json").is_file()


@pytest.fixture(scope="module")
def tiny_run(tiny_chat_model, job_env, tmp_path_factory):
    """(workdir, summary, output, the LLM requests' openings, the rerun's summary) of the tiny pipeline, run twice
    through the LLM path (a scripted server on the loopback address); the rerun must ask nothing."""
    workdir = tmp_path_factory.mktemp("trace_tiny")
    with ScriptedLLMServer(_scripted_llm) as server:
        overrides = [f"--config.llm.base_url={server.base_url}", *LLM_PATH, *_model(tiny_chat_model)]
        summary, out = _run(workdir, job_env, *overrides)
        kinds = [r["messages"][0]["content"][:30] for r in server.requests]
        again, _ = _run(workdir, job_env, *overrides)
        assert len(server.requests) == len(kinds)  # the rerun asks nothing
    return workdir, summary, out, kinds, again


def _records(folder) -> list[dict]:
    return recorded_episodes(pathlib.Path(folder) / "episodes.jsonl")


def _model_overrides(tiny_chat_model) -> dict:
    return {"model": str(tiny_chat_model), "training.lora.first_layer": 0}


def _model(tiny_chat_model) -> list[str]:
    return [f"--config.{key}={value}" for key, value in _model_overrides(tiny_chat_model).items()]


def test_the_tiny_pipeline_writes_every_artifact_and_a_rerun_repeats_nothing(tiny_run):
    """Through the LLM path: discovery, labelling and selection pick a built-in capability and one the LLM
    writes (a reply without code first, then a module that the sandbox validates and exports); both are
    calibrated and trained, the router picks among them."""
    tmp_path, summary, out, kinds, again = tiny_run
    print(f"\n[trace pipeline] tiny config, LLM path ({len(kinds)} requests): {summary}")
    assert sum(k.startswith("You are an expert Python") for k in kinds) == 2  # no code, then the module
    heldout = CONFIG.target.heldout_tasks
    assert set(summary) >= {"base_success", "trace_success", "capabilities", "episodes", "seconds"}
    assert summary["episodes"] == {"base": heldout, "trace": heldout}
    assert sorted(summary["capabilities"]) == sorted(summary["trained"]) == ["order_facts", "tool_calling"]
    stages = json.loads((tmp_path / "stages.json").read_text())
    assert list(stages) == list(STAGES) and all(stage["seconds"] >= 0 for stage in stages.values())
    for path in [
        "base_analysis/episodes.jsonl",
        "heldout/base/summary.json",
        "analysis/capabilities.json",
        "analysis/analysis.md",
        "environments/tool_calling/calibration.json",
        "environments/order_facts/written/module.py",
        "environments/order_facts/written/scenarios.json",
        "environments/order_facts/written/calibration_2/calibration.json",
        "report.md",
        *(f"adapters/{name}/adapter/adapter_config.json" for name in summary["capabilities"]),
        *(f"plots/{p}.png" for p in ("selection", "calibration", "training", "heldout")),
    ]:
        assert (tmp_path / path).is_file(), path
    written = tmp_path / "environments" / "order_facts" / "written"
    assert "no ```python code block" in json.loads((written / "attempt_1.json").read_text())["error"]
    assert len(list((tmp_path / "analysis" / "runs").glob("*.json"))) == CONFIG.analysis.runs
    for name, result in stages["environments"]["result"].items():
        calibration = json.loads((pathlib.Path(result["folder"]) / "calibration.json").read_text())
        assert calibration["calibrated"] and calibration["tries"][0]["episodes"] == 2 * 2, name
    training, steps = CONFIG.training, CONFIG.training.train.steps
    for name in summary["trained"]:  # each GRPO job's held-out evaluation, through the evaluation job's path
        folder = tmp_path / "adapters" / name
        job = json.loads((folder / "summary.json").read_text())
        for step in (0, steps):
            episodes = [json.loads(line) for line in (folder / "eval" / f"step_{step}.jsonl").read_text().splitlines()]
            assert len(episodes) == training.eval.num_tasks and all("components" in e for e in episodes), name
            assert "| all |" in (folder / "eval" / f"step_{step}.md").read_text(), name
        events = EventAccumulator(str(folder / "tensorboard"))
        events.Reload()
        evaluated = [(e.step, round(e.value, 6)) for e in events.Scalars("eval/reward")]
        assert [step for step, _ in evaluated] == list(range(steps + 1)) and evaluated[0][1] == round(
            job["base_reward"], 6
        ), name
        # training.eval.keep_best: the adapter is the step's of the highest held-out reward, ties going to the
        # highest likelihood of the held-out tasks' gold turns (training.eval.ties), logged with every evaluation
        logged = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        gold = {line["step"]: line["eval/gold_logp"] for line in logged if "eval/gold_logp" in line}
        assert sorted(gold) == list(range(steps + 1)) and all(math.isfinite(v) for v in gold.values()), name
        best = max(evaluated, key=lambda point: (point[1], gold[point[0]]))  # the earlier of equal pairs
        assert (job["best_step"], round(job["final_reward"], 6)) == best, name
        assert weights_fingerprint(folder / "adapter") == weights_fingerprint(folder / "best"), name
        kept = f"step {job['best_step']} of {steps} kept (held-out reward {job['final_reward']:.3f}, base "
        kept += f"{job['base_reward']:.3f}; gold turns' logprob {gold[job['best_step']]:.2f}, base {gold[0]:.2f})"
        assert kept in (tmp_path / "report.md").read_text(), name
    routed = stages["routing"]["result"]["by_task"]
    records = _records(tmp_path / "heldout" / "trace")
    assert len(records) == heldout and all(r["adapter_idx"] == routed[r["task_id"]] for r in records)
    taken = json.loads((tmp_path / "heldout" / "trace" / "summary.json").read_text())["reused_episodes"]
    assert taken == sum(i == -1 for i in routed.values())  # the base agent's tasks: its own episodes, not replayed
    assert sum(summary["routing"].values()) == heldout and summary["oracle"] is None  # final.per_adapter is off
    report = (tmp_path / "report.md").read_text()
    assert "## Held-out success per family" in report and "| order_facts | 0 |" in report  # calibration row
    kinds = stages["environments"]["result"]["tool_calling"]  # calibrated per family, trained on them mixed
    assert list(kinds["families"]) == ["cancel", "return", "address", "default_address"]
    assert [part["variant"] for part in kinds["env"]["parts"]] == list(kinds["families"])
    assert "| tool_calling[return] | 0 | 4 |" in report
    assert "| tool_calling | all |" in report  # the training reward table (one task a step here: no variants)
    diagnostics = stages["diagnostics"]["result"]  # sampled pass@k on each capability's targeted families
    assert set(diagnostics) == set(summary["trained"]) and "## 5. Partial learning" in report
    assert all(not r["families"] or {"pass@1", "pass@2"} <= set(r["adapter"]) for r in diagnostics.values())
    assert "| all |" in out.stdout  # the held-out table is printed
    assert f"conversation {heldout}/{heldout} (100%)" in out.stderr  # the routing stage's progress
    assert {k: v for k, v in again.items() if k != "this_run_seconds"} == {
        k: v for k, v in summary.items() if k != "this_run_seconds"
    }
    assert again["this_run_seconds"] < 120  # nothing replayed, nothing retrained (a replay takes minutes)


def test_the_report_shows_each_variants_training_reward_and_its_unhinted_episodes(tmp_path):
    """A mixed environment's GRPO metrics (as `variant_metrics` logs them) become one series per variant in the
    report's table and plot: the adapter's mean first, then each variant and its unhinted episodes; the held-out
    series join a step's lines (the gold measure a resumed run adds later)."""
    folder = tmp_path / "adapters" / "tool_calling"
    folder.mkdir(parents=True)
    lines = [
        {"step": 0, "eval/reward": 0.2},
        {"step": 1, "rollout/reward": 0.5, "rollout/return/reward": 0.5, "rollout/return/unhinted_reward": 0.0},
        {"step": 2, "rollout/reward": 0.6, "rollout/return/reward": 0.75, "rollout/return/unhinted_reward": 0.5},
        {"step": 2, "eval/reward": 0.25},
        {"step": 0, "eval/gold_logp": -40.0},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    logs = _adapter_logs(tmp_path, ["tool_calling"])
    assert _heldout_curves(logs) == {"tool_calling": {"reward": [(0, 0.2), (2, 0.25)], "gold_logp": [(0, -40.0)]}}
    curves = _training_curves(logs)
    assert curves == {
        "tool_calling": {
            "all": [(1, 0.5), (2, 0.6)],
            "return": [(1, 0.5), (2, 0.75)],
            "return unhinted": [(1, 0.0), (2, 0.5)],
        }
    }
    table = _variant_table(curves).splitlines()
    assert table[2:] == [
        "| tool_calling | all | 0.500 | 0.600 |",
        "| tool_calling | return | 0.500 | 0.750 |",
        "| tool_calling | return unhinted | 0.000 | 0.500 |",
    ]


def test_the_tiny_experiment_runs_every_arm_on_the_pipelines_run_within_one_budget(
    tiny_run, tiny_chat_model, job_env, tmp_path
):
    """configs/experiment_tiny.py on the tiny pipeline's run: every adapter alone, oracle routing chosen on the
    analysis tickets, GRPO on the target (without and with TRACE's hints), one adapter on both capability
    environments mixed and GEPA, each with TRACE's budget, and TRACE routed to its first capability only, all on
    the same held-out tickets; a rerun repeats nothing."""
    trace_dir = tiny_run[0]
    overrides = [
        f"--config.trace_run={trace_dir}",
        f"--config.results_file={tmp_path / 'committed' / 'comparison.json'}",
        *(f"--config.trace.{o[len('--config.') :]}" for o in [*LLM_PATH, *_model(tiny_chat_model)]),
    ]
    command = [
        sys.executable,
        "-m",
        "launch.experiment",
        "--config=configs/experiment_tiny.py",
        f"--workdir={tmp_path}",
        *overrides,
    ]
    outputs = [
        subprocess.run(command, cwd=REPO, env=job_env, capture_output=True, text=True, timeout=3600) for _ in range(2)
    ]
    for out in outputs:
        assert out.returncode == 0, failure_report(out)
    summary, again = (json.loads(out.stdout.strip().splitlines()[-1]) for out in outputs)
    print(f"\n[experiment] tiny config: {summary}")
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["pending"] == []
    log = outputs[0].stderr  # the table so far, rewritten after each arm (a long experiment's partial results)
    assert (
        "report.md: 4 arms; still to run: oracle, grpo_target, grpo_target_hinted, mixed, gepa, subsets, scaling"
    ) in log
    assert "report.md: 5 arms; still to run: grpo_target, grpo_target_hinted, mixed, gepa, subsets, scaling" in log
    trained = tiny_run[1]["trained"]
    budget = sum(json.loads((trace_dir / "adapters" / n / "summary.json").read_text())["rollouts"] for n in trained)
    assert results["budget"] == summary["budget"] == budget > 0
    arms = {row["arm"]: row for row in results["arms"]}
    names = list(arms)
    analysis = CONFIG.target.analysis_tasks
    assert names[:4] == [
        "base",
        "TRACE",
        f"TRACE, oracle routing (chosen on {analysis} train tasks)",
        "per family the best system on held-out (upper bound)",
    ]
    assert names[4].startswith("best single adapter (")
    assert names[5:] == [
        "GRPO on the target",
        "GRPO on the target, hinted as TRACE",
        "one adapter, environments mixed",
        "GEPA",
        "TRACE, top 1 of 2 capabilities",
    ]
    assert set(summary["success"]) == set(arms)
    heldout = CONFIG.target.heldout_tasks
    assert all(row["episodes"] == heldout for row in arms.values())
    for name in (
        "GRPO on the target",
        "GRPO on the target, hinted as TRACE",
        "one adapter, environments mixed",
        "GEPA",
    ):  # the budget, as counted
        assert abs(arms[name]["rollouts"] - budget) <= 0.05 * budget, name
    stages = json.loads((trace_dir / "stages.json").read_text())
    first = stages["analysis"]["result"]["selected"][0]
    top_1 = _records(tmp_path / "subsets" / "top_1")
    assert (
        arms["TRACE, top 1 of 2 capabilities"]["rollouts"]
        == json.loads((trace_dir / "adapters" / first / "summary.json").read_text())["rollouts"]
    )
    assert len(top_1) == heldout and {e["adapter_idx"] for e in top_1} <= {-1, 0}  # the first adapter or none
    taken = json.loads((tmp_path / "subsets" / "top_1" / "summary.json").read_text())["reused_episodes"]
    assert taken == heldout  # the first adapter's episodes alone and the base agent's: nothing played
    hinted = [
        json.loads(line)
        for path in sorted((tmp_path / "grpo_target_hinted" / "rollouts").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert any(r["hint"] for r in hinted) and not all(r["hint"] for r in hinted)  # TRACE's share of each group
    # TRACE keeps each adapter's best step (training.eval.keep_best), so GRPO on the target keeps its own, chosen by
    # train tickets it never trained on
    played = {r["task_id"] for r in hinted}
    chosen_by = {
        json.loads(line)["task_id"]
        for line in (tmp_path / "grpo_target_hinted" / "eval" / "step_0.jsonl").read_text().splitlines()
    }
    assert chosen_by and all("/train/" in t for t in played | chosen_by) and not played & chosen_by
    assert "best_step" in json.loads((tmp_path / "grpo_target_hinted" / "summary.json").read_text())
    logged = [json.loads(line) for line in (tmp_path / "grpo_target_hinted" / "metrics.jsonl").read_text().splitlines()]
    assert all("eval/gold_logp" in line for line in logged if "eval/reward" in line)  # the target's gold turns
    mixed = [
        json.loads(line)["task_id"]
        for path in sorted((tmp_path / "mixed" / "rollouts").glob("step_*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    print(f"[experiment] the mixed arm's episodes: {mixed}")
    assert {task_id.split("/")[1] for task_id in mixed} == set(trained)  # one adapter, every environment
    gepa = json.loads((tmp_path / "gepa" / "result.json").read_text())
    assert sorted(gepa["texts"]) == sorted(trained)
    share = budget // len(trained)  # each capability's; GEPA may pass it by one iteration
    assert all(
        share <= run["metric_calls"] <= share + 2 * 2 + 2 and run["episodes_played"] <= run["metric_calls"]
        for run in gepa["capabilities"].values()
    )
    episodes = _records(tmp_path / "gepa" / "heldout")
    assert all(e["messages"][0]["content"].endswith(gepa["guidance"]) for e in episodes)
    # Oracle routing: per family the system with the most successes on the analysis tickets (the base agent's
    # episodes taken from the analysis run), scored by those systems' held-out episodes.
    chosen = json.loads((tmp_path / "stages.json").read_text())["oracle"]["result"]
    systems = {
        "general_service": tmp_path / "oracle" / "general_service",
        **{n: tmp_path / "oracle" / n for n in trained},
    }
    train = {name: _records(folder) for name, folder in systems.items()}
    assert all(len(records) == analysis and {r["split"] for r in records} == {"train"} for records in train.values())
    assert json.loads((systems["general_service"] / "summary.json").read_text())["reused_episodes"] == analysis
    assert chosen["episodes_played"] == analysis * len(trained) and chosen["tasks"] == analysis
    wins = lambda name, family: sum(r["success"] for r in train[name] if r["family"] == family)
    print(f"[experiment] oracle routing's choice on the analysis tickets: {chosen['by_family']}")
    for family, name in chosen["by_family"].items():
        assert wins(name, family) == max(wins(other, family) for other in systems), family
    heldout_of = {
        "general_service": _records(stages["base"]["result"]["heldout_dir"]),
        **{n: _records(trace_dir / "heldout" / n) for n in trained},
    }
    by_task = {name: {r["task_id"]: r["success"] for r in records} for name, records in heldout_of.items()}
    system = lambda family: chosen["by_family"].get(family, "general_service")  # a family it never met: the base
    assert arms[names[2]]["success"] == pytest.approx(
        np.mean([by_task[system(r["family"])][r["task_id"]] for r in heldout_of["general_service"]])
    )
    routed = stages["routing"]["result"]["by_task"]
    weights = json.loads((trace_dir / "heldout" / "trace" / "run.json").read_text())["routes"]["adapters"]
    for index, name in enumerate(stages["training"]["result"]):  # each adapter alone: TRACE's tasks under it taken,
        alone = json.loads((trace_dir / "heldout" / name / "summary.json").read_text())  # or under the same weights
        assert alone["reused_episodes"] == sum(i >= 0 and weights[i] == weights[index] for i in routed.values()), name
    report = (tmp_path / "report.md").read_text()
    assert all(f"| {name} |" in report for name in arms) and "## Held-out success per family" in report
    for name, row in arms.items():  # paired with TRACE: the discordant tickets make up the difference in successes
        if name != "TRACE":
            pair = row["vs_trace"]
            assert pair["tasks"] == heldout and pair["only_a"] - pair["only_b"] == round(
                (arms["TRACE"]["success"] - row["success"]) * heldout
            ), name
            assert f"| {name} | {pair['only_a']} | {pair['only_b']} | {pair['p_value']:.3g} |" in report, name
    # The compact record committed as results come: the same counts as the table.
    record = json.loads((tmp_path / "committed" / "comparison.json").read_text())
    assert list(record["arms"]) == names and record["budget"] == budget and record["pending"] == []
    for name, row in arms.items():
        kept = record["arms"][name]
        assert kept["successes"] == round(row["success"] * heldout) and kept["episodes"] == heldout, name
        assert (kept["training_episodes"], kept["wall_s"]) == (row["rollouts"], row["seconds"]), name
        assert sum(s for s, _ in kept["families"].values()) == kept["successes"], name
        assert sum(n for _, n in kept["families"].values()) == heldout, name
        if name != "TRACE":
            pair = row["vs_trace"]
            assert record["vs_trace"][name] == {
                "only_trace": pair["only_a"],
                "only_arm": pair["only_b"],
                "p": pair["p_value"],
            }
    assert "TRACE" not in record["vs_trace"]
    # The scaling curve: each arm from the base agent to its finished run through its shares of the budget.
    # TRACE's one GRPO step per adapter rounds to step 0 or 1, so its points are the base and itself; GRPO on
    # the target (2 steps) is evaluated at its snapshot of step 1; GEPA with its seed texts (found at call 0).
    fractions = sorted(CONFIG.training.train.snapshot_fractions)
    curves = results["scaling"]
    assert list(curves) == ["TRACE", "GRPO on the target", "GEPA"] and "## Scaling" in report
    for arm, points in curves.items():
        assert [p["fraction"] for p in points] == [0.0, *fractions, 1.0], arm
        assert (points[0]["rollouts"], points[0]["success"]) == (0, arms["base"]["success"]), arm
        assert (points[-1]["rollouts"], points[-1]["success"]) == (arms[arm]["rollouts"], arms[arm]["success"]), arm
        assert all(p["episodes"] == heldout for p in points), arm
    assert [p["rollouts"] for p in curves["TRACE"]] == [0, 0, budget, budget, budget]
    grpo_steps = [snapshot_step(f, 2) for f in fractions]  # a budget of 4 episodes: 2 steps of 1 task x 2
    assert [p["rollouts"] for p in curves["GRPO on the target"]][1:-1] == [2 * k for k in grpo_steps]
    played = json.loads((tmp_path / "stages.json").read_text())["scaling"]["result"]  # each point's episodes
    assert [pathlib.Path(p["episodes_dir"]).name for p in played["GRPO on the target"][1:-1]] == [
        f"step_{k}" if k == 1 else "heldout" for k in grpo_steps
    ]
    assert len(_records(tmp_path / "scaling" / "grpo_target" / "step_1")) == heldout
    # The same successes in TensorBoard against training rollouts, each point once although the table was
    # written after every arm and by both runs.
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = lambda name: [(e.step, round(e.value, 6)) for e in events.Scalars(name)]
    for row in arms.values():
        assert logged(scalar_name("heldout", row["arm"])) == [(row["rollouts"], round(row["success"], 6))], row
    for arm, points in curves.items():
        assert logged(scalar_name("scaling", arm)) == sorted(
            {p["rollouts"]: round(p["success"], 6) for p in points}.items()
        ), arm
    assert (tmp_path / "grpo_target" / "snapshots" / "step_1").is_dir()
    assert not (tmp_path / "mixed" / "snapshots").exists()  # no curve for the mixed arm
    assert [p["rollouts"] for p in curves["GEPA"]][1:-1] == [
        sum(int(f * run["metric_calls"]) for run in gepa["capabilities"].values()) for f in fractions
    ]
    seeds = joined_guidance({n: run["seed_text"] for n, run in gepa["capabilities"].items()})
    for point in played["GEPA"][1:-1]:  # within 1 call of 2 per capability, GEPA had only its seed texts
        assert all(r["messages"][0]["content"].endswith(seeds) for r in _records(point["episodes_dir"]))
    assert (tmp_path / "plots" / "scaling.png").is_file()
    assert {k: v for k, v in again.items() if k != "this_run_seconds"} == {
        k: v for k, v in summary.items() if k != "this_run_seconds"
    }
    assert again["this_run_seconds"] < 60  # nothing trained or played again


def test_the_stages_and_evaluation_notebooks_read_the_pipelines_run(tiny_run, tiny_chat_model, job_env):
    """colabs/03 walks the tiny run's stages one by one (all done: each is read back, nothing runs again) and shows
    the analysis table, a capability environment's tasks and calibration rewards, the training rewards and the
    routing; colabs/04 tabulates and plots the run's held-out base evaluation."""
    workdir = tiny_run[0]
    stages = (workdir / "stages.json").read_text()
    settings = {
        "CONFIG": "trace_tiny",
        "WORKDIR": str(workdir),
        "OVERRIDES": {**LLM_OVERRIDES, **_model_overrides(tiny_chat_model)},
    }
    out = printed(run_notebook("03_trace_stages.ipynb", settings, job_env))
    assert "selected: ['order_facts', 'tool_calling']" in out and "gold calls: [" in out
    assert (workdir / "stages.json").read_text() == stages
    evaluation = run_notebook("04_evaluation_plots.ipynb", {"RUN": str(workdir / "heldout" / "base")}, job_env)
    shown = [output.get("data", {}) for cell in evaluation.cells for output in cell.get("outputs", ())]
    heldout = CONFIG.target.heldout_tasks
    assert any(f"| all | {heldout} | {heldout} |" in data.get("text/markdown", "") for data in shown)
    assert any("image/png" in data for data in shown) and "Counter({" in printed(evaluation)


def test_the_server_routes_each_conversation_as_the_routing_stage_did(tiny_run, job_env):
    """`launch.serve --trace_run`: the run's model and adapters, and as model "trace" its router, which gives a
    conversation opening as a held-out ticket that ticket's adapter (the run's stored calibration offsets), and
    keeps it for the conversation's later requests."""
    workdir = tiny_run[0]
    routing = json.loads((workdir / "stages.json").read_text())["routing"]["result"]
    process, url = start_server([f"--trace_run={workdir}", "--batch=2"], env=job_env)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list()][1:] == [*routing["labels"][1:], "trace"]
        target = make_environment(CONFIG.target.env)
        for task in target.tasks(CONFIG.target.heldout_split, CONFIG.target.heldout_tasks):
            messages = target.episode(task).reset()
            reply = client.chat.completions.create(model="trace", messages=messages, max_tokens=2, temperature=0)
            chosen = routing["labels"][routing["by_task"][task.task_id] + 1]
            assert reply.model_extra["route"]["adapter"] == chosen, task.task_id
            later = [
                *messages,
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "Thanks. Anything else?"},
            ]
            again = client.chat.completions.create(model="trace", messages=later, max_tokens=2, temperature=0)
            assert again.model_extra["route"] == reply.model_extra["route"], task.task_id
        start = time.monotonic()  # too long for the context: refused before the router reads it
        with pytest.raises(openai.BadRequestError, match="context holds"):
            client.chat.completions.create(model="trace", messages=[{"role": "user", "content": "order " * 9000}])
        assert time.monotonic() - start < 1.0
    finally:
        process.terminate()
        process.wait(timeout=60)


def _played(folder: pathlib.Path) -> list[dict]:
    """An evaluation's episodes in task order, less their timings."""
    return sorted(
        ({k: v for k, v in r.items() if k != "elapsed_s"} for r in _records(folder)),
        key=lambda r: (r["task_id"], r["trial"]),
    )


def test_two_processes_run_the_pipeline_as_one(tiny_run, tiny_chat_model, job_env, tmp_path):
    """configs/trace_tiny.py with built-in environments as two processes of one device each (one JAX run, as on
    two hosts): every stage runs, process 0 alone writes and prints. The base agent's episodes are the
    single-process run's (the LLM path changes no base setting), and the trained capability's calibration
    (episodes at temperature 1, each process playing every other one) equals one process's (the test's own)."""
    workdir, heldout = tmp_path / "two", CONFIG.target.heldout_tasks
    command = [
        sys.executable,
        "-m",
        "launch.trace",
        "--config=configs/trace_tiny.py",
        f"--workdir={workdir}",
        *_model(tiny_chat_model),
        "--config.training.eval.num_tasks=0",  # no held-out evaluation, so no best step to keep
        "--config.training.eval.keep_best=False",
    ]
    outputs = run_processes(command, 2, job_env, tmp_path / "logs")
    summary = json.loads(outputs[0].strip().splitlines()[-1])
    print(f"\n[trace pipeline] two processes: {summary}")
    assert "stage" not in outputs[1] and "trace_success" not in outputs[1]  # warnings only
    assert summary["episodes"] == {"base": heldout, "trace": heldout} and len(summary["trained"]) == 1
    assert list(json.loads((workdir / "stages.json").read_text())) == list(STAGES)
    for run in ("base_analysis", "heldout/base"):
        assert _played(workdir / run) == _played(tiny_run[0] / run), run
    name = summary["trained"][0]
    config = trace_tiny.get_config()
    config.update_from_flattened_dict(_model_overrides(tiny_chat_model))
    one = calibrate_builtin(name, calibration_evaluation(config), config.calibration, tmp_path / "one")
    two = json.loads((workdir / "environments" / name / "calibration.json").read_text())
    assert two["tries"] == one["tries"] and two["env"] == one["env"]
    episodes = pathlib.Path(one["episodes_dir"]).relative_to(tmp_path / "one")
    assert _played(workdir / "environments" / name / episodes) == _played(tmp_path / "one" / episodes)
    assert (workdir / "report.md").is_file() and not list(workdir.rglob("episodes.jsonl.process*"))


def test_a_resumed_stage_reports_the_time_of_every_process_that_worked_on_it(tmp_path):
    path = tmp_path / "stage_clock.json"
    with StageClock(path, "training", every_s=0.05):
        time.sleep(0.5)  # then "killed": what it saved is all a resume can know
    saved = json.loads(path.read_text())["training"]
    assert 0.3 <= saved <= 0.55
    with StageClock(path, "oracle", every_s=0.05):  # a stage added before it since, run first
        time.sleep(0.2)
    with StageClock(path, "training", every_s=0.05) as resumed:
        time.sleep(0.1)
    assert resumed.before == saved and saved + 0.1 <= resumed.seconds() < saved + 1.0
    assert StageClock(path, "routing").before == 0.0  # the next stage starts from zero


def test_a_capability_dropped_by_calibration_gives_its_place_to_the_next_by_coverage():
    passes = {"a": True, "b": False, "c": False, "d": True, "e": True}
    tried = []

    def calibrate(name):
        tried.append(name)
        return {"calibrated": passes[name]}

    results = calibrate_in_order(list(passes), 2, calibrate)
    assert tried == ["a", "b", "c", "d"] and [n for n, r in results.items() if r["calibrated"]] == ["a", "d"]
    assert list(calibrate_in_order(["b", "c"], 2, calibrate)) == ["b", "c"]  # fewer pass than wanted: all tried
    assert list(calibrate_in_order(list(passes), 0, calibrate)) == list(passes)  # 0: every selected one


@pytest.mark.parametrize(
    "name",
    [
        "trace_embedded",
        "trace_quick",
        "trace_tiny",
        "trace_tiny_airline",
        "trace_tau2_retail",
        "trace_tau2_retail_pod",
        "trace_tau2_airline",
    ],
)
def test_every_pipeline_config_validates_or_names_the_key_a_user_must_set(name):
    config = importlib.import_module(f"configs.{name}").get_config()
    assert target_domain(config.target.env) == ("airline" if name.endswith("airline") else "retail")
    if name.startswith("trace_tau2"):
        with pytest.raises(ValueError, match=r"config.model = '' is invalid"):
            validate_config(config)
        config.model = "/path/to/hf_checkpoint"
    if config.analysis.analyst == "llm":
        with pytest.raises(ValueError, match=r"config.llm.model = '' is invalid"):
            validate_config(config)
        config.llm.model = "some-model"
    validate_config(config)
    config.calibration.samples = 1
    with pytest.raises(ValueError, match="config.calibration.samples = 1 is invalid"):
        validate_config(config)
    config.calibration.samples = 2
    config.target.rollout.top_p = 0.0
    with pytest.raises(ValueError, match=r"config.target.rollout.top_p = 0.0 is invalid"):
        validate_config(config)


@pytest.mark.parametrize(
    "key, value",
    [
        ("target.env.name", "nope"),
        ("target.rollout.max_turns", 0),
        ("training.rollout.group_size", 1),
        ("training.lora.rank", 0),
        ("training.mesh.tensor", 3),
        ("routing.calibration", "platt"),
        ("diagnostics.temperature", 0.0),
    ],
)
def test_a_bad_value_in_any_block_of_the_pipeline_fails_naming_the_users_key(key, value):
    """The evaluations and the training job read configs the pipeline composes from its blocks; their errors
    still name the key the user wrote, also where the pipeline's config is the experiment's `trace` block."""
    for module, prefix, validate in [
        ("trace_embedded", "", validate_config),
        ("experiment_embedded", "trace.", validate_experiment_config),
    ]:
        config = importlib.import_module(f"configs.{module}").get_config()
        *path, last = f"{prefix}{key}".split(".")
        node = config
        for part in path:
            node = node[part]
        node[last] = value
        written = re.escape(f"config.{prefix}{key} = {value!r}")
        with pytest.raises(ValueError, match=rf"^{written} is invalid"):
            validate(config)


def test_a_training_seed_changes_the_grpo_jobs_draws_alone():
    """`training.seed` (a second training seed of a comparison) reaches TRACE's GRPO jobs and the GRPO baselines;
    the evaluations that calibration, the base agent and the diagnostics play keep the pipeline's seed, so their
    episodes can be taken from the first run."""
    config = importlib.import_module("configs.experiment_embedded").get_config().trace
    env = {"env": environment_config("tool_calling", 0, config.calibration)}
    assert config.seed == 0 and training_config(config, env).seed == 0  # unset: the pipeline's
    config.training.seed = 1
    assert training_config(config, env).seed == 1 and grpo_config(config, env["env"], hints=False).seed == 1
    assert calibration_evaluation(config).seed == heldout_evaluation(config).seed == 0


@pytest.mark.parametrize(
    "name", ["experiment_embedded", "experiment_tiny", "experiment_tau2_retail", "experiment_tau2_airline"]
)
def test_every_experiment_config_validates_or_names_the_key_a_user_must_set(name):
    config = importlib.import_module(f"configs.{name}").get_config()
    if name.startswith("experiment_tau2"):
        with pytest.raises(ValueError, match=r"config.trace.model = '' is invalid"):
            validate_experiment_config(config)
        config.trace.model = "/path/to/hf_checkpoint"
        if config.trace.analysis.analyst == "llm":
            config.trace.llm.model = "some-model"
    validate_experiment_config(config)
    config.arms = ("grpo_target", "teacher")
    with pytest.raises(ValueError, match=r"config.arms = .* is invalid; it must be a subset of"):
        validate_experiment_config(config)
    config.arms, config.gepa.reflection, config.trace.llm.model = ("gepa",), "llm", ""
    with pytest.raises(ValueError, match=r"config.trace.llm.model = '' is invalid"):  # GEPA reflects through it
        validate_experiment_config(config)


def test_a_run_of_several_processes_refuses_llm_written_environments_at_start_naming_the_key(monkeypatch):
    """The environment writer's sandbox, and the calibrations it asks for, run in one process."""
    config = trace_tiny.get_config()
    config.update(model="smollm2-135m-instruct")
    config.analysis.analyst, config.llm.model = "llm", "any"
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for source in ("llm", "auto"):
        config.environments.source = source
        with pytest.raises(ValueError, match=f"config.environments.source = '{source}' with the llm analyst"):
            validate_config(config)
    config.environments.source = "builtin"
    validate_config(config)
    pod = importlib.import_module("configs.trace_tau2_retail_pod").get_config()
    pod.model = "/path/to/hf_checkpoint"
    validate_config(pod)  # the pod config is one


def test_a_base_run_of_other_episodes_fails_at_start_naming_the_key(tmp_path, smollm2):
    config = trace_tiny.get_config()
    config.model = "smollm2-135m-instruct"  # the bare model: the test builds no agent
    heldout = heldout_evaluation(config)
    base = tmp_path / "base"
    base.mkdir()
    config.target.base_run = str(base)
    with pytest.raises(ValueError, match="config.target.base_run = .* is not a finished evaluation's workdir"):
        Pipeline(config, tmp_path / "run")
    other = ml_collections.ConfigDict(heldout.to_dict())
    other.rollout.max_turns += 1
    (base / "summary.json").write_text("{}")
    (base / "run.json").write_text(json.dumps(run_marker(other, "model"), default=str))
    with pytest.raises(ValueError, match=f"its run has rollout.max_turns = {other.rollout.max_turns}, this job needs"):
        Pipeline(config, tmp_path / "run")
    (base / "run.json").write_text(json.dumps(run_marker(heldout, "model"), default=str))
    assert Pipeline(config, tmp_path / "run").config.target.base_run == str(base)  # the same episodes: accepted


def _episodes(folder, outcomes):
    """An evaluation folder whose episodes.jsonl holds one record per (task id, family, success)."""
    folder.mkdir(parents=True)
    lines = [
        json.dumps({"task_id": t, "family": f, "success": s, "reward": float(s), "trial": 0}) for t, f, s in outcomes
    ]
    (folder / "episodes.jsonl").write_text("\n".join(lines) + "\n")


def test_the_oracle_takes_the_best_system_per_family_and_scores_the_router(tmp_path):
    tasks = [("a1", "a", 0), ("a2", "a", 0), ("b1", "b", 0), ("b2", "b", 0)]  # two families, two tasks each
    _episodes(tmp_path / "base", [(t, f, t == "b1") for t, f, _ in tasks])  # base: 1 of 2 on b
    _episodes(tmp_path / "heldout" / "x", [(t, f, f == "a") for t, f, _ in tasks])  # x: 2 of 2 on a
    _episodes(tmp_path / "heldout" / "y", [(t, f, t == "b2") for t, f, _ in tasks])  # y ties base on b
    routed = {"a1": 0, "a2": -1, "b1": -1, "b2": 1}
    oracle = oracle_routes(tmp_path, str(tmp_path / "base"), ["x", "y"], routed)
    assert oracle["by_family"] == {"a": "x", "b": "general_service"}  # a tie goes to the base model
    assert oracle["success"] == 3 / 4 and oracle["accuracy"] == 2 / 4 and oracle["episodes"] == 4


def test_the_experiments_oracle_routing_is_chosen_on_train_tasks_and_scored_on_held_out_ones(tmp_path):
    """Adapter x beat the base agent on family a's train tasks but not on its held-out ones: oracle routing (the
    oracle stage's choice on train tasks) serves a with x, the upper bound (chosen on held-out) with the base."""
    trace_dir, workdir = tmp_path / "trace", tmp_path / "experiment"
    tasks = [("a1", "a"), ("a2", "a"), ("b1", "b"), ("b2", "b")]
    _episodes(trace_dir / "heldout" / "base", [(t, f, f == "a") for t, f in tasks])  # 2 of 2 on a
    _episodes(trace_dir / "heldout" / "x", [(t, f, t == "a1") for t, f in tasks])  # 1 of 2 on a
    _episodes(trace_dir / "heldout" / "trace", [(t, f, False) for t, f in tasks])
    config = experiment_tiny.get_config()
    config.trace_run = str(trace_dir)
    experiment = Experiment(config, workdir)
    experiment.stages.done["oracle"] = {
        "seconds": 5.0,
        "result": {"by_family": {"a": "x", "b": "general_service"}, "tasks": 6},
    }
    trace = {
        "base_dir": str(trace_dir / "heldout" / "base"),
        "base_seconds": 1.0,
        "trace_rollouts": 8,
        "trace_seconds": 10.0,
        "adapters": {"x": str(tmp_path / "x")},
        "rollouts_by_capability": {"x": 8},
        "routing": {t: 0 for t, _ in tasks},
    }
    rows = {row["arm"]: row for row in experiment._results(trace, 8, [])["arms"]}
    oracle = rows["TRACE, oracle routing (chosen on 6 train tasks)"]
    assert (oracle["success"], oracle["families"], oracle["seconds"]) == (1 / 4, {"a": 0.5, "b": 0.0}, 15.0)
    assert rows["per family the best system on held-out (upper bound)"]["success"] == 2 / 4
    # each arm paired with TRACE (which solved none): the tickets only the arm solved
    assert rows["per family the best system on held-out (upper bound)"]["vs_trace"] == {
        "tasks": 4,
        "only_a": 0,
        "only_b": 2,
        "p_value": 0.5,
    }
    assert oracle["vs_trace"]["only_b"] == 1 and "vs_trace" not in rows["TRACE"]
