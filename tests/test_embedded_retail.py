"""The embedded retail environment: gold, noop and wrong agents through τ²'s evaluator, seeding, disjoint splits."""

from __future__ import annotations

import collections
import os

import jax
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it

from trace_jax.envs import base
from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.envs.embedded_retail_families import FAMILIES, SPLITS, split_of_user

# τ²'s evaluator costs about 0.25 s an episode here (DB copies and hashes; about 1 s on CI's machine), so the
# gold agent plays 8 tasks per family and split (112 in all), the noop and wrong agents the first 7 of them.
TASKS_PER_SPLIT = 56
FEW_PER_SPLIT = 49


@pytest.fixture(scope="module")
def env() -> EmbeddedRetail:
    return EmbeddedRetail(seed=0)


@pytest.fixture(scope="module")
def tasks(env) -> list[base.TaskSpec]:
    return [spec for split in SPLITS for spec in env.tasks(split, TASKS_PER_SPLIT)]


@pytest.fixture(scope="module")
def few_tasks(env) -> list[base.TaskSpec]:
    return [spec for split in SPLITS for spec in env.tasks(split, FEW_PER_SPLIT)]


def _reply(facts: tuple[str, ...]) -> str:
    return "Here is what I found: " + "; ".join(facts) if facts else "Your request is complete."


def _play(env: EmbeddedRetail, spec: base.TaskSpec, calls: list[dict], text: str) -> tuple[base.Outcome, list[str]]:
    """Plays the calls (one per turn) then the text; returns the outcome and the tool results."""
    episode = env.episode(spec)
    messages = episode.reset()
    assert [m["role"] for m in messages] == ["system", "user"]
    results = []
    for k, call in enumerate(calls):
        step = episode.step(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": f"call_{k}", "name": call["name"], "arguments": call["arguments"]}],
            }
        )
        assert not step.done and len(step.observations) == 1 and step.observations[0]["role"] == "tool"
        results.append(step.observations[0]["content"])
    assert episode.step({"role": "assistant", "content": text}).end_reason == base.END_AGENT_STOP
    return episode.evaluate(), results


def test_gold_agent_scores_one_on_every_task(env, tasks):
    for spec in tasks:
        gold = env.episode(spec).gold()
        outcome, results = _play(env, spec, list(gold.tool_calls), _reply(gold.facts))
        assert not any(r.startswith("Error") for r in results), (spec, results)
        assert outcome.reward == 1.0 and outcome.success, (spec, env.retail_task(spec).ticket, outcome)
    assert {spec.family for spec in tasks} == set(FAMILIES)


def test_noop_agent_scores_zero_on_every_task(env, few_tasks):
    for spec in few_tasks:
        outcome, _ = _play(env, spec, [], "I can't help.")
        assert outcome.reward == 0.0, (spec, env.retail_task(spec).ticket, outcome)


def _wrong(env: EmbeddedRetail, spec: base.TaskSpec) -> tuple[list[dict], tuple[str, ...]] | None:
    """A near miss of the gold: a wrong write, an extra forbidden write, or a missing fact."""
    task = env.retail_task(spec)
    calls, facts = [dict(c, arguments=dict(c["arguments"])) for c in task.gold.tool_calls], task.gold.facts
    last = calls[-1]["arguments"]
    if spec.family == "cancel_pending":
        last["reason"] = "no longer needed" if last["reason"] == "ordered by mistake" else "ordered by mistake"
    elif spec.family == "change_address":
        last["zip"] = "00000"
    elif spec.family == "return_delivered":
        last["item_ids"] = last["item_ids"][:-1]
    elif task.variant == "bad_reason":
        calls.append(
            {"name": "cancel_pending_order", "arguments": {"order_id": last["order_id"], "reason": "no longer needed"}}
        )
    elif task.variant == "other_user":
        (other,) = {e for e in task.entities if e.startswith("#")} - {last["order_id"]}
        calls.append({"name": "cancel_pending_order", "arguments": {"order_id": other, "reason": last["reason"]}})
    elif spec.family == "refuse":
        return None  # the tools themselves refuse these; see test_forbidden_writes_are_refused_by_the_tools
    else:
        facts = facts[:-1]
    return calls, facts


def test_wrong_writes_and_missing_facts_score_zero(env, few_tasks):
    played = collections.Counter()
    for spec in few_tasks:
        wrong = _wrong(env, spec)
        if wrong is None:
            continue
        calls, facts = wrong
        outcome, results = _play(env, spec, calls, _reply(facts))
        assert not any(r.startswith("Error") for r in results), (spec, results)
        assert outcome.reward == 0.0, (spec, env.retail_task(spec).ticket, calls, outcome)
        played[spec.family] += 1
    assert set(played) == set(FAMILIES)


def test_forbidden_writes_are_refused_by_the_tools(env, tasks):
    for spec in tasks:
        task = env.retail_task(spec)
        if task.variant not in ("cancel_not_pending", "return_not_delivered"):
            continue
        order = task.gold.tool_calls[-1]["arguments"]["order_id"]
        write = (
            {"name": "cancel_pending_order", "arguments": {"order_id": order, "reason": "no longer needed"}}
            if task.variant == "cancel_not_pending"
            else {
                "name": "return_delivered_order_items",
                "arguments": {"order_id": order, "item_ids": [], "payment_method_id": "gift_card_0000000"},
            }
        )
        _, results = _play(env, spec, [*task.gold.tool_calls, write], _reply(task.gold.facts))
        assert results[-1].startswith("Error"), results[-1]


def _describe(env: EmbeddedRetail, split: str, num: int) -> list[tuple]:
    return [(s.task_id, s.family, t.ticket, t.gold) for s in env.tasks(split, num) for t in [env.retail_task(s)]]


def test_same_seed_same_tasks_and_different_seed_different_tasks():
    first, again, other = EmbeddedRetail(seed=3), EmbeddedRetail(seed=3), EmbeddedRetail(seed=4)
    for split in SPLITS:
        assert _describe(first, split, 70) == _describe(again, split, 70)
        assert [d[2] for d in _describe(first, split, 70)] != [d[2] for d in _describe(other, split, 70)]
    assert _describe(first, "train", 70) == _describe(first, "train", 140)[:70]  # a prefix of any longer list


def _owners(env: EmbeddedRetail, spec: base.TaskSpec) -> set[str]:
    """Users behind every entity a task names, found from its gold calls and ticket through the DB."""
    db, task = env.state.db, env.retail_task(spec)
    users = set()
    for call in task.gold.tool_calls:
        args = call["arguments"]
        if "email" in args:
            users |= {u.user_id for u in db.users.values() if u.email == args["email"]}
        if "first_name" in args:
            users |= {
                u.user_id
                for u in db.users.values()
                if (u.name.first_name, u.name.last_name, u.address.zip)
                == (args["first_name"], args["last_name"], args["zip"])
            }
        if "user_id" in args:
            users.add(args["user_id"])
        if "order_id" in args:
            users.add(db.orders[args["order_id"]].user_id)
    users |= {db.orders[word.strip(".;,")].user_id for word in task.ticket.split() if word.startswith("#W")}
    assert users and users == {e for e in task.entities if not e.startswith("#")}
    return users


def test_splits_are_disjoint_in_users_and_orders():
    env = EmbeddedRetail(seed=1)
    touched = {}
    for split in SPLITS:
        specs = env.tasks(split, 700)
        touched[split] = set().union(*(_owners(env, s) for s in specs))
        assert {split_of_user(u) for u in touched[split]} == {split}
        entities = set().union(*(env.retail_task(s).entities for s in specs))
        orders = {e for e in entities if e.startswith("#")}
        assert {split_of_user(env.state.db.orders[o].user_id) for o in orders} == {split}
    assert not touched["train"] & touched["heldout"]
    assert len(touched["heldout"]) > 50 and len(touched["train"]) > 200


def test_families_are_balanced_and_selectable():
    env = EmbeddedRetail(seed=0)
    counts = collections.Counter(s.family for s in env.tasks("train", 7 * 30))
    assert counts == {family: 30 for family in FAMILIES}
    only = EmbeddedRetail(seed=0, families=["refuse", "order_status"])
    assert {s.family for s in only.tasks("heldout", 10)} == {"refuse", "order_status"}
    assert len(env.tasks("train")) == env.num_tasks
    assert len(env.tasks("heldout", 5000)) == 5000  # unlimited


def test_unknown_split_or_family_names_the_valid_ones():
    env = EmbeddedRetail(seed=0)
    with pytest.raises(ValueError, match="train, heldout"):
        env.tasks("test", 3)
    with pytest.raises(ValueError, match="order_status.*refuse"):
        EmbeddedRetail(families=["order_status", "exchange"])


def test_solo_episode_protocol(env, tasks):
    episode = env.episode(tasks[0])
    assert episode.user_simulator_messages() is None
    with pytest.raises(RuntimeError, match="solo"):
        episode.user_turn("hello")
    episode.reset()
    episode.end(base.END_MAX_TURNS)
    assert episode.evaluate().reward == 0.0
    episode.reset()
    assert episode.step({"role": "assistant", "content": "Done."}).end_reason == base.END_AGENT_STOP
    episode.end(base.END_MAX_TURNS)  # a normal stop is not overwritten
    assert episode.end_reason == base.END_AGENT_STOP
    with pytest.raises(RuntimeError, match="ended"):
        episode.step({"role": "assistant", "content": "More."})
    names = {t["function"]["name"] for t in episode.tools}
    assert {c["name"] for s in tasks for c in env.episode(s).gold().tool_calls} <= names
    assert len(EmbeddedRetail(all_tools=True).tools) == len(env.state.tool_schemas) == 15


def test_prompt_fits_a_small_model_context(env, tasks):
    from trace_jax.models.embedded import resolve_model_dir
    from trace_jax.models.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer.from_dir(resolve_model_dir("smollm2-135m-instruct"))
    episode = env.episode(tasks[0])
    length = len(tokenizer.apply_chat(episode.reset(), tools=episode.tools))
    print(f"\n[embedded_retail] first prompt: {length} tokens with {len(episode.tools)} tools")
    assert length < 3600


def test_scripted_agents_through_the_rollout_engine(env):
    from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine
    from trace_jax.envs.scripted import GoldAgent, NoopAgent, StoppingUser

    specs = [spec for split in SPLITS for spec in env.tasks(split, len(FAMILIES))]
    for agent, reward in ((GoldAgent(), 1.0), (NoopAgent(), 0.0)):
        engine = RolloutEngine(env, agent=agent, user=StoppingUser(), config=RolloutConfig(max_turns=8))
        trajectories = engine.run([EpisodeSpec(spec) for spec in specs], key=jax.random.key(0))
        assert [t.end_reason for t in trajectories] == [base.END_AGENT_STOP] * len(specs)
        assert [t.outcome.reward for t in trajectories] == [reward] * len(specs)


def test_gold_turns_are_recorded_as_the_models_tokens(env, smollm2):
    """With a tokenizer, the engine records the gold agent's turns as SFT data: each span of the loss
    mask is one turn's text followed by the end-of-turn token, and the ids decode to the chat
    rendering of the episode, so the clone learns exactly what it will sample."""
    from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine
    from trace_jax.envs.scripted import GoldAgent, StoppingUser

    tokenizer = smollm2.tokenizer
    specs = env.tasks("train", len(FAMILIES))
    engine = RolloutEngine(
        env, agent=GoldAgent(), user=StoppingUser(), tokenizer=tokenizer, config=RolloutConfig(max_turns=8)
    )
    for trajectory in engine.run([EpisodeSpec(spec) for spec in specs], key=jax.random.key(0)):
        assert trajectory.outcome.reward == 1.0
        replies = [m["content"] for m in trajectory.messages if m["role"] == "assistant"]
        mask = trajectory.loss_mask
        starts = [i for i in range(len(mask)) if mask[i] and not mask[i - 1]]
        ends = [i + 1 for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
        assert len(starts) == len(replies) == trajectory.num_turns
        for start, end, reply in zip(starts, ends, replies):
            assert trajectory.token_ids[start:end] == tokenizer.encode(reply) + tokenizer.encode("<|im_end|>")
        assert sum(mask) == trajectory.generated_tokens
        rendered = tokenizer.render_chat(trajectory.messages, tools=env.tools, add_generation_prompt=False)
        assert rendered.rstrip("\n") == tokenizer.decode(trajectory.token_ids)
