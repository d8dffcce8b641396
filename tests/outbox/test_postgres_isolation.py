"""The PostgreSQL outbox whatever the isolation of the transactions around it: a
server whose sessions default to REPEATABLE READ (the store's own connections
run READ COMMITTED), and applications that enqueue in REPEATABLE READ."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay

from .conftest import wait_for

psycopg = pytest.importorskip("psycopg")

REPEATABLE_READ = "options=-c%20default_transaction_isolation%3Drepeatable%5C%20read"


@pytest.fixture
def store(postgres_url: str) -> Iterator[PostgresStore]:
    # The server's default for every session of this store's conninfo.
    sep = "&" if "?" in postgres_url else "?"
    made = PostgresStore(
        f"{postgres_url}{sep}{REPEATABLE_READ}", table=f"ofx_iso_{uuid.uuid4().hex[:8]}"
    )
    yield made
    made.close()
    made.drop_schema()


def _isolation(conn: Any) -> str:
    row = conn.execute("SHOW transaction_isolation").fetchone()
    assert row is not None
    return str(row[0])


def test_the_stores_own_connections_run_read_committed(store: PostgresStore) -> None:
    # The relays' statements lock rows, then read and write them: under
    # REPEATABLE READ one that waited for another relay's lock failed.
    with store.connect() as app:  # (the application's: as its conninfo says)
        assert _isolation(app) == "repeatable read"
    own = store._direct()
    try:
        assert _isolation(own) == "read committed"
    finally:
        own.close()
    session = store.session()
    try:
        assert _isolation(session.connect(10.0)) == "read committed"
    finally:
        session.close()


def test_two_relays_deliver_every_row_in_order_under_a_default_of_repeatable_read(
    store: PostgresStore,
) -> None:
    sent: list[tuple[str, int]] = []

    def handler(message: OutboxMessage) -> None:
        sent.append((message.key, message.payload["i"]))

    bus = EventBus()
    bus.subscribe("t", handler)
    with store.connect() as conn:
        store.enqueue_many(
            conn,
            [{"key": f"k{i % 5}", "type": "t", "payload": {"i": i}} for i in range(300)],
        )
        conn.commit()
    relays = [Relay(store, bus, batch_size=10, poll_interval=0.02) for _ in range(2)]
    for relay in relays:
        relay.start()
    try:
        wait_for(lambda: len(sent) >= 300, timeout=60)
    finally:
        for relay in relays:
            relay.stop(30)
    assert sum(relay.stats().errors for relay in relays) == 0
    for key in {k for k, _ in sent}:
        line = [i for k, i in sent if k == key]
        assert line == sorted(line)
    assert sorted(i for _, i in sent) == list(range(300))


def test_an_enqueue_in_repeatable_read_does_not_fail_for_the_counters_sake(
    store: PostgresStore,
) -> None:
    # The counter's shared shards: a shard another enqueue changed after this
    # transaction's snapshot failed it ("could not serialize access"), for no
    # reason of the application's.
    first = store.connect()
    try:
        assert _isolation(first) == "repeatable read"
        first.execute("SELECT 1")  # (the transaction's snapshot)
        with store.connect() as other:
            store.enqueue(other, key="b", type="t", payload={})
            other.commit()
        store.enqueue(first, key="a", type="t", payload={})
        store.enqueue(first, key="a", type="t", payload={})  # (its own shard, again)
        first.commit()
    finally:
        first.close()
    status = store.status()
    assert (status.counts["pending"], status.unfinished) == (3, 3)


def test_relays_fold_the_shards_of_ended_transactions(store: PostgresStore) -> None:
    # A transaction of REPEATABLE READ counts on a shard of its own and folds
    # none; a relay's writes fold them, so they stay few.
    for _ in range(20):
        with store.connect() as app:
            app.execute("SELECT 1")
            store.enqueue(app, key="k", type="t", payload={})
            app.commit()

    def own_shards() -> int:
        with store.connect() as look:
            row = look.execute(
                f"SELECT count(*) FROM {store.table}_counts WHERE shard < 0"
            ).fetchone()
        assert row is not None
        return int(row[0])

    assert own_shards() == 20
    delivered: list[int] = []
    bus = EventBus()
    bus.subscribe("t", lambda message: delivered.append(message.id))
    with Relay(store, bus, batch_size=1, poll_interval=0.02):
        wait_for(lambda: len(delivered) == 20, timeout=60)
    assert own_shards() == 0
    status = store.status()
    assert (status.counts["sent"], status.unfinished) == (20, 0)


def test_serializable_enqueues_at_once_do_not_fail_each_other(store: PostgresStore) -> None:
    # The fold of ended transactions' shards, planned as a scan of the counter
    # table, read every row even when it deleted none: under SERIALIZABLE each
    # enqueue then conflicted with the other's own shard, and the second
    # commit failed ("read/write dependencies"), every time.
    first, second = store.connect(), store.connect()
    try:
        for conn in (first, second):
            conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        store.enqueue(first, key="a", type="t", payload={})
        store.enqueue(second, key="b", type="t", payload={})
        first.commit()
        second.commit()
    finally:
        first.close()
        second.close()
    status = store.status()
    assert (status.counts["pending"], status.unfinished) == (2, 2)


def test_pgoptions_reach_the_stores_own_connections(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given as the connections' options (for READ COMMITTED), the store's
    # own settings replaced PGOPTIONS': with a search_path there, the
    # application enqueued into one schema and the relays and status()
    # looked in another (the row never counted, never delivered).
    schema = f"ofx_s_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    monkeypatch.setenv("PGOPTIONS", f"-c search_path={schema}")
    store = PostgresStore(postgres_url, table="ofx_opts")
    try:
        with store.connect() as app:
            store.enqueue(app, key="k", type="t", payload={})
            app.commit()
        assert store.status().unfinished == 1
        own = store._direct()
        try:
            assert _isolation(own) == "read committed"
            row = own.execute("SHOW search_path").fetchone()
            assert row is not None
            assert row[0] == schema
        finally:
            own.close()
        delivered: list[int] = []
        bus = EventBus()
        bus.subscribe("t", lambda message: delivered.append(message.id))
        with Relay(store, bus, poll_interval=0.02):
            wait_for(lambda: len(delivered) == 1, timeout=60)
    finally:
        store.close()
        store.drop_schema()
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")
