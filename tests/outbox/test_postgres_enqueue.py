"""PostgreSQL enqueue: counter shards and concurrent application transactions."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outbound.outbox import PostgresStore

psycopg = pytest.importorskip("psycopg")


@pytest.fixture
def store(postgres_url: str) -> Iterator[PostgresStore]:
    made = PostgresStore(postgres_url, table=f"ofx_enq_{uuid.uuid4().hex[:8]}")
    yield made
    made.close()
    made.drop_schema()


def _scalar(store: PostgresStore, sql: str) -> Any:
    with store.connect() as conn:
        row = conn.execute(sql.replace("{t}", store.table)).fetchone()
        assert row is not None
        return row[0]


def test_an_enqueue_never_waits_for_an_unrelated_transactions_counter_shard(
    store: PostgresStore,
) -> None:
    # 15 open transactions that enqueued hold the 15 writers' shards; the
    # next ones take shards of their own instead of waiting (lock_timeout
    # turns a wait into an error, so a wait fails the test within 5 s).
    for round_ in range(3):
        conns = [store.connect() for _ in range(18)]
        try:
            for i, conn in enumerate(conns):
                conn.execute("SET lock_timeout = '5s'")
                if i == 17:
                    store.enqueue_many(
                        conn,
                        [{"key": f"m{round_}", "type": "t", "payload": n} for n in range(3)],
                    )
                else:
                    store.enqueue(conn, key=f"k{round_}-{i}", type="t", payload=i)
                    store.enqueue(conn, key=f"k{round_}-{i}", type="t", payload=i)
        finally:
            for i, conn in enumerate(conns):
                if round_ == 1 and i % 2:
                    conn.rollback()
                else:
                    conn.commit()
                conn.close()
        unfinished = _scalar(store, "SELECT count(*) FROM {t} WHERE status = 'pending'")
        assert store.status().unfinished == unfinished
    assert unfinished == 2 * (2 * 17 + 3) + 2 * 9  # round 1 rolled back the odd ones
    # A transaction's own shard folds the earlier ones in: they stay few.
    assert _scalar(store, "SELECT count(*) FROM {t}_counts WHERE shard < 0") <= 4
