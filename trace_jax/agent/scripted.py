"""Scripted actors for conformance checks and baselines: the gold agent, the noop agent, a user who stops.

They speak through the same rollout engine and evaluation path as the model, as raw
assistant text (tool calls in the project's `<tool_call>` format), so a gold run tests
parsing, tool execution, episode ends and scoring together.
"""

from __future__ import annotations

from trace_jax.agent.tool_calls import format_tool_call
from trace_jax.envs.base import Episode

USER_STOP = "###STOP###"


class GoldAgent:
    """Replays the task's gold tool calls one per turn, then states its required facts in one text turn."""

    def __init__(self):
        self._turns: dict[int, int] = {}

    def reply(self, episode: Episode) -> str:
        """The next turn for `episode` (after the facts, each further turn repeats them)."""
        gold = episode.gold()
        turn = self._turns.get(id(episode), 0)
        self._turns[id(episode)] = turn + 1
        if turn < len(gold.tool_calls):
            call = gold.tool_calls[turn]
            return format_tool_call(call["name"], call["arguments"])
        return "Here is what I found: " + "; ".join(gold.facts) if gold.facts else "Your request is complete."

    def forget(self, episode: Episode) -> None:
        """Drops the episode's turn counter once it has ended."""
        self._turns.pop(id(episode), None)


class NoopAgent:
    """Ends at once: one empty text turn."""

    def reply(self, episode: Episode) -> str:
        return ""

    def forget(self, episode: Episode) -> None:
        pass


class StoppingUser:
    """A user who ends the conversation whenever asked to speak."""

    def reply(self, episode: Episode) -> str:
        return USER_STOP

    def forget(self, episode: Episode) -> None:
        pass
