"""Scripted actors for conformance checks and baselines: the gold agent, planned agents, the noop agent,
scripted users.

They speak through the same rollout engine and evaluation path as the model, as raw
assistant text (tool calls in the project's `<tool_call>` format), so a gold run tests
parsing, tool execution, episode ends and scoring together.
"""

from __future__ import annotations

import re

from trace_jax.envs.base import Episode
from trace_jax.tool_calls import format_tool_call

USER_STOP = "###STOP###"
REQUEST = "Hi, I need help with my request."
USER_DONE = "Done."
_SCENARIO = re.compile(r"<scenario>\s*(.*?)\s*</scenario>", re.DOTALL)  # τ²'s user-simulator prompt


def _by_user(call: dict) -> bool:
    """Whether a gold call is the user's to make (telecom's dual control); calls name no requestor elsewhere."""
    return call.get("requestor", "assistant") == "user"


class GoldAgent:
    """Replays the task's gold tool calls one per turn, then states its required facts in one text turn.

    A run of consecutive user-side gold calls (telecom) is one text turn asking the user to make them;
    `ScriptedUser(user_actions=True)` makes them on its next turns."""

    def __init__(self):
        self._next: dict[int, int] = {}  # id(episode) -> index of its next gold call

    def reply(self, episode: Episode) -> str:
        """The next turn for `episode` (after the facts, each further turn repeats them)."""
        gold = episode.gold()
        calls = gold.tool_calls
        at = self._next.get(id(episode), 0)
        if at < len(calls) and _by_user(calls[at]):
            end = at
            while end < len(calls) and _by_user(calls[end]):
                end += 1
            self._next[id(episode)] = end
            return "Please do this on your phone: " + ", ".join(c["name"] for c in calls[at:end]) + "."
        if at < len(calls):
            self._next[id(episode)] = at + 1
            return format_tool_call(calls[at]["name"], calls[at]["arguments"])
        return "Here is what I found: " + "; ".join(gold.facts) if gold.facts else "Your request is complete."

    def forget(self, episode: Episode) -> None:
        """Drops the episode's turn counter once it has ended."""
        self._next.pop(id(episode), None)


class PlannedAgent:
    """Plays, per episode, the turns `plan(episode)` returns (raw assistant texts), then `final` on every
    further turn: an agent with a known behaviour (a flaw, a shortcut) for tests and checks."""

    def __init__(self, plan, final: str = "Done."):
        self.plan, self.final, self._turns = plan, final, {}

    def reply(self, episode: Episode) -> str:
        turns = self._turns.setdefault(id(episode), list(self.plan(episode)))
        return turns.pop(0) if turns else self.final

    def forget(self, episode: Episode) -> None:
        self._turns.pop(id(episode), None)


class NoopAgent:
    """Does nothing: every turn is an empty text turn."""

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


class ScriptedUser:
    """The user for scripted agents. Where the conversation opens with the agent's words (τ²'s
    greeting), its first turn states the request: the task's scenario from the user-simulator
    prompt (or a fixed sentence). With `user_actions`, it then makes the task's user-side gold
    calls (telecom), each run of them one call per turn followed by "Done.", on its turns after
    the agent's text turns, in order (as `GoldAgent` asks for them). Its every further turn, which
    follows an agent text turn, is ###STOP###, so every conversation ends after finitely many turns.
    """

    def __init__(self, user_actions: bool = False):
        self.user_actions = user_actions
        self._plans: dict[int, list[str]] = {}  # id(episode) -> its remaining turns before the stop

    def reply(self, episode: Episode) -> str:
        if id(episode) not in self._plans:
            self._plans[id(episode)] = self._plan(episode)
        plan = self._plans[id(episode)]
        return plan.pop(0) if plan else USER_STOP

    def _plan(self, episode: Episode) -> list[str]:
        plan = []
        opening = episode.user_simulator_messages() or []
        if opening and opening[-1]["role"] == "user":  # the agent spoke last (as "user" to the simulator)
            scenario = _SCENARIO.search(str(opening[0].get("content", "")))
            plan.append(f"{REQUEST}\n\n{scenario.group(1)}" if scenario else REQUEST)
        if self.user_actions:
            calls = episode.gold().tool_calls
            for i, call in enumerate(calls):
                if _by_user(call):
                    plan.append(format_tool_call(call["name"], call["arguments"]))
                    if i + 1 == len(calls) or not _by_user(calls[i + 1]):
                        plan.append(USER_DONE)
        return plan

    def forget(self, episode: Episode) -> None:
        """Drops the episode's remaining turns once it has ended."""
        self._plans.pop(id(episode), None)
