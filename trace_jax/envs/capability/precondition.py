"""Precondition verification: read the order before acting on it, and act only where the policy allows.

The customer is identified already (pre-filled); the order is not read. The agent must
read it, then either make the write the ticket asks for or refuse it and say why: every
write the task does not call for (even one the system rejects) fails the task's call level.
Difficulty adds ways a request can be forbidden:
  0  cancel a pending order (allowed) or a processed / delivered one (refuse, stating its status);
  1  also: cancel an order that belongs to another customer (refuse);
  2  also: return an item of an order that is not delivered yet (refuse, stating its status).
About two in five tasks are allowed, so acting blindly and refusing blindly both fail.
"""

from __future__ import annotations

import random

from tau2.domains.retail.data_model import Product

from trace_jax.envs.base import call
from trace_jax.envs.capability.environment import Capability, Scenario
from trace_jax.envs.capability.tool_calling import CONFIRM, REASONS
from trace_jax.envs.capability.world import build_world

FORBIDDEN = ("not_pending", "other_user", "return_not_delivered")  # by difficulty


def generate(rng: random.Random, difficulty: int, catalogue: dict[str, Product]) -> Scenario:
    """One request, allowed or forbidden by one of the preconditions `difficulty` allows."""
    db = build_world(rng, catalogue, num_customers=3, orders_per_customer=(3, 4), max_items=3)
    users = sorted(db.users.values(), key=lambda u: u.user_id)
    user = rng.choice(users)
    own = [db.orders[o] for o in user.orders]
    variant = "allowed" if rng.random() < 0.4 else rng.choice(FORBIDDEN[: difficulty + 1])
    reason = rng.choice(sorted(REASONS))
    cancel = f"Please cancel my order {{}}, {rng.choice(REASONS[reason])}."
    if variant == "allowed":
        order = rng.choice([o for o in own if o.status == "pending"])
        ask = cancel.format(order.order_id)
    elif variant == "not_pending":
        order = rng.choice([o for o in own if o.status in ("processed", "delivered")])
        ask = cancel.format(order.order_id)
    elif variant == "other_user":
        order = rng.choice(
            [db.orders[o] for u in users if u is not user for o in u.orders if db.orders[o].status == "pending"]
        )
        ask = cancel.format(order.order_id)
    else:
        order = rng.choice([o for o in own if o.status in ("pending", "processed")])
        ask = f"I want to return the {order.items[0].name} from my order {order.order_id}."
    gold = [call("get_order_details", order_id=order.order_id)]
    if variant == "allowed":
        gold.append(call("cancel_pending_order", order_id=order.order_id, reason=reason))
    facts = (order.status,) if variant in ("not_pending", "return_not_delivered") else ()
    ticket = f"My email is {user.email}. {ask} {rng.choice(CONFIRM)} If you cannot do it, tell me why."
    return Scenario(
        variant=variant,
        db=db,
        ticket=ticket,
        prefilled=(call("find_user_id_by_email", email=user.email),),
        gold_calls=tuple(gold),
        facts=facts,
    )


_TOOLS = ("find_user_id_by_email", "get_order_details", "cancel_pending_order", "return_delivered_order_items")
PRECONDITION = Capability(
    name="precondition",
    description="Checks what the policy requires before a write (the order's owner and status) and does not act "
    "when a precondition fails, saying why.",
    generate=generate,
    tools=(_TOOLS[:3], _TOOLS[:3], _TOOLS),
    hint="Read the order before any write and check its status and owner against the policy; when the policy "
    "forbids the request, make no write and tell the customer why (for example the order's status).",
)
