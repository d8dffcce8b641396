"""enqueue_many, the unfinished counter, and the operator's methods, on both stores."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from outbound import Defer
from outbound.errors import DuplicateMessage, OutboxFull, RateLimited
from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, RelayState, Store
from outbound.outbox._base import Outcome
from outbound.retry import RetryPolicy

from .conftest import StoreFactory, app_connection, wait_for

OWNER = "relay-a"


def many(store: Store, messages: list[dict[str, Any]]) -> list[int]:
    conn = app_connection(store)
    try:
        ids = store.enqueue_many(conn, messages)
        conn.commit()
        return ids
    finally:
        conn.close()


def msg(key: str, n: int = 0, **extra: Any) -> dict[str, Any]:
    return {"key": key, "type": "t", "payload": {"n": n}, **extra}


def check_counter(store: Store) -> None:
    status = store.status()
    assert status.unfinished == status.counts["pending"] + status.counts["processing"]


def test_enqueue_many_keeps_the_order_of_each_key(store: Store) -> None:
    first = many(store, [msg("a", 0), msg("b", 0), msg("a", 1)])
    second = many(store, [msg("b", 1), msg("a", 2), msg("a", 3)])
    assert first == sorted(first)
    assert min(second) > max(first)
    # The ids are those of the messages, in the list's order.
    by_id = {r.id: r for r in store.rows()}
    assert [by_id[i].key for i in first] == ["a", "b", "a"]
    big = many(store, [msg(f"z{i % 7}", i) for i in range(300)])
    session = store.session()
    try:
        claimed = session.claim(OWNER, 10, 30.0, None)
        assert sorted(c.message.id for c in claimed if c.message.key.startswith("z")) == big[:7]
        assert {c.message.payload["n"] for c in claimed if c.message.key.startswith("z")} == set(
            range(7)
        )
        session.finish(
            OWNER, [Outcome(c.message.id, c.token, c.message.key, "requeue") for c in claimed]
        )
    finally:
        session.close()
    store.cancel(big)
    seen: dict[str, list[int]] = {}
    session = store.session()
    try:
        while True:
            claimed = session.claim(OWNER, 10, 30.0, None)
            if not claimed:
                break
            for c in claimed:
                seen.setdefault(c.message.key, []).append(c.message.payload["n"])
            session.finish(
                OWNER, [Outcome(c.message.id, c.token, c.message.key, "sent") for c in claimed]
            )
    finally:
        session.close()
    assert seen == {"a": [0, 1, 2, 3], "b": [0, 1]}
    check_counter(store)


def test_enqueue_many_rolls_back_with_the_callers_transaction(store: Store) -> None:
    conn = app_connection(store)
    try:
        assert len(store.enqueue_many(conn, [msg("a"), msg("b")])) == 2
        conn.rollback()
        assert store.enqueue_many(conn, []) == []
        conn.commit()
    finally:
        conn.close()
    assert store.status().unfinished == 0
    assert store.rows() == []


def test_enqueue_many_is_all_or_nothing(make_store: StoreFactory) -> None:
    store = make_store(max_pending=5)
    many(store, [msg("a", dedupe_key="x"), msg("b")])
    conn = app_connection(store)
    try:
        with pytest.raises(OutboxFull):
            store.enqueue_many(conn, [msg(f"k{i}") for i in range(4)])
        with pytest.raises(DuplicateMessage):
            store.enqueue_many(conn, [msg("c"), msg("d", dedupe_key="x")])
        with pytest.raises(DuplicateMessage, match=r"messages\[0\] and messages\[2\]"):
            store.enqueue_many(conn, [msg("c", dedupe_key="y"), msg("d"), msg("e", dedupe_key="y")])
        with pytest.raises(TypeError, match=r"messages\[1\] misses payload"):
            store.enqueue_many(conn, [msg("c"), {"key": "d", "type": "t"}])
        with pytest.raises(TypeError, match=r"unknown fields: \['paylaod'\]"):
            store.enqueue_many(conn, [{"key": "d", "type": "t", "payload": 1, "paylaod": 2}])
        with pytest.raises(TypeError, match="iterable of mappings"):
            store.enqueue_many(conn, msg("c"))  # type: ignore[arg-type]
        # The transaction is still usable, and exactly the room left is taken.
        assert len(store.enqueue_many(conn, [msg(f"k{i}") for i in range(3)])) == 3
        conn.commit()
    finally:
        conn.close()
    assert store.status().unfinished == 5
    assert len(store.rows()) == 5


def test_the_counter_follows_every_way_a_row_comes_and_goes(store: Store) -> None:
    ids = many(store, [msg(f"k{i % 3}", i) for i in range(9)])
    conn = app_connection(store)
    try:
        store.enqueue(conn, key="k0", type="t", payload=None)
        conn.commit()
    finally:
        conn.close()
    check_counter(store)
    session = store.session()
    try:
        claimed = session.claim(OWNER, 10, 30.0, None)
        kinds = ["sent", "dead", "retry"]
        session.finish(
            OWNER,
            [
                Outcome(c.message.id, c.token, c.message.key, kinds[i % 3])  # type: ignore[arg-type]
                for i, c in enumerate(claimed)
            ],
        )
        check_counter(store)
        session.claim(OWNER, 10, 30.0, None)  # processing rows count too
        check_counter(store)
    finally:
        session.close()
    assert store.retry_dead() == 1
    check_counter(store)
    assert store.cancel([ids[-1]]) == 1
    assert store.dead_letter([ids[-2]]) == 1
    check_counter(store)
    store.purge(statuses=["sent", "dead", "cancelled"])
    check_counter(store)


def test_cancelling_a_row_a_relay_is_delivering_fences_its_outcome(store: Store) -> None:
    started = threading.Event()
    release = threading.Event()
    seen: list[int] = []

    def handler(message: OutboxMessage) -> None:
        seen.append(message.payload["n"])
        if message.payload["n"] == 0:
            started.set()
            assert release.wait(10.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    first, second, third = many(store, [msg("k", 0), msg("k", 1), msg("k", 2)])
    with Relay(store, bus, poll_interval=0.02) as relay:
        assert started.wait(10.0)
        ((lease),) = store.leases()
        assert (lease.owner, lease.rows) == (relay.owner, 1)
        assert store.cancel([third]) == 1  # waiting: it just leaves the line
        assert store.cancel([first], reason="wrong recipient") == 1
        assert store.get(second).head  # type: ignore[union-attr]  # the next row moved up
        release.set()
        wait_for(lambda: seen == [0, 1])
        wait_for(lambda: relay.stats().lost == 1)  # the late "sent" was refused
        wait_for(lambda: relay.stats().sent == 1)  # the second row
    stats = relay.stats()
    # The refused outcome counts once, as lost: not also as sent.
    assert (stats.claimed, stats.sent, stats.lost) == (2, 1, 1)
    rows = {r.id: r for r in store.rows()}
    assert (rows[first].status, rows[first].last_error) == ("cancelled", "wrong recipient")
    assert rows[third].status == "cancelled"
    assert seen == [0, 1]
    assert store.blocked() == []
    check_counter(store)


@pytest.mark.parametrize("max_concurrency", [None, 2])
def test_a_claimed_row_cancelled_before_its_handler_started_does_not_run(
    store: Store, monkeypatch: pytest.MonkeyPatch, max_concurrency: int | None
) -> None:
    """A row claimed in a batch waits for a handler thread; an operator cancels it
    meanwhile: its handler must not run (it ran, after the next row of its key)."""
    from outbound.outbox import relay as relay_module  # noqa: PLC0415

    # A row not started within 50 ms of its claim is checked first (the real
    # bound is half a second: a row that waited less may run once cancelled).
    monkeypatch.setattr(relay_module, "_START_CHECK_AFTER", 0.05)
    started = threading.Event()
    release = threading.Event()
    seen: list[str] = []

    def handler(message: OutboxMessage) -> None:
        seen.append(message.key + str(message.payload["n"]))
        if message.key == "a":
            started.set()
            assert release.wait(10.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    _, waiting = many(store, [msg("a", 0), msg("k", 0)])
    relay = Relay(
        store,
        bus,
        poll_interval=0.02,
        max_inflight=1,
        batch_size=2,
        max_concurrency=max_concurrency,
    )
    with relay:
        assert started.wait(10.0)
        wait_for(lambda: relay.stats().claimed == 2)  # "k0" waits for the only thread
        claimed_by = time.monotonic()
        assert store.cancel([waiting], reason="sent by hand") == 1
        # "k0" waits past the bound: what is under test is that time.
        wait_for(lambda: time.monotonic() > claimed_by + 0.1)
        (behind,) = many(store, [msg("k", 1)])
        release.set()
        wait_for(lambda: relay.stats().sent == 2)  # "a0", then "k1"
        wait_for(lambda: store.get(waiting).status == "cancelled")  # type: ignore[union-attr]
        wait_for(lambda: relay.stats().inflight == 0)
    assert seen == ["a0", "k1"]
    assert store.get(behind).status == "sent"  # type: ignore[union-attr]
    assert store.get(waiting).last_error == "sent by hand"  # type: ignore[union-attr]
    assert store.leases() == []
    assert all(s.owner is None for s in store.slots())
    check_counter(store)


def test_a_graceful_stop_runs_a_claimed_row_that_waited_for_a_thread(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claimed row that waited for the only thread past the bound is checked before it
    starts; during a graceful stop it was written back (pending) instead of run."""
    from outbound.outbox import relay as relay_module  # noqa: PLC0415

    monkeypatch.setattr(relay_module, "_START_CHECK_AFTER", 0.05)
    started, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def handler(message: OutboxMessage) -> None:
        seen.append(message.key)
        if message.key == "a":
            started.set()
            assert release.wait(10.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    first, waiting = many(store, [msg("a"), msg("b")])
    relay = Relay(store, bus, poll_interval=0.02, max_inflight=1, batch_size=2).start()
    stopped: list[bool] = []
    stopping = threading.Thread(target=lambda: stopped.append(relay.stop(20.0)))
    try:
        assert started.wait(10.0)
        wait_for(lambda: relay.stats().claimed == 2)
        claimed_by = time.monotonic()
        wait_for(lambda: time.monotonic() > claimed_by + 0.1)  # "b" waits past the bound
        stopping.start()
        wait_for(lambda: relay.state is RelayState.STOPPING)
    finally:
        release.set()
    stopping.join(30.0)
    assert stopped == [True]
    assert seen == ["a", "b"]
    assert [store.get(i).status for i in (first, waiting)] == ["sent", "sent"]  # type: ignore[union-attr]


def test_a_revived_row_is_aged_from_its_revival(store: Store) -> None:
    """A row revived past ``max_total`` went dead again ("expired") at its first
    Defer or failure: no second try for what an operator asked to go out."""
    (row_id,) = many(store, [msg("k")])
    created = store.get(row_id).created_at  # type: ignore[union-attr]
    # The row is older than max_total: the time is what is under test.
    wait_for(lambda: time.time() > created + 1.6)
    assert store.dead_letter([row_id], reason="platform down") == 1
    calls: list[int] = []

    def handler(message: OutboxMessage) -> None:
        calls.append(message.attempt)
        if len(calls) == 1:
            raise Defer(0.01)  # a rate limiter's "a little later"
        if len(calls) == 2:
            raise RuntimeError("a transient failure")

    bus = EventBus()
    bus.subscribe("t", handler)
    # max_total leaves room for the three calls on a slow (loaded) runner; the
    # row is revived once the relay runs (it polls every 20 ms), so that the
    # relay's start-up does not count against its age either.
    policy = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.01, max_total=1.5)
    with Relay(store, bus, poll_interval=0.02, retry=policy) as relay:
        assert store.retry_dead([row_id]) == 1
        revived = store.get(row_id)
        assert revived is not None
        assert revived.created_at > created + 1.5
        wait_for(lambda: relay.stats().sent == 1, timeout=10.0)
    row = store.get(row_id)
    assert row is not None
    assert row.status == "sent", row
    assert calls == [1, 1, 2]


def test_leases_and_slots_show_what_each_relay_holds(store: Store) -> None:
    many(store, [msg("a"), msg("b"), msg("c")])
    session = store.session()
    try:
        session.ensure_slots(3)
        held = session.claim(OWNER, 2, 30.0, 3)
        (lease,) = store.leases()
        assert (lease.owner, lease.rows, lease.slots) == (OWNER, 2, 2)
        slots = store.slots()
        assert [(s.slot, s.owner) for s in slots] == [(1, OWNER), (2, OWNER), (3, None)]
        session.finish(
            OWNER,
            [Outcome(c.message.id, c.token, c.message.key, "sent", slot=c.slot) for c in held],
        )
        assert store.leases() == []
        assert all(s.owner is None for s in store.slots())
    finally:
        session.close()


def test_enqueue_many_sends_one_notify(make_store: StoreFactory, backend: str) -> None:
    if backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    store = make_store()
    assert isinstance(store, PostgresStore)
    import psycopg  # noqa: PLC0415

    with psycopg.connect(store.conninfo, autocommit=True) as listener:
        listener.execute(f"LISTEN {store.channel}")
        many(store, [msg(f"k{i}") for i in range(50)])
        got = list(listener.notifies(timeout=0.5))
    assert len(got) == 1


def test_the_counter_stays_exact_under_racing_relays(store: Store) -> None:
    import random  # noqa: PLC0415

    def handler(message: OutboxMessage) -> None:
        if random.random() < 0.3:  # requeued: rows come and go between relays
            raise RateLimited(0.005)

    bus = EventBus()
    bus.subscribe("t", handler)
    many(store, [msg(f"k{i % 30}", i) for i in range(900)])
    relays = [
        Relay(store, bus, poll_interval=0.01, batch_size=20, max_inflight=8).start()
        for _ in range(3)
    ]
    try:
        wait_for(lambda: store.status().counts["sent"] == 900, timeout=60.0)
    finally:
        for relay in relays:
            assert relay.stop(10.0)
    assert store.status().unfinished == 0
