"""Run the container flow end to end: ``python examples/containers/run.py [--db URL]``.

``--db``: a SQLite file (default: a temporary one) or a ``postgresql://`` URL.
Each run has tables of its own (``containers_<random>``, or ``--table``),
made at the start and dropped at the end (``--keep`` keeps them), so the
same command works every time, also several at once on one database.
Prints each step and every container's state transitions; exits 0 when
every expectation held.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from containers import App, ContainerWorker

from outbound.errors import OutboxError, OutboxFull
from outbound.outbox import EventBus, PostgresStore, Relay, SQLiteStore, Store
from outbound.outbox.cli import mask_password


@dataclass
class Report:
    transitions: dict[int, list[str]]
    ids: dict[str, int]
    roles: tuple[int, int, int]  # stopped then restarted, deleted, waited for capacity
    rejected: bool
    containers_after_reject: int
    deferred: int


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for: {what}")
        time.sleep(0.02)


def run_demo(
    store: Store, *, max_concurrency: int = 2, say: Callable[[str], object] = print
) -> Report:
    """The scenario, with at most 3 create requests pending (``max_pending``)."""
    app = App(store, max_pending=3)
    worker = ContainerWorker(app, max_concurrency=max_concurrency)
    bus = EventBus()
    worker.subscribe(bus)
    try:
        ids = {name: app.create_container(name) for name in ("c1", "c2", "c3")}
        say(f"created c1, c2, c3 (pending): {ids}")
        rejected = False
        try:
            app.create_container("c4")
        except OutboxFull as exc:
            rejected = True
            say(f"c4 refused, nothing written: {exc}")
        conn = app.thread_conn()
        (count,) = conn.execute(app.sql("SELECT count(*) FROM container_instance")).fetchone()
        s = app.status_of
        with Relay(store, bus, poll_interval=0.05, max_concurrency=4, lease=10.0):
            every = list(ids.values())
            wait_until(
                "two containers running, one pending for lack of capacity",
                lambda: (
                    sorted(s(c) for c in every) == ["pending", "running", "running"]
                    and worker.deferred >= 1
                ),
            )
            first, second = (c for c in every if s(c) == "running")
            (third,) = (c for c in every if s(c) == "pending")
            names = {cid: name for name, cid in ids.items()}
            a, b, c = names[first], names[second], names[third]
            say(f"{a}, {b} running; {c} pending (deferred {worker.deferred}x)")
            app.stop_container(first)
            wait_until(f"{a} stopped, {c} running", lambda: s(third) == "running")
            assert s(first) == "stopped"
            say(f"{a} stopped -> {c} got the slot: running")
            before = worker.deferred
            app.start_container(first)
            wait_until(f"{a}'s start deferred", lambda: worker.deferred > before)
            assert s(first) == "start_pending"
            say(f"{a} start requested: start_pending (capacity full)")
            app.delete_container(second)
            wait_until(f"{a} running", lambda: s(first) == "running")
            assert s(second) == "deleted"
            say(f"{b} deleted -> {a} starting -> running")
            wait_until(
                "outbox drained",
                lambda: store.status().counts["pending"] + store.status().counts["processing"] == 0,
            )
        report = Report(
            app.transitions(), ids, (first, second, third), rejected, int(count), worker.deferred
        )
    finally:
        app.close()
    for name, cid in ids.items():
        say(f"{name}: {' -> '.join(report.transitions.get(cid, []))}")
    return report


def reset(store: Store) -> None:
    """Start from nothing, so that every run is the first: drop the run's tables.

    The container tables and the outbox table (with its companion tables)
    are the run's own; nothing else in the database is touched.
    """
    drop(store)
    store.create_schema()


def drop(store: Store) -> None:
    """Drop the run's tables (the outbox's and the containers')."""
    App(store).drop_tables()
    store.drop_schema()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the container flow end to end on the outbox; exit 0 if every "
        "expectation held. Each run has tables of its own in --db (an outbox table and two "
        "container tables named after it), dropped at the end unless --keep."
    )
    parser.add_argument(
        "--db",
        default=None,
        help="SQLite file or postgresql:// URL (default: a temporary SQLite file)",
    )
    parser.add_argument(
        "--table",
        default=None,
        help="the outbox table, which names the container tables too (default: "
        "containers_ and a random suffix, so that runs at the same time never meet; "
        "a given one is dropped and made again at the start)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the tables after the run, to look at them"
    )
    args = parser.parse_args(argv)
    table = args.table or f"containers_{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or os.path.join(tmp, "containers.db")
        store: Store
        try:
            if db.startswith(("postgresql://", "postgres://")):
                store = PostgresStore(db, table=table, create=False)
            else:
                store = SQLiteStore(db, table=table, create=False)
            try:
                reset(store)
                try:
                    run_demo(store)
                finally:
                    if not args.keep:
                        drop(store)
            finally:
                store.close()
        except (OutboxError, ImportError, sqlite3.Error, ValueError) as exc:
            print(f"error: cannot use the database {db}: {exc}", file=sys.stderr)
            return 1
    if args.keep and args.db:
        print(
            f"tables kept: python -m outbound outbox --db {mask_password(args.db)} "
            f"--table {table} status"
        )
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
