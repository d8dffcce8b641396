"""The relay in one process, on both stores: delivery, outcomes, stop, capacity, wake-up."""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from typing import Any

import pytest

from outbound import Defer
from outbound.errors import PermanentSendError
from outbound.outbox import (
    EventBus,
    OutboxMessage,
    PostgresStore,
    Relay,
    RelayState,
    RetryPolicy,
    Store,
)

from .conftest import StoreFactory, app_connection, wait_for

FAST = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05, jitter=0.0)


def enqueue_many(store: Store, rows: list[tuple[str, str, Any]]) -> list[int]:
    conn = app_connection(store)
    try:
        ids = [store.enqueue(conn, key=k, type=t, payload=p) for k, t, p in rows]
        conn.commit()
        return ids
    finally:
        conn.close()


def test_delivers_every_row_in_per_key_order(store: Store) -> None:
    seen: dict[str, list[int]] = defaultdict(list)
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            seen[message.key].append(message.payload["n"])

    bus = EventBus()
    bus.subscribe("note", handler)
    rows = [(f"k{i % 7}", "note", {"n": i}) for i in range(140)]
    enqueue_many(store, rows)
    with Relay(store, bus, batch_size=16, poll_interval=0.05, max_inflight=8) as relay:
        wait_for(lambda: store.status().counts["sent"] == 140)
    assert relay.state is RelayState.STOPPED
    for key, ns in seen.items():
        assert ns == sorted(ns), key
    assert sum(len(ns) for ns in seen.values()) == 140
    assert relay.stats().sent == 140


def test_outcomes_retry_dead_permanent_defer_and_no_handler(store: Store) -> None:
    calls: dict[str, int] = defaultdict(int)
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        kind = message.payload
        with lock:
            calls[kind] += 1
            n = calls[kind]
        if kind == "flaky" and n < 3:
            raise RuntimeError("try again")
        if kind == "broken":
            raise RuntimeError("always broken")
        if kind == "permanent":
            raise PermanentSendError("bad request")
        if kind == "defer" and n < 4:
            raise Defer(0.01)

    bus = EventBus()
    bus.subscribe("job", handler)
    ids = enqueue_many(
        store,
        [
            ("a", "job", "flaky"),
            ("b", "job", "broken"),
            ("c", "job", "permanent"),
            ("d", "job", "defer"),
            ("e", "unknown-type", None),
        ],
    )
    with Relay(store, bus, poll_interval=0.02, retry=FAST):
        wait_for(lambda: _unfinished(store) == 0)
    rows = {r.id: r for r in store.rows()}
    flaky, broken, permanent, defer, unknown = (rows[i] for i in ids)
    assert (flaky.status, flaky.attempts) == ("sent", 3)
    assert (broken.status, broken.attempts) == ("dead", 3)
    assert broken.last_error == "RuntimeError: always broken"
    assert (permanent.status, permanent.attempts) == ("dead", 1)
    assert calls["permanent"] == 1
    assert (defer.status, defer.attempts) == ("sent", 1)  # deferrals are not attempts
    assert calls["defer"] == 4
    # A type with no handler is a failed attempt (another relay may have
    # one), dead once the attempts are spent.
    assert (unknown.status, unknown.attempts) == ("dead", FAST.max_attempts)
    assert "no handler" in (unknown.last_error or "")


def test_graceful_stop_drains_claimed_rows(store: Store) -> None:
    started = threading.Event()
    release = threading.Event()

    def handler(message: OutboxMessage) -> None:
        started.set()
        assert release.wait(10.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    enqueue_many(store, [(f"k{i}", "t", i) for i in range(4)])
    relay = Relay(store, bus, poll_interval=0.02, max_inflight=4).start()
    assert started.wait(10.0)
    wait_for(lambda: relay.stats().claimed == 4)
    stopper = threading.Thread(target=relay.stop, args=(10.0,))
    stopper.start()
    wait_for(lambda: relay.state is RelayState.STOPPING)
    release.set()
    stopper.join(10.0)
    assert not stopper.is_alive()
    assert relay.state is RelayState.STOPPED
    assert store.status().counts["sent"] == 4


def _blocking_bus() -> tuple[EventBus, threading.Event, threading.Event]:
    """A bus whose handler of type "t" sets ``started`` and waits (10 s at most)
    for ``release``; returns the bus, ``started`` and ``release``."""
    started = threading.Event()
    release = threading.Event()

    def handler(message: OutboxMessage) -> None:
        started.set()
        release.wait(10.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    return bus, started, release


def test_force_stop_leaves_unfinished_rows_to_their_leases(store: Store) -> None:
    bus, started, release = _blocking_bus()
    enqueue_many(store, [("k", "t", 1)])
    relay = Relay(store, bus, poll_interval=0.02, lease=0.5).start()
    assert started.wait(10.0)
    stopped = threading.Thread(target=relay.force_stop, args=(10.0,))
    stopped.start()
    wait_for(lambda: relay.state is RelayState.STOPPED)
    release.set()
    stopped.join(10.0)
    assert store.status().counts["processing"] == 1
    # A new relay takes the row over once the lease expired.
    done = threading.Event()
    bus2 = EventBus()
    bus2.subscribe("t", lambda m: done.set())
    with Relay(store, bus2, poll_interval=0.05):
        assert done.wait(10.0)
        wait_for(lambda: store.status().counts["sent"] == 1)


def test_after_force_stop_inflight_counts_the_handlers_still_running(store: Store) -> None:
    # One handler runs (max_inflight=1) while two rows wait for a thread (or
    # are still being handed over): the forced stop drops those two, left
    # to their leases. Once stopped, the relay counts as in flight the
    # handler that still runs, then nothing.
    bus, started, release = _blocking_bus()
    enqueue_many(store, [("a", "t", 1), ("b", "t", 2), ("c", "t", 3)])
    relay = Relay(store, bus, poll_interval=0.02, max_inflight=1).start()
    assert started.wait(10.0)
    wait_for(lambda: relay.stats().claimed == 3)
    assert not relay.force_stop(0.05)  # the handler still runs
    wait_for(lambda: relay.state is RelayState.STOPPED)
    assert relay.stats().inflight == 1
    release.set()
    assert relay.force_stop(10.0)
    assert relay.stats().inflight == 0
    assert store.status().counts["processing"] == 3  # no outcome was known when it stopped


def test_max_concurrency_holds_across_relays_of_one_process(store: Store) -> None:
    running = 0
    peak = 0
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.01)  # the handler's work
        with lock:
            running -= 1

    bus = EventBus()
    bus.subscribe("t", handler)
    enqueue_many(store, [(f"k{i}", "t", i) for i in range(60)])
    relays = [
        Relay(store, bus, max_concurrency=3, max_inflight=8, poll_interval=0.02).start()
        for _ in range(2)
    ]
    try:
        wait_for(lambda: store.status().counts["sent"] == 60)
    finally:
        for relay in relays:
            relay.stop(10.0)
    assert 1 <= peak <= 3


def test_notify_wakes_an_idle_relay_at_once(make_store: StoreFactory, backend: str) -> None:
    if backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    store = make_store()
    assert isinstance(store, PostgresStore)
    done = threading.Event()
    bus = EventBus()
    bus.subscribe("t", lambda m: done.set())
    claims: list[int] = []
    real = store.claim_session  # where the relay claims, beside its writes

    def session(beside: Any) -> Any:
        made = real(beside)
        assert made is not None
        claim = made.claim

        def counted(*args: Any, **kwargs: Any) -> Any:
            found = claim(*args, **kwargs)
            claims.append(len(found))
            return found

        made.claim = counted  # type: ignore[method-assign]
        return made

    store.claim_session = session  # type: ignore[method-assign]
    with Relay(store, bus, poll_interval=30.0):
        # The first (empty) claim has passed: the wake-up must come from NOTIFY.
        wait_for(lambda: len(claims) >= 1, timeout=10.0)
        start = time.monotonic()
        enqueue_many(store, [("k", "t", 1)])
        assert done.wait(5.0)
        assert time.monotonic() - start < 2.0


def test_relay_argument_checks(store: Store) -> None:
    bus = EventBus()
    with pytest.raises(ValueError):
        Relay(store, bus, batch_size=0)
    with pytest.raises(ValueError):
        Relay(store, bus, lease=0)
    with pytest.raises(TypeError):
        Relay(object(), bus)  # type: ignore[arg-type]
    relay = Relay(store, bus)
    assert relay.stop() is True  # never started: nothing to do
    assert relay.stop() is True


def _unfinished(store: Store) -> int:
    """Pending plus processing rows, read in one snapshot."""
    counts = store.status().counts
    return counts["pending"] + counts["processing"]


def test_two_relays_under_a_short_switch_interval_keep_order_and_lose_nothing(
    store: Store,
) -> None:
    # Outcomes written in batches, next rows taken with them (PostgreSQL),
    # outcomes of held rows put aside: with the GIL switching every 10 us,
    # two relays on one table, and handlers that fail or defer now and then.
    keys, per_key = 12, 25
    rows = [(f"k{k}", "note", {"n": n}) for n in range(per_key) for k in range(keys)]
    enqueue_many(store, rows)
    lock = threading.Lock()
    sent: dict[str, list[int]] = defaultdict(list)
    tries: dict[tuple[str, int], int] = defaultdict(int)

    def handler(message: OutboxMessage) -> None:
        n = message.payload["n"]
        with lock:
            tries[message.key, n] += 1
            first = tries[message.key, n] == 1
        if first and n % 7 == 3:
            raise RuntimeError("flaky")
        if first and n % 11 == 5:
            raise Defer(0.005)
        with lock:
            sent[message.key].append(n)

    bus = EventBus()
    bus.subscribe("note", handler)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with (
            Relay(store, bus, batch_size=8, max_inflight=4, poll_interval=0.02, retry=FAST),
            Relay(store, bus, batch_size=5, max_inflight=3, poll_interval=0.02, retry=FAST),
        ):
            wait_for(lambda: store.status().counts["sent"] == keys * per_key, timeout=60.0)
    finally:
        sys.setswitchinterval(old)
    assert sent == {f"k{k}": list(range(per_key)) for k in range(keys)}  # in order, each once
    assert store.status().unfinished == 0
