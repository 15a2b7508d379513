"""The τ² domains capability environments are built over (retail, airline), and what differs between them.

A capability environment keeps its target's tools, policy and solo-ticket protocol and runs τ²'s own
tools on a small synthetic world in the domain's data model. Per domain: the DB type, the part of τ²'s
DB a generator reads (its catalogue: retail's products, airline's flight schedule; neither belongs to a
customer, so neither to a split) and the solo agent's instruction.
"""

from __future__ import annotations

import dataclasses
import importlib

from tau2.domains.airline.data_model import FlightDB
from tau2.domains.airline.tools import AirlineTools
from tau2.domains.retail.data_model import RetailDB
from tau2.domains.retail.tools import RetailTools
from tau2.environment.db import DB
from tau2.environment.environment import Environment
from tau2.environment.toolkit import ToolKitBase

from trace_jax.envs.embedded_retail import SOLO_INSTRUCTION, system_prompt
from trace_jax.envs.tau2_bridge import DomainState, domain_state

AIRLINE_INSTRUCTION = (
    "You are a customer service agent of an airline, working on one written customer ticket. "
    "You cannot talk with the customer: the ticket is their whole request and their explicit confirmation "
    "of the actions it asks for. Follow the policy below: identify the customer by their user id, check a "
    "reservation before acting on it, and refuse what the policy forbids. Make one tool call per turn. When you "
    "are done, write one final message to the customer with the outcome and the information they asked for; "
    "that message ends the conversation."
)


@dataclasses.dataclass(frozen=True)
class WorldDomain:
    """One τ² domain as capability environments use it."""

    name: str  # τ²'s domain name
    business: str  # what the agent serves, for the environment writer's prompt
    db_type: type[DB]
    toolkit: type[ToolKitBase]  # τ²'s tools of the domain
    catalogue_field: str  # the field of τ²'s DB that generators read and worlds copy from
    instruction: str  # the solo agent's instruction, before the policy

    @property
    def state(self) -> DomainState:
        return domain_state(self.name)

    def catalogue(self) -> dict:
        """τ²'s catalogue of this domain (read it, never change it)."""
        return getattr(self.state.db, self.catalogue_field)

    def environment(self, db: DB) -> Environment:
        """A τ² environment of this domain whose tools act on a private copy of `db`."""
        module = importlib.import_module(f"tau2.domains.{self.name}.environment")
        return module.get_environment(db=db.model_copy(deep=True))

    def system_prompt(self, policy: bool) -> str:
        """The instruction, followed by τ²'s policy of the domain when `policy`."""
        return system_prompt(self.state.policy, self.instruction) if policy else self.instruction


DOMAINS: dict[str, WorldDomain] = {
    "retail": WorldDomain(
        "retail", "an online retail store (τ²-bench retail)", RetailDB, RetailTools, "products", SOLO_INSTRUCTION
    ),
    "airline": WorldDomain(
        "airline", "an airline (τ²-bench airline)", FlightDB, AirlineTools, "flights", AIRLINE_INSTRUCTION
    ),
}


def world_domain(name: str) -> WorldDomain:
    """The domain called `name`; a ValueError lists the valid ones."""
    if name not in DOMAINS:
        raise ValueError(f"capability environments have no domain {name!r}; valid domains: {', '.join(DOMAINS)}")
    return DOMAINS[name]
