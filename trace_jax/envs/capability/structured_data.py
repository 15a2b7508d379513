"""Structured data reasoning: find, in tool results already on the page, the value a request needs.

The customer asks to cancel "the pending order with the <product>" without its order id.
The conversation arrives pre-filled: the customer is identified, the profile read (its
order ids) and every order's details read, so the id is there, in one of several JSON
results, and nowhere in the ticket. Every order shown is pending, so only the product
tells the right one. Difficulty widens the search:
  0  two orders on the page;
  1  three orders;
  2  four orders, and the reply must also state the amount paid for the order cancelled.
"""

from __future__ import annotations

import random

from tau2.domains.retail.data_model import Product

from trace_jax.envs.base import call
from trace_jax.envs.capability.environment import Capability, Scenario
from trace_jax.envs.capability.tool_calling import CONFIRM, REASONS
from trace_jax.envs.capability.world import build_world
from trace_jax.envs.embedded_retail_families import amount_text


def generate(rng: random.Random, difficulty: int, catalogue: dict[str, Product]) -> Scenario:
    """One ticket naming a product of one of the customer's `difficulty + 2` pending orders."""
    shown = difficulty + 2
    while True:  # until an order holds a product no other shown order has
        db = build_world(
            rng,
            catalogue,
            num_customers=2,
            orders_per_customer=(shown, shown),
            max_items=3,
            first_statuses=("pending",) * shown,
        )
        user = rng.choice(sorted(db.users.values(), key=lambda u: u.user_id))
        orders = [db.orders[o] for o in user.orders]
        names = [{i.name for i in o.items} for o in orders]
        unique = [
            (o, n) for k, o in enumerate(orders) for n in sorted(names[k] - set().union(*names[:k], *names[k + 1 :]))
        ]
        if unique:
            break
    order, product = rng.choice(unique)
    reason = rng.choice(sorted(REASONS))
    ask = f"Please cancel my pending order that has the {product} in it, {rng.choice(REASONS[reason])}."
    facts = ()
    if difficulty >= 2:
        ask += " Also tell me how much I paid for that order."
        facts = (amount_text(order.payment_history[0].amount),)
    prefilled = (
        call("find_user_id_by_email", email=user.email),
        call("get_user_details", user_id=user.user_id),
        *(call("get_order_details", order_id=o.order_id) for o in orders),
    )
    return Scenario(
        variant=f"{shown}_orders",
        db=db,
        ticket=f"My email is {user.email}. {ask} {rng.choice(CONFIRM)}",
        prefilled=prefilled,
        gold_calls=(call("cancel_pending_order", order_id=order.order_id, reason=reason),),
        facts=facts,
    )


_TOOLS = ("find_user_id_by_email", "get_user_details", "get_order_details", "cancel_pending_order")
STRUCTURED_DATA = Capability(
    name="structured_data",
    description="Reads the values a step needs (ids, items, amounts, statuses) out of earlier tool results and "
    "uses or reports them exactly.",
    generate=generate,
    tools=(_TOOLS, _TOOLS, _TOOLS),
    # the look-ups are pre-filled at every level: only the write is left, and only the hinted scaffolds add to that
    scaffolds=("exact_hint", "opened_call", "written_call"),
    hint="The ticket does not give the order id: find the order holding the product the customer names among the "
    "order details already in the conversation and use its exact id; state amounts as the tools print them.",
)
