"""Config validation shared by the jobs: every setting is checked at start and a failure names its key."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

Check = tuple[str, Callable[[Any], bool], str]  # (dotted key, predicate, what the value must be)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_config(config: ml_collections.ConfigDict, checks: Sequence[Check]) -> None:
    """Raises ValueError naming the first missing or invalid key."""
    for key, ok, expected in checks:
        node = config
        try:
            for part in key.split("."):
                node = node[part]
        except (KeyError, AttributeError):
            raise ValueError(f"config.{key} is missing; it must be {expected}") from None
        if not ok(node):
            raise ValueError(f"config.{key} = {node!r} is invalid; it must be {expected}")
