"""The relay when an outcome cannot be written, a delay is out of range, or a handler misuses it."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import platform
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, NoReturn, cast

import pytest
from private_postgres import private_server

from outbound import Defer
from outbound.errors import RateLimited, StoreError
from outbound.outbox import EventBus, OutboxMessage, Relay, RelayState, RetryPolicy, Store
from outbound.outbox import postgres as pg
from outbound.outbox._base import Claimed, Finished, Outcome, Session
from outbound.outbox.postgres import PostgresStore, _PostgresSession
from outbound.outbox.sqlite import _SQLiteSession

from .conftest import (
    StoreFactory,
    app_connection,
    attempts_bus,
    run_committed,
    unique_table,
    wait_for,
)

FAST = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05, jitter=0.0)


def enqueue(store: Store, *rows: tuple[str, str, Any]) -> list[int]:
    conn = app_connection(store)
    try:
        ids = [store.enqueue(conn, key=k, type=t, payload=p) for k, t, p in rows]
        conn.commit()
        return ids
    finally:
        conn.close()


def unfinished(store: Store) -> int:
    counts = store.status().counts
    return counts["pending"] + counts["processing"]


class FlakySession(Session):
    """A real session whose ``finish`` raises while ``refuse(outcomes)`` is true."""

    def __init__(self, inner: Session, refuse: Callable[[Sequence[Outcome]], bool]) -> None:
        self.inner = inner
        self.refuse = refuse
        # Guards the counters: the relay's loop thread writes, the test reads.
        self.lock = threading.Lock()
        self.finish_calls = 0
        self.renew_calls = 0
        self.claims = False  # a relay's claim session (see make_flaky)

    def hold_to(self, lease: float) -> None:
        self.inner.hold_to(lease)

    def ensure_slots(self, count: int) -> None:
        self.inner.ensure_slots(count)

    def claim(
        self,
        owner: str,
        limit: int,
        lease: float,
        max_concurrency: int | None,
        skip_keys: Sequence[str] = (),
        *,
        held_keys: Sequence[str] = (),
        first: Sequence[int] = (),
        held_slots: Sequence[int] = (),
    ) -> list[Claimed]:
        self.before_claim()
        return self.inner.claim(
            owner,
            limit,
            lease,
            max_concurrency,
            skip_keys,
            held_keys=held_keys,
            first=first,
            held_slots=held_slots,
        )

    def before_claim(self) -> None:
        """What happens before each claim: nothing here."""

    def finish(
        self,
        owner: str,
        outcomes: Sequence[Outcome],
        *,
        take: int = 0,
        lease: float = 0.0,
        skip_keys: Sequence[str] = (),
    ) -> Finished:
        with self.lock:
            self.finish_calls += 1
        with self.trouble(outcomes):
            return self.inner.finish(owner, outcomes, take=take, lease=lease, skip_keys=skip_keys)

    @contextlib.contextmanager
    def trouble(self, outcomes: Sequence[Outcome]) -> Iterator[None]:
        """Around each write: one that ``refuse`` picks raises here."""
        if self.refuse(outcomes):
            raise StoreError("refused by the test")
        yield

    def renew(self, owner: str, lease: float, held: Sequence[Claimed]) -> int:
        renewed = self.inner.renew(owner, lease, held)
        with self.lock:
            self.renew_calls += 1
        return renewed

    def reconcile(self, owner: str, held: Sequence[Claimed]) -> int:
        return self.inner.reconcile(owner, held)

    def refused(self, exc: StoreError) -> bool:
        return True  # the test's refusals are of the outcomes, not of the database

    def release_slots(self, owner: str) -> None:
        self.inner.release_slots(owner)

    def close(self) -> None:
        self.inner.close()


class FailingSession(FlakySession):
    """A real session whose ``finish`` fails for real (see :func:`fail_for_real`) while
    ``refuse(outcomes)`` is true; the real session says whether it was refused."""

    def __init__(self, inner: Session, refuse: Callable[[Sequence[Outcome]], bool]) -> None:
        super().__init__(inner, refuse)
        self.failures: list[StoreError] = []

    @contextlib.contextmanager
    def trouble(self, outcomes: Sequence[Outcome]) -> Iterator[None]:
        if not self.refuse(outcomes):
            yield
            return
        with fail_for_real(self.inner):
            try:
                yield
            except StoreError as exc:
                self.failures.append(exc)
                raise
        pytest.fail("the write did not fail")

    def refused(self, exc: StoreError) -> bool:
        return self.inner.refused(exc)


class StalledSession(FlakySession):
    """A real session whose ``finish`` waits for ``gate`` while ``refuse(outcomes)`` is
    true (a write held up, say waiting on a lock), then writes; so does the next
    ``claim`` once ``stall_claim`` is set."""

    def __init__(self, inner: Session, refuse: Callable[[Sequence[Outcome]], bool]) -> None:
        super().__init__(inner, refuse)
        self.gate = threading.Event()
        self.stalled = threading.Event()
        self.stall_claim = threading.Event()

    def before_claim(self) -> None:
        if self.stall_claim.is_set():
            self.stall_claim.clear()
            self.stalled.set()
            assert self.gate.wait(30.0)

    @contextlib.contextmanager
    def trouble(self, outcomes: Sequence[Outcome]) -> Iterator[None]:
        if self.refuse(outcomes):
            self.stalled.set()
            assert self.gate.wait(30.0)
        yield


class ReconnectedSession(FlakySession):
    """A real session that says it reconnected, and whose first reconcile fails."""

    def __init__(self, inner: Session, refuse: Callable[[Sequence[Outcome]], bool]) -> None:
        super().__init__(inner, refuse)
        self.said = False
        self.reconciles = 0

    def reconnected(self) -> bool:
        said, self.said = self.said, True
        return not said

    def reconcile(self, owner: str, held: Sequence[Claimed]) -> int:
        with self.lock:
            self.reconciles += 1
            first = self.reconciles == 1
        if first:
            raise StoreError("the reconcile failed (the test)")
        return self.inner.reconcile(owner, held)


class TrueSession(FlakySession):
    """A real session that says, as the real one does, when it reconnected and
    whether the database refused a statement; counts its reconciles."""

    def __init__(self, inner: Session, refuse: Callable[[Sequence[Outcome]], bool]) -> None:
        super().__init__(inner, refuse)
        self.reconciles = 0
        self.unsettled = 0  # how many times settled() said no

    def reconnected(self) -> bool:
        return self.inner.reconnected()

    def settled(self) -> bool:
        settled = self.inner.settled()
        if not settled:
            with self.lock:
                self.unsettled += 1
        return settled

    def refused(self, exc: StoreError) -> bool:
        return self.inner.refused(exc)

    def reconcile(self, owner: str, held: Sequence[Claimed]) -> int:
        released = self.inner.reconcile(owner, held)
        with self.lock:
            self.reconciles += 1
        return released


def _lose_answer(inner: _PostgresSession) -> NoReturn:
    """Close the session's connection, as the relay would find it after the server
    went away, and raise what the lost answer raises."""
    conn = inner._conn
    assert conn is not None
    conn.close()
    import psycopg  # noqa: PLC0415 - PostgreSQL only

    raise StoreError(
        "outbox database error: server closed the connection unexpectedly (the test)"
    ) from psycopg.OperationalError("server closed the connection unexpectedly")


class LostAnswerSession(TrueSession):
    """A real PostgreSQL session that loses the answer of its first statement
    named ``lose`` ("claim", or "finish" for a write that took rows) that
    returned rows: the statement committed, and the connection died before
    the rows reached the relay. With ``lose_reconcile``, the answer of its
    first reconcile after that is lost too. While ``down`` is set, its
    reconciles fail (the database is away)."""

    lose = "claim"

    def __init__(self, inner: Session, refuse: Callable[[Sequence[Outcome]], bool]) -> None:
        super().__init__(inner, refuse)
        assert isinstance(inner, _PostgresSession)
        # The ids of the rows claimed by the lost answer (the loop thread's).
        self.lost: list[int] = []
        self.lost_now = threading.Event()  # set once that answer was lost
        self.lose_reconcile = False
        self.down = threading.Event()
        # Called once the lost statement committed, before its answer is lost.
        self.on_lost: Callable[[], object] = lambda: None
        real = inner._run

        def run(name: str, params: Any) -> Any:
            if name == "reconcile" and self.down.is_set():
                raise StoreError("outbox database error: the database is away (the test)")
            cursor = real(name, params)
            if name == "reconcile" and self.lose_reconcile and self.lost:
                self.lose_reconcile = False
                _lose_answer(inner)
            if name != self.lose or self.lost:
                return cursor
            rows = cursor.fetchall()
            claimed = [r for r in rows if r[0] is None] if name == "finish" else rows
            if not claimed:
                cursor.scroll(0, mode="absolute")
                return cursor
            self.lost = sorted(r[2] if name == "finish" else r[0] for r in claimed)
            self.on_lost()
            self.lost_now.set()
            _lose_answer(inner)

        inner._run = run  # type: ignore[method-assign]


class LostTakeSession(LostAnswerSession):
    lose = "finish"


@contextlib.contextmanager
def fail_for_real(session: Session) -> Iterator[None]:
    """Make the session's next statement fail the way databases fail, not refuse.

    PostgreSQL: the session's backend is terminated (a restart, a failover).
    SQLite: another connection holds the write lock past the busy timeout.
    """
    if isinstance(session, _SQLiteSession):
        other = session._store.connect()
        try:
            other.execute("BEGIN IMMEDIATE")
            yield
        finally:
            other.rollback()
            other.close()
        return
    import psycopg  # noqa: PLC0415 - PostgreSQL only

    assert isinstance(session, _PostgresSession)
    conn = session.connect(10.0)
    with psycopg.connect(session._store.conninfo, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,)
        ).fetchone()
    assert killed == (True,)
    yield


def make_flaky(
    store: Store,
    refuse: Callable[[Sequence[Outcome]], bool],
    kind: Callable[[Session, Callable[[Sequence[Outcome]], bool]], FlakySession] = FlakySession,
    *,
    claims: bool = False,
) -> tuple[list[FlakySession], Callable[[], Session]]:
    """Make ``store.session()`` return sessions of ``kind``; return them and the real factory.

    ``claims``: ``store.claim_session()`` too (a relay's claim session, on
    PostgreSQL), its sessions marked ``claims``. Otherwise a relay claims on
    a real claim session (beside the real session inside its first), and on
    a session of ``kind`` where the store has none (SQLite). A relay's
    reconciles run on its first session (for both).
    """
    made: list[FlakySession] = []
    real = store.session
    real_claims = store.claim_session

    def session() -> Session:
        flaky = kind(real(), refuse)
        made.append(flaky)
        return flaky

    def claim_session(beside: Session) -> Session | None:
        inner = real_claims(beside.inner if isinstance(beside, FlakySession) else beside)
        if inner is None:
            return None
        flaky = kind(inner, refuse)
        flaky.claims = True
        made.append(flaky)
        return flaky

    def real_claim_session(beside: Session) -> Session | None:
        return real_claims(beside.inner if isinstance(beside, FlakySession) else beside)

    store.session = session  # type: ignore[method-assign]
    store.claim_session = (  # type: ignore[method-assign]
        claim_session if claims else real_claim_session
    )
    return made, real


def claiming(made: Sequence[FlakySession]) -> FlakySession:
    """The session of ``made`` (see :func:`make_flaky` with ``claims``) a relay claims on:
    its claim session, or its only one."""
    found = [s for s in made if s.claims] or list(made)
    assert len(found) == 1, found
    return found[0]


def looping(made: Sequence[FlakySession]) -> FlakySession:
    """The session of ``made`` a relay writes on (its first)."""
    (found,) = [s for s in made if not s.claims]
    return found


#: Retries fast, and a row goes dead at its second attempt.
ONCE = RetryPolicy(max_attempts=1, base_delay=0.01, max_delay=0.05, jitter=0.0)


def _went_out_once(store: Store, row_id: int, seen: list[tuple[int, int]]) -> None:
    """The row was delivered once, as attempt 1, and is sent (see :func:`attempts_bus`)."""
    row = store.get(row_id)
    assert row is not None
    assert (row.status, row.attempts) == ("sent", 1)
    assert seen == [(row_id, 1)]


def needs_answers(backend: str) -> None:
    """Skip unless the store answers over a connection, where an answer can be lost."""
    if backend != "postgres":
        pytest.skip("SQLite answers in process: there is no answer to lose")


def counting_bus() -> tuple[EventBus, Counter[int]]:
    """A bus whose handler of type "t" counts its calls per row id."""
    calls: Counter[int] = Counter()
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            calls[message.id] += 1

    bus = EventBus()
    bus.subscribe("t", handler)
    return bus, calls


def test_an_error_text_with_nul_is_written_escaped(store: Store) -> None:
    sent: list[int] = []

    def bad(message: OutboxMessage) -> None:
        raise ValueError("junk \x00 from upstream")

    bus = EventBus()
    bus.subscribe("bad", bad)
    bus.subscribe("good", lambda m: sent.append(m.payload))
    (bad_id,) = enqueue(store, ("a", "bad", None))
    with Relay(store, bus, poll_interval=0.02, retry=FAST) as relay:
        wait_for(lambda: unfinished(store) == 0)
        enqueue(store, ("b", "good", 1))  # later rows still flow
        wait_for(lambda: sent == [1])
    row = {r.id: r for r in store.rows()}[bad_id]
    assert (row.status, row.attempts) == ("dead", 3)
    assert row.last_error == "ValueError: junk \\x00 from upstream"
    assert relay.stats().errors == 0


class OddRateLimit(RateLimited):
    """A RateLimited whose retry_after its constructor never checked (a subclass's doing)."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(0.0)
        self.retry_after = retry_after


@pytest.mark.parametrize("delay", [math.inf, math.nan])
def test_a_delay_that_is_not_a_number_of_seconds_backs_off(store: Store, delay: float) -> None:
    calls: Counter[int] = Counter()

    def handler(message: OutboxMessage) -> None:
        calls[message.id] += 1
        if calls[message.id] == 1:
            raise OddRateLimit(delay)

    bus = EventBus()
    bus.subscribe("t", handler)
    (row_id,) = enqueue(store, ("k", "t", None))
    with Relay(store, bus, poll_interval=0.02, retry=FAST) as relay:
        wait_for(lambda: store.status().counts["sent"] == 1)
    row = store.rows()[0]
    assert (row.id, row.attempts) == (row_id, 1)  # requeued (the retry policy's delay), sent
    assert calls[row_id] == 2
    assert relay.stats().errors == 0


def test_a_huge_delay_is_cut_and_written(store: Store) -> None:
    deferred = threading.Event()
    sent: list[int] = []

    def later(message: OutboxMessage) -> None:
        deferred.set()
        raise Defer(1e300)  # finite, but no database interval holds it

    bus = EventBus()
    bus.subscribe("later", later)
    bus.subscribe("now", lambda m: sent.append(m.payload))
    (later_id,) = enqueue(store, ("a", "later", None))
    no_age_bound = RetryPolicy(max_total=math.inf)
    with Relay(store, bus, poll_interval=0.02, retry=no_age_bound) as relay:
        assert deferred.wait(10.0)
        wait_for(lambda: relay.stats().requeued == 1)
        enqueue(store, ("b", "now", 1))
        wait_for(lambda: sent == [1])
    row = {r.id: r for r in store.rows()}[later_id]
    assert (row.status, row.attempts) == ("pending", 0)
    assert relay.stats().errors == 0


def test_a_huge_retry_backoff_is_cut_and_written(store: Store) -> None:
    def broken(message: OutboxMessage) -> None:
        raise RuntimeError("down")

    bus = EventBus()
    bus.subscribe("t", broken)
    (row_id,) = enqueue(store, ("k", "t", None))
    policy = RetryPolicy(
        max_attempts=5, base_delay=1e300, max_delay=1e300, max_total=math.inf, jitter=0.0
    )
    with Relay(store, bus, poll_interval=0.02, retry=policy) as relay:
        wait_for(lambda: relay.stats().retried == 1)
    row = store.rows()[0]
    assert (row.id, row.status, row.attempts) == (row_id, "pending", 1)
    assert row.last_error == "RuntimeError: down"
    assert relay.stats().errors == 0


def test_an_outcome_the_store_refuses_becomes_a_plain_retry(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    ids = enqueue(store, *((f"k{i}", "t", i) for i in range(6)))
    poisoned = ids[2]
    refused = 0

    def refuse(outcomes: Sequence[Outcome]) -> bool:
        nonlocal refused  # the loop thread's alone
        if refused < 2 and any(o.id == poisoned and o.kind == "sent" for o in outcomes):
            refused += 1  # the batch, then the outcome on its own
            return True
        return False

    make_flaky(store, refuse)
    bus, calls = counting_bus()
    with (
        caplog.at_level(logging.ERROR, "outbound"),
        Relay(store, bus, poll_interval=0.02, retry=FAST) as relay,
    ):
        wait_for(lambda: store.status().counts["sent"] == 6)
    rows = {r.id: r for r in store.rows()}
    assert rows[poisoned].attempts == 2  # the plain retry counted an attempt
    assert calls[poisoned] == 2
    assert all(rows[i].attempts == 1 and calls[i] == 1 for i in ids if i != poisoned)
    assert refused == 2
    assert relay.stats().errors >= 2
    assert any("written as a retry instead" in r.getMessage() for r in caplog.records)


def test_an_outcome_whose_write_failed_is_written_again_not_replaced(
    backend: str, make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A sent row whose outcome was lost with its connection (or waited out
    # the file's lock) must not be written as a retry: it would be sent twice.
    store = make_store(busy_timeout=0.2) if backend == "sqlite" else make_store()
    (row_id,) = enqueue(store, ("k", "t", None))
    failed = 0

    def fail(outcomes: Sequence[Outcome]) -> bool:
        nonlocal failed  # the loop thread's alone
        if failed == 0 and any(o.id == row_id and o.kind == "sent" for o in outcomes):
            failed += 1
            return True
        return False

    made, _ = make_flaky(store, fail, FailingSession)
    bus, calls = counting_bus()
    with (
        caplog.at_level(logging.WARNING, "outbound"),
        Relay(store, bus, poll_interval=0.02, retry=FAST) as relay,
    ):
        wait_for(lambda: store.status().counts["sent"] == 1)
    row = store.rows()[0]
    assert calls[row_id] == 1
    assert (row.id, row.status, row.attempts, row.last_error) == (row_id, "sent", 1, None)
    assert relay.stats().errors >= 1
    assert relay.stats().retried == 0
    assert not any("written as a retry instead" in r.getMessage() for r in caplog.records)
    (failing,) = made
    assert isinstance(failing, FailingSession)
    (failure,) = failing.failures
    assert not failing.refused(failure)


@pytest.mark.parametrize("lost", ["claim", "take"])
def test_rows_whose_claim_answer_was_lost_keep_their_attempt(
    backend: str, store: Store, lost: str
) -> None:
    # The claim committed, and the connection died before its rows reached
    # the relay: they were never delivered. After the reconnect the relay
    # releases them; their attempt must not count (it used to: a row went
    # out with attempt 2, or dead unsent with max_attempts=1).
    needs_answers(backend)
    rows = [("a", "t", 1), ("a", "t", 2), ("b", "t", 1)] if lost == "take" else [("a", "t", 1)]
    ids = enqueue(store, *rows)
    made, _ = make_flaky(
        store,
        lambda outcomes: False,
        LostTakeSession if lost == "take" else LostAnswerSession,
        claims=True,
    )
    bus, seen = attempts_bus()
    with Relay(store, bus, poll_interval=0.02, lease=30.0, retry=ONCE) as relay:
        wait_for(lambda: unfinished(store) == 0)
    session = claiming(made) if lost == "claim" else looping(made)
    assert isinstance(session, LostAnswerSession)
    assert session.lost  # an answer was lost, with rows in it
    by_id = {row.id: row for row in store.rows()}
    assert {i: by_id[i].status for i in ids} == dict.fromkeys(ids, "sent")
    assert all(by_id[i].attempts == 1 for i in ids)
    assert sorted(seen) == sorted((i, 1) for i in ids)  # each delivered once, as attempt 1
    assert relay.stats().dead == 0


def test_a_reconcile_takes_back_the_attempt_of_unanswered_claims_only(
    backend: str, store: Store
) -> None:
    # Row a: claimed by a statement whose answer was lost. Row b: claimed
    # and seen, then no longer held (its outcome was lost with a restart):
    # b was delivered, a never was.
    needs_answers(backend)
    (a,) = enqueue(store, ("a", "t", None))
    session = LostAnswerSession(store.session(), lambda outcomes: False)
    other = store.session()
    try:
        with pytest.raises(StoreError):
            session.claim("relay-a", 10, 3600.0, None)
        assert session.lost == [a]
        (b,) = enqueue(store, ("b", "t", None))
        seen = session.claim("relay-a", 10, 3600.0, None)
        assert [c.message.id for c in seen] == [b]
        assert session.reconnected()
        assert session.reconcile("relay-a", []) == 2
        again = {c.message.id: c.message.attempt for c in other.claim("relay-b", 10, 30.0, None)}
        assert again == {a: 1, b: 2}
    finally:
        session.close()
        other.close()


def test_a_reconcile_whose_answer_was_lost_takes_back_no_attempt_twice(
    backend: str, store: Store
) -> None:
    # The reconcile committed (the attempt taken back) and its answer was
    # lost: the relay runs it again. Taking the attempt back again would
    # deliver the row as attempt 0, and drive attempts below zero.
    needs_answers(backend)
    (a,) = enqueue(store, ("a", "t", None))
    session = LostAnswerSession(store.session(), lambda outcomes: False)
    session.lose_reconcile = True
    other = store.session()
    try:
        with pytest.raises(StoreError):
            session.claim("relay-a", 10, 3600.0, None)
        with pytest.raises(StoreError):
            session.reconcile("relay-a", [])
        assert session.reconcile("relay-a", []) == 0  # released again (harmless), not counted
        assert store.get(a).attempts == 0  # type: ignore[union-attr]
        (again,) = other.claim("relay-b", 10, 30.0, None)
        assert (again.message.id, again.message.attempt) == (a, 1)
    finally:
        session.close()
        other.close()


def _lease_passed(store: Store, row_id: int) -> bool:
    """The row's lease has run out, or it is no longer processing."""
    conn = app_connection(store)
    try:
        row = conn.execute(
            f"SELECT status <> 'processing' OR lease_expires_at < now() FROM {store.table} "
            "WHERE id = %s",
            (row_id,),
        ).fetchone()
        return bool(row and row[0])
    finally:
        conn.close()


@pytest.mark.parametrize("then", ["lease passes", "stop"])
def test_a_relay_reconciles_before_it_claims_again_after_a_lost_claim_answer(
    backend: str, store: Store, then: str
) -> None:
    # "lease passes": the database stays away past the rows' lease; a claim
    # before the reconcile would take them back as expired leases (attempt
    # 2: dead with max_attempts=1). "stop": stop() right after the lost
    # answer; without a reconcile the rows would wait out their lease
    # under a relay that is gone.
    needs_answers(backend)
    (a,) = enqueue(store, ("a", "t", None))
    made, _ = make_flaky(store, lambda outcomes: False, LostAnswerSession, claims=True)
    bus, seen = attempts_bus()
    lease = 1.0 if then == "lease passes" else 30.0
    relay = Relay(store, bus, poll_interval=0.02, lease=lease, retry=ONCE)
    relay.start()
    try:
        session = claiming(made)
        assert isinstance(session, LostAnswerSession)
        if then == "lease passes":
            for each in made:  # the database is away: reconciles fail
                assert isinstance(each, LostAnswerSession)
                each.down.set()
        assert session.lost_now.wait(10.0)
        if then == "lease passes":
            wait_for(lambda: _lease_passed(store, a))
            turns = relay.stats().errors
            wait_for(lambda: relay.stats().errors >= turns + 3)  # reconciles that failed
            for each in made:
                assert isinstance(each, LostAnswerSession)
                each.down.clear()
            wait_for(lambda: unfinished(store) == 0)
        else:
            assert relay.stop(10.0)
            with Relay(store, bus, poll_interval=0.02, retry=ONCE):
                wait_for(lambda: unfinished(store) == 0)
    finally:
        relay.stop(10.0)
    assert session.lost == [a]
    _went_out_once(store, a, seen)


def test_a_row_locked_elsewhere_holds_back_no_claim_after_a_lost_claim_answer(
    backend: str, store: Store
) -> None:
    # The relay claims nothing until its reconcile is through: a reconcile
    # that waited for a row another transaction holds (here, the row of the
    # lost answer, locked for as long as the test runs) stopped every key.
    needs_answers(backend)
    (a,) = enqueue(store, ("a", "t", None))
    blocker = app_connection(store)

    def locking(inner: Session, refuse: Callable[[Sequence[Outcome]], bool]) -> FlakySession:
        session = LostAnswerSession(inner, refuse)
        session.on_lost = lambda: blocker.execute(
            f"SELECT 1 FROM {store.table} WHERE id = %s FOR UPDATE", (a,)
        )
        return session

    made, _ = make_flaky(store, lambda outcomes: False, locking, claims=True)
    bus, calls = counting_bus()
    try:
        with Relay(store, bus, poll_interval=0.02, retry=FAST) as relay:
            session = claiming(made)
            assert isinstance(session, LostAnswerSession)
            assert session.lost_now.wait(10.0)
            others = enqueue(store, *((k, "t", None) for k in "bcde"))
            wait_for(lambda: all(calls[i] == 1 for i in others))
            assert relay.state is RelayState.RUNNING
        assert calls[a] == 0  # still locked away: left to its lease
    finally:
        blocker.rollback()
        blocker.close()


class LossySession(TrueSession):
    """A real PostgreSQL session that loses, at random, the answers of claims,
    writes and reconciles that committed: the connection dies after the
    commit, before the answer reaches the relay. Used by one loop thread."""

    def __init__(self, inner: Session, refuse: Callable[[Sequence[Outcome]], bool]) -> None:
        super().__init__(inner, refuse)
        assert isinstance(inner, _PostgresSession)
        self.rng = random.Random()
        self.losses: Counter[str] = Counter()
        real = inner._run

        def run(name: str, params: Any) -> Any:
            cursor = real(name, params)
            if name not in ("claim", "finish", "reconcile"):
                return cursor
            rows = cursor.fetchall()  # the statement ran to its end and committed
            # The first of each kind that did something loses its answer
            # (so that every kind is lost in every run), then one in seven.
            first = not self.losses[name] and (bool(rows) or name != "claim")
            if not first and self.rng.random() >= 0.15:
                cursor.scroll(0, mode="absolute")  # the rows, for the caller
                return cursor
            self.losses[name] += 1
            _lose_answer(inner)

        inner._run = run  # type: ignore[method-assign]


@pytest.mark.parametrize("seed", [1, 2])
def test_answers_lost_at_random_under_fast_switching_cost_no_attempt_and_no_order(
    backend: str, store: Store, seed: int
) -> None:
    # Two relays lose about one answer in seven of their claims, writes
    # (taking the next rows or not) and reconciles, while the interpreter
    # switches threads every 10 microseconds. A lost answer's rows were
    # never delivered: each row goes out once, as attempt 1, in its key's
    # order, and none goes dead (max_attempts=1: a counted attempt would
    # kill it at its next claim; a row left to its lease would too).
    needs_answers(backend)
    keys, per_key = 12, 12
    ids = enqueue(store, *((f"k{k}", "t", {"n": n}) for n in range(per_key) for k in range(keys)))
    seeds = itertools.count(seed * 10)

    def seeded(inner: Session, refuse: Callable[[Sequence[Outcome]], bool]) -> FlakySession:
        session = LossySession(inner, refuse)
        session.rng.seed(next(seeds))
        return session

    made, _ = make_flaky(store, lambda outcomes: False, seeded, claims=True)
    seen: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            seen.append((message.key, message.payload["n"], message.attempt))

    bus = EventBus()
    bus.subscribe("t", handler)
    relays = [
        Relay(store, bus, poll_interval=0.02, lease=5.0, retry=ONCE, batch_size=8, max_inflight=4)
        for _ in range(2)
    ]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for relay in relays:
            relay.start()
        wait_for(lambda: unfinished(store) == 0, timeout=90.0)
        for relay in relays:
            assert relay.stop(20.0)
    finally:
        sys.setswitchinterval(previous)
        for relay in relays:
            relay.stop(10.0)
    losses = sum((s.losses for s in made if isinstance(s, LossySession)), Counter[str]())
    assert min(losses[name] for name in ("claim", "finish", "reconcile")) > 0, losses
    by_id = {row.id: row for row in store.rows(limit=len(ids))}
    assert {by_id[i].status for i in ids} == {"sent"}
    assert {by_id[i].attempts for i in ids} == {1}
    assert sorted(seen) == sorted((f"k{k}", n, 1) for n in range(per_key) for k in range(keys))
    for k in range(keys):
        assert [n for key, n, _ in seen if key == f"k{k}"] == list(range(per_key))


def _backend_gone(store: Store, pid: int) -> Callable[[], bool]:
    def gone() -> bool:
        with app_connection(store) as conn:
            found = conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
            return found.fetchone() is None

    return gone


def test_a_claim_left_on_a_dropped_connection_claims_nothing_after_the_reconcile(
    make_stall_store: Callable[..., PostgresStore],
) -> None:
    # The relay's server process is paused (SIGSTOP) while the relay is
    # idle: its next claim waits there unanswered until the watchdog drops
    # the connection; the relay reconnects and reconciles. Resumed after a
    # row came, that process would run the claim and commit it, under a
    # token no relay keeps: the row would wait out its lease, then go dead
    # (max_attempts=1) without a delivery. The reconcile tells the process
    # to end first, so it ends before it runs the claim.
    store = make_stall_store(connect_timeout=1.0)
    bus, seen = attempts_bus()
    with _pausable_relay(store, bus) as (relay, _, _, pid, loop):
        paused: int | None = pid
        try:
            _pause_while_idle(store, pid)
            # The next claim waits on the paused process until the watchdog
            # drops its connection (2 s); a reconcile follows the reconnect.
            wait_for(lambda: loop.reconciles >= 1, timeout=30.0)
            assert relay.stop(10.0)
            (a,) = enqueue(store, ("a", "t", None))
            os.kill(pid, signal.SIGCONT)
            paused = None
            wait_for(_backend_gone(store, pid), timeout=20.0)
            row = store.get(a)
            assert row is not None
            assert (row.status, row.attempts) == ("pending", 0)  # no claim ran there
            with Relay(store, bus, poll_interval=0.02, lease=2.0, retry=ONCE):
                wait_for(lambda: unfinished(store) == 0)
        finally:
            if paused is not None:
                os.kill(paused, signal.SIGCONT)
    _went_out_once(store, a, seen)


def test_a_reconcile_left_on_a_dropped_connection_expires_no_lease_after_the_next(
    make_stall_store: Callable[..., PostgresStore],
) -> None:
    # A reconcile waits unanswered on a paused server process until the
    # watchdog drops its connection. Resumed later, that process would run
    # it and expire the lease of every row the relay did not hold when it
    # was sent, rows claimed since included: another relay would take them
    # as expired (attempt 2: dead with max_attempts=1, or a second
    # delivery). The next reconcile tells that process to end first.
    store = make_stall_store(connect_timeout=1.0)
    (a,) = enqueue(store, ("a", "t", None))
    session = store.session()
    assert isinstance(session, _PostgresSession)
    paused: int | None = None
    try:
        (claimed,) = session.claim("me", 1, 2.0, None)  # statements now wait 2 s at most
        lease = _lease_of(store, a)
        conn = session._conn
        assert conn is not None
        paused = conn.info.backend_pid
        if not _can_pause(paused):
            pytest.skip("the PostgreSQL server's processes cannot be paused from here")
        _pause_while_idle(store, paused)
        with pytest.raises(StoreError, match="did not answer"):
            session.reconcile("me", [])  # as if the row were not held: it would expire
        assert session.reconcile("me", [claimed]) == 0  # over a new connection
        os.kill(paused, signal.SIGCONT)
        wait_for(_backend_gone(store, paused), timeout=20.0)
        paused = None
        assert _lease_of(store, a) == lease  # as the claim left it: not expired since
    finally:
        if paused is not None:
            os.kill(paused, signal.SIGCONT)
        session.close()


def test_a_claim_caught_in_its_commit_is_released_once_its_process_ends(
    stall_store: PostgresStore,
) -> None:
    # A server process stalled inside the commit of a claim (a storage
    # stall; here paused in the sleep of commit_delay) cannot be ended: it
    # commits when it runs again, after the relay has reconciled. The
    # reconcile keeps the claim's token while the process lives, and the
    # session asks for reconciles until one finds it gone: that one
    # releases the row, its attempt not counted.
    _on_x86_64_linux()
    from psycopg.conninfo import make_conninfo  # noqa: PLC0415 - PostgreSQL only

    plain = stall_store
    slow_url = make_conninfo(plain.conninfo, options="-c commit_delay=100000 -c commit_siblings=0")
    slow = PostgresStore(slow_url, table=plain.table, connect_timeout=1.0, create=False)
    session = slow.session()
    assert isinstance(session, _PostgresSession)
    paused: int | None = None
    try:
        assert session.claim("me", 1, 2.0, None) == []  # statements now wait 2 s at most
        conn = session._conn
        assert conn is not None
        pid = conn.info.backend_pid
        if not _can_pause(pid):
            pytest.skip("the PostgreSQL server's processes cannot be paused from here")
        # A commit whose record another process flushed first does not
        # sleep: its row goes out now, and the next one is tried.
        done: list[Claimed] = []
        for n in range(20):
            (a,) = enqueue(plain, (f"a{n}", "t", None))
            answers: list[list[Claimed] | StoreError] = []

            def claim() -> None:
                try:
                    answers.append(session.claim("me", 5, 2.0, None))
                except StoreError as exc:
                    answers.append(exc)

            claiming = threading.Thread(target=claim)
            claiming.start()
            paused = _pause_in_commit(pid, lambda: not claiming.is_alive())
            claiming.join(20.0)
            assert not claiming.is_alive()
            if paused is not None:
                break
            (answer,) = answers
            assert isinstance(answer, list)
            done += answer
        else:
            pytest.fail(f"server process {pid} was never caught in the commit of a claim")
        assert len(answers) == 1
        assert isinstance(answers[0], StoreError)  # the watchdog gave up on it
        assert session.reconcile("me", done) == 0  # told to end: it cannot, in its commit
        assert session.reconnected()  # once: the connection was replaced
        assert not session.reconnected()  # the next look is a second away
        os.kill(paused, signal.SIGCONT)
        paused = None
        wait_for(_backend_gone(plain, pid), timeout=20.0)
        assert _lease_of(plain, a)[0] == "processing"  # the commit went in after all
        wait_for(session.reconnected, timeout=10.0)
        assert session.reconcile("me", done) == 1  # its lease expired, its attempt taken back
        assert not session.reconnected()
        sent = [Outcome(c.message.id, c.token, c.message.key, "sent") for c in done]
        assert session.finish("me", sent).written == len(done)
        bus, seen = attempts_bus()
        with Relay(plain, bus, poll_interval=0.02, retry=ONCE):
            wait_for(lambda: unfinished(plain) == 0)
        assert seen == [(a, 1)]
    finally:
        if paused is not None:
            os.kill(paused, signal.SIGCONT)
        session.close()
        slow.close()


def test_a_relay_claims_nothing_while_a_claim_caught_in_its_commit_may_still_land(
    stall_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The relay's claim of "a" is caught in its commit past the rows' lease.
    # When it lands, the row is leased under a token no claim answered, its
    # lease already run out: the relay's next claim would take it back as
    # an expired lease (attempt 2: dead with max_attempts=1, undelivered).
    # The relay claims nothing until a reconcile finds the process gone
    # and releases the row, its attempt not counted.
    _on_x86_64_linux()
    import psycopg  # noqa: PLC0415 - PostgreSQL only
    from psycopg.conninfo import make_conninfo  # noqa: PLC0415

    # Reconciles look again 3 s apart: the claims have that long to take it.
    monkeypatch.setattr(pg, "_ORPHAN_RECHECK", 3.0)
    plain = stall_store
    slow_url = make_conninfo(plain.conninfo, options="-c commit_delay=100000 -c commit_siblings=0")
    slow = PostgresStore(slow_url, table=plain.table, connect_timeout=1.0, create=False)
    bus, seen = attempts_bus()
    with contextlib.ExitStack() as stack:
        stack.callback(slow.close)
        relay, session, inner, pid, loop = stack.enter_context(_pausable_relay(slow, bus))
        paused: int | None = None

        def resume() -> None:
            if paused is not None:
                os.kill(paused, signal.SIGCONT)

        stack.callback(resume)
        # A commit whose record another process flushed first does not
        # sleep: its row goes out now, and the next one is tried.
        with psycopg.connect(plain.conninfo, autocommit=True) as check:
            for n in range(20):
                (a,) = enqueue(plain, (f"a{n}", "t", None))
                while paused is None:
                    paused = _pause_in_commit(pid, lambda: _claimed_already(check, plain, a))
                    if paused is None:
                        break  # claimed and committed already
                    if _updating(check, plain, a, pid):
                        break  # the commit caught is the one of the claim of "a"
                    os.kill(pid, signal.SIGCONT)
                    paused = None
                if paused is not None:
                    break
            else:
                pytest.fail("the claim of a row was never caught in its commit")
        # The watchdog drops it; a reconcile finds the process still there,
        # and so does the one the reconnect asks for.
        wait_for(lambda: inner._lost.lingering_since is not None, timeout=30.0)
        wait_for(lambda: loop.reconciles >= 2)
        claimed = relay.stats().claimed
        assert not inner.settled()
        # The next look, 3 s on, finds it still there. Meanwhile the loop
        # wakes for its checks (every 0.2 s here), not in a spin.
        asked = session.unsettled
        wait_for(lambda: loop.reconciles >= 3, timeout=10.0)
        assert session.unsettled - asked < 100, session.unsettled - asked
        assert not inner.settled()
        os.kill(pid, signal.SIGCONT)
        paused = None
        wait_for(lambda: unfinished(plain) == 0, timeout=30.0)
        assert relay.stats().claimed == claimed + 1  # "a", once released
    _went_out_once(plain, a, [s for s in seen if s[0] == a])


@pytest.fixture(scope="module")
def stall_server() -> Iterator[str]:
    """A server of this module's own for the tests that pause its processes
    (SIGSTOP). Asleep in commit_delay, a paused process holds the WAL write
    lock, and every commit on its server waits for it; paused anywhere, it
    holds up a DROP DATABASE on its server. Tests running beside these do
    not wait on them."""
    pytest.importorskip("psycopg")
    with private_server("-c autovacuum=off") as server:
        yield server.url


@pytest.fixture
def make_stall_store(stall_server: str) -> Iterator[Callable[..., PostgresStore]]:
    """Build stores on fresh tables of the stall server; closed afterwards."""
    made: list[PostgresStore] = []

    def factory(**options: Any) -> PostgresStore:
        options.setdefault("table", unique_table())
        store = PostgresStore(stall_server, **options)
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


@pytest.fixture
def stall_store(make_stall_store: Callable[..., PostgresStore]) -> PostgresStore:
    return make_stall_store()


def _on_x86_64_linux() -> None:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("finds the commit's sleep by its system call number on x86-64 Linux")


def _updating(conn: Any, store: Store, row_id: int, pid: int) -> bool:
    """Whether the open transaction of server process ``pid`` has updated row
    ``row_id``. It only reads: a lock taken here would be committed, and the
    commit would wait for the WAL write lock the paused process holds."""
    found = conn.execute(
        f"SELECT o.xmax::text = a.backend_xid::text FROM {store.table} o, pg_stat_activity a"
        " WHERE o.id = %s AND a.pid = %s",
        (row_id, pid),
    ).fetchone()
    return bool(found is not None and found[0])


def _claimed_already(conn: Any, store: Store, row_id: int) -> bool:
    found = conn.execute(f"SELECT status FROM {store.table} WHERE id = %s", (row_id,)).fetchone()
    return bool(found != ("pending",))


def _pause_in_commit(pid: int, missed: Callable[[], bool]) -> int | None:
    """SIGSTOP the server process ``pid`` while it sleeps in a commit (commit_delay):
    the first select(2) or pselect6(2) it makes; None once ``missed()``."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{pid}/syscall") as f:
                number = f.read().split()[0]
            if number in ("23", "270"):
                os.kill(pid, signal.SIGSTOP)
                return pid
        if missed():
            return None
    pytest.fail(f"server process {pid} was never caught in its commit")


def _lease_of(store: Store, row_id: int) -> tuple[Any, ...]:
    """The row's status, lease token and lease expiry."""
    with app_connection(store) as conn:
        found = conn.execute(
            f"SELECT status, lease_token, lease_expires_at FROM {store.table} WHERE id = %s",
            (row_id,),
        ).fetchone()
    assert found is not None
    return tuple(found)


@contextlib.contextmanager
def _pausable_relay(
    store: Store, bus: EventBus
) -> Iterator[tuple[Relay, TrueSession, _PostgresSession, int, TrueSession]]:
    """A polling relay (lease 2 s, max_attempts=1) once it has claimed, with its
    claim session (and the session inside it), the server process of that
    session this test may pause, and its loop's session (where it
    reconciles); stopped afterwards."""
    made, _ = make_flaky(store, lambda outcomes: False, TrueSession, claims=True)
    relay = Relay(store, bus, poll_interval=0.02, lease=2.0, retry=ONCE, listen=False)
    relay.start()
    try:
        session = claiming(made)
        assert isinstance(session, TrueSession)
        inner = session.inner
        assert isinstance(inner, _PostgresSession)
        wait_for(lambda: inner._conn is not None and inner._bound == 2.0)  # a claim ran
        conn = inner._conn
        assert conn is not None
        pid = conn.info.backend_pid
        if not _can_pause(pid):
            pytest.skip("the PostgreSQL server's processes cannot be paused from here")
        loop = looping(made)
        assert isinstance(loop, TrueSession)
        yield relay, session, inner, pid, loop
    finally:
        relay.stop(10.0)


def _pause_while_idle(store: Store, pid: int) -> None:
    """SIGSTOP the server process ``pid`` between two statements, not inside one
    (a statement that started would not see the rows that come after)."""
    with app_connection(store) as conn:
        for _ in range(100):
            os.kill(pid, signal.SIGSTOP)
            found = conn.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,))
            state = found.fetchone()
            conn.rollback()  # the next read sees the activity afresh
            if state == ("idle",):
                return
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.005)  # not a synchronization: another moment to try
    pytest.fail(f"server process {pid} was never caught idle")


def _can_pause(pid: int) -> bool:
    """Whether this process may signal ``pid`` (a server on this host, run by a user
    this one may signal)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@pytest.mark.parametrize("held_up", ["write", "claim"])
def test_a_relay_held_up_past_its_leases_does_not_take_back_its_own_rows(
    store: Store, held_up: str
) -> None:
    # The loop waited on one write, or one claim waited (on a lock, a
    # paused server), for longer than a lease: no renewal ran meanwhile, and
    # the leases of the rows the relay held ran out. The claim took back
    # one of them, whose handler was still running, and delivered it a
    # second time. (A claim on a claim session waits beside the loop, which
    # renews on: the lease must not run out then.)
    stall_b = threading.Event()
    if held_up == "write":
        stall_b.set()
    sessions, _ = make_flaky(
        store,
        lambda outcomes: stall_b.is_set() and any(o.key == "b" for o in outcomes),
        StalledSession,
        claims=True,
    )
    release = threading.Event()
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            calls[message.key] += 1
        if message.key == "a":
            assert release.wait(30.0)

    def lease_end() -> float:
        row = store.get(a)
        assert row is not None
        assert row.lease_expires_at is not None
        return row.lease_expires_at

    def lapsed() -> bool:
        return lease_end() < time.time()

    bus = EventBus()
    bus.subscribe("t", handler)
    (a,) = enqueue(store, ("a", "t", None))
    with Relay(store, bus, poll_interval=0.02, lease=1.0, timeout=30.0, listen=False) as relay:
        stalled = claiming(sessions) if held_up == "claim" else looping(sessions)
        assert isinstance(stalled, StalledSession)
        wait_for(lambda: calls["a"] == 1)
        if held_up == "claim":
            stalled.stall_claim.set()
        enqueue(store, ("b", "t", None))
        assert stalled.stalled.wait(10.0)  # b's outcome is written, or the claim runs, slowly
        stall_b.clear()
        if held_up == "claim" and stalled.claims:
            # Renewed a lease after the claim began to wait (lease 1 s,
            # renewed every third of it), and running.
            since = time.time()
            wait_for(lambda: lease_end() > since + 2.0)
            assert not lapsed()
        else:
            wait_for(lapsed)  # a's handler runs; its lease ran out
        stalled.gate.set()
        wait_for(lambda: store.status().counts["sent"] == 1)  # b
        enqueue(store, ("c", "t", None))  # another claim runs: it must leave a alone
        wait_for(lambda: calls["c"] == 1)
        release.set()
        wait_for(lambda: unfinished(store) == 0)
    assert calls == {"a": 1, "b": 1, "c": 1}
    stats = relay.stats()
    # A claim held up past two thirds of the lease from when it was sent
    # (here, before it reached the database) hands over rows whose leases
    # the relay cannot vouch for: b is checked (renewed) before it runs.
    assert (stats.claimed, stats.sent, stats.lost) == (3, 3, 0)
    assert {r.id: r.attempts for r in store.rows()}[a] == 1
    assert all(r.attempts == 1 for r in store.rows())


class UnrenewedSession(FlakySession):
    """A real session whose renewals fail while ``failing`` is set (a connection
    that stopped answering them)."""

    failing = threading.Event()

    def renew(self, owner: str, lease: float, held: Sequence[Claimed]) -> int:
        if self.failing.is_set():
            raise StoreError("renewal refused by the test")
        return super().renew(owner, lease, held)


def test_a_relay_whose_leases_lapsed_runs_none_of_the_rows_it_queued(
    make_store: StoreFactory,
) -> None:
    # Relay A runs one handler at a time: row 1 runs long, row 2 (key k2)
    # waits in A's queue. A's renewals fail, so its leases lapse; relay B
    # takes row 2 back and delivers it and row 3, the next of k2. A then
    # ran row 2 from its queue, after row 3: per-key order broken, and row
    # 2 handled by two relays.
    table = unique_table()
    store_a = make_store(table=table)
    store_b = make_store(table=table)
    UnrenewedSession.failing = threading.Event()
    make_flaky(store_a, lambda outcomes: False, UnrenewedSession)
    release = threading.Event()
    lock = threading.Lock()
    seen: list[tuple[str, int]] = []

    def handler_for(relay: str) -> Callable[[OutboxMessage], None]:
        def handler(message: OutboxMessage) -> None:
            with lock:
                seen.append((relay, message.id))
            if relay == "A" and message.key == "k1":
                assert release.wait(30.0)

        return handler

    bus_a, bus_b = EventBus(), EventBus()
    bus_a.subscribe("t", handler_for("A"))
    bus_b.subscribe("t", handler_for("B"))
    (row1,) = enqueue(store_a, ("k1", "t", None))
    options: dict[str, Any] = {"poll_interval": 0.02, "lease": 1.0, "timeout": 30.0}
    with Relay(store_a, bus_a, max_inflight=1, listen=False, **options):
        wait_for(lambda: ("A", row1) in seen)
        UnrenewedSession.failing.set()
        (row2,) = enqueue(store_a, ("k2", "t", None))

        def lease_of_row2() -> float:
            row = store_a.get(row2)
            assert row is not None
            return math.inf if row.lease_expires_at is None else row.lease_expires_at

        wait_for(lambda: lease_of_row2() < time.time())  # claimed, and its lease ran out
        (row3,) = enqueue(store_a, ("k2", "t", None))
        with Relay(store_b, bus_b, listen=False, **options):
            wait_for(lambda: ("B", row3) in seen)
            release.set()
            wait_for(lambda: unfinished(store_a) == 0)
    assert ("A", row2) not in seen
    k2 = [row for _, row in seen if row in (row2, row3)]
    assert k2 == [row2, row3]


class HangingRenewals(FlakySession):
    """A real session whose renewals wait (up to 30 s) while ``hanging`` is set,
    as on a database that stopped answering; ``waiting`` is set meanwhile."""

    hanging = threading.Event()
    waiting = threading.Event()
    released = threading.Event()

    def renew(self, owner: str, lease: float, held: Sequence[Claimed]) -> int:
        if self.hanging.is_set():
            self.waiting.set()
            self.released.wait(30.0)
        return super().renew(owner, lease, held)


def count_looks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the rows each call of ``Relay._deliver`` looked at (a run, or a look
    whether a held row may run yet), in order."""
    looks: list[int] = []
    deliver = Relay._deliver

    def counted(self: Relay, item: Claimed) -> None:
        looks.append(item.message.id)
        deliver(self, item)

    monkeypatch.setattr(Relay, "_deliver", counted)
    return looks


def test_a_held_row_whose_check_hangs_looks_for_it_less_and_less_often(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As below, but the check's statement waits (a database behind a cut
    # link): the row looked every 5 ms while it waited, 200 times a second.
    HangingRenewals.hanging, HangingRenewals.waiting = threading.Event(), threading.Event()
    HangingRenewals.released = threading.Event()
    make_flaky(store, lambda outcomes: False, HangingRenewals)
    looks = count_looks(monkeypatch)

    def handler(message: OutboxMessage) -> None:
        if len(looks) == 1:
            HangingRenewals.hanging.set()
            raise Defer(0.2)

    bus = EventBus()
    bus.subscribe("t", handler)
    enqueue(store, ("k", "t", None))
    try:
        with Relay(store, bus, listen=False) as relay:
            assert HangingRenewals.waiting.wait(20.0)
            waiting_since, before = time.monotonic(), len(looks)
            wait_for(lambda: time.monotonic() > waiting_since + 1.5)  # the time is the test
            assert len(looks) - before < 20, len(looks) - before  # (before: about 300)
            HangingRenewals.hanging.clear()
            HangingRenewals.released.set()
            wait_for(lambda: relay.stats().sent == 1, timeout=20.0)
    finally:
        HangingRenewals.released.set()


def test_a_held_row_whose_check_fails_waits_for_the_next_check_without_polling(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A row put off for 0.2 s is held; its check (a renewal) fails while the
    # database does not answer renewals. The row's lane came back every
    # 5 ms to look whether it was checked yet (200 times a second per row,
    # for as long as the outage lasts); it now waits for the next check.
    UnrenewedSession.failing = threading.Event()
    make_flaky(store, lambda outcomes: False, UnrenewedSession)
    looks = count_looks(monkeypatch)
    runs: list[int] = []

    def handler(message: OutboxMessage) -> None:
        runs.append(message.attempt)
        if len(runs) == 1:
            UnrenewedSession.failing.set()
            raise Defer(0.2)

    bus = EventBus()
    bus.subscribe("t", handler)
    (row,) = enqueue(store, ("k", "t", None))
    with Relay(store, bus, poll_interval=0.5, listen=False) as relay:
        wait_for(lambda: relay.stats().errors >= 3, timeout=20.0)  # three checks failed
        assert runs == [1]
        # (Before: about 200 looks a second; now one per check, every ~0.55 s.)
        assert len(looks) < 20, len(looks)
        UnrenewedSession.failing.clear()
        wait_for(lambda: relay.stats().sent == 1, timeout=20.0)
    assert runs == [1, 1]
    assert store.get(row).status == "sent"  # type: ignore[union-attr]


class StalledWrites(UnrenewedSession):
    """Renewals fail while ``failing`` is set, and the loop's writes wait while ``stalled``
    is set (a write connection that stopped answering); claims are counted."""

    stalled = threading.Event()
    claimed = 0

    def before_claim(self) -> None:
        type(self).claimed += 1

    def finish(
        self,
        owner: str,
        outcomes: Sequence[Outcome],
        *,
        take: int = 0,
        lease: float = 0.0,
        skip_keys: Sequence[str] = (),
    ) -> Finished:
        wait_for(lambda: not self.stalled.is_set(), timeout=60.0)
        return super().finish(owner, outcomes, take=take, lease=lease, skip_keys=skip_keys)


def test_a_late_outcome_frees_no_slot_another_row_of_the_relay_took(
    backend: str, make_store: StoreFactory
) -> None:
    # max_concurrency=1. Row 1's handler returned, but its outcome's write
    # (and the renewals) stalled past the lease: the relay's claim thread,
    # on its own connection, took the slot again for row 2; the late outcome
    # then freed it, by slot and owner, under row 2, and row 3 ran beside
    # row 2, and so on for the rest of the backlog.
    needs_answers(backend)  # SQLite claims on the loop's thread: no claim beside a write
    store = make_store()
    StalledWrites.failing = threading.Event()
    StalledWrites.stalled = threading.Event()
    StalledWrites.claimed = 0
    make_flaky(store, lambda outcomes: False, StalledWrites, claims=True)
    lock = threading.Lock()
    running: list[int] = []
    ran: list[int] = []
    most = [0]
    release = threading.Event()

    def handler(message: OutboxMessage) -> None:
        with lock:
            ran.append(message.id)
            running.append(message.id)
            most[0] = max(most[0], len(running))
        try:
            if message.key != "k1":
                assert release.wait(30.0)
        finally:
            with lock:
                running.remove(message.id)

    bus = EventBus()
    bus.subscribe("t", handler)
    (row1,) = enqueue(store, ("k1", "t", None))
    options: dict[str, Any] = {"poll_interval": 0.02, "lease": 1.0, "timeout": 30.0}
    StalledWrites.failing.set()
    StalledWrites.stalled.set()
    with Relay(store, bus, max_concurrency=1, listen=False, **options):
        wait_for(lambda: row1 in ran and row1 not in running)  # its outcome waits to be written
        row2, row3 = enqueue(store, ("k2", "t", None), ("k3", "t", None))

        def slot_lapsed() -> bool:
            row = store.get(row1)
            assert row is not None
            return row.lease_expires_at is not None and row.lease_expires_at < time.time()

        wait_for(slot_lapsed)  # row 1's lease, and its slot's, ran out
        seen = StalledWrites.claimed
        wait_for(lambda: StalledWrites.claimed >= seen + 5)  # claims made meanwhile
        StalledWrites.failing.clear()
        StalledWrites.stalled.clear()  # row 1's outcome lands
        wait_for(lambda: bool(running))
        seen = StalledWrites.claimed
        wait_for(lambda: StalledWrites.claimed >= seen + 5)  # claims beside the running row
        with lock:
            assert len(running) == 1, running
        release.set()
        wait_for(lambda: unfinished(store) == 0)
    assert most[0] == 1
    assert sorted(ran) == [row1, row2, row3]
    assert store.status().counts["sent"] == 3


def test_a_stop_writes_at_once_once_the_database_is_back(store: Store) -> None:
    # After failed writes the relay waits longer and longer before the
    # next try (up to 5 s). A stop waited out that pause too, and stop(1.0)
    # returned False although the database was back.
    failing = threading.Event()
    failing.set()
    sessions, _ = make_flaky(store, lambda outcomes: failing.is_set())
    bus, calls = counting_bus()
    (row_id,) = enqueue(store, ("k", "t", None))
    relay = Relay(store, bus, poll_interval=0.02, listen=False).start()
    try:
        # Eight tries (the outcome, then a plain retry, each time): the
        # pause before the next is 2.56 s.
        wait_for(lambda: bool(sessions) and sessions[0].finish_calls >= 16)
        failing.clear()
        assert relay.stop(1.0)
    finally:
        relay.force_stop(10.0)
    assert calls[row_id] == 1
    assert store.rows()[0].status == "sent"


def test_leases_are_renewed_while_no_outcome_can_be_written(store: Store) -> None:
    failing = threading.Event()
    failing.set()
    sessions, real_session = make_flaky(store, lambda outcomes: failing.is_set())
    handled = threading.Event()
    bus = EventBus()
    bus.subscribe("t", lambda m: handled.set())
    enqueue(store, ("k", "t", None))
    lease = 0.6  # renewed every 0.2 s
    with Relay(store, bus, poll_interval=0.02, lease=lease, listen=False) as relay:
        assert handled.wait(10.0)
        (flaky,) = sessions
        wait_for(lambda: flaky.finish_calls >= 1)
        wait_for(lambda: flaky.renew_calls >= 4)  # over a lease since the claim
        other = real_session()
        try:
            assert other.claim("other-relay", 10, 30.0, None) == []  # the lease still holds
        finally:
            other.close()
        with flaky.lock:
            calls = flaky.finish_calls
        assert calls < 30  # it waits between tries: no busy loop
        assert store.status().counts["processing"] == 1
        assert relay.state is RelayState.RUNNING
        failing.clear()
        wait_for(lambda: store.status().counts["sent"] == 1)
    assert relay.stats().errors >= 2
    assert relay.stats().sent == 1


@pytest.mark.parametrize("payload", ["decodable", "undecodable"])
def test_a_row_whose_outcome_waits_to_be_written_is_not_timed_out(
    store: Store, payload: str
) -> None:
    # A handler that returned at once, or a row dead at once (its payload
    # cannot be decoded), while no outcome can be written for longer than
    # the timeout and its grace: the row was taken for a stuck handler. Its
    # lease was no longer renewed (another relay delivered it again), a
    # TimeoutError retry was queued beside its outcome, its key waited
    # for good for a handler that had returned, and stop() never ended.
    failing = threading.Event()
    failing.set()
    sessions, real_session = make_flaky(store, lambda outcomes: failing.is_set())
    bus, calls = counting_bus()
    (first,) = enqueue(store, ("k", "t", "first"))
    if payload == "undecodable":
        _undecodable(store)
    lease = 0.6  # renewed every 0.2 s
    relay = Relay(store, bus, poll_interval=0.02, lease=lease, timeout=0.3, listen=False)
    relay.start()
    try:
        wait_for(lambda: bool(sessions) and sessions[0].finish_calls >= 1)
        (flaky,) = sessions
        # Past the timeout and its grace (1 s): 2 s of renewals.
        wait_for(lambda: flaky.renew_calls >= 10)
        stats = relay.stats()
        assert (stats.timed_out, stats.inflight) == (0, 0)
        other = real_session()
        try:
            assert other.claim("other-relay", 10, 30.0, None) == []  # the lease still holds
        finally:
            other.close()
        failing.clear()
        wait_for(lambda: unfinished(store) == 0)
        (after,) = enqueue(store, ("k", "t", "next"))  # the key is not held for a stuck handler
        wait_for(lambda: calls[after] == 1)
        wait_for(lambda: unfinished(store) == 0)
    finally:
        assert relay.stop(10.0)
    stats = relay.stats()
    assert (stats.timed_out, stats.retried, stats.lost, stats.inflight) == (0, 0, 0, 0)
    row = {r.id: r for r in store.rows()}[first]
    if payload == "decodable":
        assert calls[first] == 1
        assert (row.status, row.attempts) == ("sent", 1)
    else:
        assert calls[first] == 0
        assert (row.status, row.attempts) == ("dead", 1)


def _undecodable(store: Store) -> None:
    """Make the payload of the store's only row one no handler can be given."""
    # Valid JSON that Python's decoder refuses: a number past its digit
    # limit (3.10.7 and later) inside arrays past its recursion limit (up to
    # 3.12; 3.13 decodes them).
    deep = "[" * 5000 + "1" * 5000 + "]" * 5000
    run_committed(store, f"UPDATE {store.table} SET payload = '{deep}'")


def test_stop_from_a_handler_raises_instead_of_waiting_for_itself(store: Store) -> None:
    raised: list[BaseException] = []
    done = threading.Event()
    relay: Relay | None = None

    def handler(message: OutboxMessage) -> None:
        assert relay is not None
        for stop in (relay.stop, relay.force_stop):
            try:
                stop(1.0)
            except RuntimeError as exc:
                raised.append(exc)
        done.set()

    bus = EventBus()
    bus.subscribe("t", handler)
    enqueue(store, ("k", "t", None))
    relay = Relay(store, bus, poll_interval=0.02).start()
    try:
        assert done.wait(10.0)
        assert len(raised) == 2
        assert all("handler" in str(exc) for exc in raised)
        assert relay.state is RelayState.RUNNING
        wait_for(lambda: store.status().counts["sent"] == 1)
    finally:
        assert relay.stop(10.0)
    assert relay.stats().state is RelayState.STOPPED


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1.0])
def test_rate_limited_needs_a_finite_retry_after(value: float) -> None:
    with pytest.raises(ValueError, match="retry_after"):
        RateLimited(value)
    assert RateLimited(0.0).retry_after == 0.0
    assert RateLimited(2.5).retry_after == 2.5


def test_a_handler_that_never_returns_gives_back_its_slot_and_its_key(store: Store) -> None:
    release = threading.Event()
    calls: Counter[str] = Counter()
    order: list[str] = []
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            calls[message.payload] += 1
            first = calls[message.payload] == 1
            order.append(message.payload)
        if message.payload == "stuck" and first:
            release.wait(30.0)  # never returns while the test looks

    bus = EventBus()
    bus.subscribe("t", handler)
    stuck_id, _, _ = enqueue(store, ("k", "t", "stuck"), ("k", "t", "next"), ("other", "t", "free"))
    options: dict[str, Any] = {
        "poll_interval": 0.02,
        "max_concurrency": 1,
        "retry": RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05, jitter=0.0),
    }
    stalled = Relay(store, bus, timeout=0.2, **options).start()
    helper = None
    try:
        wait_for(lambda: calls["stuck"] == 1)
        # Past its timeout the delivery is recorded as failed and its slot
        # freed: the one slot serves the other key.
        wait_for(lambda: calls["free"] == 1)
        stats = stalled.stats()
        assert (stats.timed_out, stats.stuck) == (1, 1)
        row = store.get(stuck_id)
        assert row is not None
        assert row.status == "pending"
        assert "did not return within 0.2s" in (row.last_error or "")
        # This relay takes no row of the stuck key; another relay does.
        helper = Relay(store, bus, **options).start()
        wait_for(lambda: order[-2:] == ["stuck", "next"])
        wait_for(lambda: store.status().counts["sent"] == 3)
    finally:
        release.set()
        assert stalled.stop(10.0)
        if helper is not None:
            assert helper.stop(10.0)
    assert stalled.stats().stuck == 0
    assert store.get(stuck_id).attempts == 2  # type: ignore[union-attr]
    assert calls == {"stuck": 2, "next": 1, "free": 1}


@pytest.mark.parametrize("make_exc", [lambda: Defer(0.05), lambda: RateLimited(0.05)])
def test_a_row_deferred_forever_goes_dead_past_max_total(
    store: Store, make_exc: Callable[[], Exception]
) -> None:
    calls = 0

    def handler(message: OutboxMessage) -> None:
        nonlocal calls
        calls += 1
        raise make_exc()

    bus = EventBus()
    bus.subscribe("t", handler)
    # The row's age runs from its enqueue: it is enqueued once the relay runs
    # (it polls every 20 ms), so that a slow start (a loaded CI runner) does
    # not use up max_total before the first call; and max_total leaves room
    # for more than one put-off even when each round trip is slow.
    policy = RetryPolicy(max_total=1.5, jitter=0.0)
    with Relay(store, bus, poll_interval=0.02, retry=policy) as relay:
        (row_id,) = enqueue(store, ("k", "t", None))
        wait_for(lambda: store.status().counts["dead"] == 1)
    row = store.get(row_id)
    assert row is not None
    assert (row.status, row.attempts) == ("dead", 1)
    assert (row.last_error or "").startswith("expired: ")
    assert "max_total=1.5s" in (row.last_error or "")
    assert calls >= 2  # put off (attempts not counted) until the age bound
    stats = relay.stats()
    assert stats.requeued + stats.parked == calls - 1


class _SkewedTime:
    """The relay module's ``time``, its wall clock ``skew`` seconds off the store's
    (a host whose clock drifted, or a database server's that did)."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        return time.time() + self.skew


def _failing_once(calls: list[int]) -> EventBus:
    """A bus whose handler of type ``t`` fails its first call; each call's attempt
    is appended to ``calls``."""

    def handler(message: OutboxMessage) -> None:
        calls.append(message.attempt)
        if len(calls) == 1:
            raise RuntimeError("once")

    bus = EventBus()
    bus.subscribe("t", handler)
    return bus


def _sent_on_its_retry(store: Store, row_id: int, calls: list[int]) -> None:
    """The row ``_failing_once`` failed was sent on its second attempt, not dead."""
    row = store.get(row_id)
    assert row is not None
    assert row.status == "sent", row.last_error
    assert calls == [1, 2]


def test_a_relay_whose_clock_is_ahead_counts_a_rows_age_on_the_stores_clock(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The relay counted a row's age as its own wall clock less created_at,
    # which PostgreSQL stamps with the server's: two minutes ahead, a row
    # a second old that failed once was dead, "expired" past max_total=60s.
    from outbound.outbox import relay as relay_module  # noqa: PLC0415

    monkeypatch.setattr(relay_module, "time", _SkewedTime(120.0))
    calls: list[int] = []
    bus = _failing_once(calls)
    policy = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.01, max_total=60.0)
    with Relay(store, bus, poll_interval=0.02, retry=policy):
        (row_id,) = enqueue(store, ("k", "t", None))
        wait_for(lambda: store.status().counts["sent"] + store.status().counts["dead"] == 1)
    _sent_on_its_retry(store, row_id, calls)


def test_a_relay_whose_clock_is_behind_still_ends_a_row_past_max_total(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A day behind, no row's age ever reached max_total: put off for good.
    from outbound.outbox import relay as relay_module  # noqa: PLC0415

    monkeypatch.setattr(relay_module, "time", _SkewedTime(-86400.0))

    def handler(message: OutboxMessage) -> None:
        raise Defer(0.05)

    bus = EventBus()
    bus.subscribe("t", handler)
    policy = RetryPolicy(max_total=1.5, jitter=0.0)
    with Relay(store, bus, poll_interval=0.02, retry=policy):
        (row_id,) = enqueue(store, ("k", "t", None))
        wait_for(lambda: store.status().counts["dead"] == 1)
    row = store.get(row_id)
    assert row is not None
    assert (row.last_error or "").startswith("expired: ")


class _ClockFailing(FlakySession):
    """A real session whose reads of the store's clock fail at the calls numbered in
    ``failing`` (counted over every such session), and which says once, after
    ``reconnect_after`` reads, that it reconnected (so that the relay reads the
    clock again)."""

    failing: frozenset[int] = frozenset()
    reconnect_after = 0
    reads = 0

    def now(self) -> float:
        with self.lock:
            cls = type(self)
            cls.reads += 1
            if cls.reads in cls.failing:
                raise StoreError("cannot connect to the outbox database (the test's)")
        return self.inner.now()

    def reconnected(self) -> bool:
        with self.lock:
            cls = type(self)
            if cls.reconnect_after and cls.reads >= cls.reconnect_after:
                cls.reconnect_after = 0
                return True
        return self.inner.reconnected()


def test_a_relay_that_cannot_read_the_stores_clock_does_not_start(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first read failing (the database restarting as the relay started),
    # the relay counted ages on its own clock (two days ahead: a row that
    # failed once was dead, "expired") until the next read, a minute later.
    from outbound.outbox import relay as relay_module  # noqa: PLC0415

    monkeypatch.setattr(relay_module, "time", _SkewedTime(2 * 86400.0))

    class Failing(_ClockFailing):
        failing = frozenset({1})

    make_flaky(store, lambda outcomes: False, Failing)
    calls: list[int] = []
    bus = _failing_once(calls)
    policy = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.01, max_total=86400.0)
    (row_id,) = enqueue(store, ("k", "t", None))
    with pytest.raises(StoreError, match="cannot connect"):
        Relay(store, bus, poll_interval=0.02, retry=policy).start()
    with Relay(store, bus, poll_interval=0.02, retry=policy):  # (the database is back)
        wait_for(lambda: store.status().counts["sent"] + store.status().counts["dead"] == 1)
    _sent_on_its_retry(store, row_id, calls)


def test_a_relay_reads_the_stores_clock_again_soon_after_a_read_failed(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a reconnect (another server, maybe) the clock is read again; a
    # read that fails is tried again a second later, not a minute later, and
    # the last reading counts meanwhile.
    from outbound.outbox import relay as relay_module  # noqa: PLC0415

    monkeypatch.setattr(relay_module, "time", _SkewedTime(2 * 86400.0))

    class Failing(_ClockFailing):
        failing = frozenset({2, 3})
        reconnect_after = 1

    make_flaky(store, lambda outcomes: False, Failing)
    calls: list[int] = []
    bus = _failing_once(calls)
    policy = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.01, max_total=86400.0)
    with Relay(store, bus, poll_interval=0.02, retry=policy):
        wait_for(lambda: Failing.reads >= 4)
        (row_id,) = enqueue(store, ("k", "t", None))
        wait_for(lambda: store.status().counts["sent"] + store.status().counts["dead"] == 1)
    _sent_on_its_retry(store, row_id, calls)


class _StalledTime(_SkewedTime):
    """The relay module's ``time``, its monotonic clock ``behind`` seconds behind
    until :meth:`catch_up`: a read of the store's clock begun before that and
    answered after took that long (the server stalled, and read its clock at
    the end)."""

    def __init__(self, behind: float) -> None:
        super().__init__(0.0)
        self.behind = behind

    def monotonic(self) -> float:
        return time.monotonic() - self.behind

    def catch_up(self) -> None:
        self.behind = 0.0


def test_a_stall_in_the_clock_read_counts_no_row_older_than_it_is(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reading was taken as made halfway through the round trip: a server
    # that stalled 20 s and then read its clock made every row 10 s older,
    # and one that failed once was dead as past max_total=5s.
    from outbound.outbox import relay as relay_module  # noqa: PLC0415

    stalled = _StalledTime(20.0)
    monkeypatch.setattr(relay_module, "time", stalled)

    class Stalling(_ClockFailing):
        def now(self) -> float:
            stalled.catch_up()
            return super().now()

    make_flaky(store, lambda outcomes: False, Stalling)
    calls: list[int] = []
    bus = _failing_once(calls)
    policy = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.01, max_total=5.0)
    with Relay(store, bus, poll_interval=0.02, retry=policy):
        (row_id,) = enqueue(store, ("k", "t", None))
        wait_for(lambda: store.status().counts["sent"] + store.status().counts["dead"] == 1)
        # (That slow read was kept, there being none before; read again soon.)
        wait_for(lambda: Stalling.reads >= 2)
    _sent_on_its_retry(store, row_id, calls)


def test_a_slow_clock_read_replaces_no_quick_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read whose round trip was long is less sure than a quick one: kept only
    where there is none; and said to be slow, to be read again soon."""
    from outbound.outbox import relay as relay_module  # noqa: PLC0415

    stalled = _StalledTime(0.0)
    monkeypatch.setattr(relay_module, "time", stalled)

    class Clock:
        stall = 0.0  # (how far the monotonic clock jumps ahead inside the read)

        def now(self) -> float:
            stalled.behind = -self.stall
            return 1000.0

    def offset() -> float | None:
        return relay._clock_offset

    clock = Clock()
    relay = Relay.__new__(Relay)
    relay._clock_offset = None
    clock.stall = 2.0
    assert relay._read_clock(cast(Session, clock)) is False
    assert offset() is not None
    clock.stall = 0.0
    stalled.behind = 0.0
    assert relay._read_clock(cast(Session, clock)) is True
    quick = offset()
    clock.stall = 2.0
    stalled.behind = 0.0
    assert relay._read_clock(cast(Session, clock)) is False
    assert offset() == quick


@pytest.mark.parametrize("handler", ["waits", "returns", "returns, unwritten", "raises"])
def test_a_reply_a_handler_queued_begins_no_send_once_the_row_may_be_another_relays(
    store: Store, handler: str
) -> None:
    # The handler's lease fenced sends in its own thread only: a reply it queued
    # on a dispatcher (the README's `reply_text(...).result()`), waiting there
    # (a rate limit) as the relay froze past its lease, went out on waking,
    # while another relay ran the row again and the rows after it. So with
    # the handler returned but its "sent" outcome not written as the lease
    # ran out, and with the handler failed (its row given back at once, to
    # run again). A reply queued by a handler that returned, its outcome
    # written, is no other relay's to send again: it goes out whatever the
    # lease.
    from outbound import Dispatcher  # noqa: PLC0415
    from outbound.errors import SendTimeout  # noqa: PLC0415
    from outbound.messages import SendRequest, TextMessage  # noqa: PLC0415
    from outbound.simulator import PlatformSimulator  # noqa: PLC0415
    from outbound.telegram import TelegramSender  # noqa: PLC0415

    # (While failing is set: no renewal, and no outcome written.)
    failing = UnrenewedSession.failing = threading.Event()
    make_flaky(store, lambda outcomes: failing.is_set(), UnrenewedSession)
    gate = threading.Event()
    replies: list[Future[Any]] = []
    outcome: list[BaseException | None] = []

    with (
        PlatformSimulator() as sim,
        TelegramSender(sim.token, base_url=sim.url) as sender,
        Dispatcher(send_timeout=30.0) as app,
    ):

        def reply(text: str) -> Any:
            assert gate.wait(30.0)  # (waiting its turn: a rate limit, a full lane)
            return sender.send(SendRequest(1, TextMessage(text)))

        def handle(message: OutboxMessage) -> None:
            future = app.submit(1, reply, "hello")
            replies.append(future)
            if handler == "returns, unwritten":
                failing.set()  # (from now: no renewal, no write)
            if handler.startswith("returns"):
                return
            if handler == "raises":
                raise RuntimeError("the handler failed after queuing its reply")
            try:
                future.result(30.0)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)
                raise

        bus = EventBus()
        bus.subscribe("t", handle)
        (row,) = enqueue(store, ("k", "t", None))
        retry = RetryPolicy(base_delay=30.0, max_delay=30.0, jitter=0.0)  # (not again here)
        with Relay(store, bus, poll_interval=0.02, lease=1.0, timeout=30.0, retry=retry):
            wait_for(lambda: len(replies) == 1)
            if handler == "returns":
                wait_for(lambda: store.get(row).status == "sent")  # type: ignore[union-attr]
            if handler == "raises":
                wait_for(lambda: store.get(row).status == "pending")  # type: ignore[union-attr]
            else:
                failing.set()  # (no renewal from now: the lease runs out)
                since = time.monotonic()
                wait_for(lambda: time.monotonic() > since + 1.0)  # the time is the test
            if handler == "returns, unwritten":
                assert store.get(row).status == "processing"  # type: ignore[union-attr]
            gate.set()
            if handler == "returns":
                assert replies[0].result(30.0).message_id is not None
            else:
                with pytest.raises(SendTimeout, match="lease"):
                    replies[0].result(30.0)
            if handler == "waits":
                wait_for(lambda: len(outcome) == 1)
                assert isinstance(outcome[0], SendTimeout), outcome
            failing.clear()
        assert [m["text"] for m in sim.received(1)] == (["hello"] if handler == "returns" else [])


@pytest.mark.parametrize("outcome", ["refused", "lost"])
def test_a_reply_queued_by_a_handler_whose_sent_outcome_was_not_kept_begins_no_send(
    store: Store, outcome: str
) -> None:
    # The handler returned, but its "sent" was not kept: refused by the
    # database (written as a plain retry instead), or lost (an operator
    # dead-lettered and revived the row while the handler ran). The row runs
    # again at once and replies again; the reply the first run queued went
    # out too, the fence waiting for the old lease (30 s, no longer renewed).
    from outbound import Dispatcher  # noqa: PLC0415
    from outbound.errors import SendTimeout  # noqa: PLC0415
    from outbound.messages import SendRequest, TextMessage  # noqa: PLC0415
    from outbound.simulator import PlatformSimulator  # noqa: PLC0415
    from outbound.telegram import TelegramSender  # noqa: PLC0415

    refusals = [1] if outcome == "refused" else []

    def refuse(outcomes: Sequence[Outcome]) -> bool:
        if refusals and any(o.kind == "sent" for o in outcomes):
            refusals.pop()
            return True
        return False

    make_flaky(store, refuse)
    gate, hold = threading.Event(), threading.Event()
    replies: list[Future[Any]] = []

    with (
        PlatformSimulator() as sim,
        TelegramSender(sim.token, base_url=sim.url) as sender,
        Dispatcher(send_timeout=30.0) as app,
    ):

        def reply(text: str) -> Any:
            if text == "hello 1":
                assert gate.wait(30.0)  # (waiting its turn: a rate limit, a full lane)
            return sender.send(SendRequest(1, TextMessage(text)))

        def handle(message: OutboxMessage) -> None:
            run = len(replies) + 1  # (a row revived counts its attempts anew)
            replies.append(app.submit(1, reply, f"hello {run}"))
            if run == 1:
                assert hold.wait(30.0)

        bus = EventBus()
        bus.subscribe("t", handle)
        (row,) = enqueue(store, ("k", "t", None))
        retry = RetryPolicy(base_delay=0.01, max_delay=0.01, jitter=0.0)
        with Relay(store, bus, poll_interval=0.02, lease=30.0, timeout=30.0, retry=retry):
            wait_for(lambda: len(replies) == 1)
            if outcome == "lost":
                assert store.dead_letter([row]) == 1
                assert store.retry_dead([row]) == 1
            hold.set()
            wait_for(lambda: len(replies) == 2)  # (run again; its reply waits behind)
            gate.set()
            with pytest.raises(SendTimeout, match="lease"):
                replies[0].result(30.0)
            assert replies[1].result(30.0).message_id is not None
            wait_for(lambda: store.get(row).status == "sent")  # type: ignore[union-attr]
        assert [m["text"] for m in sim.received(1)] == ["hello 2"]
