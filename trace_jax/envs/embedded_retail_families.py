"""Task families of the embedded retail environment: seeded solo tickets over τ²'s real retail DB.

Each family turns one customer of a split (and that customer's orders) into a written
ticket, the gold tool calls a policy-following agent makes, and the facts its final reply
must state. Families, easiest first:

- order_status: report an order's status and the amount charged (identified by e-mail);
- lookup_by_email: identify by e-mail, report profile facts (order ids, default address);
- lookup_by_name_zip: identify by name and zip, report profile facts (order ids, address, e-mail);
- cancel_pending: cancel a pending order for a reason that maps onto the tool's enum;
- change_address: change a pending order's shipping address (a new one, or the default);
- return_delivered: return named items (or all) of a delivered order to the original
  payment method or the customer's gift card;
- refuse: a request the policy forbids (cancel a non-pending order, return an undelivered
  one, cancel for an unacceptable reason) where the reply must state why, or a ticket
  that also asks to cancel another customer's order, of which only the own part is done.

No task passes by doing nothing: each changes the DB or requires facts that an empty or
generic reply does not contain (no short numbers, which any reply could match).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable

from tau2.domains.retail.data_model import Order, RetailDB, User, UserAddress

from trace_jax.envs.base import Call, call

SPLITS = ("train", "heldout")
HELDOUT_SHARE = 5  # one user in this many (by a stable hash of the user id) is held out


@dataclasses.dataclass(frozen=True)
class Draft:
    """A family's output: the variant, the ticket, the gold calls, the facts and the entities used."""

    variant: str
    ticket: str
    calls: tuple[Call, ...]
    facts: tuple[str, ...]
    entities: frozenset[str]  # user ids and order ids the task looks up or acts on


def split_of_user(user_id: str) -> str:
    """The split a user (and so every order of theirs) belongs to, from a stable hash of the id."""
    digest = int.from_bytes(hashlib.sha256(user_id.encode()).digest()[:8], "big")
    return "heldout" if digest % HELDOUT_SHARE == 0 else "train"


class Pool:
    """One split's customers and their orders, grouped the way the families pick them."""

    def __init__(self, db: RetailDB, split: str):
        self.db = db
        self.users = [u for _, u in sorted(db.users.items()) if split_of_user(u.user_id) == split]
        orders = [db.orders[o] for u in self.users for o in u.orders]
        self.by_status: dict[str, list[Order]] = {}
        for order in orders:
            self.by_status.setdefault(order.status, []).append(order)
        self.addresses = sorted({address_text(u.address): u.address for u in self.users}.items())

    def orders(self, *statuses: str) -> list[Order]:
        """The split's orders with any of `statuses`."""
        return [o for s in statuses for o in self.by_status.get(s, [])]

    def user(self, order: Order) -> User:
        """The customer who placed `order`."""
        return self.db.users[order.user_id]


def address_text(address: UserAddress) -> str:
    """An address as a ticket writes it: "street, suite, city, ST zip, country"."""
    parts = [address.address1, address.address2, address.city, f"{address.state} {address.zip}", address.country]
    return ", ".join(p for p in parts if p)


def amount_text(value: float) -> str:
    """A dollar amount as a fact: no trailing zeros, so "608.9" matches "608.90" too."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _identify(user: User, rng: random.Random, mode: str | None = None) -> tuple[str, Call]:
    """How the ticket identifies the customer (by e-mail or by name and zip) and the gold lookup."""
    mode = mode or rng.choice(("email", "name_zip"))
    name = f"{user.name.first_name} {user.name.last_name}"
    if mode == "email":
        intro = rng.choice((f"My email is {user.email}.", f"This is {name} ({user.email})."))
        return intro, call("find_user_id_by_email", email=user.email)
    intro = rng.choice(
        (
            f"I'm {name}, zip code {user.address.zip}.",
            f"My name is {name} and my zip code is {user.address.zip}; I don't remember my email.",
        )
    )
    return intro, call(
        "find_user_id_by_name_zip", first_name=user.name.first_name, last_name=user.name.last_name, zip=user.address.zip
    )


def _details(order: Order) -> Call:
    return call("get_order_details", order_id=order.order_id)


def _user_details(user: User) -> Call:
    return call("get_user_details", user_id=user.user_id)


def _entities(*items: User | Order) -> frozenset[str]:
    return frozenset(i.user_id if isinstance(i, User) else i.order_id for i in items)


def _item_phrase(order: Order, item_ids: list[str]) -> str:
    names = [next(i.name for i in order.items if i.item_id == item_id) for item_id in item_ids]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


CONFIRM = ("I confirm, please go ahead.", "Yes, I confirm this.", "Please do it, you have my confirmation.")
REASONS = {
    "no longer needed": ("I no longer need it", "I don't need it anymore"),
    "ordered by mistake": ("I ordered it by mistake", "I placed it by accident"),
}
BAD_REASONS = (
    "I found it cheaper somewhere else",
    "the delivery is taking too long",
    "I want to order it again with a coupon",
)


def order_status(pool: Pool, rng: random.Random) -> Draft:
    """Status and charged amount of one of the customer's orders (identified by e-mail)."""
    orders = [
        o
        for o in pool.orders("pending", "processed", "delivered", "cancelled")
        if not o.payment_history[0].amount.is_integer()
    ]
    order = rng.choice(orders)
    user = pool.user(order)
    intro, find = _identify(user, rng, "email")
    ask = rng.choice(
        (
            f"What is the status of my order {order.order_id}, and how much was I charged for it?",
            f"Could you tell me where my order {order.order_id} stands and the amount I paid?",
        )
    )
    facts = (order.status, amount_text(order.payment_history[0].amount))
    return Draft("status", f"{intro} {ask}", (find, _details(order)), facts, _entities(user, order))


def _profile_facts(user: User, kind: str) -> tuple[str, tuple[str, ...]]:
    """The question for one kind of profile fact and the facts that answer it."""
    if kind == "order_ids":
        return "Which orders do I have with you? Please list their order numbers.", tuple(user.orders)
    if kind == "address":
        return ("What default shipping address do you have on file for me?", (user.address.address1, user.address.city))
    return "Which email address is on my account?", (user.email,)


def _lookup(pool: Pool, rng: random.Random, mode: str, kinds: tuple[str, ...]) -> Draft:
    kind = rng.choice(kinds)
    users = [u for u in pool.users if u.orders] if kind == "order_ids" else pool.users
    user = rng.choice(users)
    intro, find = _identify(user, rng, mode)
    ask, facts = _profile_facts(user, kind)
    return Draft(kind, f"{intro} {ask}", (find, _user_details(user)), facts, _entities(user))


def lookup_by_email(pool: Pool, rng: random.Random) -> Draft:
    """Profile facts of a customer identified by e-mail."""
    return _lookup(pool, rng, "email", ("order_ids", "address"))


def lookup_by_name_zip(pool: Pool, rng: random.Random) -> Draft:
    """Profile facts of a customer identified by name and zip code."""
    return _lookup(pool, rng, "name_zip", ("order_ids", "address", "email"))


def cancel_pending(pool: Pool, rng: random.Random) -> Draft:
    """Cancel a pending order; the ticket's reason maps onto one of the two allowed reasons."""
    order = rng.choice(pool.orders("pending"))
    user = pool.user(order)
    intro, find = _identify(user, rng)
    reason = rng.choice(sorted(REASONS))
    ticket = f"{intro} Please cancel my order {order.order_id}; {rng.choice(REASONS[reason])}. {rng.choice(CONFIRM)}"
    calls = (find, _details(order), call("cancel_pending_order", order_id=order.order_id, reason=reason))
    return Draft(reason.replace(" ", "_"), ticket, calls, (), _entities(user, order))


def change_address(pool: Pool, rng: random.Random) -> Draft:
    """Ship a pending order to a stated new address, or to the customer's default address."""
    to_default = rng.random() < 1 / 3
    order = rng.choice([o for o in pool.orders("pending") if not to_default or o.address != pool.user(o).address])
    user = pool.user(order)
    intro, find = _identify(user, rng)
    calls = [find, _details(order)]
    if to_default:
        variant, new, where = "default", user.address, "my default address on file"
        calls.append(_user_details(user))
    else:
        variant = "stated"
        text, new = rng.choice([(t, a) for t, a in pool.addresses if a != order.address])
        where = text
    ticket = f"{intro} Please ship my order {order.order_id} to {where} instead. {rng.choice(CONFIRM)}"
    calls.append(call("modify_pending_order_address", order_id=order.order_id, **new.model_dump()))
    return Draft(variant, ticket, tuple(calls), (), _entities(user, order))


def _single_items(order: Order) -> list[str]:
    """Item ids that appear once in the order under a name no other item there has."""
    names = [i.name for i in order.items]
    return [i.item_id for i in order.items if names.count(i.name) == 1]


def return_delivered(pool: Pool, rng: random.Random) -> Draft:
    """Return some named items (or all) of a delivered order to the original payment or a gift card."""
    order = rng.choice([o for o in pool.orders("delivered") if _single_items(o)])
    user = pool.user(order)
    intro, find = _identify(user, rng)
    calls = [find, _details(order)]
    singles = _single_items(order)
    if len(order.items) > 1 and rng.random() < 0.25:
        items, what = [i.item_id for i in order.items], "all the items"
    else:
        items = rng.sample(singles, rng.randint(1, min(3, len(singles))))
        what = "the " + _item_phrase(order, items)
    gift_cards = [p.id for p in user.payment_methods.values() if p.source == "gift_card"]
    original = order.payment_history[0].payment_method_id
    if gift_cards and rng.random() < 0.5:
        payment, to = gift_cards[0], "my gift card"
        if gift_cards[0] != original:
            calls.append(_user_details(user))
    else:
        payment, to = original, "the original payment method"
    ticket = f"{intro} I'd like to return {what} from order {order.order_id}, refunded to {to}. {rng.choice(CONFIRM)}"
    calls.append(
        call("return_delivered_order_items", order_id=order.order_id, item_ids=items, payment_method_id=payment)
    )
    return Draft("gift_card" if to == "my gift card" else "original", ticket, tuple(calls), (), _entities(user, order))


def refuse(pool: Pool, rng: random.Random) -> Draft:
    """A request the policy forbids; the gold agent looks up, does not act, and says why."""
    variant = rng.choice(("cancel_not_pending", "return_not_delivered", "bad_reason", "other_user"))
    if variant == "other_user":
        return _other_user(pool, rng)
    statuses = {
        "cancel_not_pending": ("processed", "delivered"),
        "return_not_delivered": ("pending", "processed"),
        "bad_reason": ("pending",),
    }[variant]
    order = rng.choice(pool.orders(*statuses))
    user = pool.user(order)
    intro, find = _identify(user, rng)
    if variant == "cancel_not_pending":
        reason = rng.choice(REASONS[rng.choice(sorted(REASONS))])
        ask, facts = f"Please cancel my order {order.order_id}; {reason}.", (order.status,)
    elif variant == "return_not_delivered":
        ask, facts = f"I want to return the {order.items[0].name} from my order {order.order_id}.", (order.status,)
    else:
        ask = f"Please cancel my order {order.order_id}, because {rng.choice(BAD_REASONS)}."
        facts = tuple(sorted(REASONS))
    ticket = f"{intro} {ask} {rng.choice(CONFIRM)} If you can't do it, tell me why."
    return Draft(variant, ticket, (find, _details(order)), facts, _entities(user, order))


def _other_user(pool: Pool, rng: random.Random) -> Draft:
    """Cancel the customer's own pending order, but not the other customer's one the ticket adds."""
    pending = pool.orders("pending")
    order = rng.choice(pending)
    user = pool.user(order)
    other = rng.choice([o for o in pending if o.user_id != user.user_id])
    intro, find = _identify(user, rng)
    reason = rng.choice(sorted(REASONS))
    ticket = (
        f"{intro} Please cancel my order {order.order_id}; {rng.choice(REASONS[reason])}. "
        f"My neighbour also asked me to cancel their order {other.order_id} for the same reason. "
        f"{rng.choice(CONFIRM)}"
    )
    calls = (find, _details(order), call("cancel_pending_order", order_id=order.order_id, reason=reason))
    return Draft("other_user", ticket, calls, (), _entities(user, order, pool.user(other), other))


# Families, easiest first.
FAMILIES: dict[str, Callable[[Pool, random.Random], Draft]] = {
    "order_status": order_status,
    "lookup_by_email": lookup_by_email,
    "lookup_by_name_zip": lookup_by_name_zip,
    "cancel_pending": cancel_pending,
    "change_address": change_address,
    "return_delivered": return_delivered,
    "refuse": refuse,
}
