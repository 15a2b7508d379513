"""Built-in capability environments through the real rollout engine and τ²'s retail tools: the gold
agent scores 1.0 and doing nothing 0.0 on every capability (200 seeds of its top difficulty, 40 of the
others), each reward
level is reached by the agent it describes, an agent without the capability fails where it is
needed, tasks are deterministic per seed with disjoint splits, worlds hold no customer of τ²'s
retail DB, and bad settings fail naming the key."""

import jax
import ml_collections
import pytest

from trace_jax.agent.rollout import Job, RolloutConfig, RolloutEngine
from trace_jax.agent.scripted import GoldAgent, NoopAgent, PlannedAgent, ScriptedUser
from trace_jax.agent.tool_calls import format_tool_call
from trace_jax.envs import make_environment
from trace_jax.envs.capability import CAPABILITIES, CapabilityEnvironment
from trace_jax.envs.tau2_bridge import domain_state

TASKS = 40
SEEDS = 200


def _env(capability="tool_calling", **kwargs):
    settings = dict(name="capability", capability=capability, seed=0, difficulty=0, policy=False)
    return make_environment(ml_collections.ConfigDict({**settings, **kwargs}))


def _play(env, agent, tasks):
    engine = RolloutEngine(env, agent=agent, user=ScriptedUser(), config=RolloutConfig(batch_size=8, max_turns=8))
    return engine.run([Job(task, 0, -1) for task in tasks], key=jax.random.key(0))


class _Scripted:
    """Makes one call chosen from the episode's gold call by `edit`, then a text turn (or, with
    `replies=False`, the same call again until the episode is cut off)."""

    def __init__(self, edit, replies=True):
        self.edit, self.replies, self._called = edit, replies, set()

    def reply(self, episode):
        if id(episode) in self._called and self.replies:
            return "Done."
        self._called.add(id(episode))
        name, arguments = self.edit(dict(episode.gold().tool_calls[0]))
        return format_tool_call(name, arguments)

    def forget(self, episode):
        self._called.discard(id(episode))


@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_gold_scores_one_and_nothing_scores_zero_at_every_difficulty(capability):
    top = CAPABILITIES[capability].max_difficulty  # its tasks draw every variant of the lower difficulties too
    for difficulty in range(top + 1):
        env = _env(capability, difficulty=difficulty)
        seeds = SEEDS if difficulty == top else TASKS
        tasks = env.tasks("train", seeds - seeds // 4) + env.tasks("heldout", seeds // 4)
        assert {t.outcome.reward for t in _play(env, GoldAgent(), tasks)} == {1.0}, difficulty
        assert {t.outcome.reward for t in _play(env, NoopAgent(), tasks)} == {0.0}, difficulty


@pytest.mark.parametrize("cut_share", [None, 0.5, 1.0])  # None: the environment's default, τ²'s rule (0)
def test_each_reward_level_is_reached_by_the_agent_it_describes(cut_share):
    env = _env(difficulty=2) if cut_share is None else _env(difficulty=2, cut_share=cut_share)
    tasks = env.tasks("train", 12)
    wrong_order = lambda call: (call["name"], {**call["arguments"], "order_id": "#W0000000"})
    other_tool = lambda call: ("get_order_details", {"order_id": call["arguments"]["order_id"]})
    gold = lambda call: (call["name"], call["arguments"])
    cut = 0.0 if cut_share is None else 0.8 * cut_share  # the right call, then the same call until the turn limit
    for agent, level in [(_Scripted(wrong_order), 0.5), (_Scripted(other_tool), 0.2), (_Scripted(gold), 1.0),
                         (_Scripted(gold, replies=False), cut)]:
        played = _play(env, agent, tasks)
        assert {t.outcome.reward for t in played} == {level}, (level, {t.outcome.reward for t in played})
        assert all((t.end_reason == "agent_stop") == agent.replies for t in played)


def _calls(calls):
    return [format_tool_call(c["name"], c["arguments"]) for c in calls]


def _read_and_cancel(episode):
    order_id = episode.gold().tool_calls[0]["arguments"]["order_id"]
    return _calls([episode.gold().tool_calls[0], {"name": "cancel_pending_order",
                                                  "arguments": {"order_id": order_id, "reason": "no longer needed"}}])


@pytest.mark.parametrize("capability, difficulty, plan, most", [
    ("precondition", 1, _read_and_cancel, 0.5),  # acts without checking: every forbidden task fails
    ("precondition", 1, lambda e: _calls(e.gold().tool_calls[:1]), 0.5),  # refuses every request
    ("multi_step", 0, lambda e: _calls(e.gold().tool_calls[:2]), 0.0),  # does only the first request
    ("error_recovery", 0, lambda e: _calls([dict(e.scenario.prefilled[0])] * 2), 0.0),  # repeats the failing call
    ("communication", 2, lambda e: _calls(e.gold().tool_calls), 0.0),  # reads, but states no fact
    ("structured_data", 1, lambda e: _calls([{"name": "cancel_pending_order", "arguments": {  # takes the first order
        "order_id": e.scenario.prefilled[2]["arguments"]["order_id"], **{
            k: v for k, v in e.gold().tool_calls[0]["arguments"].items() if k == "reason"}}}]), 0.5),
])
def test_an_agent_without_the_capability_fails_where_it_is_needed(capability, difficulty, plan, most):
    env = _env(capability, difficulty=difficulty)
    played = _play(env, PlannedAgent(plan, final="Done, as you asked."), env.tasks("train", TASKS))
    success = sum(t.outcome.success for t in played) / len(played)
    assert success <= most, success


@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_tasks_are_deterministic_per_seed_with_disjoint_splits_and_new_customers(capability):
    first, again, other_seed = (_env(capability, difficulty=2), _env(capability, difficulty=2),
                                _env(capability, difficulty=2, seed=1))
    tickets = lambda env, split: [env.scenario(t).ticket for t in env.tasks(split, TASKS)]
    assert tickets(first, "train") == tickets(again, "train")
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
    with pytest.raises(ValueError, match="difficulty = 7 is out of range for tool_calling: 0 to 2"):
        _env(difficulty=7)
    with pytest.raises(ValueError, match=r"cut_share = 1.5 is invalid; it must be a number in \[0, 1\]"):
        _env(cut_share=1.5)
    with pytest.raises(ValueError, match="unknown split"):
        CapabilityEnvironment(CAPABILITIES["tool_calling"]).tasks("test")
