"""The curriculum that follows the agent: a scripted sequence of training rewards moves each part of a training
environment up a level after `patience` steps in a row above the gate, never past its top level, and back down
after as many below the lower gate, never below its starting level; the GRPO
job's environment source rebuilds its training tasks at the new level and keeps the held-out ones."""

import ml_collections
import pytest

from trace_jax.rl.curriculum import CurriculumConfig, climb, start_state, with_levels
from trace_jax.settings import from_config


def test_a_part_moves_up_after_patience_steps_above_the_gate_and_stops_at_its_top():
    config = CurriculumConfig(patience=2, upper=0.6)
    state = start_state([-2, -1])
    tops = [0, 0]
    moves = []
    # part 0: above, above (moves to -1), below, above, above (moves to 0), above, above (at its top: stays)
    # part 1: absent this step (keeps its streak), above, above (moves to 0), ...
    for rewards in [(0.7, None), (0.9, 0.8), (0.5, 0.7), (0.8, 0.1), (0.65, 0.9), (0.9, 0.9), (0.9, 0.9)]:
        state, moved = climb(state, list(rewards), tops, config)
        moves.append((state["levels"][:], moved))
    assert moves == [
        ([-2, -1], []),
        ([-1, -1], [0]),
        ([-1, 0], [1]),
        ([-1, 0], []),
        ([0, 0], [0]),
        ([0, 0], []),
        ([0, 0], []),
    ]
    off, _ = climb(start_state([0]), [1.0], [2], CurriculumConfig(patience=0))
    assert off["levels"] == [0] and off["streaks"] == [1]  # off: counts, never moves


def test_a_part_that_climbed_too_far_goes_back_down_but_never_below_where_it_started():
    config = CurriculumConfig(patience=2, upper=0.6, lower=0.3)
    state = start_state([-3])
    levels = []
    # above, above (climbs to -2), 0 and 0 there (back to -3), 0, 0 at its floor (stays), 0.4 holds, 0.1 counts anew
    for reward in (0.7, 0.8, 0.0, 0.0, 0.0, 0.0, 0.4, 0.1):
        state, moved = climb(state, [reward], [0], config)
        levels.append((state["levels"][0], moved))
    assert levels == [(-3, []), (-2, [0]), (-2, []), (-3, [0]), (-3, []), (-3, []), (-3, []), (-3, [])]
    assert state["streaks"] == [-1]
    # a state without floors takes its current levels as floors
    old, _ = climb({"levels": [-2], "streaks": [-1]}, [0.0], [0], config)
    assert old["levels"] == [-2] and old["floors"] == [-2]


def test_the_levels_go_into_the_environment_config_and_bad_settings_name_their_key():
    part = dict(name="capability", capability="tool_calling", seed=0, difficulty=-1, policy=False, variant="return")
    mixed = ml_collections.ConfigDict(dict(name="mixed", parts=[part, {**part, "variant": "address"}], split="train"))
    moved = with_levels(mixed, [0, -1])
    assert [p["difficulty"] for p in moved.parts] == [0, -1] and moved.split == "train"
    assert with_levels(ml_collections.ConfigDict(part), [0]).difficulty == 0
    with pytest.raises(ValueError, match="config.curriculum.patience = -1 is invalid"):
        from_config(CurriculumConfig, {"patience": -1}, "curriculum")
    with pytest.raises(ValueError, match="config.training.curriculum.upper = 2 is invalid"):
        from_config(CurriculumConfig, {"patience": 1, "upper": 2}, "training.curriculum")
    with pytest.raises(ValueError, match=r"config.curriculum.lower = 0.6 is invalid; it must be below upper = 0.5"):
        from_config(CurriculumConfig, {"patience": 1, "upper": 0.5, "lower": 0.6}, "curriculum")
    with pytest.raises(ValueError, match="needs a capability environment"):
        with_levels(ml_collections.ConfigDict(dict(name="embedded_retail")), [0])
    from configs import grpo_target_embedded
    from trace_jax.rl.trainer import validate_config

    config = grpo_target_embedded.get_config()  # the embedded retail target: no levels to climb
    config.curriculum = ml_collections.ConfigDict(dict(patience=1))
    with pytest.raises(ValueError, match=r"config.curriculum.patience = 1 is invalid; it must be 0 unless config.env"):
        validate_config(config)


def test_the_rollout_source_climbs_rebuilds_its_training_tasks_and_keeps_its_held_out_ones(tmp_path):
    from configs import grpo_env_tiny
    from trace_jax.rl.batching import StepRollouts
    from trace_jax.rl.environment_rollouts import EnvironmentRollouts
    from trace_jax.rl.trainer import validate_config

    config = grpo_env_tiny.get_config()
    config.env.update(capability="tool_calling", difficulty=-1, variant="return")
    config.curriculum = ml_collections.ConfigDict(dict(patience=1, upper=0.6))
    source = EnvironmentRollouts(validate_config(config), tokenizer=None, num_train_tasks=4, workdir=tmp_path)
    heldout = list(source.heldout)
    tasks = source.train_tasks[:2]
    done = StepRollouts([], None, None, {}, [{"task_id": t.task_id, "reward": 1.0} for t in tasks])
    assert source.follow(done) == {"curriculum/level_0": 0.0}
    assert all("/0/return/" in t.task_id for t in source.train_tasks) and source.heldout == heldout
    assert source.follow(done) == {"curriculum/level_0": 0.0}  # at the family's top level
    resumed = EnvironmentRollouts(validate_config(config), tokenizer=None, num_train_tasks=4, workdir=tmp_path)
    resumed.restore({"curriculum": source.curriculum_state})
    assert [t.task_id for t in resumed.train_tasks] == [t.task_id for t in source.train_tasks]
