"""THE RETAIL DOMAIN (DOMAIN = "retail"): `from trace_jax.envs.capability.retail_api import ...` these names.

A retail ticket identifies the customer by e-mail, or by name and zip; τ²'s retail tools find the customer
from them (find_user_id_by_email, find_user_id_by_name_zip) and take order ids with their "#".

DATA BUILDER. `build_world(rng, catalogue, num_customers=4, orders_per_customer=(2, 4), max_items=4,
first_statuses=("pending", "delivered"))` returns a new `RetailDB` of invented customers: each has
between orders_per_customer[0] and [1] orders of 1 to `max_items` catalogue products; a customer's first
orders have the statuses of `first_statuses` in turn (so every customer has a pending and a delivered
order by default), later ones a status drawn from STATUSES = ("pending", "processed", "delivered",
"cancelled"). You may change the world after building it (statuses, a variant's `available`, a gift
card's balance), keeping it consistent. `address(rng)` draws a new `UserAddress`; `address_text(a)`
writes an address as a ticket would; `amount_text(x)` writes a dollar amount ("608.9") as a fact.
REASONS maps each cancellation reason of `cancel_pending_order` ("no longer needed", "ordered by
mistake") to ways a customer says it; CONFIRM holds sentences confirming an action.

THE RETAIL DATA MODEL (pydantic models of τ²; read them as attributes):
  RetailDB: products: dict[product_id, Product], users: dict[user_id, User], orders: dict[order_id, Order]
  User: user_id, name (first_name, last_name), address (UserAddress), email,
        payment_methods: dict[id, CreditCard(source="credit_card", id, brand, last_four) |
        Paypal(source="paypal", id) | GiftCard(source="gift_card", id, balance)], orders: list[order_id]
  UserAddress: address1, address2, city, country, state, zip
  Order: order_id ("#W1234567"), user_id, address, items: list[OrderItem], status ("pending",
        "processed", "delivered", "cancelled", ...), fulfillments: list[(tracking_id: list[str],
        item_ids)], payment_history: list[(transaction_type "payment" | "refund", amount,
        payment_method_id)], cancel_reason
  OrderItem: name, product_id, item_id, price, options: dict[str, str]
  Product: name, product_id, variants: dict[item_id, Variant(item_id, options, available, price)]
The `catalogue` argument is τ²'s product catalogue (product_id -> Product): read it, never change it.
"""

from tau2.domains.retail.data_model import (
    CreditCard,
    GiftCard,
    Order,
    OrderItem,
    Paypal,
    Product,
    RetailDB,
    User,
    UserAddress,
    Variant,
)

from trace_jax.envs.base import Call, call
from trace_jax.envs.capability.environment import Scenario
from trace_jax.envs.capability.tool_calling import CONFIRM, REASONS
from trace_jax.envs.capability.world import STATUSES, address, build_world
from trace_jax.envs.embedded_retail_families import address_text, amount_text

__all__ = [
    "CONFIRM",
    "REASONS",
    "STATUSES",
    "Call",
    "CreditCard",
    "GiftCard",
    "Order",
    "OrderItem",
    "Paypal",
    "Product",
    "RetailDB",
    "Scenario",
    "User",
    "UserAddress",
    "Variant",
    "address",
    "address_text",
    "amount_text",
    "build_world",
    "call",
]
