"""Adversarial tests of the PostgreSQL store's lines (schema 4): defects found, as regressions.

Each test here failed on the code it was first written against (the
first version of schema 4), and passes since the defect was fixed.
The interleavings are made deterministic at the seams: an operator's
transaction is held open between two of its statements (a wrapper around
``_PostgresDb.run``), and a relay statement is made to wait on a row lock
taken by a plain transaction of the test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, postgres
from outbound.outbox._base import Outcome

from .conftest import unique_table, wait_for

psycopg = pytest.importorskip("psycopg")


@pytest.fixture
def store(postgres_url: str) -> Iterator[PostgresStore]:
    made = PostgresStore(postgres_url, table=unique_table())
    yield made
    made.close()
    made.drop_schema()


def enqueue(store: PostgresStore, key: str, payload: Any = None, delay: float = 0.0) -> int:
    with store.connect() as conn:
        return store.enqueue(conn, key=key, type="t", payload=payload, delay=delay)


def waiting_on_lock(url: str, table: str, marker: str, count: int = 1) -> Callable[[], bool]:
    """A predicate: ``count`` backends whose statement on ``table`` contains ``marker``
    wait for a lock (not those of tests running beside this one, on other tables)."""

    def check() -> bool:
        with psycopg.connect(url, autocommit=True) as conn:
            found = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND query LIKE %s AND query LIKE %s",
                (f"%{marker}%", f"%{table}%"),
            ).fetchone()
        return bool(found and found[0] >= count)

    return check


class Pause:
    """Hold an operator's transaction open after one of its named statements.

    Only in the thread that calls :meth:`arm`; other threads run as usual.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, statement: str) -> None:
        self.statement = statement
        self.reached = threading.Event()
        self.go = threading.Event()
        self._thread: int | None = None
        original_run = postgres._PostgresDb.run
        original_all = postgres._PostgresDb.all
        pause = self

        def run(db: postgres._PostgresDb, name: str, **params: Any) -> int:
            done = original_run(db, name, **params)
            pause.after(name)
            return done

        def all_(db: postgres._PostgresDb, name: str, **params: Any) -> list[tuple[Any, ...]]:
            found = original_all(db, name, **params)
            pause.after(name)
            return found

        monkeypatch.setattr(postgres._PostgresDb, "run", run)
        monkeypatch.setattr(postgres._PostgresDb, "all", all_)

    def after(self, name: str) -> None:
        if name == self.statement and threading.get_ident() == self._thread:
            self._thread = None  # once
            self.reached.set()
            assert self.go.wait(20.0), "the test never released the operator"

    def arm(self) -> None:
        self._thread = threading.get_ident()


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``target`` in a thread; its result or exception lands in the dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = target()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


# ---------------------------------------------------------------- retry_dead


def test_a_revived_row_goes_behind_the_new_rows_of_a_key_without_a_head(
    store: PostgresStore,
) -> None:
    # Documented: retry_dead puts rows "at the back of their key". Row 2 was
    # enqueued (and committed) before row 1 was revived, so row 2 goes first.
    session = store.session()
    try:
        first = enqueue(store, "k", 1)
        (claimed,) = session.claim("me", 10, 30.0, None)
        session.finish("me", [Outcome(first, claimed.token, "k", "dead", error="boom")])
        second = enqueue(store, "k", 2)  # new: no look has made it head yet
        assert store.retry_dead([first]) == 1
        order: list[int] = []
        for _ in range(4):
            for item in session.claim("me", 10, 30.0, None):
                order.append(item.message.id)
                session.finish("me", [Outcome(item.message.id, item.token, "k", "sent")])
        assert order == [second, first]
    finally:
        session.close()


def test_retry_dead_while_a_relay_moves_the_line_up_revives_the_row(
    store: PostgresStore, postgres_url: str
) -> None:
    session = store.session()
    blocker = psycopg.connect(postgres_url)
    try:
        dead = enqueue(store, "k", 0)
        (claimed,) = session.claim("me", 10, 30.0, None)
        session.finish("me", [Outcome(dead, claimed.token, "k", "dead", error="boom")])
        head, after = enqueue(store, "k", 1), enqueue(store, "k", 2)
        (claimed,) = session.claim("me", 10, 30.0, None)
        assert claimed.message.id == head
        # A plain transaction holds the row the finisher moves up: the
        # finisher then waits, holding the head it finishes.
        blocker.execute(f"SELECT 1 FROM {store.table} WHERE id = %s FOR SHARE", (after,))
        finisher, finished = in_thread(
            lambda: session.finish("me", [Outcome(head, claimed.token, "k", "sent")])
        )
        wait_for(waiting_on_lock(postgres_url, store.table, "snap AS"), timeout=10)
        reviver, revived = in_thread(lambda: store.retry_dead([dead]))
        wait_for(
            waiting_on_lock(postgres_url, store.table, "FOR NO KEY UPDATE", count=2), timeout=10
        )
        blocker.commit()
        finisher.join(20)
        reviver.join(20)
        assert "error" not in finished
        if "error" in revived:
            raise revived["error"]
        assert revived["result"] == 1
        # The revived row goes behind the row that was moved up.
        rows = {r.id: r for r in store.rows()}
        assert rows[after].head
        assert not rows[dead].head
    finally:
        blocker.close()
        session.close()


# ------------------------------------------------------- cancel / dead_letter


@pytest.mark.parametrize("close", ["cancel", "dead_letter"])
@pytest.mark.parametrize("at", ["lock_row", "close"])
def test_no_head_is_made_for_a_key_while_an_operator_closes_one_of_its_new_rows(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch, close: str, at: str
) -> None:
    # The key has no head while the operator closes its second row. Once a
    # look made the first row head meanwhile, and its finisher moved the
    # line up to the row being closed: the closed row went out anyway, or
    # operator and finisher deadlocked. Now the operator holds the looks'
    # lock: no head is made until it is done, and the closed row never goes.
    pause = Pause(monkeypatch, at)
    session = store.session()
    try:
        first, second = enqueue(store, "k", 1), enqueue(store, "k", 2)

        def operator() -> int:
            pause.arm()
            method: Callable[..., int] = getattr(store, close)
            return method([second])

        op, closed = in_thread(operator)
        assert pause.reached.wait(10)  # the operator's transaction is open
        assert session.claim("me", 10, 30.0, None) == []  # no look meanwhile
        pause.go.set()
        op.join(20)
        assert closed == {"result": 1}
        (claimed,) = session.claim("me", 10, 30.0, None)
        assert claimed.message.id == first
        done = session.finish(
            "me", [Outcome(first, claimed.token, "k", "sent")], take=5, lease=30.0
        )
        assert (done.written, done.claimed) == (1, ())
        row = store.get(second)
        assert row is not None
        assert row.status == ("cancelled" if close == "cancel" else "dead")
        assert store.status().unfinished == 0
    finally:
        pause.go.set()
        session.close()


# --------------------------------------------------------------------- relay


def test_a_row_revived_while_its_first_delivery_runs_is_delivered_and_the_relay_stops(
    store: PostgresStore,
) -> None:
    release = threading.Event()
    attempts: list[int] = []

    def handler(message: OutboxMessage) -> None:
        attempts.append(message.attempt)
        if len(attempts) == 1:
            assert release.wait(20.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    row = enqueue(store, "k")
    relay = Relay(store, bus, poll_interval=0.05).start()
    try:
        wait_for(lambda: attempts == [1], timeout=10)
        assert store.dead_letter([row]) == 1  # its handler still runs
        assert store.retry_dead([row]) == 1
        wait_for(lambda: relay.stats().claimed == 2, timeout=10)  # claimed again
        release.set()  # the first delivery ends: its outcome is refused
        wait_for(lambda: relay.stats().lost >= 1, timeout=10)

        def sent() -> bool:
            info = store.get(row)
            return info is not None and info.status == "sent"

        deadline = time.monotonic() + 5.0  # well within the 30 s lease
        while not sent() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sent(), (attempts, relay.stats())
        assert relay.stop(5.0)
    finally:
        release.set()
        relay.force_stop(10.0)
