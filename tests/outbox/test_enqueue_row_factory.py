"""``enqueue`` on an application connection with a row factory of its own.

An application may set ``row_factory`` on its connection for its own queries
(the dict factory of Python's sqlite3 docs, psycopg's ``dict_row``). The
store read its statement's answer through it by position, after the row was
written: ``KeyError: 0``, no id for the caller, and the row still committed
with the caller's transaction (a retry enqueued it twice).
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from outbound.errors import DuplicateMessage
from outbound.outbox import SQLiteStore, Store

from .conftest import app_connection


def _dict_rows(conn: Any) -> None:
    if isinstance(conn, sqlite3.Connection):

        def factory(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> dict[str, Any]:
            return {column[0]: value for column, value in zip(cursor.description, row)}

        conn.row_factory = factory
    else:
        import psycopg.rows  # noqa: PLC0415

        conn.row_factory = psycopg.rows.dict_row


@pytest.mark.parametrize("many", [False, True], ids=["enqueue", "enqueue_many"])
@pytest.mark.parametrize("limited", [False, True], ids=["unlimited", "max_pending"])
def test_enqueue_returns_ids_whatever_the_connections_row_factory(
    make_store: Any, many: bool, limited: bool
) -> None:
    store: Store = make_store(max_pending=100) if limited else make_store()
    conn = app_connection(store)
    try:
        _dict_rows(conn)
        if many:
            ids = store.enqueue_many(
                conn, [{"key": "k", "type": "t", "payload": n} for n in range(3)]
            )
        else:
            ids = [store.enqueue(conn, key="k", type="t", payload=0)]
        # The application's own queries still get its rows.
        row = conn.execute("SELECT 1 AS one").fetchone()
        assert row == {"one": 1}
        conn.commit()
    finally:
        conn.close()
    assert sorted(r.id for r in store.rows()) == sorted(ids)
    assert len(ids) == (3 if many else 1)
    if isinstance(store, SQLiteStore):
        assert store.status().counts["pending"] == len(ids)


@pytest.mark.parametrize("many", [False, True], ids=["enqueue", "enqueue_many"])
@pytest.mark.parametrize("factory", ["dict", "text-as-bytes", "bytearray", "latin2", "ascii"])
def test_a_duplicate_is_named_whatever_the_connections_factories(
    make_store: Any, many: bool, factory: str
) -> None:
    """enqueue_many read which dedupe_key an unfinished row held through the
    application's row factory: ``KeyError: 0`` instead of DuplicateMessage; and
    through its text factory: a key shown as ``b'...'`` or mangled (the message
    not named), or a ``UnicodeDecodeError`` from a factory that cannot read it
    (from enqueue too)."""
    store: Store = make_store()
    conn = app_connection(store)
    try:
        if factory == "dict":
            _dict_rows(conn)
        elif not isinstance(conn, sqlite3.Connection):
            pytest.skip("text_factory is sqlite3's")
        store.enqueue(conn, key="k", type="t", payload=0, dedupe_key="café")
        conn.commit()
        if factory != "dict":  # (the one of sqlite3's how-to for text not UTF-8, and others)
            conn.text_factory = {
                "text-as-bytes": bytes,
                "bytearray": bytearray,
                "latin2": lambda data: str(data, encoding="latin2"),
                "ascii": lambda data: data.decode("ascii"),
            }[factory]
        batch: list[dict[str, Any]] = [
            {"key": "k", "type": "t", "payload": 1, "dedupe_key": "other"},
            {"key": "k", "type": "t", "payload": 2, "dedupe_key": "café"},
        ]
        with pytest.raises(DuplicateMessage, match=r"'café'") as info:
            store.enqueue_many(conn, batch) if many else store.enqueue(conn, **batch[1])
        conn.rollback()
    finally:
        conn.close()
    if many:
        assert "messages[1]" in str(info.value)
    assert [r.dedupe_key for r in store.rows()] == ["café"]


@pytest.mark.parametrize("encoding", ["UTF-16le", "UTF-16be"])
def test_a_duplicate_is_named_in_a_database_of_utf16_text(tmp_path: Path, encoding: str) -> None:
    """The key read back as bytes was decoded as UTF-8: in an application's file
    made with ``PRAGMA encoding = 'UTF-16le'``, ``'o\\x00r\\x00d...'``, the message
    not named."""
    path = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as made:
        made.execute(f"PRAGMA encoding = '{encoding}'")
        made.execute("CREATE TABLE app (x)")
        made.commit()
    store = SQLiteStore(path)
    conn = store.connect()
    try:
        store.enqueue(conn, key="k", type="t", payload=0, dedupe_key="café-42")
        conn.commit()
        batch: list[dict[str, Any]] = [
            {"key": "k", "type": "t", "payload": 1, "dedupe_key": "other"},
            {"key": "k", "type": "t", "payload": 2, "dedupe_key": "café-42"},
        ]
        with pytest.raises(DuplicateMessage) as info:
            store.enqueue_many(conn, batch)
        conn.rollback()
    finally:
        conn.close()
        store.close()
    assert str(info.value) == (
        "messages[1]: an unfinished outbox row already has the dedupe_key 'café-42'"
    )
