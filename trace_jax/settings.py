"""Typed settings: frozen dataclasses built once from an ml_collections config block at a job's edge.

Jobs keep ml_collections config files and absl flags; a job builds the settings of its blocks once at start, and
the library functions a block configures take its settings class instead of the untyped dict. Each field declares
what its value must be (`setting`), and a class's `__post_init__` checks values that depend on each other (raising
`Invalid`), so `from_config` validates a block in one place and a failure names the user's key
(`config.calibration.samples`), whichever job holds the block.
The field defaults are the block's defaults: `defaults(cls)` is the ConfigDict a config file starts from.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import ml_collections

T = TypeVar("T")
REQUIRED = dataclasses.MISSING  # a `setting` default: the key has no default (its config file sets it)


class Invalid(ValueError):
    """A value wrong given the others, raised by a settings class's `__post_init__`: the field and what it must be."""

    def __init__(self, field: str, must_be: str):
        super().__init__(f"{field} is invalid; it must be {must_be}")
        self.field, self.must_be = field, must_be


def setting(default: Any, must_be: str, check: Callable[[Any], bool], *, optional: bool = False) -> Any:
    """A settings field: its default, what its value must be (said in errors; "{block}." there stands for the
    block's key) and the predicate that says so; an `optional` key may be left out of the block (its default then
    holds)."""
    return dataclasses.field(default=default, metadata={"must_be": must_be, "check": check, "optional": optional})


def positive_int(value: Any) -> bool:
    return is_int(value) and value >= 1


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def none_or(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """`check`, with None also accepted (a key whose None means "not set": all tasks, the other key's value)."""
    return lambda value: value is None or check(value)


def is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def non_negative_int(value: Any) -> bool:
    return is_int(value) and value >= 0


def non_negative_number(value: Any) -> bool:
    return number(value) and value >= 0


def is_dict(value: Any) -> bool:
    return isinstance(value, dict)


def positive_number(value: Any) -> bool:
    return number(value) and value > 0


def share(value: Any) -> bool:
    """A number in [0, 1]."""
    return number(value) and 0 <= value <= 1


def from_config(cls: type[T], block: ml_collections.ConfigDict | dict, key: str) -> T:
    """`cls` built from the config block `block` at dotted `key` ("" for the config itself), nested settings classes
    from its sub-blocks, lists as tuples and other sub-blocks as dicts. Every field must be present (unless
    optional) and valid, else ValueError naming `config.<key>.<field>`, the value written and what it must be.
    Keys the class does not declare are left to whoever reads them."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        name = f"config.{dotted(key, field.name)}"
        if not _has(block, field.name):
            if field.metadata.get("optional"):
                continue
            raise ValueError(f"{name} is missing; it must be {_must_be(cls, field, key)}")
        value = written = block[field.name]
        if dataclasses.is_dataclass(hints[field.name]):
            value = from_config(hints[field.name], value, dotted(key, field.name))
        elif isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, ml_collections.ConfigDict):  # a block no settings class types: read as a dict
            value = value.to_dict()
        if "check" in field.metadata and not field.metadata["check"](value):
            raise ValueError(f"{name} = {written!r} is invalid; it must be {_must_be(cls, field, key)}")
        values[field.name] = value
    try:
        return cls(**values)
    except Invalid as error:
        value = values.get(error.field, cls.__dataclass_fields__[error.field].default)
        raise ValueError(
            f"config.{dotted(key, error.field)} = {value!r} is invalid; it must be {error.must_be}"
        ) from None


def defaults(cls: type) -> ml_collections.ConfigDict:
    """The config block of `cls`'s defaults (a nested settings class's block within), for a config file to start
    from and override; a field whose default is None is a typed placeholder, which a flag such as
    `--config.x.y=3` can set."""
    hints = typing.get_type_hints(cls)
    block = {}
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            block[field.name] = defaults(hints[field.name])
        elif field.default is None:
            block[field.name] = ml_collections.config_dict.placeholder(_optional_type(hints[field.name]))
        else:
            block[field.name] = field.default
    return ml_collections.ConfigDict(block)


def _optional_type(hint: Any) -> type:
    """`int` of `int | None`."""
    kinds = [k for k in typing.get_args(hint) if k is not type(None)]
    if len(kinds) != 1:
        raise TypeError(f"a field defaulting to None must be typed `<type> | None`, not {hint}")
    return kinds[0]


def dotted(key: str, name: str) -> str:
    """The key `name` of the block at `key` ("" for the config itself), as errors name it after "config."."""
    return f"{key}.{name}" if key else name


def _has(block: Any, name: str) -> bool:
    try:
        return name in block
    except TypeError:
        return False


def _must_be(cls: type, field: dataclasses.Field, key: str) -> str:
    """What `field` must be, its "{block}." standing for the block's key (a message naming a flag)."""
    text = field.metadata.get("must_be") or f"a {cls.__name__}.{field.name} block"
    return text.replace("{block}.", f"{key}." if key else "")
