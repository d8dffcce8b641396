"""enqueue on an application's connection that commits each statement by itself
(``isolation_level=None``): its insert and its look for a duplicate are two
statements; another process finishing the duplicate between them made enqueue
report the outbox full (``max_pending=None``: it never is)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from outbound.errors import DuplicateMessage
from outbound.outbox import SQLiteStore


def _autocommit(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(db, isolation_level=None, timeout=10)


@pytest.mark.parametrize("many", [False, True], ids=["enqueue", "enqueue_many"])
def test_a_duplicate_finished_between_the_insert_and_its_check_is_no_full_outbox(
    tmp_path: Path, many: bool
) -> None:
    db = tmp_path / "o.db"
    store = SQLiteStore(db)
    app = _autocommit(db)
    first = store.enqueue(app, key="k", type="t", payload={}, dedupe_key="order-1")
    seen: list[bool] = []
    cancelled = threading.Event()

    def cancel() -> None:
        store.cancel([first])
        cancelled.set()

    def between(sql: str) -> None:
        # At the look for the duplicate: another connection cancels that row. It
        # must wait for the insert's transaction: what the insert found holds.
        if "INDEXED BY" in sql and not seen:
            seen.append(app.in_transaction)
            threading.Thread(target=cancel).start()
            cancelled.wait(2.0)

    row = {"key": "k", "type": "t", "payload": {}, "dedupe_key": "order-1"}

    def again() -> object:
        return store.enqueue_many(app, [row]) if many else store.enqueue(app, **row)

    app.set_trace_callback(between)
    try:
        with pytest.raises(DuplicateMessage):
            again()
    finally:
        app.set_trace_callback(None)
    assert seen == [True], "the look for the duplicate ran outside the insert's transaction"
    assert cancelled.wait(10)
    assert not app.in_transaction  # (nothing left open on the application's connection)
    # and with the duplicate gone, it goes in
    second: Any = store.enqueue(app, key="k", type="t", payload={}, dedupe_key="order-1")
    assert second > first
    app.close()
    store.close()


def test_an_enqueue_on_an_autocommit_connection_is_committed_when_it_returns(
    tmp_path: Path,
) -> None:
    db = tmp_path / "o.db"
    store = SQLiteStore(db)
    app = _autocommit(db)
    ids = [store.enqueue(app, key="k", type="t", payload={"n": 1})]
    ids += store.enqueue_many(app, [{"key": "k", "type": "t", "payload": {"n": 2}}])
    assert not app.in_transaction
    other = _autocommit(db)
    assert [r[0] for r in other.execute("SELECT id FROM outbox ORDER BY id")] == ids
    other.close()
    app.close()
    store.close()
