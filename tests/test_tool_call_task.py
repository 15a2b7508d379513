"""Tests for the single-turn tool-call task: seeded generation, split disjointness, reward levels."""

from __future__ import annotations

import json
import random

import pytest

from trace_jax.tasks.tool_call_task import TOOLS, make_tasks, reward
from trace_jax.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, format_tool_call, tool_names

# Arguments whose values come from per-split pools (the rest are shared enums, sizes, times).
DISJOINT_ARGUMENTS = ("order_id", "city", "restaurant", "to", "email", "subject", "amount")


def _task(name: str):
    """The first train task that expects tool `name`."""
    return next(task for task in make_tasks("train", 200, seed=0) if task.expected_name == name)


def _call(name: str, arguments: dict) -> str:
    return format_tool_call(name, arguments)


def test_same_seed_same_tasks_and_seeds_differ():
    assert make_tasks("train", 50, seed=3) == make_tasks("train", 50, seed=3)
    assert make_tasks("heldout", 50, seed=3) == make_tasks("heldout", 50, seed=3)
    assert make_tasks("train", 50, seed=3) != make_tasks("train", 50, seed=4)
    assert make_tasks("train", 10, seed=3) == make_tasks("train", 50, seed=3)[:10]


def test_tasks_are_well_formed_and_cover_every_tool():
    tasks = make_tasks("train", 300, seed=0)
    assert {task.expected_name for task in tasks} == set(tool_names(TOOLS))
    assert len({task.task_id for task in tasks}) == len(tasks)
    for task in tasks:
        assert task.messages[0]["role"] == "system" and task.messages[-1]["role"] == "user"
        assert task.tools == TOOLS


def test_unknown_split_names_the_valid_ones():
    with pytest.raises(ValueError, match="train, heldout, heldout_phrasings"):
        make_tasks("test", 5, seed=0)


def _request_template(text: str, task) -> str:
    """The request with its slot values put back as placeholders (the reason as its phrase)."""
    for key, value in task.expected_arguments.items():
        text = text.replace(str(value), "{" + key + "}", 1)
    return text


@pytest.mark.parametrize("heldout_split, same_phrasings", [("heldout", True), ("heldout_phrasings", False)])
def test_train_and_heldout_are_disjoint(heldout_split, same_phrasings):
    train, heldout = make_tasks("train", 2000, seed=0), make_tasks(heldout_split, 2000, seed=0)
    assert not {t.messages[-1]["content"] for t in train} & {t.messages[-1]["content"] for t in heldout}
    for key in DISJOINT_ARGUMENTS:
        train_values = {t.expected_arguments[key] for t in train if key in t.expected_arguments}
        heldout_values = {t.expected_arguments[key] for t in heldout if key in t.expected_arguments}
        assert train_values and heldout_values, key
        assert not train_values & heldout_values, key
    # E-mail addresses differ in their local part, not only as whole strings.
    local = lambda tasks: (
        {t.expected_arguments.get("to", t.expected_arguments.get("email", "@")).split("@")[0] for t in tasks} - {""}
    )
    assert not local(train) & local(heldout)
    # Phrasings: "heldout" reuses the training wordings, "heldout_phrasings" shares none of them.
    shapes = lambda tasks: {
        _request_template(t.messages[-1]["content"], t)
        for t in tasks
        if t.expected_name in ("get_order_status", "send_email", "reset_password")
    }
    assert (shapes(heldout) <= shapes(train)) if same_phrasings else not shapes(heldout) & shapes(train)


@pytest.mark.parametrize("split", ["train", "heldout", "heldout_phrasings"])
def test_every_expected_call_round_trips_to_full_reward(split):
    for task in make_tasks(split, 200, seed=1):
        score, info = reward(task, _call(task.expected_name, task.expected_arguments))
        assert score == 1.0, (task, info)
        assert info["errors"] == ()


def test_reward_levels():
    task = _task("book_table")  # three arguments: restaurant, people, time
    args = task.expected_arguments
    cases = {
        "perfect": (_call("book_table", args), 1.0),
        "case and spacing": (_call("book_table", {**args, "restaurant": "  " + args["restaurant"].upper()}), 1.0),
        "number by value": (_call("book_table", {**args, "people": float(args["people"])}), 1.0),
        "number as string": (_call("book_table", {**args, "people": str(args["people"])}), 0.5 + 0.5 * 2 / 3),
        "one wrong argument": (_call("book_table", {**args, "time": "03:15"}), 0.5 + 0.5 * 2 / 3),
        "one missing argument": (
            _call("book_table", {k: v for k, v in args.items() if k != "time"}),
            0.5 + 0.5 * 2 / 3,
        ),
        "one extra argument": (_call("book_table", {**args, "notes": "window"}), 0.5 + 0.5 * 3 / 4),
        "right tool, no arguments": (_call("book_table", {}), 0.5),
        "wrong tool": (_call("send_email", {"to": "a@b.c", "subject": "x"}), 0.2),
        "unknown tool": (_call("reserve", args), 0.2),
        "broken JSON": (f'{TOOL_CALL_OPEN}\n{{"name": "book_table", "arguments": {{\n{TOOL_CALL_CLOSE}', 0.0),
        "no call": ("I have booked your table.", 0.0),
        "empty": ("", 0.0),
        "two correct calls": (_call("book_table", args) + "\n" + _call("book_table", args), 0.5),
        "correct then broken": (_call("book_table", args) + f"\n{TOOL_CALL_OPEN}{{oops", 0.5),
        "wrong then correct": (_call("send_email", {"to": "a@b.c", "subject": "x"}) + _call("book_table", args), 0.2),
        "prose around": (f"Sure, booking now.\n{_call('book_table', args)}\nDone!", 1.0),
        "unclosed block": (_call("book_table", args).removesuffix(TOOL_CALL_CLOSE), 1.0),
    }
    for label, (text, expected) in cases.items():
        assert reward(task, text)[0] == pytest.approx(expected), label


def test_diagnostics():
    task = _task("cancel_order")
    _, info = reward(task, _call("cancel_order", {**task.expected_arguments, "reason": "bored"}))
    assert info["format_ok"] and info["name_ok"] and info["num_calls"] == 1
    assert info["args_fraction"] == pytest.approx(0.5)
    assert any("reason" in error for error in info["errors"])  # the schema problem is reported
    _, info = reward(task, f"{TOOL_CALL_OPEN}not json{TOOL_CALL_CLOSE}")
    assert not info["format_ok"] and not info["name_ok"] and info["num_calls"] == 1
    assert "not valid JSON" in info["errors"][0]


def test_reward_stays_in_unit_interval_under_fuzz():
    rng = random.Random(0)
    tasks = make_tasks("heldout", 20, seed=0)
    pieces = [
        TOOL_CALL_OPEN,
        TOOL_CALL_CLOSE,
        "{",
        "}",
        '"name"',
        '"arguments"',
        ":",
        ",",
        '"',
        "null",
        "1",
        "x",
        " ",
        "\n",
        "[",
        "]",
    ]
    for task in tasks:
        correct = _call(task.expected_name, task.expected_arguments)
        pieces_here = pieces + [json.dumps(task.expected_name), correct]
        for _ in range(100):
            text = "".join(rng.choice(pieces_here) for _ in range(rng.randint(0, 30)))
            score, info = reward(task, text)
            assert 0.0 <= score <= 1.0
            assert 0.0 <= info["args_fraction"] <= 1.0
