"""τ²'s own evaluator on reference trajectories, for tests that compare our scores with τ²'s."""

from __future__ import annotations

import importlib

from tau2.data_model.message import AssistantMessage, UserMessage
from tau2.data_model.simulation import SimulationRun, TerminationReason
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

from trace_jax.envs.scripted import USER_STOP
from trace_jax.envs.tau2_bridge import cached_domain_name
from trace_jax.envs.tau2_domains import GREETING


def tau2_environment(domain: str):
    """A τ² environment built by τ²'s own constructor (parsing the DB files)."""
    return importlib.import_module(f"tau2.domains.{domain}.environment").get_environment()


def tau2_run(task, messages: list, reason: TerminationReason = TerminationReason.USER_STOP) -> SimulationRun:
    """A simulation built directly with τ²'s classes."""
    return SimulationRun(
        id="reference",
        task_id=task.id,
        start_time="",
        end_time="",
        duration=0.0,
        termination_reason=reason,
        messages=messages,
    )


def reference(domain_name: str, task, run: SimulationRun, kind=EvaluationType.ALL):
    """τ²'s own evaluation of `run`, its environments built by the constructor registered as `domain_name`."""
    return evaluate_simulation(run, task, kind, solo_mode=False, domain=domain_name)


def empty_messages() -> list:
    """The honest empty conversation: the user stops right after the agent's greeting."""
    return [AssistantMessage(role="assistant", content=GREETING), UserMessage(role="user", content=USER_STOP)]


def empty_trajectory_reward(domain: str, task) -> float:
    """τ²'s reward for the empty conversation of `task`."""
    return reference(cached_domain_name(domain), task, tau2_run(task, empty_messages())).reward
