"""The environment wrappers: guidance at the end of the agent's system prompt (GEPA's candidates, and its texts on
the target) and several environments played as one (the mixed-capability arm), each through the rollout engine
with the gold agent and from an environment config."""

import jax
import ml_collections
import pytest
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it

from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs import make_environment
from trace_jax.envs.capability import CAPABILITIES, CapabilityEnvironment
from trace_jax.envs.guided import GuidedEnvironment
from trace_jax.envs.mixed import MixedEnvironment
from trace_jax.envs.scripted import GoldAgent, ScriptedUser


def _env(capability: str = "tool_calling") -> CapabilityEnvironment:
    return CapabilityEnvironment(CAPABILITIES[capability], policy=False)


def _capability_config(capability: str, **extra) -> dict:
    return dict(name="capability", capability=capability, seed=0, difficulty=0, policy=False, **extra)


def _play_gold(env, tasks):
    engine = RolloutEngine(env, agent=GoldAgent(), user=ScriptedUser(), config=RolloutConfig(batch_size=4))
    return engine.run([EpisodeSpec(t) for t in tasks], key=jax.random.key(0))


def test_a_guided_episode_differs_from_its_plain_twin_by_the_guidance_after_the_system_prompt():
    env, text = _env(), "Check the order before any write."
    guided = GuidedEnvironment(env, text)
    for task in env.tasks("train", 3):
        plain, twin = env.episode(task), guided.episode(task)
        opening, guided_opening = plain.reset(), twin.reset()
        assert guided_opening[0]["content"] == opening[0]["content"] + "\n\n" + text
        assert guided_opening[1:] == opening[1:] and twin.tools == plain.tools and twin.gold() == plain.gold()
    trajectories = _play_gold(guided, env.tasks("train", 3))
    assert all(t.outcome.reward == 1.0 and t.messages[0]["content"].endswith(text) for t in trajectories)


def test_an_environment_config_takes_a_guidance_text_and_names_a_bad_one():
    config = ml_collections.ConfigDict(_capability_config("tool_calling", guidance="Be precise."))
    env = make_environment(config)
    assert env.episode(env.tasks("train", 1)[0]).reset()[0]["content"].endswith("\n\nBe precise.")
    config.guidance = ""
    assert isinstance(make_environment(config), CapabilityEnvironment)  # no guidance: the environment itself
    with pytest.raises(ValueError, match=r"config.env.guidance = 3 is invalid"):
        make_environment(ml_collections.ConfigDict({**config.to_dict(), "guidance": 3}))


def test_a_mixed_environment_takes_its_parts_tasks_in_turn_and_plays_each_in_its_own_part():
    parts = [_env("tool_calling"), _env("precondition"), _env("communication")]
    mixed = MixedEnvironment(parts)
    tasks = mixed.tasks("train", 7)
    assert [t.task_id for t in tasks] == [part.tasks("train", 3)[i].task_id for i in range(3) for part in parts][:7]
    for task in tasks:
        owner = next(part for part in parts if task in part.tasks("train", 3))
        assert mixed.episode(task).reset() == owner.episode(task).reset()
        assert mixed.hint_for(task) == owner.hint_for(task)
        assert mixed.episode(task, hint=True).reset()[0]["content"].endswith(owner.hint_for(task))
    assert all(t.outcome.reward == 1.0 for t in _play_gold(mixed, tasks))
    with pytest.raises(ValueError, match="did not come from this environment's tasks"):
        MixedEnvironment(parts).episode(tasks[0])


def test_a_mixed_environment_from_its_config_and_its_errors():
    config = ml_collections.ConfigDict(
        dict(name="mixed", parts=[_capability_config("tool_calling"), _capability_config("structured_data")])
    )
    env = make_environment(config)
    assert [t.task_id.split("/")[1] for t in env.tasks("heldout", 4)] == ["tool_calling", "structured_data"] * 2
    with pytest.raises(ValueError, match="occurs in two parts"):
        MixedEnvironment([_env(), _env()]).tasks("train", 2)
    with pytest.raises(ValueError, match="config.env.parts is missing or empty"):
        make_environment(ml_collections.ConfigDict(dict(name="mixed", parts=[])))
