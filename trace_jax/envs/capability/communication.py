"""Communication: look up what the customer asks about and state every fact of it in the final reply.

The customer is identified already (pre-filled); the agent reads the order the ticket names
and answers. Difficulty asks for more facts at once:
  0  the order's status;
  1  also the amount paid;
  2  also the names of the items in it.
"""

from __future__ import annotations

import random

from tau2.domains.retail.data_model import Product

from trace_jax.envs.base import call
from trace_jax.envs.capability.environment import Capability, Scenario
from trace_jax.envs.capability.world import build_world
from trace_jax.envs.embedded_retail_families import amount_text

QUESTIONS = ("what is the status of my order {}?", "how much did I pay for it?", "which items are in it?")


def generate(rng: random.Random, difficulty: int, catalogue: dict[str, Product]) -> Scenario:
    """One question about one of the customer's orders, asking for `difficulty + 1` kinds of facts."""
    db = build_world(rng, catalogue, num_customers=2, orders_per_customer=(2, 3), max_items=3)
    user = rng.choice(sorted(db.users.values(), key=lambda u: u.user_id))
    order = db.orders[rng.choice(user.orders)]
    facts = [order.status, amount_text(order.payment_history[0].amount), *sorted({i.name for i in order.items})]
    asked = QUESTIONS[: difficulty + 1]
    ask = " And ".join(q.format(order.order_id) for q in asked)
    count = {0: 1, 1: 2, 2: len(facts)}[difficulty]
    return Scenario(
        variant=("status", "status_amount", "status_amount_items")[difficulty],
        db=db,
        ticket=f"My email is {user.email}. Could you tell me {ask}",
        prefilled=(call("find_user_id_by_email", email=user.email),),
        gold_calls=(call("get_order_details", order_id=order.order_id),),
        facts=tuple(facts[:count]),
    )


_TOOLS = ("find_user_id_by_email", "get_order_details", "get_user_details")
COMMUNICATION = Capability(
    name="communication",
    description="States in the final reply every fact the customer asked for, exactly as the tools gave it.",
    generate=generate,
    tools=(_TOOLS, _TOOLS, _TOOLS),
    scaffolds=("exact_hint", "opened_call", "written_call"),  # its one call is the read the facts come from
    hint="Read the order the customer asks about, then state in the final message every fact they asked for, "
    "written exactly as the tool returned it (status, amount paid, item names).",
)
