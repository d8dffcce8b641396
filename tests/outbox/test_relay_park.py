"""A row its handler puts off for a short while is held by the relay, on both stores.

A handler that raises ``Defer(d)`` or ``RateLimited(d)`` with ``d`` of at
most ``_PARK_AT_MOST`` seconds is run again ``d`` seconds later by the relay
itself: the row stays claimed (its lease renewed), nothing is written, and
the handler runs on time (a rate limiter's booked slot), never early. A
longer delay, a stopping relay, or a row past ``max_total`` writes the row
back as before.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence

import pytest

from outbound import Defer
from outbound.errors import RateLimited
from outbound.outbox import EventBus, OutboxMessage, Relay, RetryPolicy, Store
from outbound.outbox import relay as relay_module
from outbound.outbox._base import CLAIM_AHEAD, Outcome

from .conftest import enqueue_keys, wait_for
from .test_relay_failures import FlakySession, make_flaky


def _never(outcomes: Sequence[Outcome]) -> bool:
    return False


def _written(made: list[FlakySession]) -> int:
    """Outcome writes the relay's sessions made."""
    return sum(s.finish_calls for s in made)


@pytest.mark.parametrize("make_exc", [lambda: Defer(0.3), lambda: RateLimited(0.3)])
def test_a_row_put_off_briefly_runs_again_on_time_with_nothing_written(
    store: Store, make_exc: Callable[[], Exception]
) -> None:
    made, _ = make_flaky(store, _never)
    runs: list[float] = []
    again = threading.Event()

    def handler(message: OutboxMessage) -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise make_exc()
        again.set()

    bus = EventBus()
    bus.subscribe("t", handler)
    (row,) = enqueue_keys(store, "chat")
    with Relay(store, bus, poll_interval=3600.0) as relay:
        assert again.wait(30.0)
        wait_for(lambda: relay.stats().sent == 1)
        stats = relay.stats()
    assert runs[1] - runs[0] >= 0.3 - 0.005  # not before it was asked to (clock grain)
    assert (stats.parked, stats.requeued, stats.claimed, stats.sent) == (1, 0, 1, 1)
    assert _written(made) == 1  # the "sent" only
    (done,) = store.rows()
    assert (done.id, done.status, done.attempts) == (row, "sent", 1)


def test_a_row_put_off_longer_than_the_relay_holds_rows_is_written_back(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_module, "_PARK_AT_MOST", 0.2)
    runs: list[float] = []

    def handler(message: OutboxMessage) -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise Defer(0.25)

    bus = EventBus()
    bus.subscribe("t", handler)
    enqueue_keys(store, "chat")
    with Relay(store, bus, poll_interval=3600.0) as relay:
        wait_for(lambda: relay.stats().sent == 1)
        stats = relay.stats()
    assert runs[1] - runs[0] >= 0.25 - 0.005
    assert (stats.parked, stats.requeued, stats.claimed) == (0, 1, 2)


def test_a_held_row_is_neither_late_nor_stuck_past_a_timeout_shorter_than_its_wait(
    store: Store,
) -> None:
    # The relay's timeout counts a delivery's run, not the wait the handler
    # asked for: with a timeout of 0.5 s (and its grace of 1 s), a row held
    # for 1.8 s is not given up, nor its key stuck.
    runs: list[float] = []

    def handler(message: OutboxMessage) -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise Defer(1.8)

    bus = EventBus()
    bus.subscribe("t", handler)
    (row,) = enqueue_keys(store, "chat")
    with Relay(store, bus, poll_interval=3600.0, timeout=0.5, lease=3.0) as relay:
        wait_for(lambda: relay.stats().sent == 1)
        stats = relay.stats()
    assert runs[1] - runs[0] >= 1.8 - 0.005
    assert (stats.timed_out, stats.stuck, stats.parked, stats.sent) == (0, 0, 1, 1)
    done = store.get(row)
    assert done is not None
    assert (done.status, done.attempts) == ("sent", 1)


def test_a_held_rows_lease_is_renewed_while_it_waits(store: Store) -> None:
    # Held for longer than its lease: renewed like a running delivery, so
    # no other relay takes it (it would run twice).
    ran: list[str] = []

    def handler(message: OutboxMessage) -> None:
        ran.append("run")
        if len(ran) == 1:
            raise Defer(1.5)

    bus = EventBus()
    bus.subscribe("t", handler)
    taken: list[int] = []

    def other_handler(message: OutboxMessage) -> None:
        taken.append(message.id)

    other_bus = EventBus()
    other_bus.subscribe("t", other_handler)
    (row,) = enqueue_keys(store, "chat")
    with Relay(store, bus, poll_interval=3600.0, lease=0.6, timeout=5.0) as relay:
        wait_for(lambda: relay.stats().parked == 1)
        with Relay(store, other_bus, poll_interval=0.02, lease=0.6):
            wait_for(lambda: relay.stats().sent == 1)
    assert taken == []
    assert ran == ["run", "run"]
    done = store.get(row)
    assert done is not None
    assert (done.status, done.attempts) == ("sent", 1)


def test_stop_waits_for_a_held_row_and_writes_back_one_put_off_again(store: Store) -> None:
    # Stopping: a held row runs when due (stop drains); put off again, it
    # is written back, its attempt not counted, and the stop completes.
    runs: list[float] = []
    first = threading.Event()

    def handler(message: OutboxMessage) -> None:
        runs.append(time.monotonic())
        first.set()
        raise Defer(0.4)

    bus = EventBus()
    bus.subscribe("t", handler)
    (row,) = enqueue_keys(store, "chat")
    relay = Relay(store, bus, poll_interval=3600.0).start()
    try:
        assert first.wait(30.0)
        wait_for(lambda: relay.stats().parked == 1)
    finally:
        assert relay.stop(30.0)
    stats = relay.stats()
    assert len(runs) == 2
    assert runs[1] - runs[0] >= 0.4 - 0.005
    assert (stats.parked, stats.requeued, stats.inflight) == (1, 1, 0)
    back = store.get(row)
    assert back is not None
    assert (back.status, back.attempts) == ("pending", 0)


def test_a_row_held_past_max_total_goes_dead(store: Store) -> None:
    calls: list[float] = []

    def handler(message: OutboxMessage) -> None:
        calls.append(time.monotonic())
        raise RateLimited(0.1)

    bus = EventBus()
    bus.subscribe("t", handler)
    (row,) = enqueue_keys(store, "chat")
    with Relay(store, bus, poll_interval=3600.0, retry=RetryPolicy(max_total=0.5)) as relay:
        wait_for(lambda: relay.stats().dead == 1)
        stats = relay.stats()
    dead = store.get(row)
    assert dead is not None
    assert (dead.status, dead.attempts) == ("dead", 1)
    assert (dead.last_error or "").startswith("expired: ")
    assert stats.parked == len(calls) - 1 >= 2
    assert stats.requeued == 0


def test_a_handler_raising_base_exception_after_a_hold_is_a_failed_attempt(
    store: Store,
) -> None:
    class Stop(BaseException):
        pass

    runs = 0

    def handler(message: OutboxMessage) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise Defer(0.05)
        if runs == 2:
            raise Stop
        # the third run: sent

    bus = EventBus()
    bus.subscribe("t", handler)
    (row,) = enqueue_keys(store, "chat")
    policy = RetryPolicy(base_delay=0.01, jitter=0.0)
    with Relay(store, bus, poll_interval=0.02, retry=policy) as relay:
        wait_for(lambda: relay.stats().sent == 1)
        stats = relay.stats()
    assert (stats.parked, stats.retried, stats.sent) == (1, 1, 1)
    done = store.get(row)
    assert done is not None
    assert (done.status, done.attempts) == ("sent", 2)


def test_held_rows_keep_their_keys_order_under_a_short_switch_interval(store: Store) -> None:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        keys = [f"k{i}" for i in range(12)]
        per_key = 4
        lock = threading.Lock()
        seen: dict[str, list[int]] = {k: [] for k in keys}
        tries: dict[int, int] = {}

        def handler(message: OutboxMessage) -> None:
            with lock:
                n = tries.get(message.id, 0) + 1
                tries[message.id] = n
            if n <= 2:
                raise Defer(0.005 * n)
            with lock:
                seen[message.key].append(message.id)

        bus = EventBus()
        bus.subscribe("t", handler)
        ids = enqueue_keys(store, *[k for _ in range(per_key) for k in keys])
        with Relay(store, bus, poll_interval=0.05, batch_size=5, max_inflight=3) as relay:
            wait_for(lambda: relay.stats().sent == len(ids), timeout=60.0)
            stats = relay.stats()
    finally:
        sys.setswitchinterval(old)
    expected: dict[str, list[int]] = {k: [] for k in keys}
    for i, key in zip(ids, [k for _ in range(per_key) for k in keys], strict=True):
        expected[key].append(i)
    assert seen == expected
    assert stats.parked == 2 * len(ids)
    assert all(r.attempts == 1 and r.status == "sent" for r in store.rows(limit=1000))


def test_a_claim_takes_a_row_of_first_due_within_claim_ahead_with_its_wait(
    store: Store,
) -> None:
    # The rows a relay put back are claimed a little before they are due,
    # each with how long it has to wait; a row due later is left.
    ids = enqueue_keys(store, "soon", "later")
    soon, later = ids
    session = store.session()
    try:
        claimed = {c.message.id: c for c in session.claim("me", 10, 30.0, None)}
        back = [
            Outcome(i, claimed[i].token, claimed[i].message.key, "requeue", delay)
            for i, delay in ((soon, CLAIM_AHEAD / 2), (later, 10 * CLAIM_AHEAD))
        ]
        assert session.finish("me", back).written == 2
        got = session.claim("me", 10, 30.0, None, first=[soon, later])
    finally:
        session.close()
    assert [c.message.id for c in got] == [soon]
    (item,) = got
    assert 0.0 < item.wait <= CLAIM_AHEAD / 2
