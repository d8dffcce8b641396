"""enqueue_many on SQLite: a batch longer than SQLite's string length limit
(SQLITE_LIMIT_LENGTH, 10**9 bytes by default) went as one JSON string and
failed as a whole ("string or blob too big"). It is written in several
statements in the caller's transaction; a message too long by itself is a
ValueError naming it, before anything is written. The limit is lowered on the
test's connection to show it without gigabytes."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest

from outbound.errors import DuplicateMessage, OutboxFull
from outbound.outbox import SQLiteStore

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="Connection.setlimit() is Python 3.11+"
)

LIMIT = 4096


def _limited(conn: sqlite3.Connection) -> sqlite3.Connection:
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, LIMIT)  # type: ignore[attr-defined,unused-ignore]
    return conn


def _messages(count: int, dedupe: bool = False) -> list[dict[str, object]]:
    # About 300 bytes each: several statements under LIMIT; keys repeat.
    return [
        {
            "key": f"k{i % 3}",
            "type": "t",
            "payload": {"i": i, "pad": "é" * 120},
            **({"dedupe_key": f"d{i}"} if dedupe else {}),
        }
        for i in range(count)
    ]


def _written(store: SQLiteStore) -> list[tuple[int, str, int, int]]:
    conn = sqlite3.connect(store.path)
    try:
        return [
            (int(i), str(k), int(p), int(h))
            for i, k, p, h in conn.execute(
                "SELECT id, key, json_extract(payload, '$.i'), head FROM outbox ORDER BY id"
            )
        ]
    finally:
        conn.close()


@pytest.mark.parametrize("autocommit", [False, True], ids=["default", "isolation_level=None"])
def test_a_batch_longer_than_the_limit_is_written_in_order(
    tmp_path: Path, autocommit: bool
) -> None:
    store = SQLiteStore(tmp_path / "o.db")
    conn = _limited(
        sqlite3.connect(store.path, isolation_level=None) if autocommit else store.connect()
    )
    try:
        ids = store.enqueue_many(conn, _messages(60))
        conn.commit()
    finally:
        conn.close()
    assert len(ids) == 60
    assert ids == sorted(ids)
    rows = _written(store)
    assert [r[0] for r in rows] == ids
    assert [(r[1], r[2]) for r in rows] == [(f"k{i % 3}", i) for i in range(60)]
    # The first row of each key is its head, whichever statement wrote it.
    assert [r[3] for r in rows] == [1, 1, 1] + [0] * 57
    assert store.status().counts["pending"] == 60


def test_a_long_batch_is_all_or_nothing_with_the_callers_transaction(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "o.db")
    conn = _limited(store.connect())
    try:
        store.enqueue(conn, key="app", type="t", payload={"i": -1})
        store.enqueue_many(conn, _messages(60))
        conn.rollback()
        assert _written(store) == []
        # A duplicate held in the database refuses the batch at its last
        # statement: the ones before it are undone, the caller's row kept.
        store.enqueue(conn, key="x", type="t", payload={"i": -2}, dedupe_key="d59")
        conn.commit()
        store.enqueue(conn, key="app", type="t", payload={"i": -1})
        with pytest.raises(DuplicateMessage):
            store.enqueue_many(conn, _messages(60, dedupe=True))
        assert conn.in_transaction
        conn.commit()
    finally:
        conn.close()
    assert [(r[1], r[2]) for r in _written(store)] == [("x", -2), ("app", -1)]


def test_a_long_batch_over_max_pending_writes_nothing(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "o.db", max_pending=59)
    conn = _limited(store.connect())
    try:
        with pytest.raises(OutboxFull):
            store.enqueue_many(conn, _messages(60))
        conn.commit()
    finally:
        conn.close()
    assert _written(store) == []


def test_a_message_longer_than_the_limit_is_refused_before_any_write(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "o.db")
    conn = _limited(store.connect())
    messages = _messages(5)
    messages[3]["payload"] = {"pad": "x" * LIMIT}
    try:
        with pytest.raises(ValueError, match=r"messages\[3\].*length limit.* 4096 bytes"):
            store.enqueue_many(conn, messages)
        with pytest.raises(ValueError, match=r"payload .*length limit.* 4096 bytes"):
            store.enqueue(conn, key="k", type="t", payload=messages[3]["payload"])
        assert not conn.in_transaction
    finally:
        conn.close()
    assert _written(store) == []


def test_non_ascii_dedupe_keys_fit_as_the_rows_do(tmp_path: Path) -> None:
    # The batch's dedupe keys went as a second JSON string with non-ASCII
    # escaped (an emoji 4 bytes -> 12): a batch split to fit failed as a
    # whole with "string or blob too big".
    store = SQLiteStore(tmp_path / "o.db")
    conn = _limited(store.connect())
    messages = [
        {
            "key": f"k{i}",
            "type": "t",
            "payload": {"i": i},
            "dedupe_key": f"{i}" + "\U0001f600" * 250,
        }
        for i in range(12)
    ]
    try:
        ids = store.enqueue_many(conn, messages)
        conn.commit()
    finally:
        conn.close()
    assert len(ids) == 12
    assert store.status().counts["pending"] == 12


@pytest.mark.parametrize("under", [0, 18, 40])
def test_a_message_just_under_the_limit_is_refused_by_name_not_by_sqlite(
    tmp_path: Path, under: int
) -> None:
    # Only the payload (or the message's JSON) was counted, not the rest of
    # the row SQLite holds to the same limit: a StoreError ("string or blob
    # too big") instead of the promised ValueError, for enqueue and
    # enqueue_many alike.
    store = SQLiteStore(tmp_path / "o.db")
    conn = _limited(store.connect())
    payload = "x" * (LIMIT - under - 2)  # a JSON string: its quotes
    try:
        with pytest.raises(ValueError, match="SQLITE_LIMIT_LENGTH"):
            store.enqueue(conn, key="k", type="t", payload=payload)
        with pytest.raises(ValueError, match=r"messages\[1\].*SQLITE_LIMIT_LENGTH"):
            store.enqueue_many(
                conn,
                [
                    {"key": "k", "type": "t", "payload": 1},
                    {"key": "k", "type": "t", "payload": payload[:-40]},
                ],
            )
        conn.commit()
    finally:
        conn.close()
    assert store.status().counts.get("pending", 0) == 0
