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
