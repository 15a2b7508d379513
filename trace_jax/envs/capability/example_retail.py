"""An example retail capability environment written against the authoring API (`authoring.py`), shown to the
environment writer in its prompt: the customer asks about an order; the agent must read it and state the
fact asked for. At difficulty 1 a ticket may name an item instead of the order, so the agent must read
the customer's profile to find the order first."""

import random

from trace_jax.envs.capability.retail_api import Product, Scenario, amount_text, build_world, call

NAME = "order_facts"
DOMAIN = "retail"
DESCRIPTION = "Reads the order a customer asks about and states the facts they asked for in the final message."
TOOLS = (
    ("find_user_id_by_email", "get_order_details"),
    ("find_user_id_by_email", "get_user_details", "get_order_details"),
)


def generate(rng: random.Random, difficulty: int, catalogue: dict[str, Product]) -> Scenario:
    """One question about one of the customer's orders, named by its id (or, from difficulty 1, by an item)."""
    db = build_world(rng, catalogue, num_customers=3, orders_per_customer=(2, 4), max_items=3)
    user = rng.choice(sorted(db.users.values(), key=lambda u: u.user_id))
    orders = [db.orders[o] for o in user.orders]
    gold = []
    # items whose name appears in only one of the customer's orders identify that order
    unique = [(o, i) for o in orders for i in o.items if sum(i.name in {x.name for x in p.items} for p in orders) == 1]
    if difficulty >= 1 and unique and rng.random() < 0.5:
        order, item = rng.choice(unique)
        which, variant = f"the order with the {item.name}", "by_item"
        gold.append(call("get_user_details", user_id=user.user_id))
    else:
        order = rng.choice(orders)
        which, variant = f"order {order.order_id}", "by_id"
    gold.append(call("get_order_details", order_id=order.order_id))
    if rng.random() < 0.5:
        question, fact = f"What is the status of {which}?", order.status
    else:
        question, fact = f"How much did I pay for {which}?", amount_text(order.payment_history[0].amount)
    return Scenario(
        variant=variant,
        db=db,
        ticket=f"My email is {user.email}. {question} Please tell me.",
        prefilled=(call("find_user_id_by_email", email=user.email),),
        gold_calls=tuple(gold),
        facts=(fact,),
    )
