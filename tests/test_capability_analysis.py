"""TRACE stage 1 on real trajectories: scripted agents with known flaws play the embedded retail
environment through the rollout engine and τ²'s evaluator; the programmatic analyst must label
each flaw as LACKING the capability it breaks (and nothing else where the agent did the work),
the compact view must be what an analyst reads, and the analysis must write its artifacts,
agree with `launch.select_capabilities` on its own runs and resume without relabelling."""

import dataclasses
import json

import jax
import pytest
from scripted_llm_server import ScriptedLLMServer

from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.envs.scripted import PlannedAgent, ScriptedUser
from trace_jax.envs.tau2_bridge import domain_state
from trace_jax.llm import LlmSettings
from trace_jax.settings import from_config
from trace_jax.tool_calls import format_tool_call
from trace_jax.trace.analysis import AnalysisSettings, analyze, make_analyst
from trace_jax.trace.analyst import LACKING, NA, PRESENT
from trace_jax.trace.programmatic_analyst import CARDS, ProgrammaticAnalyst
from trace_jax.trace.selection import load_runs, select
from trace_jax.trace.trajectories import compact, load_trajectories


def _call(c, **changes):
    return format_tool_call(c["name"], {**c["arguments"], **changes})


def _gold(e, reply=None):
    calls = [_call(c) for c in e.gold().tool_calls]
    return calls + [reply if reply is not None else "Here you are: " + "; ".join(e.gold().facts)]


# name -> (family, the agent's plan); the flaws are on the gold's own calls
PLANS = {
    "gold_cancel": ("cancel_pending", _gold),
    "gold_status": ("order_status", _gold),
    "skips_the_read": (
        "cancel_pending",
        lambda e: [_call(e.gold().tool_calls[0]), _call(e.gold().tool_calls[2]), "Cancelled."],
    ),
    "wrong_reason": (
        "cancel_pending",
        lambda e: (
            [_call(c) for c in e.gold().tool_calls[:2]]
            + [
                _call(
                    e.gold().tool_calls[2],
                    reason=(
                        {"no longer needed", "ordered by mistake"} - {e.gold().tool_calls[2]["arguments"]["reason"]}
                    ).pop(),
                ),
                "Done.",
            ]
        ),
    ),
    "stops_early": ("cancel_pending", lambda e: [_call(e.gold().tool_calls[0]), "I have found your account."]),
    "repeats_a_failure": (
        "cancel_pending",
        lambda e: [_call(e.gold().tool_calls[0], email="nobody@example.com")] * 2 + ["Sorry, I cannot find you."],
    ),
    "malformed": (
        "cancel_pending",
        lambda e: ['<tool_call>\n{"name": "find_user_id_by_email", "arguments": {\n</tool_call>'] + _gold(e),
    ),
    "omits_the_facts": ("order_status", lambda e: _gold(e, reply="Your order is fine.")),
    "acts_against_policy": (
        "refuse",
        lambda e: (
            [_call(c) for c in e.gold().tool_calls]
            + [
                format_tool_call(
                    "cancel_pending_order",
                    {"order_id": e.gold().tool_calls[1]["arguments"]["order_id"], "reason": "no longer needed"},
                ),
                "Done: " + "; ".join(e.gold().facts),
            ]
        ),
    ),
}

# behaviour -> the labels that must be LACKING (every other applicable label PRESENT), and the NA ones
EXPECTED = {
    "gold_cancel": (set(), {"structured_data", "communication", "error_recovery"}),
    "gold_status": (set(), {"precondition", "error_recovery"}),
    "skips_the_read": ({"precondition", "multi_step"}, {"structured_data", "communication", "error_recovery"}),
    "wrong_reason": ({"tool_calling"}, {"structured_data", "communication", "error_recovery"}),
    "stops_early": ({"multi_step"}, {"structured_data", "communication", "error_recovery"}),
    "repeats_a_failure": ({"tool_calling", "error_recovery", "multi_step"}, {"structured_data", "communication"}),
    "malformed": ({"tool_calling"}, {"structured_data", "communication"}),
    "omits_the_facts": ({"communication", "structured_data"}, {"precondition", "error_recovery"}),
    "acts_against_policy": ({"precondition"}, {"structured_data", "error_recovery"}),  # cancels for a bad reason
}


@pytest.fixture(scope="module")
def played():
    """behaviour -> its trajectory (one task each), played through the engine and scored by τ²."""
    env = EmbeddedRetail(families=["order_status", "cancel_pending", "refuse"])
    tasks = env.tasks("train", 30)
    pools = {family: [t for t in tasks if t.family == family] for family in ("order_status", "cancel_pending")}
    pools["refuse"] = [t for t in tasks if env.retail_task(t).variant == "bad_reason"]
    records = {}
    for name, (family, plan) in PLANS.items():  # each behaviour on its own task
        task = pools[family].pop(0)
        engine = RolloutEngine(env, agent=PlannedAgent(plan), user=ScriptedUser(), config=RolloutConfig(batch_size=1))
        records[name] = engine.run([EpisodeSpec(task, 0, -1)], key=jax.random.key(0))[0].record()
    trajectories = dict(zip(records, load_trajectories(records.values(), env)))
    return env, records, trajectories


def _analyst(env):
    return ProgrammaticAnalyst(domain_state("retail").write_tools, env.tools)


def test_each_scripted_flaw_is_labelled_lacking_the_capability_it_breaks(played):
    env, _, trajectories = played
    labelling = _analyst(env).label(list(trajectories.values()), CARDS, attempt=0)
    assert trajectories["gold_cancel"].success and trajectories["gold_status"].success
    assert not trajectories["omits_the_facts"].success and not trajectories["acts_against_policy"].success
    for name, (lacking, na) in EXPECTED.items():
        got = {card.name: labelling[card.name][trajectories[name].id].label for card in CARDS}
        want = {card.name: LACKING if card.name in lacking else NA if card.name in na else PRESENT for card in CARDS}
        assert got == want, (name, {c: labelling[c][trajectories[name].id].evidence for c in got if got[c] != want[c]})
    evidence = labelling["precondition"][trajectories["skips_the_read"].id].evidence
    assert (
        "before order" in evidence
        and trajectories["skips_the_read"].gold.tool_calls[1]["arguments"]["order_id"] in evidence
    )


def test_the_compact_view_is_what_the_authors_analyst_reads(played):
    _, records, trajectories = played
    view = compact(trajectories["omits_the_facts"], message_chars=120)
    assert [m["role"] for m in view["messages"]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    gold = trajectories["omits_the_facts"].gold.tool_calls[1]
    assert view["messages"][3]["tool_calls"] == f'get_order_details(order_id="{gold["arguments"]["order_id"]}")'
    assert view["messages"][4]["content"].endswith("more chars]") and len(view["messages"][4]["content"]) < 150
    assert view["end_reason"] == "agent_stop" and view["reward"] == 0.0
    assert any(r.startswith("COMMUNICATE: the reply did not state") for r in view["failure_reasons"])
    assert "policy" not in json.dumps(view)  # the shared system prompt is left out
    assert compact(trajectories["malformed"])["messages"][1] == {
        "role": "assistant",
        "tool_calls": "<malformed tool call>",
    }
    assert trajectories["malformed"].calls[0].name == "find_user_id_by_email"  # the error observation skipped
    assert records["malformed"]["num_errors"] == 1


def test_analysis_writes_its_artifacts_agrees_with_the_cli_rule_and_resumes(played, tmp_path):
    env, _, trajectories = played
    config = AnalysisSettings(runs=6, min_runs=5)
    result = analyze(list(trajectories.values()), _analyst(env), config, tmp_path)
    folder = tmp_path / "analysis"
    runs, dropped = load_runs(folder / "runs")
    assert len(runs) == 6 and not dropped and all(r.total_failed == result["failed"] for r in runs)
    assert select(runs, min_runs=5) == [{k: row[k] for k in select(runs)[0]} for row in result["candidates"]]
    selected = [row["name"] for row in result["candidates"] if row["selected"]]
    assert result["selected"] == selected and result["selected"]  # ranked: stage 2 takes them in this order
    for row in result["candidates"]:
        assert row["cov_interval"][0] <= row["mean_cov"] + 0.2 and row["cov_interval"][1] <= 1.0
        assert row["description"] == next(c.description for c in CARDS if c.name == row["name"])
    top = result["candidates"][0]
    assert top["examples"] and all(trajectories_by_id(trajectories)[e["id"]].success is False for e in top["examples"])
    report = (folder / "analysis.md").read_text()
    assert f"## {top['name']}" in report and top["examples"][0]["evidence"] in report

    class Refuses:  # a resumed analysis must not ask again for what it has
        deterministic = True

        def discover(self, trajectories):
            raise AssertionError("rediscovered")

        def label(self, trajectories, cards, attempt):
            raise AssertionError("relabelled")

    (folder / "capabilities.json").unlink()
    assert analyze(list(trajectories.values()), Refuses(), config, tmp_path) == result
    block = {**dataclasses.asdict(config), "min_runs": 9}
    with pytest.raises(ValueError, match=r"config.analysis.min_runs = 9 is invalid; .* \[1, analysis.runs = 6\]"):
        from_config(AnalysisSettings, block, "analysis")


def trajectories_by_id(trajectories):
    return {t.id: t for t in trajectories.values()}


def _scripted_analyst(flaky_sample: int):
    """An LLM over the real OpenAI protocol: discovery answers prose first, then a fenced dictionary;
    labelling marks `reads_results` LACKING on failures and PRESENT on successes and `never_needed` NA,
    except the labelling sampled with seed `flaky_sample`, whose replies always leave out one id."""

    def answer(request):
        prompt = request["messages"][1]["content"]
        if prompt.startswith("Below are"):  # discovery
            if len(request["messages"]) == 2:
                return "I would say the agent lacks care."
            return (
                "```json\n"
                + json.dumps(
                    {
                        "capabilities": [
                            {
                                "name": "reads_results",
                                "description": "Uses values from tool results.",
                                "lacking": "Guesses.",
                            },
                            {"name": "never_needed", "description": "Speaks Latin.", "lacking": "No Latin."},
                        ]
                    }
                )
                + "\n```"
            )
        views = [json.loads(line) for line in prompt.split("Trajectories:\n", 1)[1].splitlines()]
        drop = 1 if request["seed"] == flaky_sample else 0
        return json.dumps(
            {
                "labels": {
                    "reads_results": {
                        v["id"]: {"label": "LACKING" if v["reward"] < 1 else "PRESENT", "evidence": "seen"}
                        for v in views[drop:]
                    },
                    "never_needed": {v["id"]: {"label": "NA", "evidence": ""} for v in views},
                }
            }
        )

    return answer


def test_the_llm_analyst_runs_stage_one_through_a_real_openai_compatible_server(played, tmp_path):
    env, _, trajectories = played
    settings = AnalysisSettings(analyst="llm", runs=4, min_runs=3, label_batch=4, discovery_tokens=1500)
    with ScriptedLLMServer(_scripted_analyst(flaky_sample=2)) as server:
        llm = LlmSettings(model="scripted", base_url=server.base_url, max_retries=0)
        analyst = make_analyst(settings, llm, env, tmp_path)
        result = analyze(list(trajectories.values()), analyst, settings, tmp_path)
        sent = len(server.requests)
        # 2 discovery requests; labellings 0, 1, 3: 3 batches of <= 4 trajectories; labelling 2: 3 bad replies
        assert sent == 2 + 3 * 3 + 3 and analyst.client.stats["failed"] == 1
        assert result["selected"] == ["reads_results"] and result["runs"] == 3
        assert result["dropped_labellings"][0].startswith("labelling 2: trajectories 0-3:")
        reads = result["candidates"][0]
        assert (reads["mean_cov"], reads["mean_delta"], reads["runs_passed"]) == (1.0, 1.0, 3)
        shown = server.requests[0]["messages"][1]["content"].split("Trajectories:\n", 1)[1].splitlines()
        assert len("\n".join(shown)) <= 1500 * 4 < len("\n".join(json.dumps(compact(t)) for t in trajectories.values()))
        assert [json.loads(line)["reward"] < 1 for line in shown[:2]] == [True, False]  # failed and passed in turns
        (tmp_path / "analysis" / "capabilities.json").unlink()
        (tmp_path / "analysis" / "labellings" / "01.json").unlink()
        again = analyze(list(trajectories.values()), make_analyst(settings, llm, env, tmp_path), settings, tmp_path)
        assert again == result and len(server.requests) == sent  # relabelled from the disk cache, no request


def test_records_of_more_tasks_than_the_default_load_with_their_gold():
    """An evaluation of a split's first 250 tasks (the environment's default is 200) loads whole; an id the
    environment does not have is an error naming it."""
    env = EmbeddedRetail()
    specs = env.tasks("train", 250)
    records = [
        {
            "task_id": s.task_id,
            "split": "train",
            "family": s.family,
            "success": False,
            "reward": 0.0,
            "components": {},
            "end_reason": "agent_stop",
            "messages": [{"role": "user", "content": "hi"}],
        }
        for s in specs
    ]
    loaded = load_trajectories(records, env)
    assert [t.id for t in loaded] == [s.task_id for s in specs]
    assert loaded[-1].gold == env.episode(specs[-1]).gold()
    with pytest.raises(ValueError, match="task 'nowhere/7' is not among the 'train' tasks"):
        load_trajectories([{**records[0], "task_id": "nowhere/7"}], env)
