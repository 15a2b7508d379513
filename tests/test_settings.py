"""Typed settings from config blocks: every key checked in one place, errors naming the user's key, defaults that
the command line can override."""

import dataclasses
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from trace_jax.baselines.experiment import ExperimentSettings, OracleSettings
from trace_jax.baselines.gepa import GepaSettings
from trace_jax.settings import Invalid, defaults, from_config, positive_int, setting


@dataclasses.dataclass(frozen=True)
class Inner:
    low: int = setting(1, "an int >= 1", positive_int)
    high: int = setting(4, "an int >= 1", positive_int)

    def __post_init__(self):
        if self.high < self.low:
            raise Invalid("high", f"an int >= low = {self.low}")


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    names: tuple[str, ...] = setting(("a",), "a tuple of names", lambda v: isinstance(v, tuple))


def test_a_block_builds_its_typed_settings_with_nested_blocks_and_lists_as_tuples():
    config = defaults(Outer)
    config.names = ["a", "b"]  # a list from a config file is taken as the tuple the field declares
    assert from_config(Outer, config, "outer") == Outer(Inner(1, 4), ("a", "b"))


def test_a_missing_or_invalid_key_fails_naming_it_and_what_it_must_be():
    config = defaults(Outer)
    config.inner.low = 0
    with pytest.raises(ValueError, match=r"^config\.outer\.inner\.low = 0 is invalid; it must be an int >= 1$"):
        from_config(Outer, config, "outer")
    config.inner.low = 5  # valid alone, not beside high = 4
    with pytest.raises(ValueError, match=r"^config\.outer\.inner\.high = 4 is invalid; it must be an int >= low = 5$"):
        from_config(Outer, config, "outer")
    del config.inner["high"]
    with pytest.raises(ValueError, match=r"^config\.outer\.inner\.high is missing; it must be an int >= 1$"):
        from_config(Outer, config, "outer")
    with pytest.raises(ValueError, match=r"^config\.inner is missing"):  # the config itself: key ""
        from_config(Outer, {"names": ()}, "")


def test_a_field_defaulting_to_none_can_be_set_from_the_command_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog", "--config.num_tasks=12"])  # where config_flags finds overrides
    values = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", defaults(OracleSettings), flag_values=values)
    values(sys.argv)
    assert from_config(OracleSettings, values.config, "oracle").num_tasks == 12
    assert from_config(OracleSettings, defaults(OracleSettings), "oracle").num_tasks is None


def test_the_experiments_own_keys_are_named_from_the_config_root():
    config = {
        "grpo_target": {"split": "train"},
        "oracle": {"num_tasks": None},
        "gepa": dataclasses.asdict(GepaSettings()),
        "trace_run": "",
        "budget": None,
        "arms": ("oracle", "judge"),
    }
    with pytest.raises(ValueError, match=r"^config\.arms = \('oracle', 'judge'\) is invalid; it must be a subset"):
        from_config(ExperimentSettings, config, "")


def test_a_message_naming_a_flag_names_the_blocks_own_key():
    from trace_jax.llm import LlmSettings

    for key in ("llm", "trace.llm"):
        with pytest.raises(ValueError, match=rf"^config\.{key}\.model = '' is invalid; .* --config\.{key}\.model="):
            from_config(LlmSettings, defaults(LlmSettings), key)
