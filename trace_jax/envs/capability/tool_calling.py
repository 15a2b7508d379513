"""Tool-calling precision: after the look-ups are done, make the one write call the ticket asks for
with exactly the right arguments, taken from the ticket and the tool results above it.

The conversation arrives pre-filled: the customer is found by e-mail and the order in
question is read (and the profile, where a gift card's id is needed), so every value the
call needs is on the page. Difficulty
widens the calls asked for, each with more arguments to get exactly right:
  0  cancel a pending order (order id; the ticket's words mapped onto the reason enum);
  1  also: return named items of a delivered order (item ids from the order's details, the
     refund to the original payment method or the customer's gift card);
  2  also: ship a pending order to a new address stated in the ticket (six address fields);
  3  also: ship a pending order to the default address on the customer's profile (read from it).
Each kind is a family of its own (`Capability.families`): calibrated and trained as a variant-pure level.
"""

from __future__ import annotations

import random

from tau2.domains.retail.data_model import Product

from trace_jax.envs.base import call
from trace_jax.envs.capability.environment import Capability, Scenario
from trace_jax.envs.capability.world import address, build_world
from trace_jax.envs.embedded_retail_families import address_text

VARIANTS = ("cancel", "return", "address", "default_address")  # in the order difficulty adds them
REASONS = {
    "no longer needed": ("I don't need it anymore", "it's no longer needed", "I changed my mind about it"),
    "ordered by mistake": ("I ordered it by mistake", "I placed it by accident", "it was a mistaken order"),
}
CONFIRM = ("I confirm, please go ahead.", "Yes, please do it.", "You have my confirmation.")


def generate(rng: random.Random, difficulty: int, catalogue: dict[str, Product]) -> Scenario:
    """One ticket for a write call of a variant drawn among those `difficulty` allows."""
    db = build_world(rng, catalogue, num_customers=3, orders_per_customer=(2, 3), max_items=3)
    user = rng.choice(sorted(db.users.values(), key=lambda u: u.user_id))
    variant = rng.choice(VARIANTS[: difficulty + 1])
    status = "delivered" if variant == "return" else "pending"
    order = db.orders[rng.choice([o for o in user.orders if db.orders[o].status == status])]
    intro = f"My email is {user.email}."
    lookups = [call("find_user_id_by_email", email=user.email)]
    if variant == "cancel":
        reason = rng.choice(sorted(REASONS))
        ask = f"Please cancel my order {order.order_id}, {rng.choice(REASONS[reason])}."
        gold = call("cancel_pending_order", order_id=order.order_id, reason=reason)
    elif variant == "return":
        items = rng.sample(order.items, rng.randint(1, len(order.items)))
        names = " and ".join(f"the {i.name}" for i in items)
        gift_cards = sorted(p for p, m in user.payment_methods.items() if m.source == "gift_card")
        if gift_cards and rng.random() < 0.5:
            payment, to = gift_cards[0], "my gift card"
            lookups.append(call("get_user_details", user_id=user.user_id))
        else:
            payment, to = order.payment_history[0].payment_method_id, "the original payment method"
        ask = f"I want to return {names} from order {order.order_id}, refunded to {to}."
        gold = call(
            "return_delivered_order_items",
            order_id=order.order_id,
            item_ids=[i.item_id for i in items],
            payment_method_id=payment,
        )
    elif variant == "address":
        new = address(rng)
        ask = f"Please ship my order {order.order_id} to {address_text(new)} instead."
        gold = call("modify_pending_order_address", order_id=order.order_id, **new.model_dump())
    else:
        order.address = address(rng)  # shipped elsewhere than the profile's address, which the ticket asks for
        ask = f"Please ship my order {order.order_id} to the default address on my profile instead."
        lookups.append(call("get_user_details", user_id=user.user_id))
        gold = call("modify_pending_order_address", order_id=order.order_id, **user.address.model_dump())
    lookups.append(call("get_order_details", order_id=order.order_id))
    return Scenario(
        variant=variant,
        db=db,
        ticket=f"{intro} {ask} {rng.choice(CONFIRM)}",
        prefilled=tuple(lookups),
        gold_calls=(gold,),
    )


_TOOLS = (
    "find_user_id_by_email",
    "get_order_details",
    "cancel_pending_order",
    "get_user_details",
    "return_delivered_order_items",
    "modify_pending_order_address",
)
TOOL_CALLING = Capability(
    name="tool_calling",
    description="Makes the tool call a request needs with exactly the right arguments, taken from the "
    "conversation and earlier tool results.",
    generate=generate,
    tools=(_TOOLS[:3], _TOOLS[:5], _TOOLS, _TOOLS),
    # the look-ups are pre-filled at every level: only the write is left, and only the hinted scaffolds add to that
    scaffolds=("exact_hint", "opened_call", "written_call"),
    families=VARIANTS,
    hint="Take every argument of the write call exactly from the ticket and the tool results in the conversation: "
    "ids as the tools print them, item ids from the order's details, the reason as one of its allowed values.",
)
