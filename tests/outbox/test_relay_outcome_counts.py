"""Relay outcomes: what ``RelayStats.parked`` counts, and a row of a type with no handler.

A handler's short ``Defer`` is held by the relay (not written); a relay
stopped before it is due writes the row back: held once, written once. A
row of a type with no handler is a failed attempt, not dead at once.
"""

from __future__ import annotations

from outbound import Defer
from outbound.outbox import EventBus, OutboxMessage, Relay, Store
from outbound.retry import RetryPolicy

from .conftest import enqueue_keys, wait_for


def test_a_held_deferral_written_back_at_stop_counts_as_held_and_requeued(store: Store) -> None:
    calls: list[int] = []

    def handler(message: OutboxMessage) -> None:
        calls.append(message.id)
        raise Defer(1.5)  # short: held by the relay, not written

    enqueue_keys(store, "k")
    bus = EventBus()
    bus.subscribe("t", handler)
    relay = Relay(store, bus, poll_interval=0.02).start()
    try:
        wait_for(lambda: relay.stats().parked == 1)
    finally:
        assert relay.stop(10.0)
    stats = relay.stats()
    (row,) = store.rows()
    assert calls == [row.id]  # run once, never again
    assert row.status == "pending"  # written back at the stop
    # parked counts holds (RelayStats): held once, then written once.
    assert (stats.requeued, stats.parked) == (1, 1), stats


def test_a_held_deferral_run_again_counts_as_parked(store: Store) -> None:
    calls: list[int] = []

    def handler(message: OutboxMessage) -> None:
        calls.append(message.id)
        if len(calls) == 1:
            raise Defer(0.05)

    enqueue_keys(store, "k")
    bus = EventBus()
    bus.subscribe("t", handler)
    with Relay(store, bus, poll_interval=0.02) as relay:
        wait_for(lambda: relay.stats().sent == 1)
    stats = relay.stats()
    assert len(calls) == 2
    assert (stats.parked, stats.requeued, stats.sent) == (1, 0, 1), stats


def test_a_type_with_no_handler_here_goes_to_a_relay_that_has_one(store: Store) -> None:
    # A rolling deploy: a relay of the old version, with no handler for a new
    # type, beside one of the new version. The old one fails the row (an
    # attempt, retried with backoff), not dead at once: the new one sends it.
    (row_id,) = enqueue_keys(store, "k", type="new")
    backoff = RetryPolicy(max_attempts=5, base_delay=0.5, max_delay=0.5, jitter=0.0)
    old = Relay(store, EventBus(), poll_interval=0.02, retry=backoff).start()
    try:
        wait_for(lambda: old.stats().retried == 1)
    finally:
        assert old.stop(10.0)
    (row,) = store.rows()
    assert (row.status, row.attempts) == ("pending", 1)
    assert "no handler subscribed for type 'new'" in (row.last_error or "")
    sent: list[int] = []
    bus = EventBus()
    bus.subscribe("new", lambda message: sent.append(message.id))
    with Relay(store, bus, poll_interval=0.02) as new:
        wait_for(lambda: new.stats().sent == 1)
    assert sent == [row_id]
    (row,) = store.rows()
    assert (row.status, row.attempts) == ("sent", 2)
