"""The SQLite outbox store: :class:`SQLiteStore` (stdlib ``sqlite3``, the default).

One database file, WAL journal, a busy timeout. SQLite runs one write
transaction at a time, which this store relies on: ``enqueue`` checks
``max_pending`` and inserts in one statement, which holds the write lock
from its start, so the limit holds for any number of processes; and a
relay's claim, outcomes and renewals each run in one ``BEGIN IMMEDIATE``
transaction. A process stopped inside a write transaction therefore holds
every writer back (up to their busy timeout): the relay's transactions are
single, short steps, never open across a handler.

Schema version 3, on SQLite the same as 2 (``{t}`` is the table name; made
or migrated by :meth:`SQLiteStore.create_schema`)::

    {t}          the rows; ids never reused (AUTOINCREMENT)
    {t}_slots    one row per capacity slot (max_concurrency): owner and expiry
    {t}_counts   the number of unfinished rows, kept by triggers on {t}
    {t}_schema   the schema versions applied

Times are Unix seconds (``REAL``) from the writing process's clock.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import secrets
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from outbound.errors import DuplicateMessage, OutboxFull, StoreError

from ._base import (
    CLAIM_AHEAD,
    SCHEMA_COLUMNS,
    SCHEMA_VERSION,
    V1_COLUMNS,
    Claimed,
    Db,
    Finished,
    NewRow,
    Ordering,
    OutboxMessage,
    Outcome,
    Session,
    Store,
    batch_duplicate,
    check_max_pending,
    check_messages,
    check_ordering,
    check_positive_int,
    check_row,
    check_seconds,
    check_table,
    decode_payload,
    not_an_outbox,
)

__all__ = ["SQLiteStore", "immediate"]

_UNFINISHED = "('pending', 'processing')"


class _SQL:
    """Every statement of the SQLite store. ``{t}`` is the table name."""

    # ------------------------------------------------------------ schema v2

    schema = (
        """
        CREATE TABLE {t} (
            id               INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused once committed
            key              TEXT    NOT NULL,
            type             TEXT    NOT NULL,
            payload          TEXT    NOT NULL,           -- JSON
            dedupe_key       TEXT,
            status           TEXT    NOT NULL DEFAULT 'pending'
                             CHECK (status IN ('pending', 'processing', 'sent', 'dead',
                                               'cancelled')),
            head             INTEGER NOT NULL DEFAULT 0, -- 1: the claimable row of its key
            seq              INTEGER,                    -- place in the key's line; NULL: id
            attempts         INTEGER NOT NULL DEFAULT 0,
            available_at     REAL    NOT NULL,
            lease_owner      TEXT,
            lease_token      INTEGER,                    -- fencing token of the claim
            lease_expires_at REAL,
            last_error       TEXT,
            created_at       REAL    NOT NULL,
            updated_at       REAL    NOT NULL
        )
        """,
        """
        CREATE TABLE {t}_slots (
            slot       INTEGER PRIMARY KEY,
            owner      TEXT,
            expires_at REAL
        )
        """,
        """
        CREATE TABLE {t}_counts (
            one        INTEGER PRIMARY KEY CHECK (one = 1),
            unfinished INTEGER NOT NULL
        )
        """,
        "INSERT INTO {t}_counts VALUES (1, 0)",
        "CREATE TABLE {t}_schema (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)",
    )

    indexes = (
        # The claim: due heads, oldest first.
        """
        CREATE INDEX {t}_ready ON {t} (available_at, id)
            WHERE head = 1 AND status = 'pending'
        """,
        # The claim: expired leases; renewals; leases by owner.
        "CREATE INDEX {t}_lease ON {t} (lease_expires_at) WHERE status = 'processing'",
        # At most one head per key; "has this key a head?" for enqueue.
        """
        CREATE UNIQUE INDEX {t}_head ON {t} (key)
            WHERE head = 1 AND status IN ('pending', 'processing')
        """,
        # The next row of a key, when its head finishes.
        """
        CREATE INDEX {t}_waiting ON {t} (key, coalesce(seq, id))
            WHERE head = 0 AND status = 'pending'
        """,
        """
        CREATE UNIQUE INDEX {t}_dedupe ON {t} (dedupe_key)
            WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
        """,
        # Counts, the oldest pending row, purge, listings by status.
        "CREATE INDEX {t}_state ON {t} (status, created_at)",
    )

    # The unfinished counter follows every change of a row's status.
    triggers = (
        """
        CREATE TRIGGER {t}_count_insert AFTER INSERT ON {t}
        WHEN NEW.status IN ('pending', 'processing')
        BEGIN UPDATE {t}_counts SET unfinished = unfinished + 1; END
        """,
        """
        CREATE TRIGGER {t}_count_update AFTER UPDATE OF status ON {t}
        WHEN (OLD.status IN ('pending', 'processing')) <> (NEW.status IN ('pending', 'processing'))
        BEGIN
            UPDATE {t}_counts
            SET unfinished = unfinished + (NEW.status IN ('pending', 'processing'))
                                        - (OLD.status IN ('pending', 'processing'));
        END
        """,
        """
        CREATE TRIGGER {t}_count_delete AFTER DELETE ON {t}
        WHEN OLD.status IN ('pending', 'processing')
        BEGIN UPDATE {t}_counts SET unfinished = unfinished - 1; END
        """,
    )

    record_version = "INSERT INTO {t}_schema VALUES (?, ?)"

    # Is it there, and at which version? (No {t}: None; {t} without
    # {t}_schema: version 1, the first released schema.)
    tables = "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN (?, ?, ?)"
    version = "SELECT max(version) FROM {t}_schema"

    # -------------------------------------------------- migration 1 -> 2
    # Version 1 reused ids after a purge (INTEGER PRIMARY KEY), fenced with
    # a claim counter, counted unfinished rows by scanning, and had no
    # 'cancelled' status. The table is rebuilt: ids kept, seq kept.
    v1_indexes = ("ready", "lease", "head", "waiting", "dedupe", "status")
    migrate_1_copy = """
        INSERT INTO {t} (id, key, type, payload, dedupe_key, status, head, seq, attempts,
                         available_at, lease_owner, lease_token, lease_expires_at,
                         last_error, created_at, updated_at)
        SELECT id, key, type, payload, dedupe_key, status, head, seq, attempts,
               available_at, lease_owner, NULL, lease_expires_at,
               last_error, created_at, updated_at
        FROM {t}_v1
    """
    recount = (
        "UPDATE {t}_counts SET unfinished = "
        "(SELECT count(*) FROM {t} WHERE status IN ('pending', 'processing'))"
    )

    # --------------------------------------------------------------- enqueue

    enqueue = """
        INSERT INTO {t} (key, type, payload, dedupe_key, head,
                         available_at, created_at, updated_at)
        SELECT :key, :type, :payload, :dedupe_key,
               NOT EXISTS (SELECT 1 FROM {t}
                           WHERE key = :key AND head = 1 AND status IN ('pending', 'processing')),
               :now + :delay, :now, :now
        WHERE (SELECT unfinished FROM {t}_counts) < :max_pending
        ON CONFLICT (dedupe_key)
            WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
            DO NOTHING
        RETURNING id
    """

    # Many rows: [[key, type, payload, dedupe_key, delay, first], ...] as
    # JSON, ``first`` true for the first row of its key in the batch: it
    # becomes its key's head if the key has none. The table is read before
    # any row is inserted (SQLite runs an INSERT's SELECT over its own table
    # to completion first), and rows are inserted in the batch's order (the
    # order json_each yields them in; the tests hold it).
    enqueue_many = """
        INSERT INTO {t} (key, type, payload, dedupe_key, head,
                         available_at, created_at, updated_at)
        SELECT json_extract(j.value, '$[0]'), json_extract(j.value, '$[1]'),
               json_extract(j.value, '$[2]'), json_extract(j.value, '$[3]'),
               json_extract(j.value, '$[5]') AND NOT EXISTS (
                   SELECT 1 FROM {t} AS h
                   WHERE h.key = json_extract(j.value, '$[0]') AND h.head = 1
                     AND h.status IN ('pending', 'processing')),
               :now + json_extract(j.value, '$[4]'), :now, :now
        FROM json_each(:rows) AS j
        WHERE (SELECT unfinished FROM {t}_counts) + :n <= :max_pending
          AND {no_duplicate}
        RETURNING id
    """

    # Is one of these dedupe keys (a JSON array) held by an unfinished row?
    # (The planner would rather walk {t}_state, every pending row.)
    # ({shown}: what it returns. Not the key's text: the application's connection
    # reads text through its own text_factory, which may not read it back.)
    duplicate_any = """
        SELECT {shown} FROM {t} AS u INDEXED BY {t}_dedupe
        WHERE u.dedupe_key IN (SELECT value FROM json_each(:keys))
          AND u.dedupe_key IS NOT NULL AND u.status IN ('pending', 'processing')
        LIMIT 1
    """

    # ---------------------------------------------------------------- relays

    ensure_slot = "INSERT OR IGNORE INTO {t}_slots (slot) VALUES (?)"

    take_slots = """
        UPDATE {t}_slots SET owner = :owner, expires_at = :now + :lease
        WHERE slot IN (SELECT slot FROM {t}_slots
                       WHERE slot <= :max AND (owner IS NULL OR expires_at < :now)
                         AND slot NOT IN (SELECT value FROM json_each(:held_slots))
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
        SET status = 'processing', lease_owner = :owner, lease_token = :token,
            lease_expires_at = :now + :lease, attempts = attempts + 1, updated_at = :now
        WHERE id IN (
            SELECT id FROM (SELECT id FROM {t}
                            WHERE status = 'processing' AND lease_expires_at < :now
                              AND key NOT IN (SELECT value FROM json_each(:held))
                            ORDER BY lease_expires_at LIMIT :limit)
            UNION ALL
            SELECT id FROM (SELECT id FROM {t}
                            WHERE id IN (SELECT value FROM json_each(:first))
                              -- by id ("+": no index on these for the planner)
                              AND +head = 1 AND +status = 'pending'
                              AND +available_at <= :now + :ahead
                              AND key NOT IN (SELECT value FROM json_each(:skip))
                            ORDER BY available_at, id LIMIT :limit)
            UNION ALL
            -- (The planner would rather walk {t}_state: every pending row.)
            SELECT id FROM (SELECT id FROM {t} INDEXED BY {t}_ready
                            WHERE head = 1 AND status = 'pending' AND available_at <= :now
                              AND key NOT IN (SELECT value FROM json_each(:skip))
                              AND id NOT IN (SELECT value FROM json_each(:first))
                            ORDER BY available_at, id LIMIT :limit)
            LIMIT :limit)
        RETURNING id, key, type, payload, dedupe_key, attempts, created_at, available_at - :now
    """

    fence = "id = :id AND lease_token = :token AND lease_owner = :owner AND status = 'processing'"

    finish = (
        """
        UPDATE {t}
        SET status = :status, last_error = :error, lease_owner = NULL, lease_token = NULL,
            lease_expires_at = NULL, updated_at = :now
        WHERE """
        + fence
    )

    retry_strict = (
        """
        UPDATE {t}
        SET status = 'pending', available_at = :now + :delay,
            attempts = attempts - :refund, last_error = coalesce(:error, last_error),
            lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = :now
        WHERE """
        + fence
    )

    # The next place at the back of every line: an id taken from the
    # table's AUTOINCREMENT sequence, so no later row gets it.
    next_seq = "UPDATE sqlite_sequence SET seq = seq + 1 WHERE name = '{t}' RETURNING seq"

    # "mutex" ordering: the failed row gives up its key and goes to the back.
    retry_to_back = (
        """
        UPDATE {t}
        SET status = 'pending', available_at = :now + :delay,
            attempts = attempts - :refund, last_error = coalesce(:error, last_error),
            head = 0, seq = :seq,
            lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = :now
        WHERE """
        + fence
    )

    promote = """
        UPDATE {t} SET head = 1
        WHERE id = (SELECT id FROM {t}
                    WHERE key = :key AND head = 0 AND status = 'pending'
                    ORDER BY coalesce(seq, id), id LIMIT 1)
    """

    renew = "UPDATE {t} SET lease_expires_at = :now + :lease WHERE " + fence.replace(":owner", ":o")

    renew_slot = "UPDATE {t}_slots SET expires_at = :now + :lease WHERE slot = :slot AND owner = :o"

    reconcile = """
        UPDATE {t} SET lease_expires_at = :now
        WHERE status = 'processing' AND lease_owner = :owner
          AND id || ':' || lease_token NOT IN (SELECT value FROM json_each(:held))
    """

    reconcile_slots = """
        UPDATE {t}_slots SET owner = NULL, expires_at = NULL
        WHERE owner = :owner AND slot NOT IN (SELECT value FROM json_each(:slots))
    """

    # ------------------------------------------------------------- operators

    row_columns = """
        id, key, type, status, attempts, created_at, last_error, updated_at, available_at,
        head = 1 AND status IN ('pending', 'processing'), dedupe_key, lease_owner, lease_expires_at
    """

    admin: ClassVar[Mapping[str, str | tuple[str, ...]]] = {
        "counts": "SELECT status, count(*) FROM {t} GROUP BY status",
        "oldest_pending": "SELECT :now - min(created_at) FROM {t} WHERE status = 'pending'",
        "unfinished": "SELECT unfinished FROM {t}_counts",
        "rows": """
            SELECT {cols} FROM {t}
            WHERE (:status IS NULL OR status = :status) AND (:key IS NULL OR key = :key)
            ORDER BY id DESC LIMIT :limit
        """,
        "row": "SELECT {cols} FROM {t} WHERE id = :id",
        "blocked": """
            SELECT {cols}, key, (SELECT count(*) FROM {t} AS w
                                 WHERE w.key = h.key AND w.head = 0 AND w.status = 'pending')
                                AS waiting
            FROM {t} AS h
            WHERE h.head = 1 AND h.status IN ('pending', 'processing')
              AND (h.status = 'processing' OR h.available_at > :now)
              AND (h.last_error IS NOT NULL
                   OR EXISTS (SELECT 1 FROM {t} AS w
                              WHERE w.key = h.key AND w.head = 0 AND w.status = 'pending'))
            ORDER BY h.created_at, h.id LIMIT :limit
        """,
        "leases": """
            SELECT lease_owner, count(*), min(lease_expires_at) FROM {t}
            WHERE status = 'processing' GROUP BY lease_owner
        """,
        "slot_owners": """
            SELECT owner, count(*) FROM {t}_slots
            WHERE owner IS NOT NULL AND expires_at >= :now GROUP BY owner
        """,
        # The lease each relay set last: it moves forward at every claim and renewal.
        "lease_ends": """
            SELECT lease_owner, max(lease_expires_at) FROM {t}
            WHERE status = 'processing' GROUP BY lease_owner
        """,
        # Times come from the processes' clocks: "now" is this one's.
        "clock": "SELECT :now",
        # Rows marked sent per bucket of :bucket seconds from :start (a
        # sent row's updated_at is when it was marked sent).
        "sent_since": """
            SELECT CAST((updated_at - :start) / :bucket AS INTEGER), count(*) FROM {t}
            WHERE status = 'sent' AND updated_at >= :start AND updated_at < :end
            GROUP BY 1
        """,
        "slots": """
            SELECT slot, CASE WHEN expires_at >= :now THEN owner END,
                   CASE WHEN expires_at >= :now THEN expires_at END
            FROM {t}_slots ORDER BY slot
        """,
        "dead_ids": "SELECT id FROM {t} WHERE status = 'dead' ORDER BY id",
        "row_state": "SELECT key, status, head, dedupe_key FROM {t} WHERE id = :id",
        # SQLite runs one writer at a time: the admin's transaction holds
        # the write lock, so "locking" is reading.
        "lock_head": """
            SELECT id FROM {t} WHERE key = :key AND head = 1 AND status IN ('pending', 'processing')
        """,
        "lock_lines": "SELECT 1",
        "head_of": """
            SELECT id FROM {t} WHERE key = :key AND head = 1 AND status IN ('pending', 'processing')
        """,
        "lock_row": """
            SELECT id, key, head FROM {t}
            WHERE id = :id AND status IN (SELECT value FROM json_each(:statuses))
        """,
        "duplicate": """
            SELECT 1 FROM {t} WHERE dedupe_key = :dedupe_key AND status IN ('pending', 'processing')
        """,
        "revive": (
            next_seq,
            """
            UPDATE {t}
            SET status = 'pending', attempts = 0, available_at = :now, updated_at = :now,
                created_at = :now, head = 0,
                seq = (SELECT seq FROM sqlite_sequence WHERE name = '{t}'),
                lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
            WHERE id = :id AND status = 'dead'
            """,
        ),
        "close": """
            UPDATE {t}
            SET status = :status, last_error = :error, updated_at = :now,
                lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
            WHERE id = :id AND status IN ('pending', 'processing')
        """,
        "promote": promote,
        # Nothing to do on SQLite: only one writer at a time, and triggers
        # keep the counter.
        "touch": "SELECT :id WHERE 0",
        "count": "SELECT :delta WHERE 0",
        "purge": """
            DELETE FROM {t}
            WHERE status IN (SELECT value FROM json_each(:statuses)) AND updated_at < :before
        """,
    }


def _sql(text: str, table: str) -> str:
    return text.replace("{cols}", _SQL.row_columns).replace("{t}", table)


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


@contextlib.contextmanager
def _one_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """The block's statements in one transaction: the application's, open or opened by
    the first write (Python's default handling), or, on a connection that commits
    each statement by itself (``isolation_level=None``, ``autocommit=True``), one of
    their own, committed at the block's end (a row written commits as it would have).
    So what a statement finds, the next finds too: enqueue's look for a duplicate
    after an insert that wrote nothing (another process finishing that row between
    them made it report the outbox full)."""
    autocommit = getattr(conn, "autocommit", -1)  # (Python 3.12: -1 is the legacy handling)
    of_its_own = not conn.in_transaction and (
        autocommit is True or (autocommit == -1 and conn.isolation_level is None)
    )
    if not of_its_own:
        yield
        return
    committed = False
    try:
        conn.execute("BEGIN IMMEDIATE")  # (in the try: a Ctrl-C after it rolls back)
        yield
        conn.execute("COMMIT")
        committed = True
    finally:
        # Nothing left open on the application's connection (a transaction open
        # now is this one: there was none before it).
        if not committed and conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")


def _plain(conn: sqlite3.Connection) -> sqlite3.Cursor:
    """A cursor of the caller's ``conn`` that returns plain tuples, whatever its
    ``row_factory`` (a dict factory would fail a statement's answer after the
    statement wrote)."""
    cursor = conn.cursor()
    cursor.row_factory = None
    return cursor


def _text_replaced(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _connect(
    path: str, busy_timeout: float, *, autocommit: bool, create: bool = True, wal: bool = True
) -> sqlite3.Connection:
    """A connection to ``path``; with ``create=False`` a missing file is an error, not made.

    ``wal``: put the file in WAL mode (a change to the file; an inspecting
    connection leaves its journal mode as it is).
    """
    if create:
        conn = sqlite3.connect(
            path,
            timeout=busy_timeout,
            isolation_level=None if autocommit else "DEFERRED",
            check_same_thread=False,
        )
    else:
        # An absolute path gets an empty authority ("file:///..."): a path that
        # starts with "//" would otherwise be read as one ("file://host/...").
        escaped = path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
        uri = ("file://" if path.startswith("/") else "file:") + escaped
        conn = sqlite3.connect(
            uri + "?mode=rw",
            timeout=busy_timeout,
            isolation_level=None if autocommit else "DEFERRED",
            check_same_thread=False,
            uri=True,
        )
    if not wal:
        return conn
    try:
        _set_wal(conn, busy_timeout)
    except BaseException:
        conn.close()
        raise
    return conn


def _length_limit(conn: sqlite3.Connection) -> int:
    """The longest string ``conn`` accepts, in bytes (SQLite's default before Python 3.11)."""
    getlimit = getattr(conn, "getlimit", None)  # (Python 3.11+)
    if getlimit is not None:
        # A closed connection, or one of another thread: its statement fails
        # next, as a StoreError.
        with contextlib.suppress(sqlite3.Error):
            return int(getlimit(sqlite3.SQLITE_LIMIT_LENGTH))  # type: ignore[attr-defined,unused-ignore]
    return 1_000_000_000


#: Bytes a row holds besides its key, type, payload and dedupe key (status,
#: times, ids, the record's header), with room to spare: SQLite's length limit
#: bounds the whole row too, not only the strings bound to a statement.
_ROW_MARGIN = 256


def _json_chunks(items: list[list[Any]], limit: int) -> list[tuple[str, int, int]]:
    """``items`` as JSON arrays no longer than ``limit`` bytes, in order:
    ``(text, start, end)`` for ``items[start:end]``.

    SQLite refuses a longer string as a whole ("string or blob too big").
    Raises ``ValueError`` naming an item too long by itself.
    """
    chunks: list[tuple[str, int, int]] = []
    parts: list[str] = []
    size = 2  # the brackets
    start = 0
    for index, item in enumerate(items):
        text = json.dumps(item, ensure_ascii=False)
        length = len(text.encode("utf-8", "surrogatepass"))
        if length + _ROW_MARGIN > limit:  # (the row is shorter than its text: looked at)
            row = sum(len(t.encode("utf-8", "surrogatepass")) for t in item[:4] if t)
            if row + _ROW_MARGIN > limit:
                raise ValueError(
                    f"messages[{index}] is {row} bytes (payload as JSON, key, type and "
                    f"dedupe_key), over what a row may hold under the SQLite "
                    f"connection's length limit (SQLITE_LIMIT_LENGTH) of {limit} bytes"
                )
            if length + 2 > limit:
                raise ValueError(
                    f"messages[{index}] is {length} bytes as a batch's text (its "
                    f"payload's JSON escaped again), over the SQLite connection's length "
                    f"limit (SQLITE_LIMIT_LENGTH) of {limit} bytes: enqueue() writes it"
                )
        if parts and size + 1 + length > limit:
            chunks.append(("[" + ",".join(parts) + "]", start, index))
            parts, size, start = [], 2, index
        size += length + (1 if parts else 0)
        parts.append(text)
    chunks.append(("[" + ",".join(parts) + "]", start, len(items)))
    return chunks


def _read_only(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is SQLite's answer for a file it opened read-only."""
    code = getattr(exc, "sqlite_errorcode", None)  # (Python 3.11+)
    if code is not None:
        # The plain code only: its extended ones (recovery under way, a lock
        # not to be had) pass with time.
        return bool(code == 8)  # SQLITE_READONLY
    return "attempt to write a readonly database" in str(exc)


def _read_only_message(path: str) -> str:
    return (
        f"the outbox database {path!r} is read-only to this process (SQLite opened it "
        f"read-only: the file or its file system is not writable by it); "
        f"a relay must write to it"
    )


def _check_writable(conn: sqlite3.Connection) -> None:
    """Raise SQLite's read-only error if it opened ``conn``'s file read-only.

    SQLite opens a file it may not write read-only without a word, and
    ``BEGIN IMMEDIATE`` still succeeds: a write that changes nothing, rolled
    back, is what tells. ``conn`` is in autocommit mode, outside a
    transaction. Never waits for the write lock: while another connection
    holds it (an application's long transaction) the look is skipped (it
    made the relay fail to start), and a read-only file is then found by
    the first claim (``refused``). Never blocks but on the file itself.
    """
    (waits,) = conn.execute("PRAGMA busy_timeout").fetchone()
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 5) & 0xFF == 5:  # SQLITE_BUSY: skipped
                return
            raise
        try:
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            conn.execute(f"PRAGMA user_version = {int(version)}")
        finally:
            if conn.in_transaction:  # (an error may have ended it)
                conn.execute("ROLLBACK")
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(waits)}")


def _set_wal(conn: sqlite3.Connection, busy_timeout: float) -> None:
    """Put the file in WAL mode, waiting up to ``busy_timeout`` seconds for it.

    Switching a file from its rollback journal to WAL needs it to itself,
    and SQLite answers "database is locked" at once, without its busy
    handler, while another connection reads it (several processes opening
    an older file together): try again until the busy timeout is spent.
    Blocks at most ``busy_timeout`` seconds; a file already in WAL mode
    answers at once.
    """
    deadline = time.monotonic() + busy_timeout
    pause = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class _SQLiteDb(Db):
    """The admin's connection, inside its transaction. Lists become JSON arrays."""

    def __init__(self, conn: sqlite3.Connection, table: str) -> None:
        self._conn = conn
        self._table = table

    def _params(self, params: dict[str, Any]) -> dict[str, Any]:
        return {
            name: json.dumps(list(value)) if isinstance(value, (list, tuple)) else value
            for name, value in params.items()
        }

    def all(self, name: str, **params: Any) -> list[tuple[Any, ...]]:
        sql = _SQL.admin[name]
        assert isinstance(sql, str)
        return list(self._conn.execute(_sql(sql, self._table), self._params(params)))

    def run(self, name: str, **params: Any) -> int:
        sql = _SQL.admin[name]
        statements = (sql,) if isinstance(sql, str) else sql
        count = 0
        for statement in statements:
            cursor = self._conn.execute(_sql(statement, self._table), self._params(params))
            cursor.fetchall()  # a statement with RETURNING is done only once read
            count = cursor.rowcount
        return count


class SQLiteStore(Store):
    """An outbox in one SQLite database file: the default store.

    - ``path``: the database file (``os.PathLike`` accepted). Processes that
      share the file share the outbox (local disks only, as SQLite says). A
      relative path is taken from the current directory once, here: the
      ``path`` attribute is absolute, and every connection of the store is to
      that file even after the process changes directory.
    - ``table``: the table name (a lowercase identifier); several outboxes
      may live in one file.
    - ``max_pending``: ``enqueue`` refuses with
      :class:`~outbound.errors.OutboxFull` once this many rows are
      unfinished (pending or processing); ``None``: no limit. Checked
      against a counter: its cost does not grow with the backlog.
    - ``max_payload_bytes``: the largest JSON payload accepted.
    - ``ordering``: ``"strict"`` (default) or ``"mutex"``; see
      :data:`~outbound.outbox.Ordering`.
    - ``busy_timeout``: seconds a connection waits for the write lock.
    - ``create``: create (or migrate) the schema now; with ``False`` the
      store never creates the database file (to inspect one).

    Thread-safe; the methods that are not ``enqueue``/``enqueue_many`` open
    a connection of their own and block on the database.
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
        # Resolved once: SQLite would resolve a relative path again at each
        # connection, so after a chdir the store would open (or create) another
        # file. Joined, not normalised: "link/../x" keeps meaning what it did.
        if not os.path.isabs(path):
            try:
                path = os.path.join(os.getcwd(), path)
            except OSError as exc:  # (the current directory was deleted)
                raise StoreError(
                    f"cannot open {path!r}: a relative path, and the current directory "
                    f"is gone: {exc}"
                ) from exc
        self.path = path
        self.table = check_table(table)
        if self.table.startswith("sqlite_"):
            raise ValueError(
                f"table must not begin with 'sqlite_' in SQLite, which keeps those names "
                f"for itself, not {table!r}"
            )
        self.max_pending = check_max_pending(max_pending)
        self.max_payload_bytes = check_positive_int("max_payload_bytes", max_payload_bytes)
        self.ordering = check_ordering(ordering)
        self.busy_timeout = check_seconds("busy_timeout", busy_timeout, maximum=86400.0)
        t = self.table
        self._enqueue_sql = _sql(_SQL.enqueue, t)
        # A batch with dedupe keys checks them first; one without skips it.
        no_duplicate = f"NOT EXISTS ({_SQL.duplicate_any.replace('{shown}', '1')})"
        self._enqueue_many_sql = {
            True: _sql(_SQL.enqueue_many.replace("{no_duplicate}", no_duplicate), t),
            False: _sql(_SQL.enqueue_many.replace("{no_duplicate}", "1"), t),
        }
        # (Which of the keys it is: its index in the array.)
        shown = "(SELECT j.key FROM json_each(:keys) AS j WHERE j.value = u.dedupe_key LIMIT 1)"
        self._duplicate_sql = _sql(_SQL.duplicate_any.replace("{shown}", shown), t)
        # Without a limit the check compares with a bound no count reaches.
        self._limit = self.max_pending if self.max_pending is not None else 2**62
        if create:
            self.create_schema()

    def __repr__(self) -> str:
        return f"<SQLiteStore path={self.path!r} table={self.table!r}>"

    def connect(self) -> sqlite3.Connection:
        """A new connection to the database for the application: WAL, busy timeout.

        Python's default transaction handling (a deferred ``BEGIN`` before
        the first write); use :func:`immediate` for a transaction that
        reads then writes. Never shared by the store. Creates the file if
        missing.
        """
        return _connect(self.path, self.busy_timeout, autocommit=False)

    # ------------------------------------------------------------------ schema

    def _open(self, *, wal: bool = True) -> sqlite3.Connection:
        """An autocommit connection for the store's own work; never creates the file.

        ``wal=False`` for one that only reads: it leaves the file as it is.
        """
        try:
            return _connect(self.path, self.busy_timeout, autocommit=True, create=False, wal=wal)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the outbox database {self.path!r}: {exc}") from exc

    def _version(self, conn: sqlite3.Connection) -> int | None:
        t = self.table
        names = {r[0] for r in conn.execute(_SQL.tables, (t, f"{t}_schema", f"{t}_slots"))}
        if t not in names:
            return None
        # Whatever a {t}_schema beside it says: an application's table of
        # both names is not an outbox, nor is its {t}_schema ever written.
        columns = {str(r[1]) for r in conn.execute(f"PRAGMA table_info({t})")}
        if not columns >= V1_COLUMNS:
            raise StoreError(not_an_outbox(t))
        if f"{t}_schema" not in names:
            return 1
        beside = {str(r[1]) for r in conn.execute(f"PRAGMA table_info({t}_schema)")}
        if not beside >= SCHEMA_COLUMNS:
            raise StoreError(not_an_outbox(t, beside))
        (version,) = conn.execute(_sql(_SQL.version, t)).fetchone()
        return int(version) if version is not None else 1

    def schema_version(self) -> int | None:
        """The schema version in the file (None: no outbox table). Never creates the file."""
        if not os.path.exists(self.path):
            return None
        conn = self._open(wal=False)
        try:
            return self._version(conn)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the outbox schema in {self.path!r}: {exc}") from exc
        finally:
            conn.close()

    def create_schema(self) -> None:
        """Create the tables, or migrate them to the current version. Idempotent.

        Creates the database file if missing. A migration runs in one
        transaction under SQLite's write lock (waiting up to the busy
        timeout): processes that call it at once do it once. Stop the
        relays of an older version before migrating.
        """
        self._create_schema()

    def _create_schema(self) -> int | None:
        """:meth:`create_schema`; returns the version this call found under the
        lock (None: it created the schema; the current one: nothing done)."""
        try:
            conn = _connect(self.path, self.busy_timeout, autocommit=True)
            try:
                if self._version(conn) == SCHEMA_VERSION:
                    return SCHEMA_VERSION
                with immediate(conn):
                    version = self._version(conn)
                    if version is None:
                        self._create(conn)
                    elif version == 1:
                        self._migrate_1(conn)
                    elif version < SCHEMA_VERSION:
                        # Versions 3 and 4 changed only the PostgreSQL schema.
                        conn.execute(
                            _sql(_SQL.record_version, self.table), (SCHEMA_VERSION, time.time())
                        )
                    elif version > SCHEMA_VERSION:
                        raise StoreError(
                            f"the outbox table {self.table!r} has schema version {version}, "
                            f"newer than this code's {SCHEMA_VERSION}: upgrade outbound"
                        )
                return version
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot create the outbox schema in {self.path!r}: {exc}") from exc

    def _create(self, conn: sqlite3.Connection) -> None:
        t = self.table
        for statement in (*_SQL.schema, *_SQL.indexes, *_SQL.triggers):
            conn.execute(_sql(statement, t))
        conn.execute(_sql(_SQL.record_version, t), (SCHEMA_VERSION, time.time()))

    def _migrate_1(self, conn: sqlite3.Connection) -> None:
        t = self.table
        # The application's own indexes and triggers on the table go with the
        # old table (renamed, then dropped): made again on the new one. The
        # rename is a legacy one, so that views naming the table (and the
        # triggers' bodies) are not rewritten to name the old one.
        # (Names as SQLite compares them: "ON Orders" is a trigger on orders.)
        own = {f"{t}_{suffix}" for suffix in _SQL.v1_indexes}
        theirs = [
            (str(kind), str(name), str(sql))
            for kind, name, sql in conn.execute(
                "SELECT type, name, sql FROM sqlite_master WHERE tbl_name = ? COLLATE NOCASE "
                "AND type IN ('index', 'trigger') AND sql IS NOT NULL ORDER BY rowid",
                (t,),
            )
            if str(name).lower() not in own
        ]
        conn.execute("PRAGMA legacy_alter_table = ON")
        try:
            conn.execute(f"ALTER TABLE {t} RENAME TO {t}_v1")
        finally:
            conn.execute("PRAGMA legacy_alter_table = OFF")
        for suffix in _SQL.v1_indexes:
            conn.execute(f"DROP INDEX IF EXISTS {t}_{suffix}")
        for statement in _SQL.schema:
            if "{t}_slots" in statement:
                continue  # kept as it is
            conn.execute(_sql(statement, t))
        conn.execute(_sql(_SQL.migrate_1_copy, t))
        conn.execute(f"DROP TABLE {t}_v1")
        for statement in (*_SQL.indexes, *_SQL.triggers):
            conn.execute(_sql(statement, t))
        for kind, name, sql in theirs:
            try:
                conn.execute(sql)
            except sqlite3.Error as exc:  # (the whole migration is rolled back)
                raise StoreError(
                    f"cannot migrate outbox {t!r} to version {SCHEMA_VERSION}: the {kind} "
                    f"{name!r} on it cannot be made again on the new table ({exc}); "
                    f"drop it, migrate, then make it again"
                ) from exc
        conn.execute(_sql(_SQL.recount, t))
        conn.execute(_sql(_SQL.record_version, t), (SCHEMA_VERSION, time.time()))

    def drop_schema(self) -> None:
        """Drop the outbox's tables (tests, benchmarks). Irreversible."""
        if not os.path.exists(self.path):
            return
        t = self.table
        try:
            conn = self._open()
            try:
                with immediate(conn):
                    for name in (t, f"{t}_slots", f"{t}_counts", f"{t}_schema", f"{t}_v1"):
                        conn.execute(f"DROP TABLE IF EXISTS {name}")
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot drop the outbox schema: {exc}") from exc

    # ----------------------------------------------------------------- enqueue

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
        one); on a connection that commits each statement by itself
        (``isolation_level=None``) it is committed when this returns. Every
        argument is checked before anything is written (see
        :func:`~outbound.outbox._base.check_row`): ``TypeError`` or
        ``ValueError`` naming the problem. Raises
        :class:`~outbound.errors.OutboxFull` when ``max_pending`` rows are
        unfinished, :class:`~outbound.errors.DuplicateMessage` when an
        unfinished row has ``dedupe_key``,
        :class:`~outbound.errors.StoreError` when the database fails; in
        each case nothing was written.

        The check and the insert are one statement, run under SQLite's
        write lock, so the limit holds across processes; its cost does not
        depend on the backlog. Blocks up to the busy timeout while another
        connection writes. ``delay`` seconds postpone the row; in
        ``"strict"`` ordering they also hold back the rows of its key
        enqueued after it.
        """
        row = check_row(key, type, payload, dedupe_key, delay, self.max_payload_bytes)
        if not isinstance(conn, sqlite3.Connection):
            raise TypeError(f"conn must be a sqlite3.Connection, not {conn.__class__.__name__}")
        limit = _length_limit(conn)
        texts = (row.payload, row.key, row.type, row.dedupe_key or "")
        if sum(map(len, texts)) > (limit - _ROW_MARGIN) // 4:  # (4 bytes a character at most)
            size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
            if size + _ROW_MARGIN > limit:
                raise ValueError(
                    f"the message is {size} bytes (payload as JSON, key, type and "
                    f"dedupe_key), over what a row may hold under the SQLite "
                    f"connection's length limit (SQLITE_LIMIT_LENGTH) of {limit} bytes"
                )
        params = {
            "key": row.key,
            "type": row.type,
            "payload": row.payload,
            "dedupe_key": row.dedupe_key,
            "delay": row.delay,
            "now": time.time(),
            "max_pending": self._limit,
        }
        try:
            with _one_transaction(conn):
                found = _plain(conn).execute(self._enqueue_sql, params).fetchone()
                if found is not None:
                    return int(found[0])
                duplicate = row.dedupe_key is not None and (
                    _plain(conn)
                    .execute(self._duplicate_sql, {"keys": json.dumps([row.dedupe_key])})
                    .fetchone()
                    is not None
                )
        except sqlite3.Error as exc:
            raise StoreError(f"enqueue failed: {exc}") from exc
        if duplicate:
            raise DuplicateMessage(
                f"an unfinished outbox row already has dedupe_key {row.dedupe_key!r}"
            )
        raise OutboxFull(f"the outbox {self.table!r} already holds {self.max_pending} pending rows")

    def enqueue_many(self, conn: Any, messages: Iterable[Mapping[str, Any]]) -> list[int]:
        """Write many pending rows on ``conn``; return their ids, in order.

        See :meth:`Store.enqueue_many`. The batch goes to SQLite as JSON text,
        in as few statements as its length limit allows (one, but for a batch
        of about a gigabyte): every one in the caller's transaction, so all or
        nothing with it. A message too long for SQLite by itself is a
        ``ValueError`` naming it, before anything is written.
        """
        rows = check_messages(messages, self.max_payload_bytes)
        if not isinstance(conn, sqlite3.Connection):
            raise TypeError(f"conn must be a sqlite3.Connection, not {conn.__class__.__name__}")
        if not rows:
            return []
        seen: set[str] = set()
        items = []
        for r in rows:
            items.append([r.key, r.type, r.payload, r.dedupe_key, r.delay, r.key not in seen])
            seen.add(r.key)
        chunks = _json_chunks(items, _length_limit(conn))
        now = time.time()
        try:
            with _one_transaction(conn):
                if len(chunks) == 1:
                    return self._enqueue_chunks(conn, rows, chunks, now)
                # Several statements: undone together if one writes nothing.
                # (A savepoint outside a transaction would commit at its
                # release: the transaction Python would open, opened first.)
                if not conn.in_transaction:
                    conn.execute(f"BEGIN {conn.isolation_level or ''}")
                conn.execute("SAVEPOINT outbound_enqueue_many")
                try:
                    ids = self._enqueue_chunks(conn, rows, chunks, now)
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK TO outbound_enqueue_many")
                        conn.execute("RELEASE outbound_enqueue_many")
                    raise
                conn.execute("RELEASE outbound_enqueue_many")
                return ids
        except sqlite3.Error as exc:
            raise StoreError(f"enqueue_many failed: {exc}") from exc

    def _enqueue_chunks(
        self,
        conn: sqlite3.Connection,
        rows: list[NewRow],
        chunks: list[tuple[str, int, int]],
        now: float,
    ) -> list[int]:
        """:meth:`enqueue_many`'s statements, one per chunk of the batch, in order.

        Raises as :meth:`enqueue_many` does (``sqlite3.Error`` left to it), on
        a chunk that wrote nothing: the caller undoes the chunks before it.
        """
        ids: list[int] = []
        for text, start, end in chunks:
            dedupe = [r.dedupe_key for r in rows[start:end] if r.dedupe_key is not None]
            # (Not escaped: each key as long as in the rows' text, which fits.)
            keys = json.dumps(dedupe, ensure_ascii=False)
            params = {
                "rows": text,
                "keys": keys,
                # The rows not written yet: the first statement checks room
                # for the whole batch; the next ones see the rows before them.
                "n": len(rows) - start,
                "now": now,
                "max_pending": self._limit,
            }
            sql = self._enqueue_many_sql[keys != "[]"]
            got = sorted(int(r[0]) for r in _plain(conn).execute(sql, params))
            if len(got) == end - start:
                ids.extend(got)
                continue
            if got:  # cannot happen: the checks hold for every row or for none
                raise StoreError("enqueue_many wrote part of the batch")
            found = _plain(conn).execute(self._duplicate_sql, {"keys": keys}).fetchone()
            if found is not None:
                raise batch_duplicate(rows, dedupe[int(found[0])])
            raise OutboxFull(
                f"the outbox {self.table!r} has no room for {len(rows)} more rows "
                f"(max_pending={self.max_pending})"
            )
        return ids

    # ------------------------------------------------------------------ relays

    def session(self) -> _SQLiteSession:
        """Open a relay :class:`Session` (its own connection). Never creates the file.

        Raises :class:`~outbound.errors.StoreError` if SQLite opened the file
        read-only (this process may not write it): a relay must write.
        Blocks up to the busy timeout while another connection writes.
        """
        conn = self._open()
        try:
            conn.execute("PRAGMA synchronous = NORMAL")
            _check_writable(conn)
        except sqlite3.Error as exc:
            conn.close()
            if _read_only(exc):
                raise StoreError(_read_only_message(self.path)) from exc
            raise StoreError(f"cannot open {self.path!r}: {exc}") from exc
        return _SQLiteSession(self, conn)

    # --------------------------------------------------------------- operators

    @contextlib.contextmanager
    def _admin(self, *, write: bool = False) -> Iterator[Db]:
        conn = self._open(wal=write)
        if not write:
            # Reading only (an operator's listing, the status page): text that
            # is not UTF-8 (another program wrote it) is shown replaced, not
            # a failure of the whole reading. Writes read it strictly.
            conn.text_factory = _text_replaced
        try:
            with contextlib.ExitStack() as stack:
                if write:
                    stack.enter_context(immediate(conn))
                yield _SQLiteDb(conn, self.table)
        except sqlite3.Error as exc:
            raise StoreError(f"outbox database error: {exc}") from exc
        finally:
            conn.close()

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
                "next_seq",
                "retry_to_back",
                "promote",
                "renew",
                "renew_slot",
                "reconcile",
                "reconcile_slots",
            )
        }

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        try:
            with immediate(self._conn) as conn:
                yield conn
        except sqlite3.Error as exc:
            raise StoreError(f"outbox database error: {exc}") from exc

    def refused(self, exc: StoreError) -> bool:
        """True unless ``exc`` is an operational error (the file locked past
        ``busy_timeout``, an I/O error, a full disk): those pass with time.
        A file SQLite opened read-only does not: refused. Does not block."""
        cause = exc.__cause__
        return not isinstance(cause, sqlite3.OperationalError) or _read_only(cause)

    def ensure_slots(self, count: int) -> None:
        with self._write() as conn:
            conn.executemany(self._sql["ensure_slot"], [(i,) for i in range(1, count + 1)])

    def claim(
        self,
        owner: str,
        limit: int,
        lease: float,
        max_concurrency: int | None,
        skip_keys: Sequence[str] = (),
        *,
        held_keys: Sequence[str] = (),
        first: Sequence[int] = (),
        held_slots: Sequence[int] = (),
    ) -> list[Claimed]:
        token = secrets.randbits(62)
        with self._write() as conn:
            now = time.time()
            slots: list[int] = []
            if max_concurrency is not None:
                slots = sorted(
                    int(r[0])
                    for r in conn.execute(
                        self._sql["take_slots"],
                        {
                            "owner": owner,
                            "now": now,
                            "lease": lease,
                            "max": max_concurrency,
                            "limit": limit,
                            "held_slots": json.dumps([int(i) for i in held_slots]),
                        },
                    )
                )
                limit = len(slots)
                if not limit:
                    return []
            found = conn.execute(
                self._sql["claim"],
                {
                    "owner": owner,
                    "token": token,
                    "now": now,
                    "lease": lease,
                    "limit": limit,
                    "skip": json.dumps(list(skip_keys)),
                    "held": json.dumps([*skip_keys, *held_keys]),
                    "first": json.dumps([int(i) for i in first]),
                    "ahead": CLAIM_AHEAD,
                },
            ).fetchall()
            for slot in slots[len(found) :]:
                conn.execute(self._sql["free_slot"], {"slot": slot, "owner": owner})
        found.sort(key=lambda r: r[0])
        claimed = []
        for i, (row_id, key, type_, text, dedupe_key, attempts, created, wait) in enumerate(found):
            payload, error = decode_payload(text)
            message = OutboxMessage(
                int(row_id), key, type_, payload, int(attempts), dedupe_key, float(created)
            )
            claimed.append(
                Claimed(
                    message,
                    token,
                    slots[i] if slots else None,
                    error,
                    max(0.0, float(wait)),
                    text if error is None else None,
                )
            )
        return claimed

    def finish(
        self,
        owner: str,
        outcomes: Sequence[Outcome],
        *,
        take: int = 0,
        lease: float = 0.0,
        skip_keys: Sequence[str] = (),
    ) -> Finished:
        # Claims nothing at once (``take``): one writer at a time on the
        # file, the next claim is as cheap.
        mutex = self._store.ordering == "mutex"
        sql = self._sql
        written = 0
        lost: list[Outcome] = []
        with self._write() as conn:
            now = time.time()
            for o in outcomes:
                params: dict[str, Any] = {
                    "id": o.id,
                    "token": o.token,
                    "owner": owner,
                    "now": now,
                    "error": o.error,
                    "key": o.key,
                }
                promote = False
                if o.kind in ("sent", "dead"):
                    params["status"] = o.kind
                    changed = conn.execute(sql["finish"], params).rowcount > 0
                    promote = changed
                else:
                    params["delay"] = o.delay
                    params["refund"] = 1 if o.kind == "requeue" else 0
                    if mutex and o.kind == "retry":
                        ((params["seq"],),) = conn.execute(sql["next_seq"]).fetchall()
                        changed = conn.execute(sql["retry_to_back"], params).rowcount > 0
                        promote = changed
                    else:
                        changed = conn.execute(sql["retry_strict"], params).rowcount > 0
                written += changed
                if not changed:
                    lost.append(o)
                if promote:
                    conn.execute(sql["promote"], params)
                if o.slot is not None:
                    conn.execute(sql["free_slot"], {"slot": o.slot, "owner": owner})
        return Finished(written, len(outcomes) - written, lost_outcomes=tuple(lost))

    def renew(self, owner: str, lease: float, held: Sequence[Claimed]) -> int:
        if not held:
            return 0
        base = {"o": owner, "now": time.time(), "lease": lease}
        with self._write() as conn:
            renewed = 0
            for item in held:
                params = {**base, "id": item.message.id, "token": item.token}
                renewed += conn.execute(self._sql["renew"], params).rowcount
                if item.slot is not None:
                    conn.execute(self._sql["renew_slot"], {**base, "slot": item.slot})
        return renewed

    def reconcile(self, owner: str, held: Sequence[Claimed]) -> int:
        params = {
            "owner": owner,
            "now": time.time(),
            "held": json.dumps([f"{c.message.id}:{c.token}" for c in held]),
            "slots": json.dumps([c.slot for c in held if c.slot is not None]),
        }
        with self._write() as conn:
            released = conn.execute(self._sql["reconcile"], params).rowcount
            conn.execute(self._sql["reconcile_slots"], params)
        return released

    def release_slots(self, owner: str) -> None:
        with self._write() as conn:
            conn.execute(self._sql["free_owner_slots"], {"owner": owner})

    def close(self) -> None:
        self._conn.close()
