"""Multi-step task completion: carry out every request of a ticket, each with its look-up, to the end.

The customer is identified already (pre-filled) and asks for several things at once; the
agent must read each order it acts on and make every write, then reply. Difficulty adds steps:
  0  cancel a pending order and return an item of a delivered one (four calls);
  1  also report another order's status (five calls and a fact);
  2  also change the default address on the profile (six calls and a fact).
"""

from __future__ import annotations

import random

from tau2.domains.retail.data_model import Product

from trace_jax.envs.base import call
from trace_jax.envs.capability.environment import Capability, Scenario
from trace_jax.envs.capability.tool_calling import CONFIRM, REASONS
from trace_jax.envs.capability.world import address, build_world
from trace_jax.envs.embedded_retail_families import address_text


def generate(rng: random.Random, difficulty: int, catalogue: dict[str, Product]) -> Scenario:
    """One ticket with `difficulty + 2` requests of one customer (orders: pending, delivered, then any)."""
    while True:  # until the third order's status is not "cancelled", a word any reply on a cancellation holds
        db = build_world(rng, catalogue, num_customers=2, orders_per_customer=(3, 3), max_items=3)
        user = rng.choice(sorted(db.users.values(), key=lambda u: u.user_id))
        pending, delivered, other = (db.orders[o] for o in user.orders)
        if other.status != "cancelled":
            break
    reason = rng.choice(sorted(REASONS))
    item = rng.choice(delivered.items)
    asks = [
        f"Please cancel my order {pending.order_id}, {rng.choice(REASONS[reason])}.",
        f"Also, I want to return the {item.name} from order {delivered.order_id} to the original payment method.",
    ]
    calls = [
        call("get_order_details", order_id=pending.order_id),
        call("cancel_pending_order", order_id=pending.order_id, reason=reason),
        call("get_order_details", order_id=delivered.order_id),
        call(
            "return_delivered_order_items",
            order_id=delivered.order_id,
            item_ids=[item.item_id],
            payment_method_id=delivered.payment_history[0].payment_method_id,
        ),
    ]
    facts: tuple[str, ...] = ()
    if difficulty >= 1:
        asks.append(f"And what is the status of my order {other.order_id}?")
        calls.append(call("get_order_details", order_id=other.order_id))
        facts = (other.status,)
    if difficulty >= 2:
        new = address(rng)
        asks.append(f"Finally, please make {address_text(new)} the default address on my profile.")
        calls.append(call("modify_user_address", user_id=user.user_id, **new.model_dump()))
    ticket = f"My email is {user.email}. {' '.join(asks)} {rng.choice(CONFIRM)}"
    return Scenario(
        variant=f"{len(calls)}_calls",
        db=db,
        ticket=ticket,
        prefilled=(call("find_user_id_by_email", email=user.email),),
        gold_calls=tuple(calls),
        facts=facts,
    )


_TOOLS = (
    "find_user_id_by_email",
    "get_order_details",
    "cancel_pending_order",
    "return_delivered_order_items",
    "modify_user_address",
)
MULTI_STEP = Capability(
    name="multi_step",
    description="Carries a task with several requests through every step (look up, act, report) without "
    "stopping early or looping.",
    generate=generate,
    tools=(_TOOLS[:4], _TOOLS[:4], _TOOLS),
    hint="List every request of the ticket and handle them one by one (read the order, then act) until all are "
    "done; only then write the final message, covering each request.",
)
