"""PostgreSQL ``enqueue`` on an application connection with a cursor factory of its own.

psycopg lets a connection choose its cursor class: ``RawCursor`` takes
``$1`` placeholders only, ``ClientCursor`` binds on the client. The store's
statements use ``%(name)s`` placeholders: on a ``RawCursor`` connection
every enqueue failed with psycopg's "raw queries require a sequence of
parameters", nothing written.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outbound.outbox import PostgresStore

psycopg = pytest.importorskip("psycopg")


@pytest.fixture
def store(postgres_url: str) -> Iterator[PostgresStore]:
    made = PostgresStore(postgres_url, table=f"ofx_cf_{uuid.uuid4().hex[:8]}", max_pending=100)
    yield made
    made.close()
    made.drop_schema()


@pytest.mark.parametrize("factory", ["RawCursor", "ClientCursor", "Cursor"])
@pytest.mark.parametrize("autocommit", [False, True], ids=["transaction", "autocommit"])
def test_enqueue_whatever_the_connections_cursor_factory(
    store: PostgresStore, factory: str, autocommit: bool
) -> None:
    cursor_factory: Any = getattr(psycopg, factory)
    with psycopg.connect(
        store.conninfo, cursor_factory=cursor_factory, autocommit=autocommit
    ) as conn:
        one = store.enqueue(conn, key="k", type="t", payload={"n": 1})
        many = store.enqueue_many(conn, [{"key": "k", "type": "t", "payload": n} for n in (2, 3)])
        # The application's own cursors are still of its class.
        assert type(conn.cursor()) is cursor_factory
        if not autocommit:
            conn.commit()
    with store.connect() as conn:
        rows = conn.execute(f"SELECT id, payload FROM {store.table} ORDER BY id").fetchall()
    assert rows == [(one, {"n": 1}), (many[0], 2), (many[1], 3)]
