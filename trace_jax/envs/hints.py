"""Task hints: guidance for one task, written from its gold solution, that a share of training episodes
carries in its system prompt (TRACE's hints; the learner removes them before the gradient).

A hint names the calls the task still needs and, for each argument, where its value is on the page:
the ticket, or the result of a named call (one already in the conversation or one the agent makes
first); a value found nowhere is worked out from the ticket's words (an enum such as a cancel reason).
An exact hint spells the calls out with their arguments, and the facts the final reply must state:
the most scaffolded guidance there is, for an agent that never finds the calls on its own. Hints
never change the task, its tools or its reward.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from trace_jax.envs.base import Call


@dataclasses.dataclass(frozen=True)
class Source:
    """A text on the page a value can be copied from, and how a hint names it."""

    label: str  # "the ticket", "the result of get_order_details above", ...
    text: str


def _pieces(value) -> list[str]:
    """The strings a value is written as: itself, or each element of a list."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v if isinstance(v, str) else json.dumps(v) for v in values]


def value_source(value, sources: Sequence[Source]) -> str | None:
    """The label of the first source holding every piece of `value`, or None."""
    pieces = [p for p in _pieces(value) if p]
    for source in sources:
        if pieces and all(p in source.text for p in pieces):
            return source.label
    return None


def argument_guide(name: str, value, sources: Sequence[Source]) -> str:
    """Where argument `name` of a call comes from, in words."""
    if value in ("", [], None):
        return f"{name} empty"
    label = value_source(value, sources)
    return f"{name} from {label}" if label else f"{name} as the ticket's words mean it (one of the allowed values)"


def call_guide(call: Call, sources: Sequence[Source]) -> str:
    """One gold call in a hint: its tool and its arguments' sources."""
    arguments = ", ".join(argument_guide(k, v, sources) for k, v in call["arguments"].items())
    return f"call {call['name']} with {arguments}" if arguments else f"call {call['name']}"


def exact_call(call: Call) -> str:
    """One gold call written out: `name({"argument": value, ...})`."""
    return f"call {call['name']}({json.dumps(call['arguments'])})"


def task_hint(
    calls: Sequence[Call],
    sources: Sequence[Sequence[Source]],
    facts: Sequence[str],
    writes: frozenset[str],
    exact: bool = False,
    guidance: str = "",
) -> str:
    """The hint of a task whose remaining gold calls are `calls`; `sources[i]` are the texts call i can take its
    values from (the ticket, the results above it, the results of calls before it); `writes` names the tools that
    change state; `guidance` (a capability's general advice) opens the hint."""
    steps = [exact_call(c) if exact else call_guide(c, s) for c, s in zip(calls, sources)]
    parts = [guidance] if guidance else []
    if steps:
        parts.append("For this ticket: " + "; then ".join(steps) + ".")
    if not any(c["name"] in writes for c in calls):
        parts.append("This ticket needs no change to the account: make no write.")
    if exact and facts:
        parts.append("Your final message must state: " + "; ".join(facts) + ".")
    else:
        parts.append("Then write one final message to the customer with the outcome and what they asked for.")
    return " ".join(parts)


def replay_sources(environment, ticket: str, prefilled: Sequence[Call], calls: Sequence[Call]) -> list[list[Source]]:
    """What each of `calls` can take its values from: the ticket, the results of the `prefilled` calls (shown
    above the agent's first turn) and of the calls before it, each replayed in order on `environment` (a τ²
    environment holding the task's world, changed by the replay)."""
    from trace_jax.envs.tau2_bridge import execute  # τ² is an optional extra, needed only where hints are built

    sources = [Source("the ticket", ticket)]
    for i, call in enumerate(prefilled):
        sources.append(
            Source(f"the result of {call['name']} above", execute(environment, {"id": f"hint_{i}", **call})["content"])
        )
    per_call = []
    for i, call in enumerate(calls):
        per_call.append(list(sources))
        sources.append(
            Source(
                f"the result of your {call['name']} call",
                execute(environment, {"id": f"hint_gold_{i}", **call})["content"],
            )
        )
    return per_call


def hinted_trials(share: float, trials: int) -> int:
    """How many of a task's `trials` episodes (a GRPO group, a calibration's samples) carry the hint: the first
    share x trials, rounded half up."""
    return int(share * trials + 0.5)


def offers_hint(env, task) -> bool:
    """Whether `env` has a hint for `task` (environments that offer hints define `hint_for`)."""
    hint_for = getattr(env, "hint_for", None)
    return hint_for is not None and bool(hint_for(task))
