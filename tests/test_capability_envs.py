"""Built-in capability environments through the real rollout engine and τ²'s retail tools: the gold
agent scores 1.0 and doing nothing 0.0 on every capability at every level, scaffolded and variant-pure
ones included (200 seeds of its top difficulty, 40 of the others), the paper's reward is what agents
doing part of the work, or a wrong write, earn, scaffolded levels pre-fill what they say, an agent
without the capability fails where it is needed, tasks are deterministic per seed with disjoint
splits, worlds hold no customer of τ²'s retail DB, and bad settings fail naming the key."""

import json

import jax
import ml_collections
import pytest

from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs import make_environment
from trace_jax.envs.capability import CAPABILITIES, CapabilityEnvironment
from trace_jax.envs.scripted import GoldAgent, NoopAgent, PlannedAgent, ScriptedUser
from trace_jax.envs.tau2_bridge import domain_state
from trace_jax.tool_calls import format_tool_call

TASKS = 40
SEEDS = 200


def _env(capability="tool_calling", **kwargs):
    settings = dict(name="capability", capability=capability, seed=0, difficulty=0, policy=False)
    return make_environment(ml_collections.ConfigDict({**settings, **kwargs}))


def _play(env, agent, tasks):
    engine = RolloutEngine(env, agent=agent, user=ScriptedUser(), config=RolloutConfig(batch_size=8, max_turns=8))
    return engine.run([EpisodeSpec(task, 0, -1) for task in tasks], key=jax.random.key(0))


def _gold_and_empty(env, seeds):
    tasks = env.tasks("train", seeds - seeds // 4) + env.tasks("heldout", seeds // 4)
    return (
        {t.outcome.reward for t in _play(env, GoldAgent(), tasks)},
        {t.outcome.reward for t in _play(env, NoopAgent(), tasks)},
    )


@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_gold_scores_one_and_nothing_scores_zero_at_every_level(capability):
    spec = CAPABILITIES[capability]
    top = spec.max_difficulty  # its tasks draw every variant of the lower difficulties too
    for difficulty in range(spec.min_difficulty, top + 1):
        seeds = SEEDS if difficulty == top else TASKS
        assert _gold_and_empty(_env(capability, difficulty=difficulty), seeds) == ({1.0}, {0.0}), difficulty
    for variant in spec.families:  # variant-pure levels: every kind on its own, each of its levels
        for difficulty in range(spec.min_difficulty, 1):
            env = _env(capability, difficulty=difficulty, variant=variant)
            assert {t.family for t in env.tasks("train", TASKS)} == {variant}
            assert _gold_and_empty(env, TASKS) == ({1.0}, {0.0}), (variant, difficulty)


class _Planned:
    """Makes the calls `plan(episode)` lists, one a turn, then a text turn (or, with `replies=False`, repeats
    its first call, a read, until the episode is cut off)."""

    def __init__(self, plan, replies=True, final="Done."):
        self.plan, self.replies, self.final, self._made = plan, replies, final, {}

    def reply(self, episode):
        calls = self.plan(episode)
        made = self._made.setdefault(id(episode), 0)
        if made < len(calls) or not self.replies:
            self._made[id(episode)] = made + 1
            call = calls[made] if made < len(calls) else calls[0]
            return format_tool_call(call["name"], call["arguments"])
        return self.final(episode) if callable(self.final) else self.final

    def forget(self, episode):
        self._made.pop(id(episode), None)


def _wrong_cancel(episode):
    """A well-formed write the task does not call for: cancelling an order that is not the one to act on."""
    gold = json.dumps(episode.gold().tool_calls)
    order = next(o for o in episode.scenario.db.orders.values() if o.order_id not in gold)
    return {"name": "cancel_pending_order", "arguments": {"order_id": order.order_id, "reason": "no longer needed"}}


@pytest.mark.parametrize("cut_share", [None, 0.5])  # None: the environment's default, τ²'s rule (0)
def test_the_reward_is_the_papers_and_a_wrong_write_costs(cut_share):
    """multi_step at difficulty 1: four gold calls and a fact. 1.0 for everything; 0.6 x the share of gold
    calls made otherwise, less 0.1 per wrong write; an episode cut at the turn limit keeps `cut_share` of it."""
    env = _env("multi_step", difficulty=1, **({} if cut_share is None else {"cut_share": cut_share}))
    tasks = env.tasks("train", 8)
    gold, facts = (lambda e: list(e.gold().tool_calls)), (lambda e: " ".join(e.gold().facts))
    half = lambda e: gold(e)[:2]
    for agent, reward in [
        (_Planned(gold, final=facts), 1.0),
        (_Planned(gold), 0.6),  # every call, but the reply states no fact
        (_Planned(half), 0.6 * 2 / 5),
        (_Planned(lambda e: half(e) + [_wrong_cancel(e)]), 0.6 * 2 / 5 - 0.1),
        (_Planned(lambda e: [_wrong_cancel(e)]), 0.0),  # clipped at 0: no better than nothing
        (_Planned(gold, replies=False), 0.6 * (cut_share or 0.0)),
    ]:  # cut at the turn limit
        played = _play(env, agent, tasks)
        assert {round(t.outcome.reward, 6) for t in played} == {round(reward, 6)}, reward
        assert all(t.outcome.success == (reward == 1.0) for t in played)
    assert 0.6 * 2 / 5 - 0.1 < 0.6 * 2 / 5  # the wrong write scored below the same partial episode without it


def test_scaffolded_levels_prefill_the_calls_before_the_last_write():
    """multi_step below 0: the look-ups and the first write are the agent's pre-filled turns with τ²'s results, so
    the agent makes the last write (the return) alone; -2 adds the exact hint and changes nothing else; -3 also
    opens a hinted episode's first turn with the return's tool name, written as the agent writes the call; -4
    writes the whole call in."""
    plain, prefilled, exact, opened, written = (_env("multi_step", difficulty=d) for d in (0, -1, -2, -3, -4))
    for level, env in ((-1, prefilled), (-2, exact), (-3, opened), (-4, written)):
        for task in env.tasks("train", TASKS):
            scenario = env.scenario(task)
            assert [c["name"] for c in scenario.gold_calls] == ["return_delivered_order_items"], level
            assert [c["name"] for c in scenario.prefilled] == [
                "find_user_id_by_email",
                "get_order_details",
                "cancel_pending_order",
                "get_order_details",
            ]
            opening = env.episode(task).reset()
            assert opening[-1]["role"] == "tool" and not opening[-1]["content"].startswith("Error")
            assert (json.dumps(scenario.gold_calls[0]["arguments"]) in env.hint_for(task)) == (level <= -2)
            gold_turn = format_tool_call(scenario.gold_calls[0]["name"], scenario.gold_calls[0]["arguments"])
            opening_text = env.episode(task, hint=True).opening
            assert env.episode(task).opening == ""
            assert (opening_text == gold_turn[: gold_turn.index("return_delivered_order_items") + 28]) == (level == -3)
            assert (opening_text == gold_turn) == (level == -4)
            assert opening_text == "" or opening_text.startswith('<tool_call>\n{"name": "return_delivered_order_items')
    assert all(len(plain.scenario(t).gold_calls) == 4 for t in plain.tasks("train", TASKS))
    refusals = _env("precondition", difficulty=-1)  # no write to make: the agent keeps its last call (the read)
    for task in refusals.tasks("train", TASKS):
        gold = [c["name"] for c in refusals.scenario(task).gold_calls]
        assert gold == (["cancel_pending_order"] if task.family == "allowed" else ["get_order_details"])


def _calls(calls):
    return [format_tool_call(c["name"], c["arguments"]) for c in calls]


def _read_and_cancel(episode):
    order_id = episode.gold().tool_calls[0]["arguments"]["order_id"]
    return _calls(
        [
            episode.gold().tool_calls[0],
            {"name": "cancel_pending_order", "arguments": {"order_id": order_id, "reason": "no longer needed"}},
        ]
    )


@pytest.mark.parametrize(
    "capability, difficulty, plan, most",
    [
        ("precondition", 1, _read_and_cancel, 0.5),  # acts without checking: every forbidden task fails
        ("precondition", 1, lambda e: _calls(e.gold().tool_calls[:1]), 0.5),  # refuses every request
        ("multi_step", 0, lambda e: _calls(e.gold().tool_calls[:2]), 0.0),  # does only the first request
        ("error_recovery", 0, lambda e: _calls([dict(e.scenario.prefilled[0])] * 2), 0.0),  # repeats the failing call
        ("communication", 2, lambda e: _calls(e.gold().tool_calls), 0.0),  # reads, but states no fact
        (
            "structured_data",
            1,
            lambda e: _calls(
                [
                    {
                        "name": "cancel_pending_order",
                        "arguments": {  # takes the first order
                            "order_id": e.scenario.prefilled[2]["arguments"]["order_id"],
                            **{k: v for k, v in e.gold().tool_calls[0]["arguments"].items() if k == "reason"},
                        },
                    }
                ]
            ),
            0.5,
        ),
    ],
)
def test_an_agent_without_the_capability_fails_where_it_is_needed(capability, difficulty, plan, most):
    env = _env(capability, difficulty=difficulty)
    played = _play(env, PlannedAgent(plan, final="Done, as you asked."), env.tasks("train", TASKS))
    success = sum(t.outcome.success for t in played) / len(played)
    assert success <= most, success


def _levels():
    """Every capability at its top difficulty and its most scaffolded level, and each family's most scaffolded."""
    for name, spec in sorted(CAPABILITIES.items()):
        yield name, {"difficulty": spec.max_difficulty}
        yield name, {"difficulty": spec.min_difficulty}
        yield from ((name, {"difficulty": spec.min_difficulty, "variant": v}) for v in spec.families)


@pytest.mark.parametrize("capability, level", list(_levels()))
def test_tasks_are_deterministic_per_seed_with_disjoint_splits_and_new_customers(capability, level):
    first, again, other_seed = (_env(capability, **level), _env(capability, **level), _env(capability, seed=1, **level))
    tickets = lambda env, split: [env.scenario(t).ticket for t in env.tasks(split, TASKS)]
    hints = lambda env: [env.hint_for(t) for t in env.tasks("train", TASKS)]
    assert tickets(first, "train") == tickets(again, "train") and hints(first) == hints(again)
    assert tickets(first, "train") != tickets(other_seed, "train")
    assert not set(tickets(first, "train")) & set(tickets(first, "heldout"))
    target = domain_state("retail").db
    for task in first.tasks("train", TASKS):
        world = first.scenario(task).db
        assert not set(world.users) & set(target.users) and not set(world.orders) & set(target.orders)
        assert {u.email for u in world.users.values()}.isdisjoint(u.email for u in target.users.values())


def test_a_difficulty_between_two_levels_mixes_their_tasks_and_offers_both_levels_tools():
    """Calibration's finer knob: at 0.5 about half the tasks are each level's (drawn per task key), the tools are
    both levels', the gold still scores 1.0; 1.0 is level 1 itself (the same task ids)."""
    mixed, lower, upper = _env(difficulty=0.5), _env(difficulty=0), _env(difficulty=1)
    tasks = mixed.tasks("train", TASKS)
    levels = [mixed.level(t.task_id.split("/", 1)[1]) for t in tasks]
    assert 0.3 < sum(levels) / TASKS < 0.7 and set(levels) == {0, 1}
    names = lambda env: {t["function"]["name"] for t in env.tools}
    assert names(mixed) == names(lower) | names(upper) and names(lower) < names(upper)
    upper_variants = {mixed.scenario(t).variant for t, level in zip(tasks, levels) if level == 1}
    assert {mixed.scenario(t).variant for t, level in zip(tasks, levels) if level == 0} == {"cancel"}
    assert upper_variants - {"cancel"}  # level 1 adds variants
    assert {t.outcome.reward for t in _play(mixed, GoldAgent(), tasks)} == {1.0}
    assert [t.task_id for t in _env(difficulty=1.0).tasks("train", 3)] == [t.task_id for t in upper.tasks("train", 3)]


def test_bad_settings_fail_naming_the_key():
    with pytest.raises(ValueError, match="config.env.capability = 'telepathy'"):
        _env("telepathy")
    with pytest.raises(ValueError, match="difficulty = 7 is out of range for tool_calling: -3 to 3"):
        _env(difficulty=7)
    with pytest.raises(ValueError, match="difficulty = -5 is out of range for multi_step: -4 to 2"):
        _env("multi_step", difficulty=-5)
    with pytest.raises(ValueError, match="difficulty = 1 is out of range for tool_calling: -3 to 0"):
        _env(difficulty=1, variant="return")  # a family's levels end at its level 0
    with pytest.raises(ValueError, match="variant = 'refund' is invalid for tool_calling; its families are cancel"):
        _env(variant="refund")
    with pytest.raises(ValueError, match=r"cut_share = 1.5 is invalid; it must be a number in \[0, 1\]"):
        _env(cut_share=1.5)
    with pytest.raises(ValueError, match="unknown split"):
        CapabilityEnvironment(CAPABILITIES["tool_calling"]).tasks("test")
