"""A separate OS process for the multi-process tests: enqueue, or run a relay.

    python worker.py enqueue DB TABLE --count N --max-pending M [--batch B]
    python worker.py relay DB TABLE [--max-concurrency N] [--work S] [--lease S] [--defer S]

``DB`` is a SQLite file path or a ``postgresql://`` URL. The relay's handler
writes every delivery to ``TABLE_log`` (key, n, pid) and tracks how many
handlers run at once, over all processes, in ``TABLE_probe``. A relay exits
when the outbox has no unfinished row left (or on SIGTERM: graceful stop).
With ``--defer S`` its handler delivers nothing: it puts every row off for
``S`` seconds (``Defer``) and prints ``deferred ID``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import sys
import threading
import time
from typing import Any

import psycopg

from outbound import Defer
from outbound.errors import OutboxFull
from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, SQLiteStore, Store

_SAYING = threading.Lock()


def say(line: str) -> None:
    """Print ``line`` whole: the handlers' threads and the main thread print, and
    print() writes the text and its newline in two steps ("deferred 1started")."""
    with _SAYING:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def is_postgres(db: str) -> bool:
    return db.startswith(("postgresql://", "postgres://"))


def open_store(db: str, table: str, **options: Any) -> Store:
    if is_postgres(db):
        return PostgresStore(db, table=table, **options)
    return SQLiteStore(db, table=table, **options)


def connect(db: str) -> Any:
    if is_postgres(db):
        return psycopg.connect(db, autocommit=True)
    conn = sqlite3.connect(db, timeout=30.0, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    return conn


def q(db: str, sql: str) -> str:
    """Placeholders: write ``?``; PostgreSQL gets ``%s``."""
    return sql.replace("?", "%s") if is_postgres(db) else sql


def create_aux_tables(db: str, table: str) -> None:
    conn = connect(db)
    serial = "bigserial" if is_postgres(db) else "INTEGER"
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {table}_log (id {serial} PRIMARY KEY, "
        "row_id bigint NOT NULL, key text NOT NULL, n integer NOT NULL, pid integer NOT NULL)"
    )
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {table}_probe (one integer PRIMARY KEY, "
        "running integer NOT NULL, peak integer NOT NULL)"
    )
    conn.execute(q(db, f"INSERT INTO {table}_probe VALUES (1, 0, 0) ON CONFLICT DO NOTHING"))
    conn.execute(f"CREATE TABLE IF NOT EXISTS {table}_app (id {serial} PRIMARY KEY, note text)")
    conn.close()


def drop_aux_tables(db: str, table: str) -> None:
    conn = connect(db)
    for suffix in ("log", "probe", "app"):
        conn.execute(f"DROP TABLE IF EXISTS {table}_{suffix}")
    conn.close()


def fetch(db: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = connect(db)
    try:
        return [tuple(r) for r in conn.execute(q(db, sql), params).fetchall()]
    finally:
        conn.close()


# ------------------------------------------------------------------- enqueue


def run_enqueue(db: str, table: str, count: int, max_pending: int, batch: int = 1) -> int:
    """Try ``count`` transactions, each with an app row and ``batch`` outbox rows.

    ``batch`` > 1 writes the outbox rows with one ``enqueue_many``.
    """
    store = open_store(db, table, max_pending=max_pending, create=False)
    accepted = refused = 0
    if is_postgres(db):
        conn: Any = psycopg.connect(db)
    else:
        conn = sqlite3.connect(db, timeout=30.0)
    for i in range(count):
        try:
            if not is_postgres(db):
                conn.execute("BEGIN IMMEDIATE")
            conn.execute(q(db, f"INSERT INTO {table}_app (note) VALUES (?)"), (f"n{i}",))
            if batch > 1:
                messages = [
                    {"key": f"k{i % 5}", "type": "t", "payload": {"n": i, "m": m}}
                    for m in range(batch)
                ]
                store.enqueue_many(conn, messages)
            else:
                store.enqueue(conn, key=f"k{i % 5}", type="t", payload={"n": i})
            conn.commit()
            accepted += 1
        except OutboxFull:
            conn.rollback()
            refused += 1
    conn.close()
    store.close()
    say(f"accepted={accepted} refused={refused}")
    return 0


# --------------------------------------------------------------------- relay


class Recorder:
    """The handler: log the delivery and count concurrent handlers in the database."""

    def __init__(self, db: str, table: str, work: float, defer: float | None = None) -> None:
        self.db = db
        self.table = table
        self.work = work
        self.defer = defer
        self.local = threading.local()
        self.lock = threading.Lock()
        self.shared: Any = None

    def conn(self) -> Any:
        if is_postgres(self.db):
            # One connection per process (psycopg's are thread-safe): one per
            # handler thread crowded the server's max_connections when other
            # tests' relays ran beside these, and relays then could not connect.
            with self.lock:
                if self.shared is None:
                    self.shared = connect(self.db)
                return self.shared
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = connect(self.db)
        return conn

    def __call__(self, message: OutboxMessage) -> None:
        if self.defer is not None:
            say(f"deferred {message.id}")
            raise Defer(self.defer)
        conn, t, db = self.conn(), self.table, self.db
        conn.execute(
            f"UPDATE {t}_probe SET running = running + 1, "
            + (
                "peak = greatest(peak, running + 1)"
                if is_postgres(db)
                else "peak = max(peak, running + 1)"
            )
        )
        try:
            if self.work:
                time.sleep(self.work)  # the handler's work
            conn.execute(
                q(db, f"INSERT INTO {t}_log (row_id, key, n, pid) VALUES (?, ?, ?, ?)"),
                (message.id, message.key, message.payload["n"], os.getpid()),
            )
        finally:
            conn.execute(f"UPDATE {t}_probe SET running = running - 1")


def run_relay(
    db: str,
    table: str,
    max_concurrency: int | None,
    work: float,
    lease: float,
    wait_go: bool,
    defer: float | None = None,
) -> int:
    store = open_store(db, table, create=False)
    if wait_go:  # start together with the other processes
        say("ready")
        assert sys.stdin.readline().strip() == "go"
    bus = EventBus()
    bus.subscribe("t", Recorder(db, table, work, defer))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    relay = Relay(
        store,
        bus,
        batch_size=20,
        max_inflight=8,
        max_concurrency=max_concurrency,
        lease=lease,
        poll_interval=0.05,
    ).start()
    say("started")
    try:
        while not stop.wait(0.1):
            counts = store.status().counts
            if counts["pending"] + counts["processing"] == 0:
                break
    finally:
        relay.stop(30.0)
        store.close()
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["enqueue", "relay"])
    parser.add_argument("db")
    parser.add_argument("table")
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--max-pending", type=int, default=100)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--work", type=float, default=0.0)
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--wait-go", action="store_true")
    parser.add_argument("--defer", type=float, default=None)
    args = parser.parse_args(argv)
    if args.mode == "enqueue":
        return run_enqueue(args.db, args.table, args.count, args.max_pending, args.batch)
    return run_relay(
        args.db, args.table, args.max_concurrency, args.work, args.lease, args.wait_go, args.defer
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
