"""Counting XLA compiles in a block of test code (`jax.monitoring`'s backend compile events)."""

import contextlib

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles():
    """The number of XLA compiles while the block runs, in `counted[0]`."""
    counted = [0]

    def listener(name, _seconds, **_):
        counted[0] += name == COMPILE_EVENT

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counted
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
