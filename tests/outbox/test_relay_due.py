"""A row a relay puts back comes back when it was asked to, on both stores.

A handler that raises ``Defer(d)`` (a rate limiter's booked send slot)
must be run again ``d`` seconds after it asked: not later by the time its
outcome waited to be written, nor at the relay's next poll.
"""

from __future__ import annotations

import sqlite3
import sys
import threading
import time
from typing import Any

import pytest

from outbound import Defer
from outbound.errors import RateLimited, StoreError
from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, Store
from outbound.outbox import relay as relay_module
from outbound.outbox._base import Outcome

from .conftest import enqueue_keys, wait_for


@pytest.fixture(autouse=True)
def written_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row put off is written back (none held by the relay: see test_relay_park)."""
    monkeypatch.setattr(relay_module, "_PARK_AT_MOST", -1.0)


@pytest.mark.parametrize("make_exc", [lambda: Defer(0.3), lambda: RateLimited(0.3)])
def test_a_row_put_back_is_run_again_when_due_not_at_the_next_poll(
    store: Store, make_exc: Any
) -> None:
    # An hour between polls: only the relay's own wake-up can bring it back.
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
        assert again.wait(30.0), "the row put back was not claimed again when due"
        wait_for(lambda: relay.stats().sent == 1)
        stats = relay.stats()
    assert runs[1] - runs[0] >= 0.3 - 0.005  # not before it was asked to (clock grain)
    assert (stats.requeued, stats.sent) == (1, 1)
    (done,) = store.rows()
    assert (done.id, done.status, done.attempts) == (row, "sent", 1)


def test_rows_put_back_again_and_again_each_come_back(store: Store) -> None:
    # Many keys, each deferred three times with different delays: every
    # deferral is brought back by the relay's wake-ups, none by a poll.
    keys = [f"k{i}" for i in range(40)]
    lock = threading.Lock()
    runs: dict[str, int] = dict.fromkeys(keys, 0)

    def handler(message: OutboxMessage) -> None:
        with lock:
            runs[message.key] += 1
            n = runs[message.key]
        if n <= 3:
            raise Defer(0.01 * (1 + int(message.key[1:]) % 7) * n)

    bus = EventBus()
    bus.subscribe("t", handler)
    enqueue_keys(store, *keys)
    with Relay(store, bus, poll_interval=3600.0, batch_size=8, max_inflight=4) as relay:
        wait_for(lambda: relay.stats().sent == len(keys), timeout=60.0)
        stats = relay.stats()
    assert stats.requeued == 3 * len(keys)
    assert runs == dict.fromkeys(keys, 4)


def test_the_delay_written_counts_from_when_it_was_asked_for(store: Store) -> None:
    # An outcome that waited 0.6 s to be written (a busy database, a loop
    # held up) with a delay of 1 s asked for: the row is due 0.4 s after
    # the write, and the relay wakes to claim it then.
    (row,) = enqueue_keys(store, "chat")
    relay = Relay(store, EventBus(), poll_interval=3600.0)
    session = store.session()
    try:
        (item,) = session.claim(relay.owner, 10, 30.0, None)
        # Both clocks read around the write, in this order: "asked" is not
        # before `before`, and `done` not before the write (a slow runner can
        # stop this thread between any two lines).
        before = time.time()
        now = time.monotonic()
        asked = now - 0.6
        later = relay._finish(
            session,
            [Outcome(row, item.token, "chat", "requeue", 1.0, None, item.slot, since=asked)],
        )
        after = time.time()
        done = time.monotonic()
    finally:
        session.close()
    assert later == []
    (back,) = store.rows()
    assert back.status == "pending"
    assert back.attempts == 0
    assert back.available_at is not None
    # 0.4 s after the write (within the write's own time), not 1 s after it.
    assert before + 0.4 - 0.05 <= back.available_at <= after + 0.4 + 0.05
    ((due, due_row, _),) = relay._due
    assert due_row == row
    # Due 0.4 s after the write on the loop's clock too (not 1 s; not read
    # against a clock that ran on while the rows were fetched above).
    assert now + 0.4 - 0.05 <= due <= done + 0.4 + 0.05


def test_a_delay_that_has_passed_while_its_outcome_waited_is_written_as_none(
    store: Store,
) -> None:
    (row,) = enqueue_keys(store, "chat")
    relay = Relay(store, EventBus(), poll_interval=3600.0)
    session = store.session()
    try:
        (item,) = session.claim(relay.owner, 10, 30.0, None)
        asked = time.monotonic() - 5.0
        relay._finish(
            session,
            [Outcome(row, item.token, "chat", "requeue", 1.0, None, item.slot, since=asked)],
        )
        # At once: the row can be claimed again by the next claim.
        (again,) = session.claim(relay.owner, 10, 30.0, None)
    finally:
        session.close()
    assert again.message.id == row


def test_the_relay_keeps_a_bounded_number_of_due_times(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the bound, a row put back comes back at a poll: nothing grows
    # without limit, and nothing is lost.
    monkeypatch.setattr(relay_module, "_MAX_DUE", 2)
    keys = [f"k{i}" for i in range(6)]
    lock = threading.Lock()
    runs: dict[str, int] = dict.fromkeys(keys, 0)

    def handler(message: OutboxMessage) -> None:
        with lock:
            runs[message.key] += 1
            n = runs[message.key]
        if n == 1:
            raise Defer(0.05)

    bus = EventBus()
    bus.subscribe("t", handler)
    enqueue_keys(store, *keys)
    with Relay(store, bus, poll_interval=0.2, batch_size=10) as relay:
        wait_for(lambda: relay.stats().sent == len(keys))
        assert len(relay._due) <= 2
    assert runs == dict.fromkeys(keys, 2)


def _status(store: Store, row: int) -> str:
    return next(r.status for r in store.rows() if r.id == row)


def test_a_row_due_while_the_relay_is_full_is_claimed_once_room_frees(store: Store) -> None:
    # When "x" comes due, the relay's room (max_inflight + batch_size = 4)
    # is full of handlers that block. The first one to return makes room:
    # "x" is claimed then, not at the next poll, nor once all have returned.
    release = {k: threading.Event() for k in ("l1", "l2", "l3", "l4")}
    runs: list[float] = []

    def handler(message: OutboxMessage) -> None:
        if message.key == "x":
            runs.append(time.monotonic())
            if len(runs) == 1:
                raise Defer(0.3)
            return
        assert release[message.key].wait(30.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    x, *_ = enqueue_keys(store, "x", "l1", "l2", "l3", "l4")
    relay = Relay(store, bus, poll_interval=3600.0, max_inflight=2, batch_size=2).start()
    try:
        wait_for(lambda: relay.stats().claimed == 5)  # x once, and the four that block
        wait_for(lambda: relay._room_wanted)  # x is due, and there is no room
        assert _status(store, x) == "pending"
        release["l1"].set()
        # Claimed (and, a thread free while l3 is checked, maybe sent already).
        wait_for(lambda: _status(store, x) != "pending", timeout=10.0)
    finally:
        for event in release.values():
            event.set()
        assert relay.stop(30.0)
    assert len(runs) == 2
    assert runs[1] - runs[0] >= 0.3 - 0.005
    assert {r.status for r in store.rows()} == {"sent"}


@pytest.mark.parametrize("lag", [0.0, 0.5], ids=["prompt", "slow-server"])
def test_a_put_back_whose_answer_was_lost_still_comes_back_when_due(
    store: Store, monkeypatch: pytest.MonkeyPatch, lag: float
) -> None:
    # The write of the Defer commits, and its answer is lost: the relay
    # writes it again, finds it written (counted lost), and must still
    # claim the row when it is due. With a slow server (the lost write began
    # ``lag`` late: the row's delay started then), the claim for it came
    # before the row was due, took nothing, and the row was left to the poll.
    probe = store.session()
    cls = type(probe)
    probe.close()
    original = cls.finish
    dropped: list[int] = []
    slow = threading.Event()  # (never set: a wait of ``lag``, the server's)

    def lossy(self: Any, owner: str, outcomes: Any, **kwargs: Any) -> Any:
        if not dropped and any(o.kind == "requeue" for o in outcomes):
            slow.wait(lag)
        finished = original(self, owner, outcomes, **kwargs)
        if not dropped and any(o.kind == "requeue" for o in outcomes):
            dropped.append(1)
            raise StoreError("outbox database error: the answer was lost") from _transient(store)
        return finished

    monkeypatch.setattr(cls, "finish", lossy)
    runs: list[float] = []
    again = threading.Event()

    def handler(message: OutboxMessage) -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise Defer(2.0)
        again.set()

    bus = EventBus()
    bus.subscribe("t", handler)
    enqueue_keys(store, "x")
    with Relay(store, bus, poll_interval=3600.0) as relay:
        assert again.wait(30.0), "the row whose answer was lost was left to the poll"
        wait_for(lambda: relay.stats().sent == 1)
        stats = relay.stats()
    assert dropped == [1]
    assert runs[1] - runs[0] >= 2.0 - 0.005
    assert (stats.lost, stats.sent) == (1, 1)


def _transient(store: Store) -> Exception:
    """An error the store takes for a failing database, not a refused write."""
    if isinstance(store, PostgresStore):
        import psycopg  # noqa: PLC0415

        return psycopg.OperationalError("the connection was lost")
    return sqlite3.OperationalError("disk I/O error")


def test_a_row_put_back_comes_back_before_older_rows_when_due(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "x" is put back for 0.3 s behind rows f0..f5, all older than its due
    # time. When "x" is due and room frees, the relay claims "x" (its slot
    # is now), not the next of the older rows. (f1, which waits for the
    # thread, is not checked before it starts: a check would let "x" run
    # first, and the claim after it take f2.)
    from outbound.outbox import relay as relay_module  # noqa: PLC0415

    monkeypatch.setattr(relay_module, "_START_CHECK_AFTER", 3600.0)
    gates = {f"f{i}": threading.Event() for i in range(6)}
    runs: list[float] = []

    def handler(message: OutboxMessage) -> None:
        if message.key == "x":
            runs.append(time.monotonic())
            if len(runs) == 1:
                raise Defer(0.3)
            return
        assert gates[message.key].wait(30.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    x, *f = enqueue_keys(store, "x", *gates)
    # Room for two rows: x, then f0; x is put back, f1 taken; f0 runs.
    relay = Relay(store, bus, poll_interval=3600.0, max_inflight=1, batch_size=1).start()
    try:
        wait_for(lambda: relay._room_wanted)  # x is due; f0 runs, f1 waits: no room
        assert relay.stats().requeued == 1
        assert [_status(store, i) for i in f] == ["processing"] * 2 + ["pending"] * 4
        gates["f0"].set()
        wait_for(lambda: _status(store, x) != "pending", timeout=10.0)
        assert [_status(store, i) for i in f[2:]] == ["pending"] * 4
        for gate in gates.values():
            gate.set()
        wait_for(lambda: relay.stats().sent == 7)
    finally:
        for gate in gates.values():
            gate.set()
        assert relay.stop(30.0)
    assert len(runs) == 2
    assert {r.status for r in store.rows()} == {"sent"}


def test_a_sqlite_claim_reads_due_heads_through_their_index(tmp_path: Any) -> None:
    # Not through {t}_state, every pending row: a claim's cost would grow
    # with the backlog (46 ms a claim with 100,000 rows pending, 4 ms here).
    from outbound.outbox import SQLiteStore  # noqa: PLC0415

    store = SQLiteStore(str(tmp_path / "outbox.db"))
    conn = store.connect()
    store.enqueue_many(
        conn, [{"key": f"k{i % 50}", "type": "t", "payload": {}} for i in range(2000)]
    )
    conn.commit()
    conn.close()
    session = store.session()
    try:
        params = {
            "owner": "o",
            "token": 1,
            "now": time.time(),
            "lease": 1.0,
            "limit": 10,
            "skip": "[]",
            "held": "[]",
            "first": "[1]",
            "ahead": 0.1,
        }
        plan = [
            row[3]
            for row in session._conn.execute(
                "EXPLAIN QUERY PLAN " + session._sql["claim"],
                params,
            )
        ]
    finally:
        session.close()
    assert any("USING INDEX outbox_ready" in step for step in plan), plan
    assert any("INTEGER PRIMARY KEY" in step for step in plan), plan  # the rows of first


def test_a_claim_takes_no_row_of_first_that_is_not_claimable(store: Store) -> None:
    # Rows of ``first`` of a skipped key, not yet due, not a head, leased to
    # another, or unknown: none is taken; the claimable one is, once, ahead
    # of an older due head.
    ids = enqueue_keys(store, "skipped", "later", "k", "k", "taken", "free")
    skipped, later, first_k, behind, taken, free = ids  # "behind" waits behind k's first row
    session = store.session()
    other = store.session()
    try:
        claimed = {c.message.id: c for c in other.claim("other", 10, 30.0, None)}
        assert set(claimed) == {skipped, later, first_k, taken, free}
        back = [
            Outcome(
                i,
                claimed[i].token,
                claimed[i].message.key,
                "requeue",
                3600.0 if i == later else 0.0,
            )
            for i in (skipped, later, first_k, free)
        ]
        assert other.finish("other", back).written == 4  # all pending heads again; "taken" stays
        got = session.claim(
            "me",
            1,
            30.0,
            None,
            ["skipped"],
            first=[skipped, later, behind, taken, 10**12, free, free],
        )
    finally:
        session.close()
        other.close()
    assert [c.message.id for c in got] == [free]
    status = {r.id: r.status for r in store.rows()}
    assert status[first_k] == "pending"  # older and due, but not of first
    assert status[skipped] == "pending"


def test_deferrals_under_a_short_switch_interval_lose_nothing_and_keep_order(
    store: Store,
) -> None:
    # Two relays, keys with three rows each, every row deferred twice
    # (0, a few ms) while threads switch every 10 microseconds: each row is
    # sent once, attempt 1, in its key's order, none left to the poll.
    keys = [f"k{i}" for i in range(10)]
    lock = threading.Lock()
    runs: dict[int, int] = {}
    sent: list[tuple[str, int]] = []

    def handler(message: OutboxMessage) -> None:
        with lock:
            n = runs[message.id] = runs.get(message.id, 0) + 1
        if n <= 2:
            raise Defer(0.0 if n == 1 else 0.003)
        with lock:
            sent.append((message.key, message.id))

    bus = EventBus()
    bus.subscribe("t", handler)
    ids = enqueue_keys(store, *(k for _ in range(3) for k in keys))
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    relays = [
        Relay(store, bus, poll_interval=3600.0, batch_size=4, max_inflight=2) for _ in range(2)
    ]
    try:
        for relay in relays:
            relay.start()
        wait_for(lambda: len(sent) == len(ids), timeout=60.0)
    finally:
        sys.setswitchinterval(previous)
        for relay in relays:
            assert relay.stop(20.0)
    assert sorted(i for _, i in sent) == sorted(ids)
    for key in keys:
        mine = [i for k, i in sent if k == key]
        assert mine == sorted(mine), key
    assert {(r.status, r.attempts) for r in store.rows(limit=len(ids))} == {("sent", 1)}
