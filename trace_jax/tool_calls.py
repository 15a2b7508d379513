"""The project's tool-call format: Hermes/Qwen `<tool_call>` blocks with a JSON body.

An assistant turn is free text followed by zero or more blocks, one per call:

    <tool_call>
    {"name": "get_order", "arguments": {"order_id": "#W123"}}
    </tool_call>

Tool schemas use the OpenAI form `{"type": "function", "function": {"name", "description",
"parameters"}}`; a bare `{"name", "description", "parameters"}` dict is accepted too.
Tool results go back to the model inside `<tool_response></tool_response>`.

Generation must stop at the chat template's end-of-turn tokens, not at `</tool_call>`:
a turn may hold several calls. A block left unclosed (generation cut off, or the model
forgot the tag) runs to the next `<tool_call>` or to the end of the text.

The parser never raises on any string: each malformed block becomes one human-readable
error message meant to be shown to the agent as an observation, and is not executed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

_FORMAT_HINT = 'Use <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
_MAX_LISTED_PROBLEMS = 5  # schema problems quoted per block; a long list helps no one


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One well-formed call; `id` is `call_{i}` for the i-th call of a message unless replaced."""

    name: str
    arguments: dict
    id: str


@dataclasses.dataclass(frozen=True)
class ParsedAssistant:
    """An assistant turn: the text outside blocks (each piece stripped, pieces joined by
    newlines), the valid calls, and one error per malformed or schema-invalid block."""

    content: str
    tool_calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]


def format_tool_call(name: str, arguments: dict) -> str:
    """The exact text a model should emit for a call (also used to render past calls).

    Tags occurring inside argument strings are written with a `\\u003c` escape so that
    they cannot end or start a block; the JSON still decodes to the same arguments.
    """
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    for tag in (TOOL_CALL_CLOSE, TOOL_CALL_OPEN):
        body = body.replace(tag, "\\u003c" + tag[1:])
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def parse_assistant_output(text: str, tools: list[dict] | None = None) -> ParsedAssistant:
    """Split `text` into content and tool calls; with `tools`, also check names and arguments.

    Lenient where models commonly drift: `arguments` may be missing or null (meaning {}),
    a JSON-encoded object string, or spelled `parameters`. Runs in linear time.
    """
    specs = None if tools is None else {_function(tool).get("name"): _function(tool) for tool in tools}
    pieces: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    for start, body_start, body_end, resume in _blocks(text):
        pieces.append(text[pos:start])
        pos = resume
        result = _parse_block(text[body_start:body_end], len(calls) + len(errors) + 1, specs)
        if isinstance(result, str):
            errors.append(result)
        else:
            calls.append(ToolCall(name=result[0], arguments=result[1], id=f"call_{len(calls)}"))
    pieces.append(text[pos:])
    # Joining with a newline keeps "<tool_" + "call>" from two pieces from forming a tag.
    content = "\n".join(piece.strip() for piece in pieces if piece.strip())
    return ParsedAssistant(content=content, tool_calls=tuple(calls), errors=tuple(errors))


def validate_arguments(arguments: dict, schema: dict) -> list[str]:
    """Check `arguments` against a small JSON-schema subset; one message per problem.

    Supports `type` (string or list), `enum`, `properties`, `required`,
    `additionalProperties` (false or a schema) and `items`; other keywords are ignored.
    """
    return _validate(arguments, schema, "")


def render_tool_instructions(tools: list[dict]) -> str:
    """A system-prompt section teaching the call format, for templates without tool support.

    Lists one JSON schema per line inside `<tools></tools>` as Qwen's template does;
    returns "" when there are no tools.
    """
    if not tools:
        return ""
    first = _function(tools[0])
    parameters = first.get("parameters") or {}
    properties = parameters.get("properties", {})
    example_arguments = {key: _example_value(properties.get(key, {})) for key in parameters.get("required", [])}
    example = format_tool_call(first["name"], example_arguments)
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You may call one or more tools to help with the user's request.\n\n"
        "The available tools are described by JSON schemas within <tools></tools> XML tags:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "To call a tool, write a JSON object with the tool's name and arguments within "
        f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags, one block per call, for example:\n"
        f"{example}\n\n"
        "The result of each call will be given back to you within "
        f"{TOOL_RESPONSE_OPEN}{TOOL_RESPONSE_CLOSE} XML tags."
    )


def tool_names(tools: list[dict]) -> list[str]:
    """The names of `tools`, in order."""
    return [_function(tool)["name"] for tool in tools]


def _function(tool: dict) -> dict:
    """The function spec of an OpenAI-style tool, or the tool itself if it is already bare."""
    return tool.get("function", tool)


def _blocks(text: str) -> Iterator[tuple[int, int, int, int]]:
    """Yield `(start, body_start, body_end, resume)` per block; each search only moves forward,
    so the scan is linear even for thousands of unclosed blocks."""
    close = text.find(TOOL_CALL_CLOSE)
    start = text.find(TOOL_CALL_OPEN)
    while start != -1:
        body_start = start + len(TOOL_CALL_OPEN)
        if close != -1 and close < body_start:
            close = text.find(TOOL_CALL_CLOSE, body_start)
        reopen = text.find(TOOL_CALL_OPEN, body_start)
        if close != -1 and (reopen == -1 or close < reopen):
            yield start, body_start, close, close + len(TOOL_CALL_CLOSE)
        else:
            end = len(text) if reopen == -1 else reopen
            yield start, body_start, end, end
        start = reopen


def _parse_block(body: str, number: int, specs: dict[str, dict] | None) -> tuple[str, dict] | str:
    """Decode one block body into `(name, arguments)`, or return its error message."""
    prefix = f"Error: tool call {number}"
    if not body.strip():
        return f"{prefix} is empty. {_FORMAT_HINT}"
    data, problem = _loads(body)
    if problem:
        return f"{prefix} is not valid JSON: {problem}. {_FORMAT_HINT}"
    if not isinstance(data, dict):
        return f"{prefix} must be a JSON object, got {_json_type(data)}. {_FORMAT_HINT}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return f'{prefix} needs a non-empty string "name". {_FORMAT_HINT}'
    arguments = data.get("arguments", data.get("parameters"))
    if isinstance(arguments, str):
        decoded, problem = _loads(arguments)
        arguments = arguments if problem else decoded
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        got = _json_type(arguments)
        return f'{prefix} ({name}): "arguments" must be a JSON object, got {got}. {_FORMAT_HINT}'
    if specs is None:
        return name, arguments
    if name not in specs:
        available = ", ".join(map(str, specs)) or "none"
        return f"{prefix} uses unknown tool {name!r}. Available tools: {available}."
    problems = validate_arguments(arguments, specs[name].get("parameters") or {})
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED_PROBLEMS])
        hidden = len(problems) - _MAX_LISTED_PROBLEMS
        more = f" (and {hidden} more)" if hidden > 0 else ""
        return f"{prefix} ({name}) has invalid arguments: {shown}{more}."
    return name, arguments


def _loads(text: str) -> tuple[Any, str]:
    """`json.loads` that reports failure as a message instead of raising."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as error:
        return None, f"{error.msg} at char {error.pos}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as error:  # e.g. an integer longer than Python's digit limit
        return None, str(error)


_TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: type(v) is int or (type(v) is float and v.is_integer()),  # JSON allows 1.0
    "number": lambda v: type(v) in (int, float),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}
_JSON_TYPE_NAMES = {
    type(None): "null",
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}


def _validate(value: Any, schema: dict, path: str) -> list[str]:
    """Problems of `value` at `path` ("" for the top-level arguments object)."""
    if not isinstance(schema, dict):  # boolean schemas (`true`/`false`) constrain nothing we check
        return []
    where = f"argument {path!r}" if path else "arguments"
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else [str(kind) for kind in types]
        if not any(kind in _TYPE_CHECKS and _TYPE_CHECKS[kind](value) for kind in allowed):
            return [f"{where} must be {' or '.join(allowed)}, got {_json_type(value)}"]
    if "enum" in schema and not any(_json_equal(value, option) for option in schema["enum"]):
        options = ", ".join(_describe(option) for option in schema["enum"])
        return [f"{where} must be one of [{options}], got {_describe(value)}"]
    problems: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"missing required argument {_join(path, key)!r}")
        for key, item in value.items():
            if key in properties:
                problems += _validate(item, properties[key], _join(path, key))
            elif extra is False:
                allowed_keys = ", ".join(properties) or "none"
                problems.append(f"unexpected argument {_join(path, key)!r} (allowed: {allowed_keys})")
            elif isinstance(extra, dict):
                problems += _validate(item, extra, _join(path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            problems += _validate(item, schema["items"], f"{path}[{index}]")
    return problems


def _join(path: str, key: str) -> str:
    """Dotted path of `key` under `path`."""
    return f"{path}.{key}" if path else key


def _json_type(value: Any) -> str:
    """JSON type name of a decoded value, for error messages."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality: unlike Python, `true` is not `1`."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _describe(value: Any) -> str:
    """Short text for a value in an error: scalars as JSON (truncated), containers by type."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 60 else text[:57] + "..."
    return _json_type(value)


def _example_value(schema: dict) -> Any:
    """A placeholder value of the schema's type, for the example call in the instructions."""
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    placeholders = {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}, "null": None}
    return placeholders.get(kind, "...")
