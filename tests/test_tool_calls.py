"""Tests for the Hermes/Qwen tool-call format: round trips, malformed blocks, schemas, fuzzing."""

from __future__ import annotations

import gc
import json
import random
import time

import pytest

from trace_jax.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedAssistant,
    ToolCall,
    format_tool_call,
    parse_assistant_output,
    render_tool_instructions,
    tool_names,
    validate_arguments,
)

HINT = 'Use <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Look up an order.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "description": "Like #W123."},
                    "verbose": {"type": "boolean"},
                },
                "required": ["order_id"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "exchange_items",
            "description": "Exchange items of an order.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string"},
                    "item_ids": {"type": "array", "items": {"type": "integer"}},
                    "reason": {"type": "string", "enum": ["size", "color"]},
                    "note": {"type": ["string", "null"]},
                },
                "required": ["order_id", "item_ids"],
            },
        },
    },
]


def block(body: str) -> str:
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def test_format_is_exact_hermes_text():
    assert format_tool_call("get_order", {"order_id": "#W123"}) == (
        '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W123"}}\n</tool_call>'
    )


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"order_id": "#W123"},
        {"city": "Zürich", "greeting": "こんにちは 👋", "rtl": "שלום", "ctrl": 'a\nb\t"c"\\d\x00'},
        {"nested": {"list": [1, 2.5, -3e10, True, False, None, {"deep": [[["x"]]]}]}, "empty": {"a": []}},
        {"tags": "</tool_call> and <tool_call> and <tool_call></tool_call>", "\\</tool_call>": "\\"},
    ],
)
def test_round_trip(arguments):
    parsed = parse_assistant_output(format_tool_call("do_thing", arguments))
    assert parsed == ParsedAssistant(content="", tool_calls=(ToolCall("do_thing", arguments, "call_0"),), errors=())


def _random_value(rng: random.Random, depth: int):
    alphabet = "ab <>/\\\"'{}[]:,\n\té中😀" + TOOL_CALL_OPEN + TOOL_CALL_CLOSE
    kind = rng.randrange(7 if depth < 4 else 5)
    if kind == 0:
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
    if kind == 1:
        return rng.randint(-(10**12), 10**12)
    if kind == 2:
        return rng.uniform(-1e6, 1e6)
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(_random_value(rng, 4)): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_random_round_trips_with_surrounding_text():
    rng = random.Random(0)
    for _ in range(200):
        calls = [
            (f"tool_{rng.randrange(5)}", {f"k{j}": _random_value(rng, 0) for j in range(rng.randrange(4))})
            for _ in range(3)
        ]
        text = "Thinking...\n" + "\n".join(format_tool_call(name, args) for name, args in calls)
        parsed = parse_assistant_output(text)
        assert parsed.errors == ()
        assert parsed.content == "Thinking..."
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
        assert [c.id for c in parsed.tool_calls] == ["call_0", "call_1", "call_2"]


def test_several_blocks_with_text_between_and_after():
    text = (
        "  I'll check.\n"
        + block('{"name": "a", "arguments": {"x": 1}}')
        + "\nthen\n"
        + block('{"name": "b", "arguments": {}}')
        + " done  "
    )
    parsed = parse_assistant_output(text)
    assert parsed.content == "I'll check.\nthen\ndone"
    assert parsed.tool_calls == (ToolCall("a", {"x": 1}, "call_0"), ToolCall("b", {}, "call_1"))
    assert parsed.errors == ()


def test_missing_close_tag_at_end_is_accepted():
    parsed = parse_assistant_output('Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": "y"}}\n')
    assert parsed.tool_calls == (ToolCall("a", {"x": "y"}, "call_0"),)
    assert parsed.content == "Sure."
    assert parsed.errors == ()


def test_missing_close_tag_before_next_block_ends_the_block():
    text = '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in parse_assistant_output(text).tool_calls] == ["a", "b"]


def test_stray_close_tag_stays_in_content():
    parsed = parse_assistant_output("oops </tool_call> text")
    assert parsed == ParsedAssistant(content="oops </tool_call> text", tool_calls=(), errors=())


def test_invalid_json_error_names_the_block_position_and_format():
    text = block('{"name": "a", "arguments": {}}') + block('{"name": "get_order" "arguments": {}}')
    parsed = parse_assistant_output(text)
    assert [c.name for c in parsed.tool_calls] == ["a"]
    assert parsed.errors == (f"Error: tool call 2 is not valid JSON: Expecting ',' delimiter at char 21. {HINT}",)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("", "Error: tool call 1 is empty."),
        ("  \n ", "Error: tool call 1 is empty."),
        ("[1, 2]", "Error: tool call 1 must be a JSON object, got array."),
        ('"get_order"', "Error: tool call 1 must be a JSON object, got string."),
        ("null", "Error: tool call 1 must be a JSON object, got null."),
        ('{"arguments": {}}', 'Error: tool call 1 needs a non-empty string "name".'),
        ('{"name": 3, "arguments": {}}', 'Error: tool call 1 needs a non-empty string "name".'),
        ('{"name": "", "arguments": {}}', 'Error: tool call 1 needs a non-empty string "name".'),
        ('{"name": "a", "arguments": [1]}', 'Error: tool call 1 (a): "arguments" must be a JSON object, got array.'),
        ('{"name": "a", "arguments": "[1]"}', 'Error: tool call 1 (a): "arguments" must be a JSON object, got array.'),
        ('{"name": "a", "arguments": "{x"}', 'Error: tool call 1 (a): "arguments" must be a JSON object, got string.'),
        ('{"name": "a", "parameters": 5}', 'Error: tool call 1 (a): "arguments" must be a JSON object, got integer.'),
        ('{"a": ' * 5000, "Error: tool call 1 is not valid JSON: nested too deeply."),
        ('{"name": "a", "arguments": {"n": ' + "7" * 5000 + "}}", "Error: tool call 1 is not valid JSON: Exceeds"),
    ],
)
def test_malformed_block_gives_specific_error(body, expected):
    parsed = parse_assistant_output("text " + block(body))
    assert parsed.tool_calls == ()
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith(expected)
    assert parsed.content == "text"


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"name": "a", "arguments": "{\\"x\\": [1, {}]}"}', {"x": [1, {}]}),
        ('{"name": "a"}', {}),
        ('{"name": "a", "arguments": null}', {}),
        ('{"name": "a", "parameters": {"x": 1}}', {"x": 1}),
        ('{"name": "a", "arguments": {"x": 1}, "parameters": {"x": 2}}', {"x": 1}),
        ('  \n {"name": "a", "arguments": {}, "id": "ignored"} \n ', {}),
    ],
)
def test_lenient_spellings_are_accepted(body, arguments):
    parsed = parse_assistant_output(block(body))
    assert parsed.errors == ()
    assert parsed.tool_calls == (ToolCall("a", arguments, "call_0"),)


def test_valid_calls_pass_schema_check():
    text = format_tool_call("get_order", {"order_id": "#W1", "verbose": True}) + format_tool_call(
        "exchange_items", {"order_id": "#W1", "item_ids": [1, 2.0], "reason": "size", "note": None, "extra": 1}
    )
    parsed = parse_assistant_output(text, TOOLS)
    assert parsed.errors == ()
    assert [c.name for c in parsed.tool_calls] == ["get_order", "exchange_items"]


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("refund", {}, "Error: tool call 1 uses unknown tool 'refund'. Available tools: get_order, exchange_items."),
        (
            "get_order",
            {},
            "Error: tool call 1 (get_order) has invalid arguments: missing required argument 'order_id'.",
        ),
        (
            "get_order",
            {"order_id": "#W1", "user": "x"},
            "Error: tool call 1 (get_order) has invalid arguments: "
            "unexpected argument 'user' (allowed: order_id, verbose).",
        ),
        (
            "get_order",
            {"order_id": 123, "verbose": "yes"},
            "Error: tool call 1 (get_order) has invalid arguments: "
            "argument 'order_id' must be string, got integer; argument 'verbose' must be boolean, got string.",
        ),
        (
            "exchange_items",
            {"order_id": "#W1", "item_ids": [1, "2", True], "reason": "price", "note": 5},
            "Error: tool call 1 (exchange_items) has invalid arguments: "
            "argument 'item_ids[1]' must be integer, got string; argument 'item_ids[2]' must be integer, got boolean; "
            'argument \'reason\' must be one of ["size", "color"], got "price"; '
            "argument 'note' must be string or null, got integer.",
        ),
    ],
)
def test_schema_violations_are_errors(name, arguments, expected):
    parsed = parse_assistant_output(format_tool_call(name, arguments), TOOLS)
    assert parsed.tool_calls == ()
    assert parsed.errors == (expected,)


def test_many_schema_problems_are_summarised():
    parsed = parse_assistant_output(format_tool_call("exchange_items", {"order_id": "1", "item_ids": ["x"] * 8}), TOOLS)
    assert parsed.errors[0].count("must be integer") == 5
    assert parsed.errors[0].endswith("(and 3 more).")


def test_without_tools_any_name_is_accepted_and_empty_tools_reject_all():
    text = format_tool_call("anything", {"x": 1})
    assert parse_assistant_output(text).tool_calls[0].name == "anything"
    assert parse_assistant_output(text, []).errors == (
        "Error: tool call 1 uses unknown tool 'anything'. Available tools: none.",
    )


def test_bare_function_specs_are_accepted():
    bare = [tool["function"] for tool in TOOLS]
    assert tool_names(bare) == tool_names(TOOLS) == ["get_order", "exchange_items"]
    assert (
        parse_assistant_output(format_tool_call("get_order", {}), bare)
        .errors[0]
        .endswith("missing required argument 'order_id'.")
    )


@pytest.mark.parametrize(
    ("arguments", "schema", "expected"),
    [
        ({"n": 3}, {"properties": {"n": {"type": "integer"}}}, []),
        ({"n": 3.0}, {"properties": {"n": {"type": "integer"}}}, []),
        ({"n": 3.5}, {"properties": {"n": {"type": "integer"}}}, ["argument 'n' must be integer, got number"]),
        ({"n": True}, {"properties": {"n": {"type": "number"}}}, ["argument 'n' must be number, got boolean"]),
        ({"n": 1}, {"properties": {"n": {"type": "boolean"}}}, ["argument 'n' must be boolean, got integer"]),
        ({"n": None}, {"properties": {"n": {"type": "null"}}}, []),
        ({"n": 0}, {"properties": {"n": {"type": "null"}}}, ["argument 'n' must be null, got integer"]),
        ({"n": {}}, {"properties": {"n": {"type": "array"}}}, ["argument 'n' must be array, got object"]),
        ({"n": []}, {"properties": {"n": {"type": "object"}}}, ["argument 'n' must be object, got array"]),
        ({"n": 1}, {"properties": {"n": {"enum": [True, "1"]}}}, ["argument 'n' must be one of [true, \"1\"], got 1"]),
        ({"n": 2}, {"properties": {"n": {"enum": [1, 2]}}}, []),
        ({"n": "x"}, {"properties": {"n": {"type": "uuid"}}}, ["argument 'n' must be uuid, got string"]),
        ([], {"type": "object"}, ["arguments must be object, got array"]),
        (
            {"a": {"b": [{"c": "x"}, {}]}},
            {
                "properties": {
                    "a": {
                        "type": "object",
                        "properties": {"b": {"items": {"properties": {"c": {"type": "integer"}}, "required": ["c"]}}},
                    }
                }
            },
            ["argument 'a.b[0].c' must be integer, got string", "missing required argument 'a.b[1].c'"],
        ),
        (
            {"a": 1, "b": "x"},
            {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
            ["argument 'b' must be integer, got string"],
        ),
        ({"a": 1}, {"properties": {"a": True}, "additionalProperties": False}, []),
        ({"a": 1}, {"additionalProperties": False}, ["unexpected argument 'a' (allowed: none)"]),
    ],
)
def test_validate_arguments(arguments, schema, expected):
    assert validate_arguments(arguments, schema) == expected


def test_render_tool_instructions():
    text = render_tool_instructions(TOOLS)
    lines = text.splitlines()
    start, end = lines.index("<tools>"), lines.index("</tools>")
    assert [json.loads(line) for line in lines[start + 1 : end]] == TOOLS
    example = format_tool_call("get_order", {"order_id": "..."})
    assert f"for example:\n{example}\n" in text
    assert parse_assistant_output(example, TOOLS).errors == ()
    assert "<tool_response></tool_response>" in text
    assert render_tool_instructions([]) == ""


def test_render_example_uses_placeholder_of_each_required_type():
    properties = {"k": {"enum": ["x"]}, "n": {"type": ["integer", "null"]}}
    tool = {"name": "t", "parameters": {"properties": properties, "required": ["k", "n", "free"]}}
    example = format_tool_call("t", {"k": "x", "n": 1, "free": "..."})
    assert f"for example:\n{example}\n" in render_tool_instructions([tool])
    assert parse_assistant_output(example, [tool]).errors == ()


def _fuzz_strings(rng: random.Random) -> list[str]:
    valid = [format_tool_call("get_order", {"order_id": "#W1"}), format_tool_call("f", {"a": [1, {"b": "ü"}]})]
    stops = ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", TOOL_CALL_CLOSE, TOOL_CALL_OPEN, "</tool_response>"]
    tokens = [
        TOOL_CALL_OPEN,
        TOOL_CALL_CLOSE,
        "<tool_",
        "call>",
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        ":",
        ",",
        '"name"',
        '"arguments"',
        '"parameters"',
        '"get_order"',
        "null",
        "1e999",
        "\n",
        " ",
        "é",
        "😀",
    ]
    strings = []
    for i in range(3000):
        kind = i % 6
        if kind == 0:  # random bytes decoded as text, lone surrogates included
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(80)))
            strings.append(raw.decode("utf-8", errors=rng.choice(["replace", "surrogateescape", "ignore"])))
        elif kind == 1:  # truncated valid calls
            call = rng.choice(valid)
            strings.append("pre " + call[: rng.randrange(len(call) + 1)])
        elif kind == 2:  # nested / unbalanced tags and JSON fragments
            strings.append("".join(rng.choice(tokens) for _ in range(rng.randrange(30))))
        elif kind == 3:  # stop strings inserted at odd places in valid calls
            call = rng.choice(valid) * rng.randrange(1, 3)
            cut = rng.randrange(len(call) + 1)
            strings.append(call[:cut] + rng.choice(stops) + call[cut:])
        elif kind == 4:  # point mutations of valid calls
            chars = list(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                chars[rng.randrange(len(chars))] = rng.choice(tokens)
            strings.append("".join(chars))
        else:  # plain text around valid calls, with tools that may or may not match
            strings.append(rng.choice(["", "x", " \n"]) + rng.choice(valid) + rng.choice(["", "y", "\t"]))
    depth = 10_000
    strings += [
        block("[" * depth + "]" * depth),
        block('{"a":' * depth),
        TOOL_CALL_OPEN + "[" * depth,
        "[" * depth + "]" * depth,
        block('{"name": "a", "arguments": ' + "[" * depth + "]" * depth + "}"),
        block('{"name": "a", "arguments": "' + "[" * depth + "]" * depth + '"}'),
        TOOL_CALL_OPEN * 3 + TOOL_CALL_CLOSE * 3,
        TOOL_CALL_CLOSE + TOOL_CALL_OPEN,
    ]
    return strings


def _check_invariants(text: str, parsed: ParsedAssistant) -> None:
    assert isinstance(parsed, ParsedAssistant)
    assert isinstance(parsed.content, str) and parsed.content == parsed.content.strip()
    assert TOOL_CALL_OPEN not in parsed.content
    assert isinstance(parsed.tool_calls, tuple) and isinstance(parsed.errors, tuple)
    for index, call in enumerate(parsed.tool_calls):
        assert isinstance(call, ToolCall) and call.id == f"call_{index}"
        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
    assert all(isinstance(error, str) and error.startswith("Error: tool call ") for error in parsed.errors)
    assert len(parsed.tool_calls) + len(parsed.errors) == text.count(TOOL_CALL_OPEN)
    if TOOL_CALL_OPEN not in text:
        assert parsed == ParsedAssistant(content=text.strip(), tool_calls=(), errors=())


def test_fuzz_parse_never_raises():
    rng = random.Random(1234)
    strings = _fuzz_strings(rng)
    assert sum(TOOL_CALL_OPEN in s for s in strings) > 1000  # the fuzz really exercises blocks
    assert sum(TOOL_CALL_OPEN not in s for s in strings) > 500
    outcomes = {"calls": 0, "errors": 0}
    for text in strings:
        for tools in (None, TOOLS):
            parsed = parse_assistant_output(text, tools)
            _check_invariants(text, parsed)
            outcomes["calls"] += len(parsed.tool_calls)
            outcomes["errors"] += len(parsed.errors)
    assert outcomes["calls"] > 300 and outcomes["errors"] > 1000, outcomes


def _huge_inputs(size: int) -> list[str]:
    """Adversarial outputs of about `size` characters: plain text, near-miss and unclosed tags, many calls."""
    call = format_tool_call("get_order", {"order_id": "#W1"})
    return [
        "a" * size,
        "<tool_" * (size // 6),  # near-miss tags
        TOOL_CALL_OPEN * (size // len(TOOL_CALL_OPEN)),  # many empty unclosed blocks
        TOOL_CALL_CLOSE * (size // len(TOOL_CALL_CLOSE)),
        call * (size // len(call)),
        TOOL_CALL_OPEN + '{"name": "a", "arguments": {"s": "' + "x" * size,  # unterminated string
        TOOL_CALL_OPEN + "[" * size,
        "text " * (size // 5) + TOOL_CALL_OPEN,
    ]


def _best_parse_seconds(text: str, repeats: int) -> float:
    """The least CPU time of this process over `repeats` parses, with the garbage collector off: CPU time leaves
    out the spells when the other test worker has the core (wall time once read 24.3x for a linear parse), and a
    full collection in a worker that holds a large heap stalls for seconds, which is the process, not the parser."""
    best, collecting = float("inf"), gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.process_time()
            parse_assistant_output(text, TOOLS)
            best = min(best, time.process_time() - start)
    finally:
        if collecting:
            gc.enable()
    return best


def test_huge_inputs_parse_in_linear_time():
    """Sixteen times the input may take at most 64 times the CPU time (linear: 16, quadratic: 256); an absolute
    time would measure the machine. The two sizes are timed in turn, three times, so that a slow spell of the
    machine (caches shared with the other worker) falls on both."""
    for big, small in zip(_huge_inputs(1 << 21), _huge_inputs(1 << 17)):
        big_seconds = small_seconds = float("inf")
        for _ in range(3):
            big_seconds = min(big_seconds, _best_parse_seconds(big, repeats=1))
            small_seconds = min(small_seconds, _best_parse_seconds(small, repeats=2))
        assert big_seconds < max(0.1, 64 * small_seconds), (big[:40], big_seconds, small_seconds)
        _check_invariants(big, parse_assistant_output(big, TOOLS))
