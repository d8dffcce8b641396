"""A PostgreSQL relay claims on a connection of its own, beside its writes.

The seams: a reconcile (which releases the leases the relay has but does
not track) against a claim whose rows are not tracked yet; a stop against
a claim in progress; the room shared by the claims and the writes that
take rows; the claim connection dying; the claim thread failing.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, cast

import psycopg
import pytest

from outbound import Defer
from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, RelayState, RetryPolicy
from outbound.outbox._base import Claimed, Session
from outbound.outbox.postgres import _PostgresSession

from .conftest import POSTGRES_URL, attempts_bus, enqueue_keys, unique_table, wait_for
from .test_relay_failures import ONCE, LostAnswerSession


@pytest.fixture
def store() -> Iterator[PostgresStore]:
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    made = PostgresStore(POSTGRES_URL, table=unique_table())
    try:
        yield made
    finally:
        made.close()
        made.drop_schema()


class Gated:
    """Wraps a relay's session: its claims that take rows wait for ``gate`` once
    ``hold`` is set, after the statement committed (the rows are the relay's,
    not yet tracked by it); ``reconnect`` makes it say once that it reconnected;
    its next write waits for ``write_gate`` once ``stall_write`` is set.
    Counts reconciles, and the loop's turns since (its ``reconnected()`` calls)."""

    def __init__(self, inner: Session) -> None:
        self.inner = inner
        self.hold = threading.Event()
        self.gate = threading.Event()
        self.held = threading.Event()  # a claim's rows wait at the gate
        self.reconnect = threading.Event()
        self.asked = threading.Event()  # reconnected() said so
        self.lock = threading.Lock()
        self.reconciles = 0
        self.turns = 0  # reconnected() calls since ``asked``
        self.after_reconcile: Any = lambda: None  # called after each reconcile
        # Once ``stall_write`` is set, the next write waits for ``write_gate``.
        self.stall_write = threading.Event()
        self.write_stalled = threading.Event()
        self.write_gate = threading.Event()
        self.claimed: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def finish(self, *args: Any, **kwargs: Any) -> Any:
        if self.stall_write.is_set():
            self.stall_write.clear()
            self.write_stalled.set()
            assert self.write_gate.wait(60.0)
        return self.inner.finish(*args, **kwargs)

    def claim(self, *args: Any, **kwargs: Any) -> list[Claimed]:
        found = self.inner.claim(*args, **kwargs)
        if found and self.hold.is_set():
            self.hold.clear()
            with self.lock:
                self.claimed = [c.message.id for c in found]
            self.held.set()
            assert self.gate.wait(30.0)
        return found

    def reconnected(self) -> bool:
        if self.reconnect.is_set():
            self.reconnect.clear()
            self.asked.set()
            return True
        if self.asked.is_set():
            with self.lock:
                self.turns += 1
        return self.inner.reconnected()

    def reconcile(self, owner: str, held: Sequence[Claimed]) -> int:
        with self.lock:
            self.reconciles += 1
        released = self.inner.reconcile(owner, held)
        self.after_reconcile()
        return released


def gated(store: PostgresStore) -> tuple[list[Gated], list[Gated]]:
    """Wrap the relay sessions ``store`` makes from now on: (loop's, claims')."""
    loops: list[Gated] = []
    claims: list[Gated] = []
    real, real_claims = store.session, store.claim_session

    def session() -> Any:
        made = Gated(real())
        loops.append(made)
        return made

    def claim_session(beside: Any) -> Any:
        inner = real_claims(beside.inner if isinstance(beside, Gated) else beside)
        assert inner is not None
        made = Gated(inner)
        claims.append(made)
        return made

    store.session = session  # type: ignore[method-assign]
    store.claim_session = claim_session  # type: ignore[method-assign]
    return loops, claims


def _processing(store: PostgresStore, ids: Sequence[int]) -> bool:
    """Every row of ``ids`` is processing, its lease running."""
    rows = {row.id: row for row in store.rows(limit=1000)}
    return all(rows[i].status == "processing" for i in ids)


def test_a_relay_claims_on_a_connection_of_its_own(store: PostgresStore) -> None:
    # The claim connection is not the pool's: a relay runs on a store whose
    # pool has one connection.
    small = PostgresStore(store.conninfo, table=store.table, pool_size=1, create=False)
    bus, seen = attempts_bus()
    ids = enqueue_keys(small, *(f"k{i % 5}" for i in range(50)))
    try:
        with Relay(small, bus, poll_interval=0.02) as relay:
            wait_for(lambda: len(seen) == 50)
            loop, side = relay._session, relay._side
            assert isinstance(loop, _PostgresSession)
            assert isinstance(side, _PostgresSession)
            assert loop._conn is not None
            assert side._conn is not None
            assert loop._conn.info.backend_pid != side._conn.info.backend_pid
    finally:
        small.close()
    assert sorted(seen) == [(i, 1) for i in ids]
    assert relay.stats().sent == 50


def test_a_reconcile_waits_for_the_claim_whose_rows_are_not_tracked_yet(
    store: PostgresStore,
) -> None:
    # A claim has committed and its rows have not reached the relay when the
    # loop's connection comes back from a reconnect. The reconcile would
    # release every lease the relay has but does not track, these rows
    # included: they would be claimed again (attempt 2) and delivered twice.
    loops, claims = gated(store)
    bus, seen = attempts_bus()
    with Relay(store, bus, poll_interval=0.02) as relay:
        (loop,), (side,) = loops, claims
        try:
            side.hold.set()
            (row,) = enqueue_keys(store, "a")
            assert side.held.wait(10.0)
            assert side.claimed == [row]
            loop.reconnect.set()
            assert loop.asked.wait(10.0)
            # Two turns of the loop since: each would have run the reconcile.
            wait_for(lambda: loop.turns >= 2)
            assert loop.reconciles == 0
            assert _processing(store, [row])
        finally:
            side.gate.set()
        wait_for(lambda: loop.reconciles >= 1)
        wait_for(lambda: store.status().counts["sent"] == 1)
    assert seen == [(row, 1)]
    stats = relay.stats()
    assert (stats.claimed, stats.sent, stats.released, stats.lost) == (1, 1, 0, 0)


def test_a_stop_waits_for_the_claim_in_progress(store: PostgresStore) -> None:
    # stop() came while a claim's rows were on their way to the relay: the
    # loop must not end before they are delivered and their outcomes
    # written (they would be left to their leases, under a relay that is
    # gone).
    _, claims = gated(store)
    running = threading.Event()
    may_return = threading.Event()
    seen: list[int] = []

    def handler(message: OutboxMessage) -> None:
        seen.append(message.id)
        running.set()
        assert may_return.wait(30.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    relay = Relay(store, bus, poll_interval=0.02).start()
    (side,) = claims
    try:
        side.hold.set()
        enqueue_keys(store, "a")
        assert side.held.wait(10.0)
        assert relay.stop(0.2) is False  # a claim is on its way
        assert relay.state is RelayState.STOPPING
        side.gate.set()
        assert running.wait(10.0)
        # Its handler runs: the loop waits for its outcome.
        thread = relay._thread
        assert thread is not None
        thread.join(0.5)
        assert thread.is_alive()
        may_return.set()
        assert relay.stop(10.0)
    finally:
        side.gate.set()
        may_return.set()
        relay.stop(10.0)
    assert seen == side.claimed
    rows = {row.id: row for row in store.rows()}
    assert [rows[i].status for i in seen] == ["sent"]
    assert relay.stats().inflight == 0


def test_claims_and_takes_together_stay_within_the_room(store: PostgresStore) -> None:
    # The claim thread claims while the loop's writes take the next rows of
    # the keys they finish: each leaves the other's share of the room. A
    # relay runs or queues at most max_inflight + batch_size rows.
    batch, inflight = 4, 2
    relay: Relay | None = None
    peak = 0
    lock = threading.Lock()
    done: Counter[str] = Counter()

    def handler(message: OutboxMessage) -> None:
        nonlocal peak
        assert relay is not None
        running = relay.stats().inflight
        with lock:
            peak = max(peak, running)
            done[message.key] += 1
        time.sleep(0.002)  # the work of a send: rows pile up to the room

    bus = EventBus()
    bus.subscribe("t", handler)
    keys = [f"k{k}" for k in range(24)]
    enqueue_keys(store, *(key for _ in range(12) for key in keys))
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        relay = Relay(store, bus, poll_interval=0.02, batch_size=batch, max_inflight=inflight)
        with relay:
            wait_for(lambda: sum(done.values()) == len(keys) * 12, timeout=60.0)
    finally:
        sys.setswitchinterval(previous)
    assert 0 < peak <= batch + inflight
    assert done == dict.fromkeys(keys, 12)


def test_a_relay_goes_on_after_its_claim_connection_is_terminated(
    store: PostgresStore,
) -> None:
    bus, seen = attempts_bus()
    with Relay(store, bus, poll_interval=0.02) as relay:
        first = enqueue_keys(store, "a", "b")
        wait_for(lambda: len(seen) == 2)
        side = relay._side
        assert isinstance(side, _PostgresSession)
        assert side._conn is not None
        pid = side._conn.info.backend_pid
        with psycopg.connect(store.conninfo, autocommit=True) as admin:
            killed = admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
        assert killed == (True,)
        later = enqueue_keys(store, "a", "c", "d")
        wait_for(lambda: len(seen) == 5)
        assert side._conn is not None
        assert side._conn.info.backend_pid != pid
    assert sorted(seen) == sorted((i, 1) for i in first + later)
    assert relay.stats().state is RelayState.STOPPED


class Interrupt(BaseException):
    """Raised by a claim: what no relay code catches as an error."""


class Raising(logging.Handler):
    """A logging handler that raises (a broken log pipe, say)."""

    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("the log is broken")


@pytest.mark.parametrize("log", ["works", "raises"])
def test_a_claim_thread_that_fails_stops_the_relay(
    store: PostgresStore,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    log: str,
) -> None:
    # "raises": the failure cannot even be logged. The relay must stop all
    # the same, not go on running with no claim thread, claiming nothing.
    real = store.claim_session
    raised = threading.Event()

    def claim_session(beside: Any) -> Any:
        made = real(beside)
        assert made is not None

        def claim(*args: Any, **kwargs: Any) -> list[Claimed]:
            raised.set()
            raise Interrupt

        made.claim = claim  # type: ignore[method-assign]
        return made

    store.claim_session = claim_session  # type: ignore[method-assign]
    uncaught: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.exc_value))
    logger = logging.getLogger("outbound")
    broken = Raising(logging.ERROR)
    if log == "raises":
        logger.addHandler(broken)
    bus, seen = attempts_bus()
    try:
        with caplog.at_level(logging.ERROR, "outbound"):
            relay = Relay(store, bus, poll_interval=0.02).start()
            try:
                enqueue_keys(store, "a")
                assert raised.wait(10.0)
                wait_for(lambda: relay.state is RelayState.STOPPED)
            finally:
                stopped = relay.stop(10.0)
    finally:
        logger.removeHandler(broken)
    assert stopped is False  # it had failed: its rows are left to their leases
    if log == "works":
        assert any("claim thread failed" in r.getMessage() for r in caplog.records)
        assert uncaught == []
    else:
        assert [type(e) for e in uncaught] == [RuntimeError]  # said, not hidden
    assert seen == []
    assert store.status().counts["pending"] == 1


def test_a_store_without_a_claim_session_claims_between_its_writes(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop claims itself, as it does on SQLite: same rows, same order.
    monkeypatch.setattr(store, "claim_session", lambda beside: None)
    bus, seen = attempts_bus()
    ids = enqueue_keys(store, *(f"k{i % 3}" for i in range(30)))
    with Relay(store, bus, poll_interval=0.02) as relay:
        assert relay._side is None
        wait_for(lambda: len(seen) == 30)
    assert [i for i, _ in seen if i in ids[0::3]] == ids[0::3]
    assert relay.stats().sent == 30


def test_keys_with_long_lines_do_not_starve_a_new_key(store: PostgresStore) -> None:
    # The writes take the next rows of the keys they finish, within three
    # quarters of the room; the claims get the rest, oldest heads first, a
    # quarter of a batch at a time or every _CLAIM_GATHER. A key that comes
    # while a few keys with long lines fill the room goes out well before
    # those lines end.
    order: list[str] = []
    lock = threading.Lock()
    started = threading.Event()

    def handler(message: OutboxMessage) -> None:
        with lock:
            order.append(message.key)
            if len(order) == 60:
                started.set()
        time.sleep(0.002)  # the work of a send

    bus = EventBus()
    bus.subscribe("t", handler)
    lines = [f"line{k}" for k in range(6)]
    enqueue_keys(store, *(key for _ in range(60) for key in lines))
    with Relay(store, bus, poll_interval=0.02, batch_size=8, max_inflight=4):
        assert started.wait(20.0)
        enqueue_keys(store, "new")
        wait_for(lambda: "new" in order)
        wait_for(lambda: len(order) == 361, timeout=60.0)
    at = order.index("new")
    # 300 rows of the lines were still to go when it came.
    assert at < 60 + 100, at


def test_an_outcome_is_written_while_other_rows_run(store: PostgresStore) -> None:
    # With a claim thread, the loop's turns come from the writes alone: the
    # outcome of a row whose handler returned while another runs must be
    # written (_GATHER after it), and the next row of its key go out, not
    # wait for the loop's next check (here, never).
    release = threading.Event()
    seen: list[str] = []

    def handler(message: OutboxMessage) -> None:
        seen.append(message.key)
        if message.key == "b":
            assert release.wait(30.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    enqueue_keys(store, "b", "a", "a")
    relay = Relay(store, bus, poll_interval=3600.0, lease=3600.0)
    relay._check_every = 3600.0
    relay.start()
    try:
        wait_for(lambda: seen.count("a") == 2)
        assert seen.count("b") == 1  # still running
    finally:
        release.set()
        assert relay.stop(10.0)
    assert store.status().counts["sent"] == 3


def _leased_to(store: PostgresStore, owner: str) -> int:
    """How many rows are processing under ``owner``'s lease."""
    with psycopg.connect(store.conninfo, autocommit=True) as conn:
        found = conn.execute(
            f"SELECT count(*) FROM {store.table} WHERE status = 'processing' AND lease_owner = %s",
            (owner,),
        ).fetchone()
    assert found is not None
    return int(found[0])


def _grows_past(measure: Any, bound: int, seconds: float) -> bool:
    """Whether ``measure()`` goes past ``bound`` within ``seconds`` (a look for
    what must not happen: the time is the chance given to it)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if measure() > bound:
            return True
        time.sleep(0.02)
    return False


def test_a_write_held_up_holds_the_claims_up(store: PostgresStore) -> None:
    # The loop's write waits (a lock, a slow server) while the handlers
    # finish their rows. A row's room comes back with the write of its
    # outcome: the claims must stop at the room, not lease more and more
    # rows that nothing renews while the loop waits.
    batch, inflight = 16, 4
    loops, _ = gated(store)
    enqueue_keys(store, *(f"k{i}" for i in range(300)))
    bus, seen = attempts_bus()
    relay = Relay(store, bus, poll_interval=0.02, batch_size=batch, max_inflight=inflight)
    relay.start()
    (loop,) = loops
    try:
        wait_for(lambda: len(seen) >= 10)
        loop.stall_write.set()
        assert loop.write_stalled.wait(10.0)
        assert not _grows_past(lambda: _leased_to(store, relay.owner), batch + inflight, 1.5)
        assert relay.stats().inflight <= batch + inflight
        loop.write_gate.set()
        wait_for(lambda: store.status().counts["sent"] == 300)
    finally:
        loop.write_gate.set()
        assert relay.stop(20.0)
    assert sorted(i for i, _ in seen) == sorted({i for i, _ in seen})  # each once


def test_a_lost_claim_answer_costs_no_attempt_when_both_sessions_reconnect(
    store: PostgresStore,
) -> None:
    # A server restart: the claim session's claim committed and its answer
    # was lost, and the loop's session reconnected too. Reconciled on each
    # session in turn, the first released the claim's row without taking
    # its attempt back (the token was the other session's), and a relay
    # that claimed it in between got it as attempt 2: dead, never
    # delivered, with max_attempts=1. One reconcile now covers both.
    (a,) = enqueue_keys(store, "a")
    real_claims = store.claim_session
    loops, _ = gated(store)
    sides: list[LostAnswerSession] = []

    def claim_session(beside: Any) -> Any:
        inner = real_claims(beside.inner if isinstance(beside, Gated) else beside)
        assert inner is not None
        made = LostAnswerSession(inner, lambda outcomes: False)
        sides.append(made)
        return made

    store.claim_session = claim_session  # type: ignore[method-assign]
    other = PostgresStore(store.conninfo, table=store.table, create=False)
    another = other.session()
    got: list[tuple[int, int]] = []
    bus, _ = attempts_bus()
    relay = Relay(store, bus, poll_interval=0.02, lease=30.0, retry=ONCE)
    try:
        relay.start()
        (loop,), (side,) = loops, sides

        def lost() -> None:  # the claim committed; the loop's connection went too
            loop.reconnect.set()
            assert loop.asked.wait(10.0)

        def another_claims() -> None:  # right after the reconcile, before any claim
            if not got:
                got.extend(
                    (c.message.id, c.message.attempt) for c in another.claim("b", 9, 30, None)
                )

        side.on_lost = lost
        loop.after_reconcile = another_claims
        assert side.lost_now.wait(10.0)
        wait_for(lambda: bool(got))
    finally:
        relay.stop(10.0)
        another.close()
        other.close()
    assert side.lost == [a]
    assert got == [(a, 1)]


def test_only_a_session_of_the_store_gets_a_claim_session(store: PostgresStore) -> None:
    # A session wrapped by the application, or another store's: the relay
    # claims between its writes (a claim session must share what its
    # first session lost, and only the store's own sessions can).
    other = PostgresStore(store.conninfo, table=store.table, create=False)
    mine, theirs = store.session(), other.session()
    try:
        assert store.claim_session(cast(Any, object())) is None
        assert store.claim_session(theirs) is None
        side = store.claim_session(mine)
        assert isinstance(side, _PostgresSession)
        assert side._lost is mine._lost
        side.close()
    finally:
        mine.close()
        theirs.close()
        other.close()


class Boom(BaseException):
    """Raised by a handler: what no handler should raise."""


@pytest.mark.parametrize("seed", [1, 2])
def test_relays_whose_connections_die_keep_every_guarantee(store: PostgresStore, seed: int) -> None:
    # Three relays (sizes drawn at random) under a 10 us switch interval;
    # handlers fail, put rows off or raise BaseException now and then; the
    # claim connection (or, less often, the loop's) of a relay is
    # terminated, up to 40 times. Checked at every delivery: no two rows of
    # a key at once, none before every earlier row of its key was sent, no
    # attempt run again once it ended, each relay within its room; at the
    # end, every row sent and every stop complete.
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(25)]
    order = [key for _ in range(8) for key in keys]
    ids = enqueue_keys(store, *order)
    line: dict[str, list[int]] = {key: [] for key in keys}
    for row_id, key in zip(ids, order, strict=True):
        line[key].append(row_id)
    lock = threading.Lock()
    running: dict[str, int] = {}
    sent: set[int] = set()
    ended: Counter[tuple[int, int]] = Counter()
    errors: list[str] = []
    relays: list[Relay] = []
    rooms: list[int] = []

    def handler(message: OutboxMessage) -> None:
        key = message.key
        with lock:
            if key in running:
                errors.append(f"{key}: {message.id} while {running[key]} runs")
            running[key] = message.id
            early = [i for i in line[key] if i < message.id and i not in sent]
            if early:
                errors.append(f"{key}: {message.id} before {early} were sent")
            if ended[(message.id, message.attempt)]:
                errors.append(f"{message.id}: attempt {message.attempt} ran again")
            for relay, room in zip(relays, rooms, strict=True):
                if relay.stats().inflight > room:
                    errors.append(f"{relay.stats().inflight} rows in flight, room {room}")
            roll = rng.random()
        ok = deferred = False
        try:
            time.sleep(0.001)  # the work of a send
            if roll < 0.08:
                raise RuntimeError("a send failed")
            if roll < 0.12:
                deferred = True
                raise Defer(0.01)
            if roll < 0.14:
                raise Boom
            ok = True
        finally:
            with lock:
                running.pop(key, None)
                if not deferred:
                    ended[(message.id, message.attempt)] += 1
                if ok:
                    sent.add(message.id)

    bus = EventBus()
    bus.subscribe("t", handler)
    retry = RetryPolicy(max_attempts=1000, base_delay=0.005, max_delay=0.02, jitter=0.0)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for n in range(3):
            batch, inflight = rng.choice([(4, 2), (8, 3), (3, 5)])
            rooms.append(batch + inflight)
            relays.append(
                Relay(
                    store,
                    bus,
                    poll_interval=0.05,
                    batch_size=batch,
                    max_inflight=inflight,
                    lease=5.0,
                    retry=retry,
                    name=f"r{n}",
                )
            )
        for relay in relays:
            relay.start()
        kills = 0

        def done_or_kill() -> bool:
            nonlocal kills
            with lock:
                if len(sent) == len(ids):
                    return True
            # (The first kill at once: a fast run may be over in a few polls.)
            if kills < 40 and (kills == 0 or rng.random() < 0.5):
                relay = rng.choice(relays)
                session = relay._side if rng.random() < 0.7 else relay._session
                conn = getattr(session, "_conn", None)
                if kills == 0 and conn is None:
                    # The first kill at the first connection there is: one
                    # session picked at random, not connected yet, and then
                    # coin tosses, let a fast run end with none (seen once).
                    sessions = [s for r in relays for s in (r._side, r._session)]
                    conn = next(
                        (c for c in (getattr(s, "_conn", None) for s in sessions) if c),
                        None,
                    )
                if conn is not None:
                    with psycopg.connect(store.conninfo, autocommit=True) as admin:
                        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
                    kills += 1
            return False

        wait_for(done_or_kill, timeout=90.0)
        stopped = [relay.stop(30.0) for relay in relays]
    finally:
        sys.setswitchinterval(previous)
        for relay in relays:
            relay.force_stop(10.0)
    assert errors == [], "\n".join(errors[:12])
    assert stopped == [True, True, True]
    assert kills > 0
    counts = store.status().counts
    assert (counts["sent"], counts["processing"]) == (len(ids), 0)


def test_an_idle_relay_claims_at_its_poll_not_at_each_turn_of_its_loop(
    store: PostgresStore,
) -> None:
    # The loop turns often (here every 50 ms, for its checks) while it has
    # nothing to write: a turn that writes nothing wakes no claim. (The
    # claims came at every turn, not at the poll interval.)
    _, claims = gated(store)
    counted: list[int] = []
    bus, _ = attempts_bus()
    relay = Relay(store, bus, poll_interval=30.0, listen=False)
    relay._check_every = 0.05
    with relay:
        (side,) = claims
        real = side.inner.claim

        def claim(*args: Any, **kwargs: Any) -> list[Claimed]:
            counted.append(1)
            return real(*args, **kwargs)

        side.inner.claim = claim  # type: ignore[method-assign]
        # (The first claim may come after the count began.)
        assert not _grows_past(lambda: len(counted), 1, 1.0)
