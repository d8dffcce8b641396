"""Run the container flow end to end: ``python examples/containers/run.py [--db URL]``.

``--db``: a SQLite file (default: a temporary one) or a ``postgresql://`` URL.
Each run starts afresh (the example's own tables are dropped and made
again), so the same command works every time. Prints each step and every
container's state transitions; exits 0 when every expectation held.
"""

from __future__ import annotations

import argparse
import os
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
    """Start from nothing, so that every run is the first: drop the example's tables.

    The container tables and the outbox table ``containers_outbox`` (with
    its companion tables) are the example's own; nothing else in the database is
    touched.
    """
    App(store).drop_tables()
    store.drop_schema()
    store.create_schema()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the container flow end to end on the outbox; exit 0 if every "
        "expectation held. Each run starts afresh: it drops and recreates the example's "
        "own tables (containers_outbox and two container tables) in --db."
    )
    parser.add_argument(
        "--db",
        default=None,
        help="SQLite file or postgresql:// URL (default: a temporary SQLite file)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or os.path.join(tmp, "containers.db")
        store: Store
        try:
            if db.startswith(("postgresql://", "postgres://")):
                store = PostgresStore(db, table="containers_outbox", create=False)
            else:
                store = SQLiteStore(db, table="containers_outbox", create=False)
            try:
                reset(store)
                run_demo(store)
            finally:
                store.close()
        except (OutboxError, ImportError, sqlite3.Error) as exc:
            print(f"error: cannot use the database {db}: {exc}", file=sys.stderr)
            return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
