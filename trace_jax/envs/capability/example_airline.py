"""An example airline capability environment written against the authoring API (`authoring.py`), shown to the
environment writer in its prompt: the customer asks about a reservation; the agent must read it and state
the fact asked for. At difficulty 1 the question may be a flight's status on its date, so the agent must
also look the flight up."""

import random

from trace_jax.envs.capability.airline_api import Flight, Scenario, build_world, call

NAME = "reservation_facts"
DOMAIN = "airline"
DESCRIPTION = "Reads the reservation a customer asks about and states the facts they asked for in the final message."
TOOLS = (
    ("get_user_details", "get_reservation_details"),
    ("get_user_details", "get_reservation_details", "get_flight_status"),
)


def generate(rng: random.Random, difficulty: int, catalogue: dict[str, Flight]) -> Scenario:
    """One question about one of the customer's reservations (or, from difficulty 1, about one of its flights)."""
    db = build_world(rng, catalogue, num_customers=2, reservations_per_customer=(1, 3))
    user = rng.choice(sorted(db.users.values(), key=lambda u: u.user_id))
    reservation = db.reservations[rng.choice(user.reservations)]
    gold = [call("get_reservation_details", reservation_id=reservation.reservation_id)]
    which = f"reservation {reservation.reservation_id}"
    kind = rng.choice(("flight", "cabin", "paid") if difficulty >= 1 else ("cabin", "paid"))
    if kind == "flight":
        leg = rng.choice(reservation.flights)
        gold.append(call("get_flight_status", flight_number=leg.flight_number, date=leg.date))
        question = f"What is the status of my flight from {leg.origin} to {leg.destination} in {which}?"
        fact = db.flights[leg.flight_number].dates[leg.date].status
        variant = "flight_status"
    elif kind == "cabin":
        question, fact, variant = f"Which cabin did I book in {which}?", reservation.cabin.replace("_", " "), "cabin"
    else:
        question, fact, variant = f"How much did I pay for {which}?", str(reservation.payment_history[0].amount), "paid"
    return Scenario(
        variant=variant,
        db=db,
        ticket=f"My user id is {user.user_id}. {question} Please tell me.",
        prefilled=(call("get_user_details", user_id=user.user_id),),
        gold_calls=tuple(gold),
        facts=(fact,),
    )
