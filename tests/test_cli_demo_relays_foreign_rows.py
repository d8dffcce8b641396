"""The demo refuses a --db table holding another application's unfinished row
wherever it is (here behind 1000 pending demo rows): its relay would deliver
it, and find no handler."""

import sqlite3
from pathlib import Path

from outbound_process import FAST, outbound

from outbound.demo import DEMO_TYPE
from outbound.outbox import SQLiteStore


def test_a_foreign_row_behind_1000_demo_rows_is_left_alone(tmp_path: Path) -> None:
    db = str(tmp_path / "app.db")
    store = SQLiteStore(db)
    with store.connect() as conn:
        store.enqueue(conn, key="user-1", type="app.invoice", payload={"amount": 1})
    with store.connect() as conn:
        # What an interrupted demo of 1,000+ messages leaves pending.
        store.enqueue_many(
            conn,
            [
                {
                    "key": str(1000 + i % 50),
                    "type": DEMO_TYPE,
                    "payload": {"chat_id": 1000 + i % 50, "text": "x", "run": "earlier"},
                }
                for i in range(1000)
            ],
        )
    store.close()
    rc, out, err = outbound(
        "demo", "--db", db, "--chats", "1", "--messages", "1", *FAST, cwd=tmp_path, timeout=120
    )
    conn = sqlite3.connect(db)
    try:
        status, error = conn.execute(
            "SELECT status, last_error FROM outbox WHERE id = 1"
        ).fetchone()
    finally:
        conn.close()
    assert status == "pending", (status, error, rc, out[-600:], err)
