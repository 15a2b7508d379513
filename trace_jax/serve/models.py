"""What a request's `model` may name: the base model, one of the served adapters, or `trace`, for which a
finished TRACE run's router picks the adapter of each conversation, as its routing stage did."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import pathlib
import threading
from collections.abc import Sequence

from trace_jax.files import read_json
from trace_jax.lora import NO_ADAPTER
from trace_jax.models.model import Model
from trace_jax.serve.protocol import ApiError
from trace_jax.trace.routing import RouteOption, Router

TRACE = "trace"
MAX_DECISIONS = 4096  # conversations whose route the router remembers (the least recently used are forgotten)


@dataclasses.dataclass(frozen=True)
class Route:
    """The router's decision for one conversation: the adapter that serves it (its index in the served stack,
    NO_ADAPTER for the base), its name and the label weights."""

    adapter: int
    name: str
    weights: dict[str, float]

    def body(self) -> dict:
        return {"adapter": self.name, "weights": self.weights}


def opening(messages: Sequence[dict]) -> list[dict]:
    """A conversation's opening: its messages before the model's first turn (the first assistant message after a
    user message), what the routing stage reads of a task (its system prompt and ticket)."""
    seen_user = False
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and seen_user:
            return list(messages[:i])
        seen_user |= message["role"] == "user"
    return list(messages)


def _stages(run_dir: pathlib.Path) -> dict:
    path = run_dir / "stages.json"
    if not path.exists():
        raise ValueError(f"{run_dir} is not a TRACE run's workdir (no stages.json)")
    stages = read_json(path)
    if "routing" not in stages:
        raise ValueError(f"the TRACE run in {run_dir} has not finished its routing stage")
    return stages


def trace_run_adapters(run_dir: str | pathlib.Path) -> dict[str, str]:
    """A finished TRACE run's adapters, capability name -> PEFT folder, in routing order."""
    stages = _stages(pathlib.Path(run_dir))
    return {name: stages["training"]["result"][name] for name in stages["routing"]["result"]["labels"][1:]}


def trace_run_model(run_dir: str | pathlib.Path) -> tuple[str, str]:
    """(model, dtype) a TRACE run's base agent was evaluated with."""
    marker = read_json(pathlib.Path(run_dir) / "heldout" / "trace" / "run.json")
    return marker["config"]["model"], marker["config"]["dtype"]


class TraceRouter:
    """A finished TRACE run's Select & Adapt, one conversation at a time: the run's options (descriptions,
    examples), router settings and calibration offsets, so a conversation that opens as one of its held-out
    tasks gets that task's adapter. One decision per conversation (its `opening`), cached for the
    MAX_DECISIONS most recent conversations."""

    def __init__(self, model: Model, run_dir: str | pathlib.Path, adapter_index: dict[str, int]):
        run_dir = pathlib.Path(run_dir)
        routing = _stages(run_dir)["routing"]["result"]
        self.names = routing["labels"][1:]
        self.adapters = [adapter_index[name] for name in self.names]
        self._router, self._offsets = None, None
        if self.names:
            if "router" not in routing:
                raise ValueError(
                    f"the TRACE run in {run_dir} did not store its router's settings (a run before "
                    "they were kept): run its routing stage again (remove 'routing' from stages.json)"
                )
            candidates = read_json(run_dir / "analysis" / "capabilities.json")["candidates"]
            descriptions = {c["name"]: c["description"] for c in candidates}
            options = [RouteOption(n, descriptions[n], routing["examples"][n]) for n in self.names]
            settings = routing["router"]
            self._router = Router(
                model, options, max_messages=settings["max_messages"], batch_size=1, calibration=settings["calibration"]
            )
            self._offsets = settings["offsets"]
        self._decisions: collections.OrderedDict[str, Route] = collections.OrderedDict()
        self._lock = threading.Lock()

    def route(self, messages: Sequence[dict]) -> Route:
        """The adapter for the conversation `messages` belongs to (the same for each of its requests)."""
        start = opening(messages)
        key = hashlib.sha256(json.dumps(start, sort_keys=True).encode()).hexdigest()
        with self._lock:
            if key not in self._decisions:
                self._decisions[key] = self._decide(start)
                while len(self._decisions) > MAX_DECISIONS:
                    self._decisions.popitem(last=False)
            self._decisions.move_to_end(key)
            return self._decisions[key]

    def _decide(self, start: list[dict]) -> Route:
        if self._router is None:
            return Route(NO_ADAPTER, "general_service", {"general_service": 1.0})
        (index,), weights, _ = self._router.route([start], self._offsets)
        labels = ["general_service", *self.names]
        return Route(
            NO_ADAPTER if index == NO_ADAPTER else self.adapters[index],
            labels[index + 1],
            {label: round(float(w), 4) for label, w in zip(labels, weights[0])},
        )


class Catalog:
    """The served names: `base` (no adapter), each adapter of the stack by its name, and `trace` with a router."""

    def __init__(self, base: str, adapters: Sequence[str], router: TraceRouter | None = None):
        names = [base, *adapters] + ([TRACE] if router else [])
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must differ: {names}")
        self.base, self.adapters, self.router = base, list(adapters), router

    def names(self) -> list[str]:
        return [self.base, *self.adapters] + ([TRACE] if self.router else [])

    def resolve(self, name: object, messages: Sequence[dict] | None = None) -> tuple[int, Route | None]:
        """The adapter index serving a request for model `name` (and the route, for `trace`)."""
        if not isinstance(name, str):
            raise ApiError(f"model must be a string naming one of: {', '.join(self.names())}", param="model")
        if name == TRACE and self.router is not None:
            if messages is None:
                raise ApiError("model 'trace' routes conversations: use /v1/chat/completions", param="model")
            route = self.router.route(messages)
            return route.adapter, route
        if name == self.base:
            return NO_ADAPTER, None
        if name in self.adapters:
            return self.adapters.index(name), None
        raise ApiError(
            f"the model {name!r} does not exist here; served: {', '.join(self.names())}",
            param="model",
            status=404,
            code="model_not_found",
        )
