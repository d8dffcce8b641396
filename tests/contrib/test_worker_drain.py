"""The worker commands' drain (``drain_relay``, shared by ``flask outbound worker``
and ``manage.py outbound_worker``): a handler past its timeout, which the relay
has written back and stopped waiting for, is still waited for within the drain;
it was taken for a relay that stopped on an error, and the drain reported
unfinished (status 1) seconds before the handler returned."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from dispatch_helpers import until

from outbound.contrib._worker import FORCE_TIMEOUT, drain_relay
from outbound.outbox import (
    EventBus,
    OutboxMessage,
    PostgresStore,
    Relay,
    RelayState,
    RelayStats,
    SQLiteStore,
)


class _Watched:
    """The relay, as the drain sees it; the handler is released at the drain's second
    look at the relay stopped (the first found the handler still running)."""

    def __init__(self, relay: Relay, released: threading.Event) -> None:
        self._relay = relay
        self._released = released
        self._looks = 0

    @property
    def state(self) -> RelayState:
        return self._relay.state

    def stats(self) -> RelayStats:
        stats = self._relay.stats()
        if stats.state is RelayState.STOPPED:
            self._looks += 1
            if self._looks >= 2:
                self._released.set()
        return stats

    def stop(self, timeout: float) -> bool:
        return self._relay.stop(timeout)

    def force_stop(self, timeout: float) -> bool:
        return self._relay.force_stop(timeout)


def _drained_past_a_late_handler(tmp_path: Path) -> bool:
    """A relay with one row whose handler runs past its timeout (half a second); the
    drain, the handler released at the drain's second look at the relay stopped:
    what drain_relay says, once the handler has returned."""
    store = SQLiteStore(tmp_path / "o.db")
    started, released, returned = threading.Event(), threading.Event(), threading.Event()

    def slow(message: OutboxMessage) -> None:
        started.set()
        released.wait(30)
        returned.set()

    bus = EventBus()
    bus.subscribe("slow", slow)
    conn = store.connect()
    with conn:
        store.enqueue(conn, key="k", type="slow", payload={})
    conn.close()
    relay = Relay(store, bus, poll_interval=0.05, lease=0.5).start()
    try:
        assert started.wait(10), "the handler never started"
        watched: Any = _Watched(relay, released)
        drained = bool(drain_relay(watched, time.monotonic() + 20.0, threading.Event()))
        assert returned.is_set()
        return drained
    finally:
        released.set()
        relay.force_stop(5.0)
        store.close()


def test_a_handler_past_its_timeout_is_waited_for_within_the_drain(tmp_path: Path) -> None:
    assert _drained_past_a_late_handler(tmp_path)


class _SlowLog(logging.Handler):
    """Takes a second over the relay's line about a handler that returned late."""

    def emit(self, record: logging.LogRecord) -> None:
        if "after its timeout" in record.getMessage():
            threading.Event().wait(1.0)  # (a log shipper's time: what is tested)


def test_a_late_handler_whose_return_is_still_being_logged_is_waited_for(
    tmp_path: Path,
) -> None:
    """The relay takes a handler off its count of handlers past their timeout, then
    logs its return in the same task: the drain took the relay for one that stopped
    on an error while that line was being written."""
    log = logging.getLogger("outbound")
    handler, level = _SlowLog(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        assert _drained_past_a_late_handler(tmp_path)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _idle_relay_drains_at_once(store: Any) -> None:
    relay = Relay(store, EventBus(), poll_interval=0.05).start()
    try:
        assert until(lambda: relay.stats().state is RelayState.RUNNING)
        began = time.monotonic()
        assert drain_relay(relay, began, threading.Event())
        assert relay.stats().state is RelayState.STOPPED
        assert time.monotonic() - began < FORCE_TIMEOUT + 1.0
    finally:
        relay.force_stop(5.0)
        store.close()


def test_an_idle_relay_drains_within_a_drain_of_no_time_sqlite(tmp_path: Path) -> None:
    _idle_relay_drains_at_once(SQLiteStore(tmp_path / "o.db"))


def test_an_idle_relay_drains_within_a_drain_of_no_time_postgres(postgres_url: str) -> None:
    # A PostgreSQL relay takes a tenth of a second to close its connections:
    # a drain of 0 s (or 0.1 s) forced it and said the drain did not finish
    # (status 1), nothing being left.
    store = PostgresStore(postgres_url, table=f"drain_idle_{uuid.uuid4().hex[:8]}")
    try:
        _idle_relay_drains_at_once(store)
    finally:
        store.drop_schema()
