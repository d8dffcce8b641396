"""What each handler call of a relay gets, and settings too small to work with.

Every call gets the payload as enqueued: a second subscriber's, and a run again
after a short 429 (the relay holds the row and runs it again), whatever an
earlier call did to it; so a handler that consumes its payload spends no
attempt on a 429. A lease too short to renew is refused; a tiny timeout does
not make an idle relay spin."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from outbound.errors import RateLimited
from outbound.outbox import EventBus, OutboxMessage, Relay, RetryPolicy, SQLiteStore, Store
from outbound.outbox._base import Claimed
from outbound.outbox.relay import check_option

from .conftest import app_connection, wait_for


def enqueue(store: Store, payload: Any) -> int:
    conn = app_connection(store)
    try:
        row_id = store.enqueue(conn, key="chat", type="t", payload=payload)
        conn.commit()
        return row_id
    finally:
        conn.close()


def deliver(store: Store, bus: EventBus, row_id: int, **options: Any) -> Any:
    """Run a relay until row ``row_id`` is finished; stop it; return the row."""
    relay = Relay(store, bus, poll_interval=0.05, **options).start()
    try:
        wait_for(lambda: store.get(row_id).status in ("sent", "dead"))  # type: ignore[union-attr]
    finally:
        assert relay.stop(10)
    row = store.get(row_id)
    assert row is not None
    return row


def test_a_run_again_after_a_short_429_gets_the_payload_as_enqueued(store: Store) -> None:
    seen: list[Any] = []
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            seen.append(repr(message.payload))
            first = len(seen) == 1
        assert message.payload.pop("text") == "hi"  # a handler that consumes its payload
        message.payload["items"].append("more")
        if first:
            raise RateLimited(0.2)  # a booked send slot: the relay holds the row

    bus = EventBus()
    bus.subscribe("t", handler)
    row_id = enqueue(store, {"text": "hi", "items": ["a"]})
    policy = RetryPolicy(max_attempts=5, base_delay=0.05, max_delay=0.1, jitter=0.0)
    row = deliver(store, bus, row_id, retry=policy)
    assert seen == [repr({"text": "hi", "items": ["a"]})] * 2
    assert (row.status, row.attempts) == ("sent", 1), row.last_error


@pytest.mark.parametrize("payload", [{"text": "hi"}, ["hi"], "hi", 7, None])
def test_a_second_subscriber_gets_the_payload_as_enqueued(store: Store, payload: Any) -> None:
    second_saw: list[Any] = []

    def first(message: OutboxMessage) -> None:
        if isinstance(message.payload, dict):
            message.payload["text"] = "CHANGED"
        elif isinstance(message.payload, list):
            message.payload.append("CHANGED")

    bus = EventBus()
    bus.subscribe("t", first)
    bus.subscribe("t", lambda message: second_saw.append(message.payload))
    row_id = enqueue(store, payload)
    relay = Relay(store, bus, poll_interval=0.05).start()
    try:
        wait_for(lambda: store.get(row_id).status == "sent")  # type: ignore[union-attr]
    finally:
        assert relay.stop(10)
    assert second_saw == [payload]


@pytest.mark.parametrize("lease", [1e-6, 0.05, 0.0999])
def test_a_lease_too_short_to_renew_is_refused(store: Store, lease: float) -> None:
    with pytest.raises(ValueError, match=r"lease must be at least 0\.1 seconds"):
        check_option("lease", lease)
    with pytest.raises(ValueError, match=r"lease must be at least 0\.1 seconds"):
        Relay(store, EventBus(), lease=lease)
    assert check_option("lease", 0.1) == 0.1


def test_a_tiny_timeout_does_not_make_an_idle_relay_spin(store: Store) -> None:
    got = threading.Event()
    bus = EventBus()
    bus.subscribe("t", lambda message: got.set())
    enqueue(store, {})
    relay = Relay(store, bus, timeout=1e-6, poll_interval=1.0).start()
    try:
        assert got.wait(10)
        wait_for(
            lambda: (
                relay.stats().inflight == 0 and relay.stats().timed_out + relay.stats().sent >= 1
            )
        )
        # Idle now: this process's CPU over a second (a loop that never
        # blocks takes all of it).
        cpu, wall = time.process_time(), time.monotonic()
        threading.Event().wait(1.0)  # the idle second measured, not a synchronization
        busy = (time.process_time() - cpu) / (time.monotonic() - wall)
    finally:
        assert relay.stop(10)
    assert busy < 0.3, f"an idle relay with timeout=1e-6 used {busy:.0%} of a core"


class _DecimalStore(SQLiteStore):
    """A store of its own: payload numbers decoded as Decimal, Claimed without text."""

    def session(self) -> Any:
        session = super().session()
        claim = session.claim

        def decimal_claim(*args: Any, **kwargs: Any) -> list[Claimed]:
            out = []
            for item in claim(*args, **kwargs):
                assert item.text is not None
                payload = json.loads(item.text, parse_float=Decimal)
                message = dataclasses.replace(item.message, payload=payload)
                out.append(dataclasses.replace(item, message=message, text=None))
            return out

        session.claim = decimal_claim  # type: ignore[method-assign]
        return session


def test_a_store_that_gives_no_text_gets_its_own_payload_to_every_call(tmp_path: Path) -> None:
    """Its payload goes to the first call as it claimed it, and a deep copy of that
    to the others; nothing is encoded again (Decimal is not JSON)."""
    store = _DecimalStore(tmp_path / "outbox.db")
    try:
        row_id = enqueue(store, {"amount": 12.34, "items": ["a"]})
        seen: list[Any] = []

        def first(message: OutboxMessage) -> None:
            seen.append(repr(message.payload))
            message.payload["items"].append("CHANGED")

        bus = EventBus()
        bus.subscribe("t", first)
        bus.subscribe("t", lambda message: seen.append(repr(message.payload)))
        row = deliver(store, bus, row_id)
        assert (row.status, row.last_error) == ("sent", None)
        assert seen == [repr({"amount": Decimal("12.34"), "items": ["a"]})] * 2
    finally:
        store.close()
