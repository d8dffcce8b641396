"""The SQLite outbox store: :class:`SQLiteStore` (stdlib ``sqlite3``, the default).

One database file, WAL journal, a busy timeout. SQLite runs one write
transaction at a time, which this store relies on: ``enqueue`` counts and
inserts in one statement, which holds the write lock from its start, so
``max_pending`` holds for any number of processes; and a relay's claim,
capacity slots and completions each run in a ``BEGIN IMMEDIATE``
transaction.

Schema (``{t}`` is the table name; created by :meth:`SQLiteStore.create_schema`)::

    {t}         the rows; see the SQL below and outbound.outbox._base for the model
    {t}_slots   one row per capacity slot (max_concurrency): owner and expiry

Times are Unix seconds (``REAL``) from the writing process's clock.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from typing import Any

from outbound.errors import DuplicateMessage, OutboxFull, StoreError

from ._base import (
    Claimed,
    Ordering,
    OutboxMessage,
    OutboxStatus,
    Outcome,
    RowInfo,
    Session,
    Store,
    check_list_status,
    check_max_pending,
    check_ordering,
    check_positive_int,
    check_purge_statuses,
    check_row,
    check_seconds,
    check_table,
)

__all__ = ["SQLiteStore", "immediate"]


class _SQL:
    """Every statement of the SQLite store. ``{t}`` is the table name."""

    schema = (
        """
        CREATE TABLE IF NOT EXISTS {t} (
            id               INTEGER PRIMARY KEY,
            key              TEXT    NOT NULL,
            type             TEXT    NOT NULL,
            payload          TEXT    NOT NULL,           -- JSON
            dedupe_key       TEXT,
            status           TEXT    NOT NULL DEFAULT 'pending'
                             CHECK (status IN ('pending', 'processing', 'sent', 'dead')),
            head             INTEGER NOT NULL DEFAULT 0, -- 1: the claimable row of its key
            seq              INTEGER NOT NULL,           -- order within the key
            attempts         INTEGER NOT NULL DEFAULT 0,
            claims           INTEGER NOT NULL DEFAULT 0, -- fencing token
            available_at     REAL    NOT NULL,
            lease_owner      TEXT,
            lease_expires_at REAL,
            last_error       TEXT,
            created_at       REAL    NOT NULL,
            updated_at       REAL    NOT NULL
        )
        """,
        # The claim: due heads, oldest first.
        """
        CREATE INDEX IF NOT EXISTS {t}_ready ON {t} (available_at, id)
            WHERE head = 1 AND status = 'pending'
        """,
        # The claim: expired leases.
        """
        CREATE INDEX IF NOT EXISTS {t}_lease ON {t} (lease_expires_at)
            WHERE status = 'processing'
        """,
        # At most one head per key; "has this key a head?" for enqueue.
        """
        CREATE UNIQUE INDEX IF NOT EXISTS {t}_head ON {t} (key)
            WHERE head = 1 AND status IN ('pending', 'processing')
        """,
        # The next row of a key, when its head finishes.
        """
        CREATE INDEX IF NOT EXISTS {t}_waiting ON {t} (key, seq)
            WHERE head = 0 AND status = 'pending'
        """,
        """
        CREATE UNIQUE INDEX IF NOT EXISTS {t}_dedupe ON {t} (dedupe_key)
            WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
        """,
        # max_pending, the command line's counts, oldest pending, purge.
        """
        CREATE INDEX IF NOT EXISTS {t}_status ON {t} (status, created_at)
        """,
        """
        CREATE TABLE IF NOT EXISTS {t}_slots (
            slot       INTEGER PRIMARY KEY,
            owner      TEXT,
            expires_at REAL
        )
        """,
    )

    insert_head = """
        NOT EXISTS (SELECT 1 FROM {t}
                    WHERE key = :key AND head = 1 AND status IN ('pending', 'processing'))
    """

    enqueue = (
        """
        INSERT INTO {t} (key, type, payload, dedupe_key, head, seq,
                         available_at, created_at, updated_at)
        SELECT :key, :type, :payload, :dedupe_key, """
        + insert_head
        + """,
               coalesce((SELECT max(id) FROM {t}), 0) + 1,
               :now + :delay, :now, :now
        WHERE {limit}
        ON CONFLICT (dedupe_key)
            WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
            DO NOTHING
        RETURNING id
        """
    )

    pending_below_limit = """
        (SELECT count(*) FROM (SELECT 1 FROM {t}
                               WHERE status IN ('pending', 'processing') LIMIT :max_pending))
        < :max_pending
    """

    duplicate = """
        SELECT 1 FROM {t}
        WHERE dedupe_key = :dedupe_key AND status IN ('pending', 'processing')
    """

    ensure_slot = "INSERT OR IGNORE INTO {t}_slots (slot) VALUES (?)"

    take_slots = """
        UPDATE {t}_slots SET owner = :owner, expires_at = :now + :lease
        WHERE slot IN (SELECT slot FROM {t}_slots
                       WHERE slot <= :max AND (owner IS NULL OR expires_at < :now)
                       ORDER BY slot LIMIT :limit)
        RETURNING slot
    """

    free_slot = """
        UPDATE {t}_slots SET owner = NULL, expires_at = NULL
        WHERE slot = :slot AND owner = :owner
    """

    free_owner_slots = """
        UPDATE {t}_slots SET owner = NULL, expires_at = NULL WHERE owner = :owner
    """

    claim = """
        UPDATE {t}
        SET status = 'processing', lease_owner = :owner, lease_expires_at = :now + :lease,
            attempts = attempts + 1, claims = claims + 1, updated_at = :now
        WHERE id IN (
            SELECT id FROM (SELECT id FROM {t}
                            WHERE status = 'processing' AND lease_expires_at < :now
                            ORDER BY lease_expires_at LIMIT :limit)
            UNION ALL
            SELECT id FROM (SELECT id FROM {t}
                            WHERE head = 1 AND status = 'pending' AND available_at <= :now
                            ORDER BY available_at, id LIMIT :limit)
            LIMIT :limit)
        RETURNING id, key, type, payload, dedupe_key, attempts, claims, created_at
    """

    fence = "id = :id AND claims = :claims AND lease_owner = :owner AND status = 'processing'"

    finish = (
        """
        UPDATE {t}
        SET status = :status, last_error = :error,
            lease_owner = NULL, lease_expires_at = NULL, updated_at = :now
        WHERE """
        + fence
    )

    retry_strict = (
        """
        UPDATE {t}
        SET status = 'pending', available_at = :now + :delay,
            attempts = attempts - :refund, last_error = coalesce(:error, last_error),
            lease_owner = NULL, lease_expires_at = NULL, updated_at = :now
        WHERE """
        + fence
    )

    # "mutex" ordering: the failed row gives up its key and goes to the back.
    retry_to_back = (
        """
        UPDATE {t}
        SET status = 'pending', available_at = :now + :delay,
            attempts = attempts - :refund, last_error = coalesce(:error, last_error),
            head = 0, seq = (SELECT max(id) FROM {t}) + 1,
            lease_owner = NULL, lease_expires_at = NULL, updated_at = :now
        WHERE """
        + fence
    )

    promote = """
        UPDATE {t} SET head = 1
        WHERE id = (SELECT id FROM {t}
                    WHERE key = :key AND head = 0 AND status = 'pending'
                    ORDER BY seq, id LIMIT 1)
    """

    renew = """
        UPDATE {t} SET lease_expires_at = :now + :lease
        WHERE lease_owner = :owner AND status = 'processing'
    """

    renew_slots = "UPDATE {t}_slots SET expires_at = :now + :lease WHERE owner = :owner"

    counts = "SELECT status, count(*) FROM {t} GROUP BY status"

    oldest_pending = "SELECT min(created_at) FROM {t} WHERE status = 'pending'"

    rows = """
        SELECT id, key, type, status, attempts, created_at, last_error FROM {t}
        {where} ORDER BY id DESC LIMIT :limit
    """

    dead_ids = "SELECT id FROM {t} WHERE status = 'dead' ORDER BY id"

    revive = (
        """
        UPDATE {t}
        SET status = 'pending', attempts = 0, available_at = :now, updated_at = :now,
            head = """
        + insert_head
        + """,
            seq = (SELECT max(id) FROM {t}) + 1
        WHERE id = :id AND status = 'dead'
          AND (dedupe_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM {t} AS u
                WHERE u.dedupe_key = {t}.dedupe_key AND u.status IN ('pending', 'processing')))
        """
    )

    purge = "DELETE FROM {t} WHERE status IN ({marks}) AND updated_at < :before"


def _sql(text: str, table: str, **parts: str) -> str:
    return text.replace("{t}", table).format(**parts) if parts else text.replace("{t}", table)


@contextlib.contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """Run the block in a ``BEGIN IMMEDIATE`` transaction on ``conn``: commit, or roll back.

    The write lock is taken at the start (waiting up to the busy timeout),
    so reads inside the block see the latest data and the block's writes
    cannot fail with a stale snapshot. ``conn`` must not be inside a
    transaction already. Blocks while another connection writes.
    """
    if conn.in_transaction:
        raise RuntimeError("immediate(): the connection is already inside a transaction")
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.rollback()  # a no-op if SQLite already rolled back
        raise
    else:
        conn.commit()


def _connect(path: str, busy_timeout: float, *, autocommit: bool) -> sqlite3.Connection:
    conn = sqlite3.connect(
        path,
        timeout=busy_timeout,
        isolation_level=None if autocommit else "DEFERRED",
        check_same_thread=False,
    )
    conn.execute("PRAGMA journal_mode = WAL")
    return conn


class SQLiteStore(Store):
    """An outbox in one SQLite database file: the default store.

    - ``path``: the database file (``os.PathLike`` accepted). Processes that
      share the file share the outbox (local disks only, as SQLite says).
    - ``table``: the table name (a lowercase identifier); several outboxes
      may live in one file.
    - ``max_pending``: ``enqueue`` refuses with
      :class:`~outbound.errors.OutboxFull` once this many rows are
      unfinished (pending or processing); ``None``: no limit.
    - ``max_payload_bytes``: the largest JSON payload accepted.
    - ``ordering``: ``"strict"`` (default) or ``"mutex"``; see
      :data:`~outbound.outbox.Ordering`.
    - ``busy_timeout``: seconds a connection waits for the write lock.

    Thread-safe; the methods that are not ``enqueue`` open a connection of
    their own and block on the database.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        table: str = "outbox",
        max_pending: int | None = None,
        max_payload_bytes: int = 256 * 1024,
        ordering: Ordering = "strict",
        busy_timeout: float = 10.0,
        create: bool = True,
    ) -> None:
        path = os.fspath(path)
        if not isinstance(path, str) or not path or path == ":memory:" or path.startswith("file:"):
            raise ValueError(
                f"path must name a database file shared by the processes, not {path!r}"
            )
        self.path = path
        self.table = check_table(table)
        self.max_pending = check_max_pending(max_pending)
        self.max_payload_bytes = check_positive_int("max_payload_bytes", max_payload_bytes)
        self.ordering = check_ordering(ordering)
        self.busy_timeout = check_seconds("busy_timeout", busy_timeout)
        t = self.table
        limit = _SQL.pending_below_limit if self.max_pending is not None else "1"
        self._enqueue_sql = _sql(_SQL.enqueue, t, limit=limit.replace("{t}", t))
        self._duplicate_sql = _sql(_SQL.duplicate, t)
        if create:
            self.create_schema()

    def __repr__(self) -> str:
        return f"<SQLiteStore path={self.path!r} table={self.table!r}>"

    def connect(self) -> sqlite3.Connection:
        """A new connection to the database for the application: WAL, busy timeout.

        Python's default transaction handling (a deferred ``BEGIN`` before
        the first write); use :func:`immediate` for a transaction that
        reads then writes. Never shared by the store.
        """
        return _connect(self.path, self.busy_timeout, autocommit=False)

    def create_schema(self) -> None:
        """Create the table, its indexes and the slot table if missing. Idempotent."""
        try:
            conn = _connect(self.path, self.busy_timeout, autocommit=True)
            try:
                with immediate(conn):
                    for statement in _SQL.schema:
                        conn.execute(_sql(statement, self.table))
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot create the outbox schema in {self.path!r}: {exc}") from exc

    def enqueue(
        self,
        conn: Any,
        *,
        key: str | int,
        type: str,
        payload: Any,
        dedupe_key: str | None = None,
        delay: float | _dt.timedelta | None = None,
    ) -> int:
        """Write one pending row on ``conn`` inside its transaction; return the row's id.

        ``conn`` is the application's ``sqlite3.Connection`` to this file;
        the row commits or rolls back with the application's transaction
        (with Python's default transaction handling the ``INSERT`` opens
        one). Every argument is checked before anything is written:
        ``TypeError``/``ValueError`` for a bad key, type, dedupe key,
        delay, a NUL character in any of them or in the payload (refused
        on every store, as PostgreSQL cannot store it), or a payload that
        is not JSON-serializable or is over ``max_payload_bytes``. Raises
        :class:`~outbound.errors.OutboxFull` when ``max_pending`` rows are
        unfinished,
        :class:`~outbound.errors.DuplicateMessage` when an unfinished row
        has ``dedupe_key``, :class:`~outbound.errors.StoreError` when the
        database fails; in each case nothing was written.

        The count and the insert are one statement, run under SQLite's
        write lock, so the limit holds across processes. Blocks up to the
        busy timeout while another connection writes. ``delay`` seconds
        postpone the row; in ``"strict"`` ordering they also hold back the
        rows of its key enqueued after it.
        """
        row = check_row(key, type, payload, dedupe_key, delay, self.max_payload_bytes)
        if not isinstance(conn, sqlite3.Connection):
            raise TypeError(f"conn must be a sqlite3.Connection, not {conn.__class__.__name__}")
        params = {
            "key": row.key,
            "type": row.type,
            "payload": row.payload,
            "dedupe_key": row.dedupe_key,
            "delay": row.delay,
            "now": time.time(),
            "max_pending": self.max_pending,
        }
        try:
            found = conn.execute(self._enqueue_sql, params).fetchone()
            if found is not None:
                return int(found[0])
            duplicate = row.dedupe_key is not None and (
                conn.execute(self._duplicate_sql, params).fetchone() is not None
            )
        except sqlite3.Error as exc:
            raise StoreError(f"enqueue failed: {exc}") from exc
        if duplicate:
            raise DuplicateMessage(
                f"an unfinished outbox row already has dedupe_key {row.dedupe_key!r}"
            )
        raise OutboxFull(f"the outbox {self.table!r} already holds {self.max_pending} pending rows")

    def session(self) -> _SQLiteSession:
        """Open a relay :class:`Session` (its own connection)."""
        try:
            conn = _connect(self.path, self.busy_timeout, autocommit=True)
            conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self.path!r}: {exc}") from exc
        return _SQLiteSession(self, conn)

    @contextlib.contextmanager
    def _admin(self) -> Iterator[sqlite3.Connection]:
        try:
            conn = _connect(self.path, self.busy_timeout, autocommit=True)
            try:
                yield conn
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StoreError(f"outbox database error: {exc}") from exc

    def status(self) -> OutboxStatus:
        """Counts by status and the age of the oldest pending row. Blocks on the database."""
        with self._admin() as conn:
            counts = dict.fromkeys(("pending", "processing", "sent", "dead"), 0)
            for status, count in conn.execute(_sql(_SQL.counts, self.table)):
                counts[str(status)] = int(count)
            (oldest,) = conn.execute(_sql(_SQL.oldest_pending, self.table)).fetchone()
        age = None if oldest is None else max(0.0, time.time() - float(oldest))
        return OutboxStatus(counts, age)

    def rows(self, *, status: str | None = None, limit: int = 50) -> list[RowInfo]:
        """Up to ``limit`` rows of ``status`` (or all), newest first."""
        check_list_status(status)
        check_positive_int("limit", limit)
        where = "" if status is None else "WHERE status = :status"
        with self._admin() as conn:
            found = conn.execute(
                _sql(_SQL.rows, self.table, where=where), {"status": status, "limit": limit}
            ).fetchall()
        return [RowInfo(int(r[0]), r[1], r[2], r[3], int(r[4]), float(r[5]), r[6]) for r in found]

    def retry_dead(self, ids: Sequence[int] | None = None) -> int:
        """Make dead rows pending again (attempts reset), each at the back of its key.

        A row whose dedupe key an unfinished row now holds is left dead.
        Returns how many rows were revived.
        """
        revive = _sql(_SQL.revive, self.table)
        with self._admin() as conn, immediate(conn):
            if ids is None:
                targets = [int(r[0]) for r in conn.execute(_sql(_SQL.dead_ids, self.table))]
            else:
                targets = sorted(int(i) for i in ids)
            done = 0
            now = time.time()
            for row_id in targets:
                key = conn.execute(
                    f"SELECT key FROM {self.table} WHERE id = ?", (row_id,)
                ).fetchone()
                if key is None:
                    continue
                cur = conn.execute(revive, {"id": row_id, "key": key[0], "now": now})
                done += cur.rowcount
        return done

    def purge(self, *, statuses: Sequence[str] = ("sent",), older_than: float = 0.0) -> int:
        """Delete rows of ``statuses`` (finished only) not updated for ``older_than`` seconds."""
        wanted = check_purge_statuses(statuses)
        older_than = check_seconds("older_than", older_than, zero=True)
        if not wanted:
            return 0
        marks = ", ".join("?" for _ in wanted)
        sql = _sql(_SQL.purge, self.table, marks=marks).replace(":before", "?")
        with self._admin() as conn, immediate(conn):
            cur = conn.execute(sql, [*wanted, time.time() - older_than])
            return cur.rowcount

    def close(self) -> None:
        """Nothing to release: the store keeps no connection open. Idempotent."""


class _SQLiteSession(Session):
    """A relay's connection to the file. Confined to one thread at a time."""

    def __init__(self, store: SQLiteStore, conn: sqlite3.Connection) -> None:
        self._store = store
        self._conn = conn
        t = store.table
        self._sql = {
            name: _sql(getattr(_SQL, name), t)
            for name in (
                "ensure_slot",
                "take_slots",
                "free_slot",
                "free_owner_slots",
                "claim",
                "finish",
                "retry_strict",
                "retry_to_back",
                "promote",
                "renew",
                "renew_slots",
            )
        }

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        try:
            with immediate(self._conn) as conn:
                yield conn
        except sqlite3.Error as exc:
            raise StoreError(f"outbox database error: {exc}") from exc

    def ensure_slots(self, count: int) -> None:
        with self._write() as conn:
            conn.executemany(self._sql["ensure_slot"], [(i,) for i in range(1, count + 1)])

    def claim(
        self, owner: str, limit: int, lease: float, max_concurrency: int | None
    ) -> list[Claimed]:
        with self._write() as conn:
            now = time.time()
            slots: list[int] = []
            if max_concurrency is not None:
                slots = [
                    int(r[0])
                    for r in conn.execute(
                        self._sql["take_slots"],
                        {
                            "owner": owner,
                            "now": now,
                            "lease": lease,
                            "max": max_concurrency,
                            "limit": limit,
                        },
                    )
                ]
                slots.sort()
                limit = len(slots)
                if not limit:
                    return []
            found = conn.execute(
                self._sql["claim"], {"owner": owner, "now": now, "lease": lease, "limit": limit}
            ).fetchall()
            for slot in slots[len(found) :]:
                conn.execute(self._sql["free_slot"], {"slot": slot, "owner": owner})
        found.sort(key=lambda r: r[0])
        claimed = []
        for i, (row_id, key, type_, payload, dedupe_key, attempts, claims, created) in enumerate(
            found
        ):
            message = OutboxMessage(
                int(row_id), key, type_, json.loads(payload), int(attempts), dedupe_key, created
            )
            claimed.append(Claimed(message, int(claims), slots[i] if slots else None))
        return claimed

    def finish(self, owner: str, outcomes: Sequence[Outcome]) -> int:
        mutex = self._store.ordering == "mutex"
        sql = self._sql
        updated = 0
        with self._write() as conn:
            now = time.time()
            for o in outcomes:
                params = {
                    "id": o.id,
                    "claims": o.claims,
                    "owner": owner,
                    "now": now,
                    "error": o.error,
                    "key": o.key,
                }
                if o.kind in ("sent", "dead"):
                    params["status"] = o.kind
                    promote = conn.execute(sql["finish"], params).rowcount > 0
                else:
                    params["delay"] = o.delay
                    params["refund"] = 1 if o.kind == "requeue" else 0
                    to_back = mutex and o.kind == "retry"
                    statement = sql["retry_to_back"] if to_back else sql["retry_strict"]
                    changed = conn.execute(statement, params).rowcount > 0
                    promote = to_back and changed
                    updated += changed
                if o.kind in ("sent", "dead"):
                    updated += promote
                if promote:
                    conn.execute(sql["promote"], params)
                if o.slot is not None:
                    conn.execute(sql["free_slot"], {"slot": o.slot, "owner": owner})
        return updated

    def renew(self, owner: str, lease: float) -> None:
        params = {"owner": owner, "now": time.time(), "lease": lease}
        with self._write() as conn:
            conn.execute(self._sql["renew"], params)
            conn.execute(self._sql["renew_slots"], params)

    def release_slots(self, owner: str) -> None:
        with self._write() as conn:
            conn.execute(self._sql["free_owner_slots"], {"owner": owner})

    def close(self) -> None:
        self._conn.close()
