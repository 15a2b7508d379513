"""Fuzzing the rollout engine: hundreds of random and adversarial assistant turns never crash it.

A scripted agent sends broken JSON, unknown tools, wrong argument types, huge strings,
stop strings and tags in odd places, through the embedded retail environment (τ²'s real
retail tools and evaluator). Every turn must yield observations for the agent or a clean
episode end with a recorded reason.
"""

from __future__ import annotations

import json
import random

import jax
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it

from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs import base
from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.envs.scripted import StoppingUser
from trace_jax.tool_calls import format_tool_call

TURNS = 600
# Turns that end a solo episode (plain text) are drawn rarely, so episodes run long: τ²'s evaluator
# copies and hashes the retail DB twice per episode (~0.3 s), which short episodes would pay per few turns.
_KIND_WEIGHTS = (1, 10, 10, 10, 10, 10, 10, 1, 1)

_JUNK = [
    "",
    " ",
    "{",
    "}",
    "null",
    "[]",
    '"',
    "\\",
    "\\u0000",
    "\x00",
    "é漢🙂",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "<|im_end|>",
    "<|im_start|>assistant",
    "###STOP###",
    "###TRANSFER###",
    "###OUT-OF-SCOPE###",
    "NaN",
    "Infinity",
    "1e999",
    "-0",
    "true",
    '{"name": ',
    '"arguments": {',
    "x" * 5000,
]


class FuzzAgent:
    """Writes seeded random, mostly malformed, assistant turns."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def reply(self, episode: base.Episode) -> str:
        rng, names = self.rng, [t["function"]["name"] for t in episode.tools]
        kind = rng.choices(range(len(_KIND_WEIGHTS)), _KIND_WEIGHTS)[0]
        if kind == 0:  # junk
            return "".join(rng.choice(_JUNK) for _ in range(rng.randint(1, 6)))
        if kind == 1:  # a truncated block
            text = format_tool_call(rng.choice(names), {"order_id": "#W0000000"})
            return text[: rng.randrange(len(text))]
        if kind == 2:  # an unknown tool
            return format_tool_call(rng.choice(["rm_rf", "", "get_order_details ", "GET_USER"]), {})
        if kind == 3:  # a real tool with arguments of the wrong types or names
            value = rng.choice([None, 1, -1.5, True, [], {}, "x" * rng.choice([0, 10, 100000]), ["#W1"], {"a": 1}])
            return format_tool_call(rng.choice(names), {rng.choice(["order_id", "user_id", "email", "zzz"]): value})
        if kind == 4:  # invalid JSON inside a block
            body = rng.choice(
                [
                    '{"name": "x", "arguments": {',
                    "{'name': 'x'}",
                    '{"name": 1}',
                    "[1, 2]",
                    '{"name": "x", "arguments": "not json"}',
                    '{"arguments": {}}',
                    "{" * 500,
                ]
            )
            return f"<tool_call>\n{body}\n</tool_call>"
        if kind == 5:  # many blocks, some fine
            return "\n".join(self.reply(episode) for _ in range(rng.randint(2, 4)))
        if kind == 6:  # stop strings and tags inside argument strings
            return format_tool_call(rng.choice(names), {"order_id": rng.choice(_JUNK[12:20])})
        if kind == 7:  # plain text with stop strings in odd places
            return rng.choice(["Done. ###STOP###", "###STOP", "</tool_call> ok", "<tool_response>{}</tool_response>"])
        return json.dumps({"name": rng.choice(names), "arguments": {}})  # a call without the tags: text

    def forget(self, episode: base.Episode) -> None:
        pass


def _check(trajectories: list) -> int:
    """Asserts every assistant turn got observations or ended its episode; returns the number of turns."""
    turns = 0
    allowed_ends = {base.END_AGENT_STOP, base.END_USER_STOP, base.END_MAX_TURNS, base.END_MAX_ERRORS}
    for trajectory in trajectories:
        assert trajectory.end_reason in allowed_ends, trajectory.end_reason
        assert 0.0 <= trajectory.outcome.reward <= 1.0
        messages = trajectory.messages
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < trajectory_first_agent_turn(messages):
                continue
            turns += 1
            following = messages[i + 1 : i + 2]
            assert following or i == len(messages) - 1
            if following:
                assert following[0]["role"] in ("tool", "user")
                assert not str(following[0]["content"]).startswith("Error: Error")  # each error is said once
        assert json.dumps(trajectory.record())  # episode logs can always be written
    return turns


def trajectory_first_agent_turn(messages: list[dict]) -> int:
    """Index of the first assistant message the agent wrote (τ² opens with a scripted greeting)."""
    return 2 if len(messages) > 1 and messages[1]["role"] == "assistant" else 0


def test_random_and_adversarial_turns_never_crash_the_engine():
    env = EmbeddedRetail(seed=0)
    config = RolloutConfig(max_turns=60, max_errors=40)
    engine = RolloutEngine(env, agent=FuzzAgent(seed=0), user=StoppingUser(), config=config)
    tasks, trajectories, turns = env.tasks("train", TURNS), [], 0
    while turns < TURNS:  # episodes end early on text turns, so play them in batches until enough turns
        batch = engine.run(
            [EpisodeSpec(task) for task in tasks[len(trajectories) : len(trajectories) + 64]],
            key=jax.random.key(len(trajectories)),
        )
        turns += _check(batch)
        trajectories += batch
    ends = {t.end_reason for t in trajectories}
    print(f"\n[fuzz] {len(trajectories)} episodes, {turns} agent turns, ends {sorted(ends)}")
    assert {base.END_MAX_ERRORS, base.END_AGENT_STOP} <= ends  # the error limit and text turns really end episodes
