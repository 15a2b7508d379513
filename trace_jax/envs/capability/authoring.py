"""The authoring API of LLM-written capability environments (TRACE stage 2): what a module defines and may use.

A capability environment trains one capability of a customer-service agent in a τ²-bench domain
(retail: an online store; airline). Each task is a written customer ticket on a small synthetic world;
the agent reads it (with some tool calls already made for it), makes tool calls, then writes one final
message to the customer, which ends the episode.

THE MODULE defines exactly these five names:

    NAME: str          snake_case, the capability's name (the one you are asked for)
    DOMAIN: str        the τ² domain of its tasks, "retail" or "airline" (the one you are asked for)
    DESCRIPTION: str   one or two sentences: what the capability is
    TOOLS: tuple[tuple[str, ...], ...]
                       the domain's τ² tools offered to the agent at each difficulty 0, 1, ... (1 to 5
                       difficulties); each a tuple of tool names; every gold call of a task of difficulty d
                       must be one of TOOLS[d]. Offer the look-up tools the agent needs to read what it
                       acts on, plus the write tools the capability is about.
    def generate(rng: random.Random, difficulty: int, catalogue: dict) -> Scenario
                       one task: a world, a ticket, the calls already made and the gold solution;
                       `catalogue` is the domain's (below)

Import only the standard library (`random`, `math`, `itertools`, ...) and the domain's API module:
`from trace_jax.envs.capability.<DOMAIN>_api import Scenario, build_world, call, ...` (its names below).

`generate` MUST:
  * draw every random value from `rng` (never `random.random()`, time, uuids or the order of a set): a
    task is a pure function of the rng's seed; choose from sorted lists (`rng.choice(sorted(...))`);
  * never raise, for any seed and any difficulty in range(len(TOOLS)): pick only among objects that
    exist (filter first, and build a world with enough of the objects you need);
  * be quick (milliseconds) and small; no files, network, threads or subprocesses.
It is run for 100 seeds at every difficulty in a separate process with time and memory limits.

THE SCENARIO `generate` returns (`call(name, **arguments)` builds a Call, {"name": ..., "arguments": {...}}):
  Scenario(variant: str,                the task's family, for per-family tables ("cancel", "refuse", ...)
           db: the domain's DB,         the world the tools act on (build_world's)
           ticket: str,                 the customer's whole request, with everything the agent needs to
                                        find (the ids the domain's tools take, or what identifies them) and
                                        their explicit confirmation of any action they ask for
           prefilled: tuple[Call, ...], calls made before the agent's first turn (shown with their real
                                        results), e.g. the customer's look-up, so the agent's work is the
                                        capability itself
           gold_calls: tuple[Call, ...],the calls the agent still has to make, exactly (argument values as
                                        JSON: str, int, float, bool, lists; ids exactly as the tools take them)
           facts: tuple[str, ...] = ()) strings the final message must contain (case-insensitive; no commas)
Write calls the ticket does not call for must not be in gold_calls: a task where the policy forbids the
request has only the look-ups as gold and a fact saying why (for example the order's status).

THE REWARD is computed by the environment's code from the scenario, never by the module (do not define
one): the agent's calls run through τ²'s real tools of the domain on a copy of `db`, then
  1.0  every gold call made with its arguments (lists compared as sets), no other write attempted, the
       final database equal to the one replaying prefilled + gold_calls gives, and the final message
       stating every fact;
  else 0.6 x the share of gold calls made - 0.1 per write no gold call matches, clipped to [0, 1].
The environment adds scaffolded levels below difficulty 0 itself (earlier gold calls pre-filled, hints
that name the calls and where their arguments are): generate only difficulties 0 and up.
An episode cut at a limit (too many turns or errors) before the agent's final message earns 0 by default.
Extra read calls are allowed. The module is accepted when the gold solution (the gold calls one per
turn, then a message stating the facts) scores 1.0 on at least 95% of the seeds, an agent that does
nothing scores at most 0.1 on average, and no seed raises. Make the tasks need the capability: an agent
lacking it should fail them, and difficulty should add what makes the capability harder.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
from collections.abc import Callable

from trace_jax.envs.capability.domains import DOMAINS, world_domain
from trace_jax.envs.capability.environment import Capability, Scenario

MAX_DIFFICULTIES = 5
REQUIRED = ("NAME", "DOMAIN", "DESCRIPTION", "TOOLS", "generate")
_NAME = re.compile(r"^[a-z][a-z0-9_]{1,48}$")


class AuthoringError(ValueError):
    """A written module, or a scenario it generated, that breaks the authoring API."""


def guide(domain: str) -> str:
    """The whole API a writer reads for `domain`: this module's docstring, then the domain API module's."""
    return __doc__ + "\n" + importlib.import_module(f"trace_jax.envs.capability.{domain}_api").__doc__


@functools.cache
def domain_tools(domain: str) -> dict[str, dict]:
    """τ²'s tools of `domain` by name: their OpenAI schemas, read from τ²'s toolkit class (no DB is loaded)."""
    return {name: tool.openai_schema for name, tool in world_domain(domain).toolkit(None).get_tools().items()}


@functools.cache
def tool_kinds(domain: str) -> dict[str, str]:
    """Each τ² tool's kind in `domain`: "read", "write" (it changes the DB) or "generic"."""
    toolkit = world_domain(domain).toolkit(None)
    return {name: toolkit.tool_type(name).value for name in toolkit.tools}


def _kind(spec: dict, defs: dict) -> str:
    """An argument's JSON type as the listing writes it: "string", "array of string", "array of object
    {flight_number, date}" (an object τ² defines by reference, with its fields)."""
    options = spec.get("anyOf", [spec])
    named = [o for o in options if "$ref" in o]
    if named:
        return "object {" + ", ".join(defs.get(named[0]["$ref"].rsplit("/", 1)[-1], {}).get("properties", {})) + "}"
    kind = options[0].get("type", "any")
    return f"{kind} of {_kind(spec['items'], defs)}" if "items" in spec else kind


def tool_listing(domain: str) -> str:
    """τ²'s tools of `domain` as the writer's prompt lists them: name, kind and description, then each argument."""
    blocks = []
    for name, schema in sorted(domain_tools(domain).items()):
        function = schema["function"]
        lines = [f"{name} [{tool_kinds(domain)[name]}]: " + " ".join(function["description"].split())]
        defs = function["parameters"].get("$defs", {})
        for argument, spec in function["parameters"].get("properties", {}).items():
            kind = _kind(spec, defs)
            lines.append(f"    {argument} ({kind}): " + " ".join(spec.get("description", "").split()))
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def _tools(value: object, domain: str) -> tuple[tuple[str, ...], ...]:
    known = domain_tools(domain)
    if not isinstance(value, (tuple, list)) or not 1 <= len(value) <= MAX_DIFFICULTIES:
        raise AuthoringError(
            f"TOOLS must be a tuple of 1 to {MAX_DIFFICULTIES} tuples of tool names (one per "
            f"difficulty); got {value!r:.200}"
        )
    for difficulty, names in enumerate(value):
        if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) for n in names):
            raise AuthoringError(f"TOOLS[{difficulty}] must be a non-empty tuple of tool names; got {names!r:.200}")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise AuthoringError(
                f"TOOLS[{difficulty}] names tools τ²'s {domain} domain does not have: {unknown}; "
                f"valid names: {', '.join(sorted(known))}"
            )
        if len(set(names)) != len(names):
            raise AuthoringError(f"TOOLS[{difficulty}] repeats a tool: {list(names)}")
    return tuple(tuple(names) for names in value)


def capability_from_module(module: types.ModuleType, name: str | None = None, domain: str | None = None) -> Capability:
    """The module's `Capability`, after checking that it defines NAME, DOMAIN, DESCRIPTION, TOOLS and generate
    with the right types (and, given `name` or `domain`, that NAME or DOMAIN is it); AuthoringError says what is
    missing or wrong."""
    missing = [n for n in REQUIRED if not hasattr(module, n)]
    if missing:
        raise AuthoringError(f"the module must define {', '.join(REQUIRED)}; it does not define {', '.join(missing)}")
    if not isinstance(module.NAME, str) or not _NAME.match(module.NAME):
        raise AuthoringError(f"NAME must be a snake_case string of 2 to 49 characters; got {module.NAME!r:.100}")
    if name is not None and module.NAME != name:
        raise AuthoringError(f"NAME = {module.NAME!r}, but this environment is for the capability {name!r}")
    if not isinstance(module.DOMAIN, str) or module.DOMAIN not in DOMAINS:
        raise AuthoringError(f"DOMAIN must be one of {', '.join(map(repr, DOMAINS))}; got {module.DOMAIN!r:.100}")
    if domain is not None and module.DOMAIN != domain:
        raise AuthoringError(f"DOMAIN = {module.DOMAIN!r}, but this environment is for τ²'s {domain} domain")
    if not isinstance(module.DESCRIPTION, str) or not module.DESCRIPTION.strip():
        raise AuthoringError(f"DESCRIPTION must be a non-empty string; got {module.DESCRIPTION!r:.100}")
    generate = module.generate
    if not callable(generate) or not _takes_three(generate):
        raise AuthoringError("generate must be a function generate(rng, difficulty, catalogue) -> Scenario")
    return Capability(
        name=module.NAME,
        description=module.DESCRIPTION.strip(),
        generate=generate,
        tools=_tools(module.TOOLS, module.DOMAIN),
        domain=module.DOMAIN,
    )


def _takes_three(function: Callable) -> bool:
    try:
        inspect.signature(function).bind(None, 0, {})
    except (TypeError, ValueError):
        return False
    return True


def _check_calls(calls: object, field: str, domain: str) -> None:
    if not isinstance(calls, (tuple, list)):
        raise AuthoringError(f"Scenario.{field} must be a tuple of calls; got {type(calls).__name__}")
    for c in calls:
        if not (
            isinstance(c, dict)
            and set(c) == {"name", "arguments"}
            and isinstance(c["name"], str)
            and isinstance(c["arguments"], dict)
        ):
            raise AuthoringError(f"Scenario.{field} holds {c!r:.200}, not a call(name, **arguments)")
        if c["name"] not in domain_tools(domain):
            raise AuthoringError(f"Scenario.{field} calls {c['name']!r}, which is not a τ² {domain} tool")


def check_scenario(scenario: object, difficulty: int, tools: tuple[str, ...], domain: str) -> None:
    """Raises AuthoringError naming the first field of a generated scenario of `domain` that breaks the API
    (types, gold calls of tools not offered at `difficulty`, facts that can never be matched)."""
    if not isinstance(scenario, Scenario):
        raise AuthoringError(f"generate returned {type(scenario).__name__}, not a Scenario")
    for field in ("variant", "ticket"):
        if not isinstance(getattr(scenario, field), str) or not getattr(scenario, field).strip():
            raise AuthoringError(f"Scenario.{field} must be a non-empty string; got {getattr(scenario, field)!r:.100}")
    db_type = world_domain(domain).db_type
    if not isinstance(scenario.db, db_type):
        raise AuthoringError(
            f"Scenario.db must be a {db_type.__name__} (build_world's); got {type(scenario.db).__name__}"
        )
    _check_calls(scenario.prefilled, "prefilled", domain)
    _check_calls(scenario.gold_calls, "gold_calls", domain)
    not_offered = sorted({c["name"] for c in scenario.gold_calls} - set(tools))
    if not_offered:
        raise AuthoringError(f"gold_calls use {not_offered}, which TOOLS[{difficulty}] does not offer: {list(tools)}")
    if not isinstance(scenario.facts, (tuple, list)) or not all(isinstance(f, str) and f for f in scenario.facts):
        raise AuthoringError(f"Scenario.facts must be a tuple of non-empty strings; got {scenario.facts!r:.200}")
    with_commas = [f for f in scenario.facts if "," in f]
    if with_commas:
        raise AuthoringError(
            f"facts {with_commas} hold commas: the check removes commas from the message, so "
            "they can never match; state facts without commas"
        )
