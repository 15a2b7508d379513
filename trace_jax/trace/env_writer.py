"""TRACE stage 2 by synthesis: an LLM writes a capability's environment as a module of the authoring API.

The writer shows the LLM the authoring API for the target's τ² domain (`authoring.guide`: retail or airline),
a complete example module of that domain that passes validation, τ²'s tools of the domain and the capability
(its description, what lacking it looks like, evidence from the analysis), and asks for one module in a
```python block. The module is validated in the sandbox (`trace_jax.envs.capability.sandbox`); a reply without
code, or a module that fails, is answered in the same conversation with the failure report and asked again, up
to `max_attempts` attempts. A `judge` may then reject a module that passed (the pipeline calibrates it against
the base agent, and a module it cannot calibrate is asked for again with the calibration's verdict, as the
paper regenerates an environment that is too easy or too hard). Files, in the capability's folder:

  attempt_<i>.py, attempt_<i>.json   each attempt's module (when the reply held one) and report
  module.py, validation.json         the accepted module and its report
  scenarios.json                     its exported train and held-out tasks (`ExportedEnvironment`)
  synthesis.json                     the outcome: accepted or not, attempts, requests, every report

A rerun resumes: an accepted module is not regenerated, an attempt whose module is already on disk is
not validated again, and the client's disk cache answers repeated requests without sending them.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable, Sequence

from absl import logging

from trace_jax.envs.capability import authoring
from trace_jax.envs.capability.domains import world_domain
from trace_jax.envs.capability.sandbox import Checks, ExportedEnvironment, Limits, ValidationReport, validate_module
from trace_jax.files import read_json, write_json_atomic
from trace_jax.isolation import IsolationUnavailable, isolation_problem
from trace_jax.llm.client import ChatClient
from trace_jax.settings import non_negative_int, positive_int, positive_number, setting, share
from trace_jax.trace.analyst import CapabilityCard

_CODE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

SYSTEM = (
    "You are an expert Python engineer who writes training environments for LLM customer-service agents of "
    "{business}. You write one complete Python module against the authoring API below and reply with the "
    "whole module in one ```python code block.\n\n{guide}"
)

REQUEST = """Write the capability environment for this capability of the agent:

NAME = {name!r}
DOMAIN = {domain!r}
description: {description}
what an agent lacking it does: {lacking}
evidence from the agent's failed tasks:
{evidence}

τ²'s {domain} tools (TOOLS names a subset of them):
{tools}

An example module for another capability, which passes validation:
```python
{example}
```

Design tasks that an agent with the capability solves and one lacking it fails, in the ways the evidence shows; \
use 2 or 3 difficulties, each adding what makes the capability harder. Reply with the whole module in one \
```python code block."""

RETRY = """Your module was not accepted.

{report}

Fix the module and reply with the whole corrected module in one ```python code block."""

NO_CODE = "The reply held no ```python code block with the module."

# (attempt, its passing report, its exported tasks) -> None to accept, or why not (sent back to the LLM)
Judge = Callable[[int, ValidationReport, pathlib.Path], str | None]


@dataclasses.dataclass(frozen=True)
class EnvWriterSettings:
    """The `env_writer` block (the paper's released code regenerates up to 5 times)."""

    # modules asked for per capability, each told the previous one's failure
    max_attempts: int = setting(5, "an int >= 1", positive_int)
    seeds: int = setting(100, "an int >= 1", positive_int)  # validation seeds at each difficulty
    # share of seeds (at each difficulty) where the gold solution must score 1.0
    min_gold_success: float = setting(0.95, "a number in [0, 1]", share)
    max_empty_reward: float = setting(0.1, "a number in [0, 1]", share)  # most mean reward of the do-nothing agent
    # the sandbox's wall clock for one validation (with the export)
    timeout_s: float = setting(600.0, "a number of seconds > 0", positive_number)
    cpu_s: float = setting(300.0, "a number of seconds > 0", positive_number)  # the module's CPU seconds in the sandbox
    # the module's memory in the sandbox, on top of the sandbox's own
    memory_mb: int = setting(2048, "an int >= 1 (MB)", positive_int)
    # train and held-out tasks exported per difficulty (at least `seeds`, which the replay plays on them)
    export_tasks: int = setting(200, "an int >= 1", positive_int)
    max_evidence: int = setting(5, "an int >= 0", non_negative_int)  # evidence lines shown


@dataclasses.dataclass(frozen=True)
class Synthesis:
    """One capability's synthesis: whether a module was accepted, how many attempts and requests it took, and
    each attempt's report."""

    name: str
    accepted: bool
    attempts: int
    requests: int  # requests sent to the endpoint by this run (the cache answered the others)
    cache_hits: int
    scenarios: str | None  # the accepted module's exported tasks
    reports: tuple[ValidationReport, ...]

    def environment(self, difficulty: float = 0, policy: bool = True) -> ExportedEnvironment | None:
        """The accepted environment at `difficulty`, or None when no module was accepted."""
        return ExportedEnvironment(self.scenarios, difficulty, policy) if self.accepted else None

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "reports": [r.to_json() for r in self.reports]}

    @classmethod
    def from_json(cls, data: dict) -> Synthesis:
        return cls(**{**data, "reports": tuple(ValidationReport.from_json(r) for r in data["reports"])})


def extract_code(reply: str) -> str | None:
    """The module in a reply: its longest fenced code block (```python or bare), or None when it has none."""
    blocks = [b for b in _CODE.findall(reply) if b.strip()]
    return max(blocks, key=len) if blocks else None


def example(domain: str) -> pathlib.Path:
    """The example module of `domain` the writer is shown (it passes validation)."""
    return pathlib.Path(authoring.__file__).with_name(f"example_{domain}.py")


def prompt(card: CapabilityCard, evidence: Sequence[str], domain: str) -> list[dict]:
    """The first request for `card`'s module in τ²'s `domain`: the API as the system message, the capability,
    the domain's tools and its example."""
    lines = "\n".join(f"- {line}" for line in evidence) or "- (none)"
    request = REQUEST.format(
        name=card.name,
        domain=domain,
        description=card.description,
        lacking=card.lacking,
        evidence=lines,
        tools=authoring.tool_listing(domain),
        example=example(domain).read_text(encoding="utf-8").strip(),
    )
    system = SYSTEM.format(business=world_domain(domain).business, guide=authoring.guide(domain))
    return [{"role": "system", "content": system}, {"role": "user", "content": request}]


def _attempt(
    source: str | None,
    folder: pathlib.Path,
    i: int,
    name: str,
    domain: str,
    settings: EnvWriterSettings,
    checks: Checks,
) -> ValidationReport:
    """Attempt `i`'s report: read back when this very module was validated before, else from the sandbox."""
    report_path, source_path = folder / f"attempt_{i}.json", folder / f"attempt_{i}.py"
    if report_path.exists() and (
        source is None or (source_path.exists() and source_path.read_text(encoding="utf-8") == source)
    ):
        return ValidationReport.from_json(read_json(report_path))
    if source is None:
        report = ValidationReport.failed(NO_CODE, checks)
    else:
        source_path.write_text(source, encoding="utf-8")
        limits = Limits(timeout_s=settings.timeout_s, cpu_s=settings.cpu_s, memory_mb=settings.memory_mb)
        report = validate_module(
            source,
            name=name,
            domain=domain,
            checks=checks,
            limits=limits,
            export=folder / "scenarios.json",
            export_tasks=settings.export_tasks,
        )
    write_json_atomic(report_path, report.to_json())
    return report


def write_environment(
    card: CapabilityCard,
    evidence: Sequence[str],
    client: ChatClient,
    folder: str | pathlib.Path,
    settings: EnvWriterSettings,
    judge: Judge | None = None,
    domain: str = "retail",
) -> Synthesis:
    """Asks `client` for `card`'s environment module in τ²'s `domain` until one passes validation (and
    `judge`, when given) or `settings.max_attempts` attempts have failed (`settings`: the `env_writer` block);
    writes everything under `folder` (see the module docstring) and resumes from it."""
    if isolation_problem():  # before any request: written code is never run unisolated
        raise IsolationUnavailable(isolation_problem())
    folder = pathlib.Path(folder)
    summary_path = folder / "synthesis.json"
    if summary_path.exists():
        done = Synthesis.from_json(read_json(summary_path))
        if done.accepted:
            logging.info("env writer %s: accepted before (%d attempts)", card.name, done.attempts)
            return done
    folder.mkdir(parents=True, exist_ok=True)
    checks = Checks(
        seeds=settings.seeds, min_gold_success=settings.min_gold_success, max_empty_reward=settings.max_empty_reward
    )
    stats_before = dict(client.stats)
    messages = prompt(card, evidence[: settings.max_evidence], domain)
    reports: list[ValidationReport] = []
    for i in range(1, settings.max_attempts + 1):
        reply = client.complete(messages)
        source = extract_code(reply)
        report = _attempt(source, folder, i, card.name, domain, settings, checks)
        if report.passed and judge is not None:
            verdict = judge(i, report, folder / "scenarios.json")
            if verdict:
                report = dataclasses.replace(report, passed=False, error=verdict)
                write_json_atomic(folder / f"attempt_{i}.json", report.to_json())
        reports.append(report)
        logging.info(
            "env writer %s: attempt %d/%d %s",
            card.name,
            i,
            settings.max_attempts,
            "passed" if report.passed else "failed: " + report.failure_report().replace("\n", " | ")[:300],
        )
        if report.passed:
            (folder / "module.py").write_text(source, encoding="utf-8")
            write_json_atomic(folder / "validation.json", report.to_json())
            break
        messages = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": RETRY.format(report=report.failure_report())},
        ]
    accepted = reports[-1].passed
    synthesis = Synthesis(
        name=card.name,
        accepted=accepted,
        attempts=len(reports),
        requests=client.stats["requests"] - stats_before["requests"],
        cache_hits=client.stats["cache_hits"] - stats_before["cache_hits"],
        scenarios=str(folder / "scenarios.json") if accepted else None,
        reports=tuple(reports),
    )
    write_json_atomic(summary_path, synthesis.to_json())
    if not accepted:
        logging.warning(
            "env writer %s: no module passed in %d attempts; the capability is dropped", card.name, len(reports)
        )
    return synthesis
