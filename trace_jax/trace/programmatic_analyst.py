"""The programmatic analyst, stage 1's offline default: a fixed dictionary of capabilities, each with a
deterministic labeller over the trajectory and the evaluator's diagnostics.

The dictionary holds the paper's four τ² capabilities (tool calling, structured data,
multi-step, precondition) and two more that retail trajectories show (communication of
the facts asked for, recovery from errors). A labeller compares the agent's calls with the
task's gold calls, reads the results the agent got (tool errors, writes rejected by the
order's state) and the facts missing from its reply. As the authors advise their analysts,
a failure where the capability was exercised but something else went wrong is PRESENT.
The labels do not change between runs, so the K-of-N runs are bootstrap resamples.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from trace_jax.envs.base import END_MAX_ERRORS, END_MAX_TURNS, NORMAL_ENDS
from trace_jax.trace.analyst import LACKING, NA, PRESENT, CapabilityCard, Label, Labelling
from trace_jax.trace.trajectories import AgentCall, ScoredTrajectory, call_text

IDENTIFY_TOOLS = ("find_user_id_by_email", "find_user_id_by_name_zip")  # τ² retail's authentication


def _same(a: object, b: object) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _made(t: ScoredTrajectory, gold: dict) -> bool:
    return any(c.name == gold["name"] and _same(c.arguments, gold["arguments"]) for c in t.calls)


def _called(t: ScoredTrajectory, name: str) -> bool:
    return any(c.name == name for c in t.calls)


def _leaves(value: object) -> list[str]:
    """The string values inside an argument (lists and objects flattened)."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in _leaves(v)]
    if isinstance(value, list):
        return [s for v in value for s in _leaves(v)]
    return [str(value)] if isinstance(value, str) else []


class ProgrammaticAnalyst:
    """Labels retail trajectories (the embedded environment's or τ²'s) with the fixed dictionary."""

    deterministic = True

    def __init__(self, write_tools: Sequence[str], tools: Sequence[dict]):
        """`write_tools`: the tools that change the DB; `tools`: the schemas offered to the agent (a value
        they spell out, like the reason "no longer needed", is mapped from the ticket, not read from a result)."""
        self.write_tools = frozenset(write_tools)
        self._schema_text = json.dumps(list(tools)).lower()
        self._labellers: dict[str, Callable[[ScoredTrajectory], Label]] = {
            "tool_calling": self._tool_calling,
            "structured_data": self._structured_data,
            "multi_step": self._multi_step,
            "precondition": self._precondition,
            "communication": self._communication,
            "error_recovery": self._error_recovery,
        }

    def discover(self, trajectories: Sequence[ScoredTrajectory]) -> list[CapabilityCard]:
        """The fixed dictionary (the trajectories do not change it)."""
        return list(CARDS)

    def label(
        self, trajectories: Sequence[ScoredTrajectory], cards: Sequence[CapabilityCard], attempt: int
    ) -> Labelling:
        """Every card's label on every trajectory (the same for every attempt)."""
        unknown = [c.name for c in cards if c.name not in self._labellers]
        if unknown:
            raise ValueError(
                f"the programmatic analyst has no labeller for {unknown}; it labels {sorted(self._labellers)}"
            )
        return {card.name: {t.id: self._labellers[card.name](t) for t in trajectories} for card in cards}

    def _tool_calling(self, t: ScoredTrajectory) -> Label:
        if not t.gold.tool_calls:
            return Label(NA, "the task needs no tool call")
        if t.format_errors:
            return Label(LACKING, f"malformed or invalid call: {t.format_errors[0][:160]}")
        gold_writes = {g["name"] for g in t.gold.tool_calls if g["name"] in self.write_tools}
        other = next((c for c in t.calls if c.name in self.write_tools and c.name not in gold_writes), None)
        if gold_writes and other is not None:
            return Label(LACKING, f"called {other} where the task needs {sorted(gold_writes)}")
        for gold in t.gold.tool_calls:
            if _called(t, gold["name"]) and not _made(t, gold):
                made = next(c for c in t.calls if c.name == gold["name"])
                return Label(LACKING, f"called {made} but the task needs {call_text(**gold)}")
        wrong = [c for c in t.calls if c.failed and not any(c.name == g["name"] for g in t.gold.tool_calls)]
        if wrong:
            return Label(
                LACKING, f"called a tool the task does not need, which failed: {wrong[0]} -> {wrong[0].result[:80]}"
            )
        return Label(PRESENT, "every call well-formed; each gold tool it called got the gold arguments")

    def _derived(self, t: ScoredTrajectory) -> tuple[list[tuple[dict, str]], list[str]]:
        """The gold calls' argument values and the facts that neither the ticket nor the tool schemas
        state: the agent has to read them from tool results."""

        def derived(value: str) -> bool:
            return value.lower() not in t.ticket.lower() and value.lower() not in self._schema_text

        values = [(g, v) for g in t.gold.tool_calls for v in _leaves(g["arguments"]) if derived(v)]
        return values, [f for f in t.gold.facts if derived(f)]

    def _structured_data(self, t: ScoredTrajectory) -> Label:
        values, facts = self._derived(t)
        if not values and not facts:
            return Label(NA, "every value the task needs is in the ticket")
        for gold, value in values:
            if _called(t, gold["name"]) and not _made(t, gold):
                made = next(c for c in t.calls if c.name == gold["name"])
                return Label(
                    LACKING, f"{made} does not carry {value!r} from the tool results (gold {call_text(**gold)})"
                )
        seen = " ".join(c.result for c in t.calls if not c.failed).lower()
        missed = [f for f in facts if f in (t.info.get("failed_communicate") or ()) and f.lower() in seen]
        if missed:
            return Label(LACKING, f"a tool result showed {missed} but the reply did not state it")
        return Label(PRESENT, "the values read from tool results were used and reported correctly")

    def _multi_step(self, t: ScoredTrajectory) -> Label:
        if len(t.gold.tool_calls) + bool(t.gold.facts) < 2:
            return Label(NA, "the task is a single step")
        if t.end_reason == END_MAX_TURNS:
            return Label(LACKING, f"ran out of turns after {len(t.calls)} calls")
        missing = [g["name"] for g in t.gold.tool_calls if not _called(t, g["name"])]
        if missing and t.end_reason in NORMAL_ENDS:
            return Label(LACKING, f"stopped without ever calling {missing}")
        return Label(PRESENT, "went through every step the task needs")

    def _precondition(self, t: ScoredTrajectory) -> Label:
        writes = [c for c in t.calls if c.name in self.write_tools]
        gold_writes = {g["name"] for g in t.gold.tool_calls if g["name"] in self.write_tools}
        if not writes and not gold_writes:
            return Label(NA, "neither the task nor the agent writes")
        for write in writes:
            before = [c for c in t.calls if c.turn < write.turn and not c.failed]
            order = write.arguments.get("order_id")
            if not gold_writes:
                return Label(LACKING, f"made {write}, which the task's state or policy does not allow")
            if write.failed:
                return Label(LACKING, f"{write} was rejected: {write.result[:100]}")
            if not any(c.name in IDENTIFY_TOOLS for c in before):
                return Label(LACKING, f"{write} came before the customer was identified")
            if order is not None and not any(c.arguments.get("order_id") == order for c in before):
                return Label(LACKING, f"{write} came before order {order} was read")
        if not writes:
            return Label(PRESENT, "made no write (so none against a precondition)")
        return Label(PRESENT, "each write came after identifying the customer and reading its order")

    def _communication(self, t: ScoredTrajectory) -> Label:
        if not t.gold.facts:
            return Label(NA, "the task asks for no fact")
        missing = t.info.get("failed_communicate") or []
        if t.end_reason in NORMAL_ENDS and missing:
            return Label(LACKING, f"the final reply did not state {missing}")
        return Label(PRESENT, "the reply stated what was asked (or the episode never reached one)")

    def _error_recovery(self, t: ScoredTrajectory) -> Label:
        failed = [c for c in t.calls if c.failed]
        if not failed and not t.format_errors:
            return Label(NA, "no error to recover from")
        if t.end_reason == END_MAX_ERRORS:
            return Label(
                LACKING, f"ended after too many errors ({len(failed)} failed calls, {len(t.format_errors)} malformed)"
            )
        repeated = next((b for a, b in zip(t.calls, t.calls[1:]) if a.failed and _is_repeat(a, b)), None)
        if repeated is not None:
            return Label(LACKING, f"repeated a failing call: {repeated}")
        return Label(PRESENT, "changed course after each error")


def _is_repeat(a: AgentCall, b: AgentCall) -> bool:
    return a.name == b.name and _same(a.arguments, b.arguments)


CARDS = (
    CapabilityCard(
        "tool_calling",
        "Makes well-formed calls to the right tool with exactly the right arguments.",
        "Malformed call blocks, a needed tool called with wrong arguments, or a failing call to a "
        "tool the task does not need.",
    ),
    CapabilityCard(
        "structured_data",
        "Reads the values a step needs (user ids, item ids, payment methods, "
        "addresses, statuses, amounts) out of earlier tool results and uses or reports them exactly.",
        "A call carries a wrong or invented value where a tool result held the right one, or a "
        "fact shown in a tool result is not reported.",
    ),
    CapabilityCard(
        "multi_step",
        "Carries a task through every step it needs (identify, look up, act, report) "
        "without stopping early or looping.",
        "Stops before making a call the task needs, or runs out of turns.",
    ),
    CapabilityCard(
        "precondition",
        "Checks what the policy requires before a write: identifies the customer, "
        "reads the order and its status, and does not act when a precondition fails.",
        "A write before identification or before reading the order, a write the order's state "
        "or the policy forbids, or a write the system rejects.",
    ),
    CapabilityCard(
        "communication",
        "States in the final reply the facts the customer asked for, or why a request cannot be done.",
        "The final reply leaves out a required fact.",
    ),
    CapabilityCard(
        "error_recovery",
        "After a tool error, corrects the call or changes approach.",
        "Repeats a failing call or ends the episode with too many errors.",
    ),
)
