"""Error recovery: after a tool error, correct the call or change approach instead of repeating it.

The ticket gives a mistyped e-mail as well as the customer's name and zip code, and the
conversation arrives with the failed e-mail look-up already made ("Error: User not
found"): the agent must identify the customer by name and zip instead, then do the request.
Difficulty adds errors to recover from:
  0  the failed look-up, then cancel a pending order;
  1  also: the ticket writes the order id without its "#", so a look-up by it fails too;
  2  as 1, with a return of a delivered order's item instead of a cancellation.
"""

from __future__ import annotations

import random

from tau2.domains.retail.data_model import Product

from trace_jax.envs.base import call
from trace_jax.envs.capability.environment import Capability, Scenario
from trace_jax.envs.capability.tool_calling import CONFIRM, REASONS
from trace_jax.envs.capability.world import build_world


def _mistyped(email: str, rng: random.Random) -> str:
    """The e-mail with two letters of its local part swapped (or one dropped): no such customer."""
    local, domain = email.split("@")
    i = rng.randrange(len(local) - 1)
    swapped = local[:i] + local[i + 1] + local[i] + local[i + 2 :]
    return (swapped if swapped != local else local[:i] + local[i + 1 :]) + "@" + domain


def generate(rng: random.Random, difficulty: int, catalogue: dict[str, Product]) -> Scenario:
    """One request after a failed e-mail look-up (and, from difficulty 1, an order id missing its "#")."""
    db = build_world(rng, catalogue, num_customers=2, orders_per_customer=(2, 3), max_items=3)
    user = rng.choice(sorted(db.users.values(), key=lambda u: u.user_id))
    pending, delivered = (db.orders[o] for o in user.orders[:2])
    order = delivered if difficulty >= 2 else pending
    written = order.order_id.lstrip("#") if difficulty >= 1 else order.order_id
    mistyped = _mistyped(user.email, rng)
    intro = f"My email is {mistyped}, I'm {user.name.first_name} {user.name.last_name}, zip code {user.address.zip}."
    if difficulty >= 2:
        item = rng.choice(order.items)
        ask = f"I want to return the {item.name} from order {written} to the original payment method."
        write = call(
            "return_delivered_order_items",
            order_id=order.order_id,
            item_ids=[item.item_id],
            payment_method_id=order.payment_history[0].payment_method_id,
        )
    else:
        reason = rng.choice(sorted(REASONS))
        ask = f"Please cancel my order {written}, {rng.choice(REASONS[reason])}."
        write = call("cancel_pending_order", order_id=order.order_id, reason=reason)
    find = call(
        "find_user_id_by_name_zip", first_name=user.name.first_name, last_name=user.name.last_name, zip=user.address.zip
    )
    return Scenario(
        variant=("email", "email_and_id", "email_id_return")[difficulty],
        db=db,
        ticket=f"{intro} {ask} {rng.choice(CONFIRM)}",
        prefilled=(call("find_user_id_by_email", email=mistyped),),
        gold_calls=(find, call("get_order_details", order_id=order.order_id), write),
    )


_TOOLS = (
    "find_user_id_by_email",
    "find_user_id_by_name_zip",
    "get_order_details",
    "cancel_pending_order",
    "return_delivered_order_items",
)
ERROR_RECOVERY = Capability(
    name="error_recovery",
    description="After a tool error, corrects the call or changes approach instead of repeating it.",
    generate=generate,
    tools=(_TOOLS[:4], _TOOLS[:4], _TOOLS),
    hint="When a tool returns an error, do not repeat the call: correct its argument (order ids start with '#') "
    "or take another way (find the customer by name and zip code).",
)
