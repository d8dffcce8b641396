"""enqueue on an application's connection that commits each statement by itself
(``isolation_level=None``): its insert and its look for a duplicate are two
statements; another process finishing the duplicate between them made enqueue
report the outbox full (``max_pending=None``: it never is)."""

from __future__ import annotations

import sqlite3
import sys
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

    row: dict[str, Any] = {"key": "k", "type": "t", "payload": {}, "dedupe_key": "order-1"}

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


def test_a_ctrl_c_anywhere_in_the_transaction_of_its_own_leaves_nothing_open(
    tmp_path: Path,
) -> None:
    """A Ctrl-C just after its BEGIN left the application's connection in a
    transaction holding the write lock: every other writer got 'database is
    locked', and the application's next enqueue there was never committed."""
    from interrupts import interrupt_after_call  # noqa: PLC0415

    from outbound.outbox import sqlite as sqlite_store  # noqa: PLC0415

    code = sqlite_store._one_transaction.__wrapped__.__code__  # type: ignore[attr-defined]
    db = tmp_path / "o.db"
    store = SQLiteStore(db)
    app = _autocommit(db)
    points = 0
    for n in range(1, 50):
        profile, fired = interrupt_after_call(code, n)
        sys.setprofile(profile)
        try:
            store.enqueue(app, key="k", type="t", payload={"n": n})
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        if not fired:
            break
        points += 1
        assert not app.in_transaction, f"call {n} ({fired[0]}): a transaction left open"
        other = _autocommit(db)
        other.execute("BEGIN IMMEDIATE")  # (no lock left held)
        other.execute("ROLLBACK")
        other.close()
        count = _autocommit(db).execute("SELECT count(*) FROM outbox").fetchone()[0]
        store.enqueue(app, key="k", type="t", payload={"n": -n})
        after = _autocommit(db).execute("SELECT count(*) FROM outbox").fetchone()[0]
        assert after == count + 1, f"call {n}: the next enqueue was not committed"
    assert points > 0
    app.close()
    store.close()
