"""A row its handler puts off for a short while is held by the relay, on both stores.

A handler that raises ``Defer(d)`` or ``RateLimited(d)`` with ``d`` of at
most ``_PARK_AT_MOST`` seconds is run again ``d`` seconds later by the relay
itself: the row stays claimed (its lease renewed), nothing is written, and
the handler runs on time (a rate limiter's booked slot), never early. A
longer delay, a stopping relay, or a row past ``max_total`` writes the row
back as before.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence

import pytest

from outbound import Defer
from outbound.errors import RateLimited, StoreError
from outbound.outbox import EventBus, OutboxMessage, Relay, RetryPolicy, Store
from outbound.outbox import relay as relay_module
from outbound.outbox._base import CLAIM_AHEAD, Claimed, Outcome, Session

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


@pytest.mark.parametrize(
    ("delay", "held"),
    [(0.2, True), (math.nextafter(0.2, math.inf), False)],
    ids=["at-the-limit", "just-past"],
)
def test_the_longest_hold_is_inclusive(
    store: Store, monkeypatch: pytest.MonkeyPatch, delay: float, held: bool
) -> None:
    # A delay of exactly _PARK_AT_MOST is held; the next float up is
    # written back.
    monkeypatch.setattr(relay_module, "_PARK_AT_MOST", 0.2)
    made, _ = make_flaky(store, _never)
    runs: list[float] = []

    def handler(message: OutboxMessage) -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise Defer(delay)

    bus = EventBus()
    bus.subscribe("t", handler)
    (row,) = enqueue_keys(store, "chat")
    with Relay(store, bus, poll_interval=3600.0) as relay:
        wait_for(lambda: relay.stats().sent == 1)
        stats = relay.stats()
    assert runs[1] - runs[0] >= 0.2 - 0.005
    if held:
        assert (stats.parked, stats.requeued, stats.claimed, _written(made)) == (1, 0, 1, 1)
    else:
        assert (stats.parked, stats.requeued, stats.claimed, _written(made)) == (0, 1, 2, 2)
    done = store.get(row)
    assert done is not None
    assert (done.status, done.attempts) == ("sent", 1)  # a deferral is no attempt


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


def test_stop_writes_back_a_held_row_at_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stopping: a held row is written back at once, its attempt not
    # counted, and not run again; the stop does not wait out its delay
    # (held for a minute here, the stop has 20 s).
    monkeypatch.setattr(relay_module, "_PARK_AT_MOST", 60.0)
    runs: list[float] = []
    first = threading.Event()

    def handler(message: OutboxMessage) -> None:
        runs.append(time.monotonic())
        first.set()
        raise Defer(60.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    (row,) = enqueue_keys(store, "chat")
    relay = Relay(store, bus, poll_interval=3600.0).start()
    try:
        assert first.wait(30.0)
        wait_for(lambda: relay.stats().parked == 1)
    finally:
        assert relay.stop(20.0)
    stats = relay.stats()
    assert len(runs) == 1
    assert (stats.parked, stats.requeued, stats.inflight, stats.sent) == (1, 1, 0, 0)
    back = store.get(row)
    assert back is not None
    assert (back.status, back.attempts) == ("pending", 0)


@pytest.mark.parametrize("operator", ["cancel", "dead_letter"])
def test_a_held_row_an_operator_takes_out_is_not_run_again_and_its_key_goes_on(
    store: Store, operator: str
) -> None:
    # The relay checks a held row is still its own before running it again:
    # cancelled (or dead-lettered) meanwhile, it is not run again, the write
    # back is refused, and the next row of its key goes out.
    runs: dict[int, int] = {}
    sent: list[int] = []

    def handler(message: OutboxMessage) -> None:
        runs[message.id] = runs.get(message.id, 0) + 1
        if message.id == held:
            raise Defer(1.9)  # ever again: a rate limit that never lets it go
        sent.append(message.id)

    bus = EventBus()
    bus.subscribe("t", handler)
    held, behind = enqueue_keys(store, "a", "a")
    with Relay(store, bus, poll_interval=0.05) as relay:
        wait_for(lambda: relay.stats().parked == 1)
        assert getattr(store, operator)([held]) == 1  # well before its check, 1.85 s on
        wait_for(lambda: sent == [behind])
        # Both written: the next row's outcome, and the held row's write-back
        # (refused).
        wait_for(lambda: (relay.stats().sent, relay.stats().lost) == (1, 1))
        stats = relay.stats()
    assert runs == {held: 1, behind: 1}
    assert (stats.parked, stats.sent, stats.inflight) == (1, 1, 0)
    taken_out = store.get(held)
    assert taken_out is not None
    assert taken_out.status == ("cancelled" if operator == "cancel" else "dead")


def test_held_rows_checked_together_run_on_when_an_operator_takes_one_out(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two rows held, checked in one renewal; an operator cancels one
    # meanwhile. The renewal renews one row of two, and the relay put both
    # back (the other claimed again: a write and a claim more, its handler
    # later than booked). Only the cancelled one goes back.
    runs: dict[int, int] = {}
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            runs[message.id] = runs.get(message.id, 0) + 1
            if runs[message.id] == 1:
                raise Defer(1.5)

    bus = EventBus()
    bus.subscribe("t", handler)
    cancelled, kept = enqueue_keys(store, "a", "b")
    relay = Relay(store, bus, poll_interval=0.05, batch_size=2)
    check = relay._check_parked

    def check_both_at_once(session: Session) -> None:
        # Both rows' checks are due (their wakes come microseconds apart):
        # the loop takes both in one check.
        with relay._lock:
            due = [entry[0] for entry in relay._to_check]
        if len(due) == 2:
            ahead = relay_module._PARK_CHECK_AHEAD
            threading.Event().wait(max(0.0, max(due) - ahead - time.monotonic()))
        check(session)

    monkeypatch.setattr(relay, "_check_parked", check_both_at_once)
    with relay:
        wait_for(lambda: relay.stats().parked == 2)
        assert store.cancel([cancelled]) == 1  # well before their check, 1.45 s on
        wait_for(lambda: relay.stats().sent == 1)
        wait_for(lambda: relay.stats().lost == 1)  # the cancelled row's write-back
        stats = relay.stats()
    assert runs == {cancelled: 1, kept: 2}
    assert (stats.claimed, stats.requeued, stats.sent, stats.inflight) == (2, 0, 1, 0)
    done = store.get(kept)
    assert done is not None
    assert (done.status, done.attempts) == ("sent", 1)


def test_rows_a_rate_limit_keeps_putting_off_leave_room_for_other_keys(store: Store) -> None:
    # A held row takes its room in the relay, but only once per claim: put
    # off again, it is written back, and the relay claims other keys.
    release = threading.Event()
    lock = threading.Lock()
    sent: list[str] = []

    def handler(message: OutboxMessage) -> None:
        if message.key.startswith("hot") and not release.is_set():
            raise RateLimited(1.0)
        with lock:
            sent.append(message.key)

    bus = EventBus()
    bus.subscribe("t", handler)
    hot = [f"hot{i}" for i in range(6)]
    cold = [f"cold{i}" for i in range(20)]
    enqueue_keys(store, *hot, *cold)  # the hot rows first: claimed first
    with Relay(store, bus, poll_interval=0.05, batch_size=2, max_inflight=2) as relay:
        wait_for(lambda: sorted(k for k in sent if k.startswith("cold")) == sorted(cold))
        assert not any(k.startswith("hot") for k in sent)
        release.set()
        wait_for(lambda: relay.stats().sent == len(hot) + len(cold))
        stats = relay.stats()
    assert stats.parked >= len(hot)
    assert stats.requeued >= 1  # put off again: written back
    assert stats.inflight == 0


def test_a_held_row_whose_lease_passed_to_another_relay_is_not_run_again(store: Store) -> None:
    # A cannot reach the database to renew (or check) its held row past
    # its lease; B takes the row over and sends it and the row behind it.
    # A runs a held row only once it found it still its own: it never runs
    # this one again, and its write-back, once the database answers, is
    # refused.
    blocked = threading.Event()

    class NoRenewals(FlakySession):
        def renew(self, owner: str, lease: float, held: Sequence[Claimed]) -> int:
            if blocked.is_set():
                raise StoreError("the test keeps renewals from the database")
            return super().renew(owner, lease, held)

    a_runs: list[int] = []
    b_sent: list[int] = []

    def handler_a(message: OutboxMessage) -> None:
        a_runs.append(message.id)
        raise Defer(0.3)  # a booked slot, again and again

    def handler_b(message: OutboxMessage) -> None:
        b_sent.append(message.id)

    bus_a, bus_b = EventBus(), EventBus()
    bus_a.subscribe("t", handler_a)
    bus_b.subscribe("t", handler_b)
    first, second = enqueue_keys(store, "a", "a")
    _, real = make_flaky(store, _never, NoRenewals)
    with Relay(store, bus_a, poll_interval=0.05, lease=0.6) as a:
        wait_for(lambda: a.stats().parked >= 1)
        blocked.set()
        runs_when_blocked = len(a_runs)
        store.session = real  # type: ignore[method-assign]
        with Relay(store, bus_b, poll_interval=0.05, lease=0.6):
            wait_for(lambda: b_sent == [first, second])
        runs_after = len(a_runs) - runs_when_blocked
        blocked.clear()
        wait_for(lambda: a.stats().lost >= 1)  # A's write-back, refused
        stats = a.stats()
    assert runs_after <= 1  # one may have begun as renewals stopped
    assert set(a_runs) == {first}
    assert (stats.sent, stats.inflight) == (0, 0)


def test_a_row_held_past_max_total_goes_dead(store: Store) -> None:
    calls: list[float] = []

    def handler(message: OutboxMessage) -> None:
        calls.append(time.time())  # the store's created_at is wall-clock time
        raise RateLimited(0.1)

    bus = EventBus()
    bus.subscribe("t", handler)
    (row,) = enqueue_keys(store, "chat")
    # The age runs from the enqueue, before the relay (and its pool) starts:
    # max_total leaves room for three calls 0.1 s apart after a slow start
    # (a loaded CI runner took over 0.3 s to the first call).
    with Relay(store, bus, poll_interval=3600.0, retry=RetryPolicy(max_total=2.0)) as relay:
        wait_for(lambda: relay.stats().dead == 1)
        stats = relay.stats()
    dead = store.get(row)
    assert dead is not None
    assert (dead.status, dead.attempts) == ("dead", 1)
    assert (dead.last_error or "").startswith("expired: ")
    # Held once per claim, written back when put off again.
    assert stats.parked + stats.requeued == len(calls) - 1 >= 2, (
        f"{len(calls)} calls, the first {calls[0] - dead.created_at:.2f} s after the enqueue"
    )
    assert stats.parked >= 1


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
    assert (stats.parked, stats.requeued) == (len(ids), len(ids))  # once held, once written
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
