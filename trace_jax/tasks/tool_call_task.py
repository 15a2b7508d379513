"""Single-turn tool calling: answer a described request with one correct tool call.

Each task is a system prompt, two fixed worked exchanges and one customer-service request
("Please cancel order W12345, I ordered it by mistake."), rendered with a fixed toolset of
seven tools; the agent should reply with exactly one call in the project's `<tool_call>`
format (`trace_jax.tool_calls`). The reward is graded so that GRPO groups see
variance even while the model is weak (see `reward`).

Requests come from phrasing templates with sampled slot values. Three splits share the
tools; each draws values from its own pools of order ids, cities, restaurants, e-mail
addresses, subjects and amounts (small closed sets such as enum values, party sizes and
times are shared):

- "train": the training phrasings and the training values;
- "heldout": the training phrasings with held-out values: new requests of the kinds
  trained on (every held-out prompt differs from every training prompt);
- "heldout_phrasings": held-out phrasings and held-out values: transfer to wordings
  never trained on, a harder test a 135M model barely passes.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from trace_jax.tool_calls import format_tool_call, parse_assistant_output, validate_arguments

# split -> (value pools, phrasing templates) it draws from
SPLITS = {"train": ("train", "train"), "heldout": ("heldout", "train"), "heldout_phrasings": ("heldout", "heldout")}

SYSTEM_PROMPT = (
    "You are a customer-service assistant that acts only through tools. "
    "Answer each user request with exactly one tool call and no other text."
)

# Two worked exchanges put before every request. Without them the 135M base model never
# emits the format (greedy reward 0.0 on held-out), so GRPO would see no reward variance.
# Their values lie outside both splits' pools.
DEMONSTRATIONS: list[dict] = [
    {"role": "user", "content": "Where is my order W00042?"},
    {"role": "assistant", "content": format_tool_call("get_order_status", {"order_id": "W00042"})},
    {"role": "user", "content": "What's the weather like in Reykjavik? In fahrenheit please."},
    {"role": "assistant", "content": format_tool_call("get_weather", {"city": "Reykjavik", "unit": "fahrenheit"})},
]

# Reward levels; see `reward`.
FORMAT_CREDIT = 0.2
NAME_CREDIT = 0.3
ARGUMENTS_CREDIT = 0.5
MULTI_CALL_CAP = 0.5

_REASONS = {
    "no_longer_needed": "I no longer need it",
    "ordered_by_mistake": "I ordered it by mistake",
    "found_cheaper": "I found it cheaper somewhere else",
    "delivery_too_slow": "the delivery is taking too long",
}
_CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CAD", "AUD", "CHF", "INR")
_UNITS = ("celsius", "fahrenheit")
_TIMES = tuple(f"{hour}:{minute}" for hour in range(12, 22) for minute in ("00", "30"))


def _tool(name: str, description: str, properties: dict[str, dict]) -> dict:
    """An OpenAI-style tool whose arguments are all required and no others are allowed."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,
            },
        },
    }


TOOLS: list[dict] = [
    _tool(
        "get_order_status",
        "Look up the shipping status of an order.",
        {"order_id": {"type": "string", "description": "Order id, like W12345."}},
    ),
    _tool(
        "cancel_order",
        "Cancel an order that has not shipped yet.",
        {
            "order_id": {"type": "string", "description": "Order id, like W12345."},
            "reason": {"type": "string", "enum": list(_REASONS)},
        },
    ),
    _tool(
        "get_weather",
        "Current weather in a city.",
        {"city": {"type": "string"}, "unit": {"type": "string", "enum": list(_UNITS)}},
    ),
    _tool(
        "convert_currency",
        "Convert an amount of money between currencies.",
        {
            "amount": {"type": "number"},
            "from_currency": {"type": "string", "enum": list(_CURRENCIES)},
            "to_currency": {"type": "string", "enum": list(_CURRENCIES)},
        },
    ),
    _tool(
        "book_table",
        "Reserve a restaurant table.",
        {
            "restaurant": {"type": "string"},
            "people": {"type": "integer", "description": "Party size."},
            "time": {"type": "string", "description": "24-hour time, like 19:30."},
        },
    ),
    _tool(
        "send_email",
        "Send an e-mail.",
        {"to": {"type": "string", "description": "Recipient e-mail address."}, "subject": {"type": "string"}},
    ),
    _tool(
        "reset_password", "Send a password-reset link to an account's e-mail address.", {"email": {"type": "string"}}
    ),
]


@dataclasses.dataclass(frozen=True)
class _Pools:
    """The slot values one split draws from; the two splits' pools do not overlap."""

    order_numbers: range
    amounts: range
    cities: tuple[str, ...]
    restaurants: tuple[str, ...]
    people_names: tuple[str, ...]
    subjects: tuple[str, ...]


_POOLS = {
    "train": _Pools(
        order_numbers=range(10000, 55000),
        amounts=range(2, 2001, 2),  # even
        cities=(
            "Paris",
            "Tokyo",
            "Berlin",
            "Madrid",
            "Chicago",
            "Toronto",
            "Sydney",
            "Cairo",
            "Lima",
            "Oslo",
            "Dublin",
            "Seoul",
            "Denver",
            "Mumbai",
            "Nairobi",
            "Lisbon",
            "Vienna",
            "Boston",
        ),
        restaurants=(
            "Luigi's",
            "The Blue Door",
            "Sakura House",
            "El Toro",
            "Green Fork",
            "Bistro Nord",
            "Golden Dragon",
            "Casa Verde",
            "The Oak Room",
            "Spice Route",
        ),
        people_names=(
            "anna",
            "ben",
            "carla",
            "dmitri",
            "elena",
            "farid",
            "grace",
            "hugo",
            "ines",
            "jonas",
            "kofi",
            "lena",
            "marco",
            "nadia",
        ),
        subjects=(
            "Invoice question",
            "Meeting tomorrow",
            "Holiday plans",
            "Project update",
            "Refund request",
            "Lunch on Friday",
            "New address",
            "Contract draft",
        ),
    ),
    "heldout": _Pools(
        order_numbers=range(55000, 100000),
        amounts=range(1, 2000, 2),  # odd
        cities=(
            "Rome",
            "Austin",
            "Helsinki",
            "Prague",
            "Bangkok",
            "Quito",
            "Athens",
            "Montreal",
            "Osaka",
            "Zurich",
            "Lagos",
            "Perth",
        ),
        restaurants=("Chez Marie", "The Red Lantern", "Olive Grove", "Taco Loco", "Harbor Grill", "Little Saigon"),
        people_names=("olga", "pedro", "quinn", "rosa", "samir", "tara", "umar", "vera", "wes", "yuki"),
        subjects=("Budget review", "Team dinner", "Travel receipts", "Weekly report", "Birthday party"),
    ),
}

_TEMPLATES = {
    "train": {
        "get_order_status": (
            "What's the status of my order {order_id}?",
            "Can you check where order {order_id} is?",
            "Has my order {order_id} shipped yet?",
        ),
        "cancel_order": (
            "Please cancel order {order_id}, {reason}.",
            "I want to cancel my order {order_id} because {reason}.",
        ),
        "get_weather": (
            "What's the weather in {city} in {unit}?",
            "How warm is it in {city} right now? Give me {unit}.",
        ),
        "convert_currency": (
            "Convert {amount} {from_currency} to {to_currency}.",
            "How much is {amount} {from_currency} in {to_currency}?",
        ),
        "book_table": (
            "Book a table at {restaurant} for {people} people at {time}.",
            "Can you reserve {restaurant} for {people} at {time}?",
        ),
        "send_email": ('Send an email to {to} with the subject "{subject}".', 'Email {to} about "{subject}".'),
        "reset_password": (
            "I forgot my password, my account email is {email}.",
            "Please reset the password for {email}.",
        ),
    },
    "heldout": {
        "get_order_status": (
            "I'd like an update on order {order_id}, please.",
            "Where is my package from order {order_id}?",
        ),
        "cancel_order": ("Cancel {order_id} for me: {reason}.",),
        "get_weather": ("Tell me the current weather for {city}, using {unit}.",),
        "convert_currency": ("I have {amount} {from_currency}; what is that in {to_currency}?",),
        "book_table": ("Get us a table for {people} at {restaurant}, {time} please.",),
        "send_email": ('Write to {to}, subject line: "{subject}".',),
        "reset_password": ("Help me get back into my account {email}, I can't log in.",),
    },
}


def _email(rng: random.Random, pools: _Pools) -> str:
    return f"{rng.choice(pools.people_names)}@{rng.choice(('example.com', 'mail.net', 'work.org'))}"


def _order_id(rng: random.Random, pools: _Pools) -> str:
    return f"W{rng.choice(pools.order_numbers)}"


def _conversion(rng: random.Random, pools: _Pools) -> dict[str, Any]:
    source, target = rng.sample(_CURRENCIES, 2)
    return {"amount": rng.choice(pools.amounts), "from_currency": source, "to_currency": target}


# tool name -> draws that tool's expected arguments from a split's pools.
_ARGUMENT_SAMPLERS: dict[str, Callable[[random.Random, _Pools], dict[str, Any]]] = {
    "get_order_status": lambda rng, pools: {"order_id": _order_id(rng, pools)},
    "cancel_order": lambda rng, pools: {"order_id": _order_id(rng, pools), "reason": rng.choice(list(_REASONS))},
    "get_weather": lambda rng, pools: {"city": rng.choice(pools.cities), "unit": rng.choice(_UNITS)},
    "convert_currency": _conversion,
    "book_table": lambda rng, pools: {
        "restaurant": rng.choice(pools.restaurants),
        "people": rng.randint(1, 10),
        "time": rng.choice(_TIMES),
    },
    "send_email": lambda rng, pools: {"to": _email(rng, pools), "subject": rng.choice(pools.subjects)},
    "reset_password": lambda rng, pools: {"email": _email(rng, pools)},
}


@dataclasses.dataclass(frozen=True)
class ToolCallTask:
    """One request and the single call that answers it.

    `messages` (system, `DEMONSTRATIONS`, the request) are ready for
    `ChatTokenizer.apply_chat(messages, tools=tools)`; `tools` and the demonstration
    messages are shared by all tasks and must not be mutated.
    """

    task_id: str
    messages: list[dict]
    tools: list[dict]
    expected_name: str
    expected_arguments: dict


def make_tasks(split: str, num: int, seed: int) -> list[ToolCallTask]:
    """`num` tasks of `split` (one of `SPLITS`); the same arguments give the same tasks.

    Tools are drawn uniformly; slot values and wordings come from the split's pools and
    templates (see `SPLITS`).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits are {', '.join(SPLITS)}")
    rng = random.Random(f"tool-call-task/{split}/{seed}")  # str seeds are hashed stably (sha512)
    pools, templates = _POOLS[SPLITS[split][0]], _TEMPLATES[SPLITS[split][1]]
    tasks = []
    for index in range(num):
        name = rng.choice(sorted(_ARGUMENT_SAMPLERS))
        arguments = _ARGUMENT_SAMPLERS[name](rng, pools)
        slots = {**arguments, "reason": _REASONS[arguments["reason"]]} if "reason" in arguments else arguments
        request = rng.choice(templates[name]).format(**slots)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *DEMONSTRATIONS, {"role": "user", "content": request}]
        tasks.append(ToolCallTask(f"{split}-{seed}-{index}", messages, TOOLS, name, arguments))
    return tasks


def reward(task: ToolCallTask, completion_text: str) -> tuple[float, dict]:
    """Score a completion in [0, 1] and say why.

    The first well-formed call (a `<tool_call>` block holding a JSON object with a string
    `name` and object `arguments`) is graded:

    - 0.0  no well-formed call;
    - 0.2  a well-formed call (`FORMAT_CREDIT`), whatever its name;
    - +0.3 its name is the expected tool (`NAME_CREDIT`);
    - +0.5 x the argument fraction (`ARGUMENTS_CREDIT`), only with the right name:
      expected arguments given with the right value, divided by the number of expected
      arguments plus the number of unexpected ones (so invented arguments cost credit).
      Strings match ignoring case and runs of whitespace; numbers match by value
      (12 == 12.0), never a string spelling of a number.

    More than one block in the reply (well-formed or not) caps the score at 0.5: the task
    is one call, and a correct call among others must not look like success. Prose
    around the call is not penalised. Arguments are scored here rather than by the
    parser's schema check so that a call with a wrong value still earns its name credit;
    schema problems of a right-name call are reported in `errors`.

    Diagnostics: `format_ok`, `name_ok`, `args_fraction`, `num_calls` (blocks, including
    malformed ones) and `errors` (parser errors, then schema problems).
    """
    parsed = parse_assistant_output(completion_text)
    num_calls = len(parsed.tool_calls) + len(parsed.errors)
    errors = list(parsed.errors)
    call = parsed.tool_calls[0] if parsed.tool_calls else None
    name_ok = call is not None and call.name == task.expected_name
    fraction = 0.0
    score = 0.0
    if call is not None:
        score = FORMAT_CREDIT
    if name_ok:
        matched = sum(
            key in call.arguments and _same(call.arguments[key], value)
            for key, value in task.expected_arguments.items()
        )
        unexpected = len(set(call.arguments) - set(task.expected_arguments))
        fraction = matched / (len(task.expected_arguments) + unexpected)
        score += NAME_CREDIT + ARGUMENTS_CREDIT * fraction
        errors += validate_arguments(call.arguments, _parameters(task.tools, task.expected_name))
    if num_calls > 1:
        score = min(score, MULTI_CALL_CAP)
    diagnostics = {
        "format_ok": call is not None,
        "name_ok": name_ok,
        "args_fraction": fraction,
        "num_calls": num_calls,
        "errors": tuple(errors),
    }
    return score, diagnostics


def _parameters(tools: list[dict], name: str) -> dict:
    """The parameter schema of tool `name`."""
    return next(tool["function"]["parameters"] for tool in tools if tool["function"]["name"] == name)


def _same(given: Any, expected: Any) -> bool:
    """Whether an emitted argument value equals the expected one (see `reward`)."""
    if isinstance(expected, str):
        return isinstance(given, str) and " ".join(given.split()).casefold() == " ".join(expected.split()).casefold()
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        return isinstance(given, (int, float)) and not isinstance(given, bool) and given == expected
    return given == expected
