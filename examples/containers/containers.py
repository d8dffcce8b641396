"""The Go design's ContainerInstance flow on top of outbound.outbox (SQLite or PostgreSQL).

- The create API checks ``max_pending`` and writes ``ContainerInstance{pending}``
  and its ``OutboxCreateRequestEvent`` in one transaction; over the limit it
  raises ``OutboxFull`` and the transaction rolls back: nothing is written.
  As in the Go design, ``max_pending`` counts the create requests not yet
  handled, and only create requests: a stop or delete request, which frees
  capacity, is never refused (refusing it while creates wait for that
  capacity would block both for good).
- The relay publishes ``OutboxCreateRequestEvent`` / ``OutboxStartRequestEvent`` /
  ``OutboxStopRequestEvent`` / ``OutboxDeleteRequestEvent``, keyed by the
  container id, so one container's requests run in order.
- :class:`ContainerWorker` handles them. Create and start go through
  :meth:`ContainerWorker.acquire_capacity_and_transition`: in one
  serialized transaction it counts the containers holding a slot (creating,
  starting, running); below ``max_concurrency`` the container moves to
  creating/starting (then running), otherwise the handler raises
  ``Defer``: the request goes back to pending without counting an attempt
  and the container stays pending / start_pending (the Go design's
  "pending → pending").

Every status change is recorded in ``container_transition``.
"""

from __future__ import annotations

import threading
from typing import Any

from outbound import Defer
from outbound.errors import OutboxFull
from outbound.outbox import EventBus, OutboxMessage, PostgresStore, SQLiteStore, Store, immediate

CREATE = "OutboxCreateRequestEvent"
START = "OutboxStartRequestEvent"
STOP = "OutboxStopRequestEvent"
DELETE = "OutboxDeleteRequestEvent"

#: Statuses that hold a concurrency slot.
ACTIVE = ("creating", "starting", "running")

#: The advisory locks (PostgreSQL) serializing the count-then-write of the
#: create API and of the capacity check, across processes.
CREATE_LOCK = 8237460
CAPACITY_LOCK = 8237461


class App:
    """The application's side: its tables, its API, on the outbox's database.

    ``max_pending``: the most create requests not yet handled (pending or
    being handled); ``create_container`` raises ``OutboxFull`` beyond it.
    ``None``: no limit.
    """

    def __init__(self, store: Store, *, max_pending: int | None = None) -> None:
        self.store = store
        self.max_pending = max_pending
        self.pg = isinstance(store, PostgresStore)
        # Guards _conns, the worker threads' connections (closed by close()).
        self._lock = threading.Lock()
        self._conns: list[Any] = []
        self._local = threading.local()
        conn = self.connect()
        serial = "bigserial" if self.pg else "INTEGER"
        with self.transaction(conn):
            conn.execute(
                self.sql(
                    "CREATE TABLE IF NOT EXISTS container_instance ("
                    f" id {serial} PRIMARY KEY, name text NOT NULL, status text NOT NULL)"
                )
            )
            conn.execute(
                self.sql(
                    "CREATE TABLE IF NOT EXISTS container_transition ("
                    f" id {serial} PRIMARY KEY, container_id bigint NOT NULL,"
                    " old text, new text NOT NULL)"
                )
            )
        conn.close()

    # --------------------------------------------------------------- plumbing

    def connect(self) -> Any:
        if isinstance(self.store, PostgresStore):
            conn = self.store.connect()
            conn.autocommit = True  # transactions are explicit: conn.transaction()
            return conn
        assert isinstance(self.store, SQLiteStore)
        lite = self.store.connect()
        lite.isolation_level = None  # transactions are explicit: BEGIN IMMEDIATE
        return lite

    def thread_conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.connect()
            with self._lock:
                self._conns.append(conn)
        return conn

    def transaction(self, conn: Any) -> Any:
        """A write transaction; on SQLite ``BEGIN IMMEDIATE`` (the write lock first)."""
        return conn.transaction() if self.pg else immediate(conn)

    def sql(self, text: str) -> str:
        """Placeholders for the driver; the tables are named after the outbox table."""
        text = text.replace("container_instance", f"{self.store.table}_container")
        text = text.replace("container_transition", f"{self.store.table}_transition")
        return text.replace("?", "%s") if self.pg else text

    def drop_tables(self) -> None:
        conn = self.connect()
        try:
            with self.transaction(conn):
                conn.execute(self.sql("DROP TABLE IF EXISTS container_instance"))
                conn.execute(self.sql("DROP TABLE IF EXISTS container_transition"))
        finally:
            conn.close()

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    def _set_status(self, conn: Any, cid: int, old: str | None, new: str) -> None:
        conn.execute(self.sql("UPDATE container_instance SET status = ? WHERE id = ?"), (new, cid))
        conn.execute(
            self.sql("INSERT INTO container_transition (container_id, old, new) VALUES (?, ?, ?)"),
            (cid, old, new),
        )

    def status_of(self, cid: int) -> str:
        conn = self.thread_conn()
        row = conn.execute(
            self.sql("SELECT status FROM container_instance WHERE id = ?"), (cid,)
        ).fetchone()
        return str(row[0]) if row else "missing"

    # -------------------------------------------------------------------- API

    def create_container(self, name: str) -> int:
        """ContainerInstance{pending} and its create request, in one transaction.

        Raises OutboxFull (nothing written) when max_pending create requests
        wait. The count and the writes are serialized across processes
        (``BEGIN IMMEDIATE`` on SQLite, an advisory lock on PostgreSQL).
        """
        conn = self.thread_conn()
        with self.transaction(conn):
            if self.max_pending is not None:
                if self.pg:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (CREATE_LOCK,))
                (waiting,) = conn.execute(
                    self.sql(
                        f"SELECT count(*) FROM {self.store.table} "
                        "WHERE type = ? AND status IN ('pending', 'processing')"
                    ),
                    (CREATE,),
                ).fetchone()
                if waiting >= self.max_pending:
                    raise OutboxFull(
                        f"{waiting} create requests already wait (max_pending={self.max_pending})"
                    )
            cur = conn.execute(
                self.sql(
                    "INSERT INTO container_instance (name, status) VALUES (?, 'pending') "
                    "RETURNING id"
                ),
                (name,),
            )
            cid = int(cur.fetchone()[0])
            conn.execute(
                self.sql(
                    "INSERT INTO container_transition (container_id, old, new) "
                    "VALUES (?, NULL, 'pending')"
                ),
                (cid,),
            )
            self.store.enqueue(conn, key=f"container-{cid}", type=CREATE, payload={"id": cid})
        return cid

    def _request(self, cid: int, type: str, old: str | None, new: str | None) -> None:
        conn = self.thread_conn()
        with self.transaction(conn):
            if new is not None:
                self._set_status(conn, cid, old, new)
            self.store.enqueue(conn, key=f"container-{cid}", type=type, payload={"id": cid})

    def start_container(self, cid: int) -> None:
        """stopped → start_pending, and a start request."""
        self._request(cid, START, "stopped", "start_pending")

    def stop_container(self, cid: int) -> None:
        self._request(cid, STOP, None, None)

    def delete_container(self, cid: int) -> None:
        self._request(cid, DELETE, None, None)

    def transitions(self) -> dict[int, list[str]]:
        conn = self.connect()
        try:
            rows = conn.execute(
                self.sql("SELECT container_id, new FROM container_transition ORDER BY id")
            ).fetchall()
        finally:
            conn.close()
        out: dict[int, list[str]] = {}
        for cid, new in rows:
            out.setdefault(int(cid), []).append(str(new))
        return out


class ContainerWorker:
    """The Go design's ContainerCreateWorker: subscribes to the four request events."""

    def __init__(self, app: App, *, max_concurrency: int, retry_delay: float = 0.05) -> None:
        self.app = app
        self.max_concurrency = max_concurrency
        self.retry_delay = retry_delay
        #: Requests put back for lack of capacity (a statistic for the demo).
        self.deferred = 0
        # Guards deferred.
        self._lock = threading.Lock()

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(CREATE, self.on_create)
        bus.subscribe(START, self.on_start)
        bus.subscribe(STOP, self.on_stop)
        bus.subscribe(DELETE, self.on_delete)

    def acquire_capacity_and_transition(self, cid: int, waiting: str, busy: str) -> bool:
        """``waiting`` → ``busy`` if fewer than max_concurrency containers are active.

        False: no capacity (the container stays ``waiting``); True also when
        the container already moved on (a redelivered request).
        """
        app = self.app
        conn = app.thread_conn()
        with app.transaction(conn):
            if app.pg:  # serialize the count-then-update across processes
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (CAPACITY_LOCK,))
            status = conn.execute(
                app.sql("SELECT status FROM container_instance WHERE id = ?"), (cid,)
            ).fetchone()[0]
            if status != waiting:
                return True
            marks = ", ".join("?" for _ in ACTIVE)
            (active,) = conn.execute(
                app.sql(f"SELECT count(*) FROM container_instance WHERE status IN ({marks})"),
                ACTIVE,
            ).fetchone()
            if active >= self.max_concurrency:
                return False
            app._set_status(conn, cid, waiting, busy)
        return True

    def _finish(self, cid: int, busy: str) -> None:
        app = self.app
        conn = app.thread_conn()
        with app.transaction(conn):
            row = conn.execute(
                app.sql("SELECT status FROM container_instance WHERE id = ?"), (cid,)
            ).fetchone()
            if row[0] == busy:
                # The actual container runtime call goes here.
                app._set_status(conn, cid, busy, "running")

    def _capacity_short(self) -> None:
        with self._lock:
            self.deferred += 1
        raise Defer(self.retry_delay)

    def on_create(self, message: OutboxMessage) -> None:
        cid = int(message.payload["id"])
        if not self.acquire_capacity_and_transition(cid, "pending", "creating"):
            self._capacity_short()
        self._finish(cid, "creating")

    def on_start(self, message: OutboxMessage) -> None:
        cid = int(message.payload["id"])
        if not self.acquire_capacity_and_transition(cid, "start_pending", "starting"):
            self._capacity_short()
        self._finish(cid, "starting")

    def _move(self, cid: int, new: str) -> None:
        app = self.app
        conn = app.thread_conn()
        with app.transaction(conn):
            row = conn.execute(
                app.sql("SELECT status FROM container_instance WHERE id = ?"), (cid,)
            ).fetchone()
            if row[0] != new:
                app._set_status(conn, cid, row[0], new)

    def on_stop(self, message: OutboxMessage) -> None:
        self._move(int(message.payload["id"]), "stopped")

    def on_delete(self, message: OutboxMessage) -> None:
        self._move(int(message.payload["id"]), "deleted")
