"""THE AIRLINE DOMAIN (DOMAIN = "airline"): `from trace_jax.envs.capability.airline_api import ...` these names.

An airline ticket gives the customer's user id (τ²'s airline tools find customers by id only) and names
reservations by their id (six characters, no "#") or by what identifies them (route, date, passengers).
τ²'s airline tools run at TODAY = "2024-05-15", 15:00 EST: a flight after TODAY can be booked, changed or
cancelled; an earlier one has flown (or was cancelled).

DATA BUILDER. `build_world(rng, catalogue, num_customers=3, reservations_per_customer=(1, 3),
first_future=1)` returns a new `FlightDB` of invented customers: each has between
reservations_per_customer[0] and [1] reservations of 1 to 3 passengers (the customer first, then saved
passengers), one way or round trip, on flights of `catalogue`, paid with one of the customer's payment
methods; a customer's first `first_future` reservations fly after TODAY, later ones before or after it.
Every reservation is active (status None), without bags. The world holds the reserved flights and every
other flight of the same routes in both directions; add more with
`db.flights[n] = catalogue[n].model_copy(deep=True)` (for example for searches). You may change the world
after building it (a reservation's cabin, bags, insurance or status, a flight date's status, a payment
method's amount, a membership), keeping it consistent. CABINS = ("basic_economy", "economy", "business"),
MEMBERSHIPS = ("regular", "silver", "gold"); CONFIRM holds sentences confirming an action.

THE AIRLINE DATA MODEL (pydantic models of τ²; read them as attributes):
  FlightDB: flights: dict[flight_number, Flight], users: dict[user_id, User],
            reservations: dict[reservation_id, Reservation]
  User: user_id, name (first_name, last_name), address, email, dob ("YYYY-MM-DD"), membership,
        payment_methods: dict[id, CreditCard(source="credit_card", id, brand, last_four) |
        GiftCard(source="gift_card", id, amount) | Certificate(source="certificate", id, amount)],
        saved_passengers: list[Passenger], reservations: list[reservation_id]
  Passenger: first_name, last_name, dob
  Reservation: reservation_id ("4WQ150"), user_id, origin, destination (IATA codes), flight_type
        ("one_way", "round_trip"), cabin, flights: list[ReservationFlight(flight_number, origin,
        destination, date, price)], passengers: list[Passenger], payment_history: list[Payment(payment_id:
        a payment method's id, amount)], created_at, total_baggages, nonfree_baggages, insurance ("yes",
        "no"), status (None, or "cancelled")
  Flight: flight_number ("HAT001"), origin, destination, scheduled_departure_time_est,
        scheduled_arrival_time_est, dates: dict[date, status], where status.status is "available" (with
        available_seats and prices, each by cabin), "landed", "cancelled", "delayed", "flying" or "on time"
The `catalogue` argument is τ²'s flight schedule (flight_number -> Flight): read it, never change it.
"""

from tau2.domains.airline.data_model import (
    Certificate,
    CreditCard,
    Flight,
    FlightDB,
    GiftCard,
    Passenger,
    Payment,
    Reservation,
    ReservationFlight,
    User,
)

from trace_jax.envs.base import Call, call
from trace_jax.envs.capability.airline_world import CABINS, MEMBERSHIPS, TODAY, build_world
from trace_jax.envs.capability.environment import Scenario
from trace_jax.envs.capability.tool_calling import CONFIRM

__all__ = [
    "CABINS",
    "CONFIRM",
    "MEMBERSHIPS",
    "TODAY",
    "Call",
    "Certificate",
    "CreditCard",
    "Flight",
    "FlightDB",
    "GiftCard",
    "Passenger",
    "Payment",
    "Reservation",
    "ReservationFlight",
    "Scenario",
    "User",
    "build_world",
    "call",
]
