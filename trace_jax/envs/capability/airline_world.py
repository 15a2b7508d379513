"""Seeded synthetic airline worlds in τ²'s airline data model, for capability environments.

A world is a small `FlightDB`: a few invented customers (names, addresses, dates of birth, saved
passengers, payment methods: cards, gift cards and certificates, a membership level), their
reservations on flights of τ²'s schedule, and those flights with every other flight of the same routes
(both directions). Only the schedule comes from τ²'s airline DB (flights belong to no customer and so to
no split); no customer or reservation of the target appears. τ²'s airline tools run on the world
unchanged, with their clock (TODAY, 15:00 EST): a flight after TODAY can still be booked, changed or
cancelled, an earlier one has flown or was cancelled.
"""

from __future__ import annotations

import random

from tau2.domains.airline.data_model import (
    Address,
    Certificate,
    CreditCard,
    Flight,
    FlightDB,
    GiftCard,
    Name,
    Passenger,
    Payment,
    Reservation,
    ReservationFlight,
    User,
)

from trace_jax.envs.capability.world import CARD_BRANDS, FIRST_NAMES, LAST_NAMES, address, digits, person

TODAY = "2024-05-15"  # τ²'s airline tools' date
CABINS = ("basic_economy", "economy", "business")
MEMBERSHIPS = ("regular", "silver", "gold")
PRICES = {"basic_economy": (50, 100), "economy": (100, 200), "business": (200, 500)}  # a flown flight's fare range
INSURANCE_PER_PASSENGER = 30
_ID_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"


def _dob(rng: random.Random, last_year: int) -> str:
    return f"{rng.randint(1950, last_year)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _passenger(rng: random.Random) -> Passenger:
    return Passenger(first_name=rng.choice(FIRST_NAMES), last_name=rng.choice(LAST_NAMES), dob=_dob(rng, 2010))


def _customer(rng: random.Random, taken: set[str]) -> User:
    first, last, user_id = person(rng, taken)
    methods = {}
    for source in ["credit_card"] + rng.sample(("gift_card", "certificate"), rng.randint(0, 2)):
        method_id = f"{source}_{digits(rng, 7)}"
        if source == "credit_card":
            methods[method_id] = CreditCard(
                source=source, id=method_id, brand=rng.choice(CARD_BRANDS), last_four=digits(rng, 4)
            )
        elif source == "gift_card":
            methods[method_id] = GiftCard(source=source, id=method_id, amount=float(rng.randint(0, 300)))
        else:
            methods[method_id] = Certificate(source=source, id=method_id, amount=float(rng.choice((100, 150, 250))))
    return User(
        user_id=user_id,
        name=Name(first_name=first, last_name=last),
        address=Address(**address(rng).model_dump()),
        email=f"{first.lower()}.{last.lower()}{digits(rng, 4)}@example.com",
        dob=_dob(rng, 2004),
        payment_methods=methods,
        saved_passengers=[_passenger(rng) for _ in range(rng.randint(0, 2))],
        membership=rng.choice(MEMBERSHIPS),
        reservations=[],
    )


def _dates(flight: Flight, future: bool) -> list[str]:
    """The flight's dates after TODAY with seats for sale, or its dates before TODAY."""
    if future:
        return sorted(d for d, s in flight.dates.items() if d > TODAY and s.status == "available")
    return sorted(d for d in flight.dates if d < TODAY)


def _fare(rng: random.Random, flight: Flight, date: str, cabin: str) -> int:
    status = flight.dates[date]
    return status.prices[cabin] if status.status == "available" else rng.randint(*PRICES[cabin])


def _reservation(
    rng: random.Random,
    user: User,
    schedule: list[Flight],
    by_route: dict[tuple[str, str], list[Flight]],
    reservation_id: str,
    future: bool,
) -> Reservation:
    while True:
        out = rng.choice(schedule)
        dates = _dates(out, future)
        if dates:
            break
    date = rng.choice(dates)
    legs = [(out, date)]
    backs = [(f, d) for f in by_route.get((out.destination, out.origin), ()) for d in _dates(f, future) if d > date]
    if backs and rng.random() < 0.5:
        legs.append(rng.choice(backs))
    cabin = rng.choice(CABINS)
    me = Passenger(first_name=user.name.first_name, last_name=user.name.last_name, dob=user.dob)
    passengers = [me] + user.saved_passengers[: rng.randint(0, len(user.saved_passengers))]
    flights = [
        ReservationFlight(
            flight_number=f.flight_number,
            origin=f.origin,
            destination=f.destination,
            date=d,
            price=_fare(rng, f, d, cabin),
        )
        for f, d in legs
    ]
    insurance = rng.choice(("yes", "no"))
    total = (sum(f.price for f in flights) + (INSURANCE_PER_PASSENGER if insurance == "yes" else 0)) * len(passengers)
    method = rng.choice(sorted(user.payment_methods))
    last = min(int(date[8:]), int(TODAY[8:]))  # booked before the first flight and before today (all in May 2024)
    booked = f"2024-05-{rng.randint(1, last - 1):02d}" if last > 1 else f"2024-04-{rng.randint(1, 30):02d}"
    return Reservation(
        reservation_id=reservation_id,
        user_id=user.user_id,
        origin=out.origin,
        destination=out.destination,
        flight_type="round_trip" if len(legs) == 2 else "one_way",
        cabin=cabin,
        flights=flights,
        passengers=passengers,
        payment_history=[Payment(payment_id=method, amount=total)],
        created_at=f"{booked}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00",
        total_baggages=0,
        nonfree_baggages=0,
        insurance=insurance,
    )


def build_world(
    rng: random.Random,
    catalogue: dict[str, Flight],
    num_customers: int = 3,
    reservations_per_customer: tuple[int, int] = (1, 3),
    first_future: int = 1,
) -> FlightDB:
    """`num_customers` invented customers, each with reservations on flights of `catalogue` (τ²'s schedule);
    a customer's first `first_future` reservations fly after TODAY, the later ones before or after it."""
    schedule = [catalogue[k] for k in sorted(catalogue)]
    by_route: dict[tuple[str, str], list[Flight]] = {}
    for flight in schedule:
        by_route.setdefault((flight.origin, flight.destination), []).append(flight)
    users: dict[str, User] = {}
    reservations: dict[str, Reservation] = {}
    for _ in range(num_customers):
        user = _customer(rng, set(users))
        for index in range(rng.randint(*reservations_per_customer)):
            reservation_id = "".join(rng.choice(_ID_CHARS) for _ in range(6))
            while reservation_id in reservations:
                reservation_id = "".join(rng.choice(_ID_CHARS) for _ in range(6))
            future = index < first_future or rng.random() < 0.5
            reservations[reservation_id] = _reservation(rng, user, schedule, by_route, reservation_id, future)
            user.reservations.append(reservation_id)
        users[user.user_id] = user
    routes = {(r.origin, r.destination) for r in reservations.values()}
    numbers = {f.flight_number for route in routes | {(b, a) for a, b in routes} for f in by_route.get(route, ())}
    return FlightDB(
        flights={n: catalogue[n].model_copy(deep=True) for n in sorted(numbers)}, users=users, reservations=reservations
    )
