"""Seeded synthetic retail worlds in τ²'s retail data model, for capability environments.

A world is a small `RetailDB`: a few invented customers (names, addresses, e-mails and
payment methods drawn from the pools below), their orders in every status τ²'s tools
act on, and the catalogue products those orders hold. Only the catalogue comes from τ²'s
retail DB (products belong to no customer and so to no split); no customer or order of
the target environment appears, so nothing of its held-out split leaks into training.
τ²'s own retail tools run on the world unchanged, so observations look exactly as the
target's do.
"""

from __future__ import annotations

import functools
import random

from tau2.domains.retail.data_model import (
    CreditCard,
    GiftCard,
    Order,
    OrderFullfilment,
    OrderItem,
    OrderPayment,
    Paypal,
    Product,
    RetailDB,
    User,
    UserAddress,
    UserName,
)

from trace_jax.envs.tau2_bridge import domain_state

FIRST_NAMES = (
    "Amara",
    "Bruno",
    "Celine",
    "Dario",
    "Elif",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Keiko",
    "Lars",
    "Mira",
    "Nadia",
    "Oscar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wendell",
    "Ximena",
    "Yusuf",
    "Zoe",
)
LAST_NAMES = (
    "Abbott",
    "Brennan",
    "Castillo",
    "Delacroix",
    "Eriksen",
    "Fontaine",
    "Galloway",
    "Hartmann",
    "Iverson",
    "Jablonski",
    "Kowalczyk",
    "Lindqvist",
    "Moreau",
    "Nakamura",
    "Okafor",
    "Petrov",
    "Quintero",
    "Rasmussen",
    "Sorensen",
    "Takahashi",
    "Underwood",
    "Valdez",
    "Whitaker",
    "Yamamoto",
    "Zielinski",
)
STREETS = (
    "Maple Avenue",
    "Harbor Lane",
    "Juniper Street",
    "Quarry Road",
    "Willow Court",
    "Summit Drive",
    "Orchard Way",
    "Lantern Street",
    "Birch Boulevard",
    "Meadow Lane",
    "Foundry Road",
    "Clover Street",
)
CITIES = (
    ("Portland", "OR", "972"),
    ("Madison", "WI", "537"),
    ("Tucson", "AZ", "857"),
    ("Raleigh", "NC", "276"),
    ("Boise", "ID", "837"),
    ("Albany", "NY", "122"),
    ("Savannah", "GA", "314"),
    ("Spokane", "WA", "992"),
    ("Omaha", "NE", "681"),
    ("Tulsa", "OK", "741"),
    ("Reno", "NV", "895"),
    ("Burlington", "VT", "054"),
)
CARD_BRANDS = ("visa", "mastercard", "amex", "discover")
STATUSES = ("pending", "processed", "delivered", "cancelled")


@functools.cache
def target_order_ids() -> frozenset[str]:
    """The order ids of τ²'s retail DB, which a world's random ids must avoid."""
    return frozenset(domain_state("retail").db.orders)


def digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def address(rng: random.Random) -> UserAddress:
    """A new street address in one of the pool's cities."""
    city, state, zip_prefix = rng.choice(CITIES)
    suite = rng.choice(("", f"Suite {rng.randint(100, 999)}", f"Apt {rng.randint(1, 40)}"))
    return UserAddress(
        address1=f"{rng.randint(10, 9999)} {rng.choice(STREETS)}",
        address2=suite,
        city=city,
        country="USA",
        state=state,
        zip=zip_prefix + digits(rng, 2),
    )


def person(rng: random.Random, taken: set[str]) -> tuple[str, str, str]:
    """An invented customer's first name, last name and a user id made of them that is not in `taken`."""
    while True:
        first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
        user_id = f"{first.lower()}_{last.lower()}_{digits(rng, 4)}"
        if user_id not in taken:
            return first, last, user_id


def _customer(rng: random.Random, taken: set[str]) -> User:
    first, last, user_id = person(rng, taken)
    methods = {}
    for source in rng.sample(("credit_card", "paypal", "gift_card"), rng.randint(1, 3)):
        method_id = f"{source}_{digits(rng, 7)}"
        if source == "credit_card":
            methods[method_id] = CreditCard(
                source=source, id=method_id, brand=rng.choice(CARD_BRANDS), last_four=digits(rng, 4)
            )
        elif source == "paypal":
            methods[method_id] = Paypal(source=source, id=method_id)
        else:
            methods[method_id] = GiftCard(source=source, id=method_id, balance=float(rng.randint(0, 300)))
    return User(
        user_id=user_id,
        name=UserName(first_name=first, last_name=last),
        address=address(rng),
        email=f"{first.lower()}.{last.lower()}{digits(rng, 4)}@example.com",
        payment_methods=methods,
        orders=[],
    )


def _order(
    rng: random.Random, user: User, catalogue: list[Product], status: str, order_id: str, max_items: int
) -> Order:
    items = []
    for product in rng.sample(catalogue, rng.randint(1, max_items)):
        variant = rng.choice(sorted(product.variants.values(), key=lambda v: v.item_id))
        items.append(
            OrderItem(
                name=product.name,
                product_id=product.product_id,
                item_id=variant.item_id,
                price=variant.price,
                options=dict(variant.options),
            )
        )
    method = rng.choice(sorted(user.payment_methods))
    total = round(sum(i.price for i in items), 2)
    payments = [OrderPayment(transaction_type="payment", amount=total, payment_method_id=method)]
    fulfillments = []
    if status in ("processed", "delivered"):
        fulfillments = [OrderFullfilment(tracking_id=[digits(rng, 12)], item_ids=[i.item_id for i in items])]
    reason = None
    if status == "cancelled":
        payments.append(OrderPayment(transaction_type="refund", amount=total, payment_method_id=method))
        reason = rng.choice(("no longer needed", "ordered by mistake"))
    return Order(
        order_id=order_id,
        user_id=user.user_id,
        address=user.address.model_copy(),
        items=items,
        status=status,
        fulfillments=fulfillments,
        payment_history=payments,
        cancel_reason=reason,
    )


def build_world(
    rng: random.Random,
    catalogue: dict[str, Product],
    num_customers: int = 4,
    orders_per_customer: tuple[int, int] = (2, 4),
    max_items: int = 4,
    first_statuses: tuple[str, ...] = ("pending", "delivered"),
) -> RetailDB:
    """`num_customers` invented customers, each with orders of 1 to `max_items` products sampled from
    `catalogue`, whose statuses are `first_statuses` in turn, then drawn."""
    products = [catalogue[k] for k in sorted(catalogue)]
    users: dict[str, User] = {}
    orders: dict[str, Order] = {}
    for _ in range(num_customers):
        user = _customer(rng, set(users))
        for index in range(rng.randint(*orders_per_customer)):
            status = first_statuses[index] if index < len(first_statuses) else rng.choice(STATUSES)
            order_id = f"#W{rng.randint(1_000_000, 9_999_999)}"
            while order_id in orders or order_id in target_order_ids():
                order_id = f"#W{rng.randint(1_000_000, 9_999_999)}"
            orders[order_id] = _order(rng, user, products, status, order_id, max_items)
            user.orders.append(order_id)
        users[user.user_id] = user
    used = {item.product_id for order in orders.values() for item in order.items}
    return RetailDB(products={p: catalogue[p].model_copy(deep=True) for p in sorted(used)}, users=users, orders=orders)
