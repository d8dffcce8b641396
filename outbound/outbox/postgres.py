"""The PostgreSQL outbox store: :class:`PostgresStore` (psycopg 3, extra ``postgres``).

For many processes on many machines. psycopg and psycopg_pool are imported
when a store is built, with an error naming the extra when missing.

How concurrency is handled:

- ``enqueue`` runs on the caller's connection, in a savepoint when the
  caller is inside a transaction (a database error leaves it usable). With
  ``max_pending`` it first takes a transaction-scoped advisory lock, so the
  count and the insert of concurrent writers are serialized (a plain
  count-then-insert races under READ COMMITTED); the lock is released when
  the caller's transaction ends. The insert also sends ``NOTIFY``
  (delivered on commit) unless ``notify=False``.
- A new row is inserted unsequenced (``seq IS NULL``); the relay that
  claims next gives it its place in its key's line (``seq``, ``head``)
  under a second advisory lock, the same lock a relay takes to pass a
  finished head to the next row of its key. Both are short relay-side
  transactions; no application transaction ever waits for a relay.
- Claims use ``FOR UPDATE SKIP LOCKED`` on heads read through an index.
- Capacity (``max_concurrency``) is a table of slot rows, taken with
  ``FOR UPDATE SKIP LOCKED`` in the claim transaction and held under the
  relay's lease, so a crashed relay's slots come back when it expires.
- A relay whose connection died (a server restart, a terminated backend)
  takes a new one from the pool at its next statement; the statement that
  found it dead fails, and the relay tries it again later.
- ``create_schema`` (run by every ``PostgresStore(...)``) reads the catalog
  first and takes no lock when the schema is there.

Schema (``{t}`` is the table name; created by :meth:`PostgresStore.create_schema`)::

    {t}         the rows (see _SQL.schema)
    {t}_slots   one row per capacity slot: owner and expiry

The relay's own transactions run with ``synchronous_commit = off``: a
crash may lose their last few milliseconds, which at worst delivers a row
once more (at-least-once) or returns a claim to pending.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

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

if TYPE_CHECKING:
    import psycopg
    import psycopg_pool

__all__ = ["PostgresStore"]


class _SQL:
    """Every statement of the PostgreSQL store. ``{t}`` is the table name."""

    schema = (
        """
        CREATE TABLE IF NOT EXISTS {t} (
            id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            key              text        NOT NULL,
            type             text        NOT NULL,
            payload          jsonb       NOT NULL,
            dedupe_key       text,
            status           text        NOT NULL DEFAULT 'pending'
                             CHECK (status IN ('pending', 'processing', 'sent', 'dead')),
            head             boolean     NOT NULL DEFAULT false, -- the claimable row of its key
            seq              bigint,                             -- order in the key; NULL: new
            attempts         integer     NOT NULL DEFAULT 0,
            claims           integer     NOT NULL DEFAULT 0,     -- fencing token
            available_at     timestamptz NOT NULL DEFAULT now(),
            lease_owner      text,
            lease_expires_at timestamptz,
            last_error       text,
            created_at       timestamptz NOT NULL DEFAULT now(),
            updated_at       timestamptz NOT NULL DEFAULT now()
        )
        """,
        # The claim: due heads, oldest first.
        """
        CREATE INDEX IF NOT EXISTS {t}_ready ON {t} (available_at, id)
            WHERE head AND status = 'pending'
        """,
        # The claim: expired leases.
        """
        CREATE INDEX IF NOT EXISTS {t}_lease ON {t} (lease_expires_at)
            WHERE status = 'processing'
        """,
        # Rows still to be sequenced.
        """
        CREATE INDEX IF NOT EXISTS {t}_new ON {t} (id) WHERE seq IS NULL
        """,
        # At most one head per key; "has this key a head?" when sequencing.
        """
        CREATE UNIQUE INDEX IF NOT EXISTS {t}_head ON {t} (key)
            WHERE head AND status IN ('pending', 'processing')
        """,
        # The next row of a key, when its head finishes.
        """
        CREATE INDEX IF NOT EXISTS {t}_waiting ON {t} (key, seq)
            WHERE NOT head AND status = 'pending' AND seq IS NOT NULL
        """,
        """
        CREATE UNIQUE INDEX IF NOT EXISTS {t}_dedupe ON {t} (dedupe_key)
            WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
        """,
        # max_pending, the command line's counts, oldest pending, purge.
        # Processing rows are left out: they are found by id (the fence) or
        # through {t}_lease (expiry, renewal), and a claim adds no entry
        # here. With them in, the dead entries of finished rows piled up
        # under 'processing' until a VACUUM, and the planner (which expects
        # about one processing row) walked them all in every claim and finish.
        """
        CREATE INDEX IF NOT EXISTS {t}_state ON {t} (status, created_at)
            WHERE status <> 'processing'
        """,
        """
        CREATE TABLE IF NOT EXISTS {t}_slots (
            slot       integer PRIMARY KEY,
            owner      text,
            expires_at timestamptz
        )
        """,
    )

    #: The indexes of {t} (``{t}_<suffix>``) created above.
    indexes = ("ready", "lease", "new", "head", "waiting", "dedupe", "state")

    #: The previous version's index, on every row, replaced by {t}_state:
    #: dropped (if on {t}) by create_schema, which locks the table a moment, once.
    old_indexes = ("status",)

    # Is the schema there? Whether {t} and {t}_slots exist, and for every
    # relation in {t}'s schema named like one of its indexes, whether it is
    # an index on {t} (index names are per schema, not per table). Reads the
    # catalog only: takes no lock on {t}.
    schema_state = """
        SELECT to_regclass(%(table)s) IS NOT NULL, to_regclass(%(slots)s) IS NOT NULL,
               c.relname::text, x.indrelid IS NOT DISTINCT FROM t.oid, c.oid::regclass::text
        FROM (SELECT 1) AS one
        LEFT JOIN pg_class AS t ON t.oid = to_regclass(%(table)s)
        LEFT JOIN pg_class AS c ON c.relnamespace = t.relnamespace AND c.relname = ANY(%(names)s)
        LEFT JOIN pg_index AS x ON x.indexrelid = c.oid
    """

    ddl_lock_timeout = "SET LOCAL lock_timeout = '{ms}ms'"

    drop_index = "DROP INDEX {name}"

    lock = "SELECT pg_advisory_xact_lock(%s)"

    lock_and_isolation = (
        "SELECT pg_advisory_xact_lock(%s), current_setting('transaction_isolation')"
    )

    enqueue = """
        WITH ins AS (
            INSERT INTO {t} (key, type, payload, dedupe_key, available_at)
            VALUES (%(key)s, %(type)s, %(payload)s::jsonb, %(dedupe_key)s,
                    now() + %(delay)s * interval '1 second')
            ON CONFLICT (dedupe_key)
                WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
                DO NOTHING
            RETURNING id
        )
        SELECT id, CASE WHEN %(channel)s <> '' THEN pg_notify(%(channel)s, '') END FROM ins
    """

    enqueue_limited = """
        WITH n AS (
            SELECT count(*) AS unfinished
            FROM ((SELECT 1 FROM {t} WHERE status = 'pending' LIMIT %(max_pending)s)
                  UNION ALL
                  (SELECT 1 FROM {t} WHERE status = 'processing' LIMIT %(max_pending)s)
                  LIMIT %(max_pending)s) AS s
        ), ins AS (
            INSERT INTO {t} (key, type, payload, dedupe_key, available_at)
            SELECT %(key)s, %(type)s, %(payload)s::jsonb, %(dedupe_key)s,
                   now() + %(delay)s * interval '1 second'
            WHERE (SELECT unfinished FROM n) < %(max_pending)s
            ON CONFLICT (dedupe_key)
                WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
                DO NOTHING
            RETURNING id
        )
        SELECT (SELECT id FROM ins), (SELECT unfinished FROM n),
               (SELECT CASE WHEN %(channel)s <> '' THEN pg_notify(%(channel)s, '') END FROM ins)
    """

    # Give new rows their place: the first new row of a key with no head
    # becomes its head, the others wait. Run under the heads lock.
    sequence = """
        WITH new AS (
            SELECT id, key, row_number() OVER (PARTITION BY key ORDER BY id) AS rn
            FROM (SELECT id, key FROM {t} WHERE seq IS NULL ORDER BY id LIMIT %(limit)s) AS n
        )
        UPDATE {t} AS o
        SET seq = o.id,
            head = new.rn = 1 AND NOT EXISTS (
                SELECT 1 FROM {t} AS h
                WHERE h.key = new.key AND h.head AND h.status IN ('pending', 'processing'))
        FROM new
        WHERE o.id = new.id
    """

    ensure_slots = """
        INSERT INTO {t}_slots (slot) SELECT generate_series(1, %(count)s)
        ON CONFLICT (slot) DO NOTHING
    """

    take_slots = """
        UPDATE {t}_slots SET owner = %(owner)s,
                             expires_at = statement_timestamp() + %(lease)s * interval '1 second'
        WHERE slot IN (SELECT slot FROM {t}_slots
                       WHERE slot <= %(max)s
                         AND (owner IS NULL OR expires_at < statement_timestamp())
                       ORDER BY slot LIMIT %(limit)s
                       FOR UPDATE SKIP LOCKED)
        RETURNING slot
    """

    free_slots = """
        UPDATE {t}_slots SET owner = NULL, expires_at = NULL
        WHERE slot = ANY(%(slots)s) AND owner = %(owner)s
    """

    free_owner_slots = "UPDATE {t}_slots SET owner = NULL, expires_at = NULL WHERE owner = %s"

    claim = """
        WITH expired AS (
            SELECT id FROM {t}
            WHERE status = 'processing' AND lease_expires_at < statement_timestamp()
            ORDER BY lease_expires_at LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ), ready AS (
            SELECT id FROM {t}
            WHERE head AND status = 'pending' AND available_at <= statement_timestamp()
            ORDER BY available_at, id LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ), picked AS (
            (SELECT id FROM expired) UNION ALL (SELECT id FROM ready) LIMIT %(limit)s
        )
        UPDATE {t} AS o
        SET status = 'processing', lease_owner = %(owner)s,
            lease_expires_at = statement_timestamp() + %(lease)s * interval '1 second',
            attempts = o.attempts + 1, claims = o.claims + 1, updated_at = statement_timestamp()
        FROM picked
        WHERE o.id = picked.id
        RETURNING o.id, o.key, o.type, o.payload, o.dedupe_key, o.attempts, o.claims,
                  extract(epoch FROM o.created_at)::float8
    """

    # Every update of a claimed row is fenced by its claim and its owner.
    # ``IS NOT DISTINCT FROM`` (status is never NULL: the same as ``=``) is
    # not indexable, so the rows are found by id, one primary-key probe
    # each, and never by scanning every processing entry of an index (dead
    # ones included: the planner's estimate of processing rows is often 1).
    fence = """
        o.id = d.id AND o.claims = d.claims AND o.lease_owner = %(owner)s
        AND o.status IS NOT DISTINCT FROM 'processing'
    """

    # The next waiting row of key ``{k}``: the first live entry of the key
    # in {t}_waiting, read once per key (a LATERAL join, not a subquery the
    # planner may run twice per key).
    next_waiting = """
        SELECT n.id FROM {t} AS n
        WHERE n.key = {k} AND NOT n.head AND n.status = 'pending' AND n.seq IS NOT NULL
        ORDER BY n.seq LIMIT 1
    """

    # sent / dead, and the next row of each finished key becomes its head.
    finish = (
        """
        WITH done AS (
            UPDATE {t} AS o
            SET status = d.status, last_error = d.error,
                lease_owner = NULL, lease_expires_at = NULL, updated_at = statement_timestamp()
            FROM unnest(%(ids)s::bigint[], %(claims)s::int[], %(statuses)s::text[],
                        %(errors)s::text[]) AS d(id, claims, status, error)
            WHERE """
        + fence
        + """
            RETURNING o.key
        ), promoted AS (
            UPDATE {t} AS w SET head = true
            FROM done CROSS JOIN LATERAL ("""
        + next_waiting.replace("{k}", "done.key")
        + """) AS nx
            WHERE w.id = nx.id
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM promoted)
        """
    )

    # Back to pending. ``refund``: the attempt is not counted. ``to_back``
    # ("mutex" ordering, a failure): the row gives up its key's head and
    # goes to the back of its key's line.
    retry = (
        """
        UPDATE {t} AS o
        SET status = 'pending',
            available_at = statement_timestamp() + d.delay * interval '1 second',
            attempts = o.attempts - d.refund, last_error = coalesce(d.error, o.last_error),
            head = o.head AND NOT d.to_back,
            seq = CASE WHEN d.to_back THEN nextval(pg_get_serial_sequence('{t}', 'id'))
                       ELSE o.seq END,
            lease_owner = NULL, lease_expires_at = NULL, updated_at = statement_timestamp()
        FROM unnest(%(ids)s::bigint[], %(claims)s::int[], %(delays)s::float8[],
                    %(refunds)s::int[], %(errors)s::text[], %(to_back)s::bool[])
             AS d(id, claims, delay, refund, error, to_back)
        WHERE """
        + fence
        + """
        RETURNING o.key, d.to_back
        """
    )

    promote = (
        """
        UPDATE {t} AS w SET head = true
        FROM (SELECT DISTINCT key FROM unnest(%(keys)s::text[]) AS u(key)) AS k
             CROSS JOIN LATERAL ("""
        + next_waiting.replace("{k}", "k.key")
        + """) AS nx
        WHERE w.id = nx.id
        """
    )

    renew = """
        UPDATE {t} SET lease_expires_at = statement_timestamp() + %(lease)s * interval '1 second'
        WHERE lease_owner = %(owner)s AND status = 'processing'
    """

    renew_slots = """
        UPDATE {t}_slots
        SET expires_at = statement_timestamp() + %(lease)s * interval '1 second'
        WHERE owner = %(owner)s
    """

    counts = "SELECT status, count(*) FROM {t} GROUP BY status"

    oldest_pending = """
        SELECT extract(epoch FROM statement_timestamp() - min(created_at))::float8
        FROM {t} WHERE status = 'pending'
    """

    rows = """
        SELECT id, key, type, status, attempts, extract(epoch FROM created_at)::float8, last_error
        FROM {t} {where} ORDER BY id DESC LIMIT %(limit)s
    """

    dead_ids = "SELECT id FROM {t} WHERE status = 'dead' ORDER BY id"

    revive = """
        UPDATE {t} AS o
        SET status = 'pending', attempts = 0, available_at = statement_timestamp(),
            updated_at = statement_timestamp(),
            head = NOT EXISTS (SELECT 1 FROM {t} AS h
                               WHERE h.key = o.key AND h.head
                                 AND h.status IN ('pending', 'processing')),
            seq = nextval(pg_get_serial_sequence('{t}', 'id'))
        WHERE o.id = %(id)s AND o.status = 'dead'
          AND (o.dedupe_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM {t} AS u
                WHERE u.dedupe_key = o.dedupe_key AND u.status IN ('pending', 'processing')))
    """

    purge = """
        DELETE FROM {t}
        WHERE status = ANY(%(statuses)s)
          AND updated_at < statement_timestamp() - %(older_than)s * interval '1 second'
    """


def _sql(text: str, table: str, **parts: str) -> str:
    text = text.replace("{t}", table)
    return text.format(**parts) if parts else text


#: Seconds the schema's DDL waits for a lock on the table before it gives up.
_DDL_LOCK_TIMEOUT = 5.0

#: Seconds a relay waits for a new connection when its own died.
_RECONNECT_TIMEOUT = 5.0


@dataclass
class _SchemaState:
    """What :meth:`PostgresStore.create_schema` found in the catalog."""

    table: bool
    slots: bool
    present: set[str] = field(default_factory=set)  # its indexes found on the table
    old: set[str] = field(default_factory=set)  # old indexes on the table, to drop (qualified)
    foreign: set[str] = field(default_factory=set)  # its index names, taken elsewhere (qualified)


def _lock_id(table: str, purpose: str) -> int:
    """A stable 63-bit advisory-lock id for (``table``, ``purpose``)."""
    high = zlib.crc32(f"outbound.outbox:{table}".encode())
    low = zlib.crc32(purpose.encode())
    return ((high & 0x7FFFFFFF) << 32) | low


def _import_psycopg() -> tuple[Any, Any]:
    try:
        import psycopg  # noqa: PLC0415 - optional, imported when a store is built
        import psycopg_pool  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            "outbound.outbox.PostgresStore needs psycopg 3 and psycopg_pool: "
            "pip install 'outbound-dispatcher[postgres]'"
        ) from exc
    return psycopg, psycopg_pool


class PostgresStore(Store):
    """An outbox table in PostgreSQL, for any number of processes and machines.

    - ``conninfo``: a libpq URL or DSN (``postgresql://user@host/db``) for the
      store's own connections (relays, the command line).
    - ``table``: the table name (a lowercase identifier, in the search path).
    - ``max_pending``: ``enqueue`` refuses with
      :class:`~outbound.errors.OutboxFull` once this many rows are
      unfinished; ``None``: no limit.
    - ``max_payload_bytes``: the largest JSON payload accepted.
    - ``ordering``: ``"strict"`` (default) or ``"mutex"``.
    - ``notify``: ``enqueue`` sends ``NOTIFY`` on the table's channel so
      that listening relays wake at once.
    - ``pool_size``: the most connections the store's pool opens (each
      relay holds one while it runs, and one more to listen).

    Thread-safe. The pool is opened on first use; :meth:`close` closes it.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        table: str = "outbox",
        max_pending: int | None = None,
        max_payload_bytes: int = 256 * 1024,
        ordering: Ordering = "strict",
        notify: bool = True,
        pool_size: int = 4,
        create: bool = True,
    ) -> None:
        self._psycopg, self._psycopg_pool = _import_psycopg()
        if not isinstance(conninfo, str) or not conninfo:
            raise ValueError("conninfo must be a non-empty libpq URL or DSN string")
        self.conninfo = conninfo
        self.table = check_table(table)
        self.max_pending = check_max_pending(max_pending)
        self.max_payload_bytes = check_positive_int("max_payload_bytes", max_payload_bytes)
        self.ordering = check_ordering(ordering)
        self.notify = bool(notify)
        self.pool_size = check_positive_int("pool_size", pool_size)
        #: The LISTEN/NOTIFY channel of this table.
        self.channel = f"outbound_{self.table}"
        self._pending_lock = _lock_id(self.table, "pending")
        self._heads_lock = _lock_id(self.table, "heads")
        t = self.table
        self._enqueue_sql = _sql(
            _SQL.enqueue_limited if self.max_pending is not None else _SQL.enqueue, t
        )
        # Guards _pool and _closed; held only to create or close the pool.
        self._lock = threading.Lock()
        self._pool: psycopg_pool.ConnectionPool[Any] | None = None
        self._closed = False
        if create:
            self.create_schema()

    def __repr__(self) -> str:
        return f"<PostgresStore table={self.table!r}>"

    # ---------------------------------------------------------------- connections

    def _get_pool(self) -> psycopg_pool.ConnectionPool[Any]:
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
            if self._pool is None:
                pool = self._psycopg_pool.ConnectionPool(
                    self.conninfo,
                    min_size=0,
                    max_size=self.pool_size,
                    kwargs={"autocommit": True},
                    open=False,
                    name=f"outbound-{self.table}",
                    # A connection the server dropped while it sat in the
                    # pool (a restart) is replaced before it is handed out.
                    check=self._psycopg_pool.ConnectionPool.check_connection,
                )
                try:
                    pool.open(wait=False)
                except self._psycopg.Error as exc:
                    raise StoreError(f"cannot open the connection pool: {exc}") from exc
                self._pool = pool
            return self._pool

    @contextlib.contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            with self._get_pool().connection(timeout=30.0) as conn:
                yield conn
        except (self._psycopg.Error, self._psycopg_pool.PoolTimeout) as exc:
            raise StoreError(f"outbox database error: {exc}") from exc

    def connect(self) -> psycopg.Connection[Any]:
        """A new connection for the application (not from the pool; close it yourself)."""
        try:
            conn: psycopg.Connection[Any] = self._psycopg.connect(self.conninfo)
        except self._psycopg.Error as exc:
            raise StoreError(f"cannot connect: {exc}") from exc
        return conn

    def create_schema(self) -> None:
        """Create the table, its indexes and the slot table if missing. Idempotent.

        When they all exist it only reads the catalog: no lock, so a
        process may start while application transactions use the table.
        Otherwise the DDL waits at most ``_DDL_LOCK_TIMEOUT`` seconds for
        its locks (an open transaction on the table holds it back; the
        enqueues behind it wait meanwhile), then raises ``StoreError``.
        Serialized by an advisory lock, so processes may call it at once.
        Raises ``StoreError`` if a relation of another table holds the name
        of one of its indexes.
        """
        psycopg = self._psycopg
        try:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                if self._schema_ready(conn):
                    return
                with conn.transaction():
                    conn.execute(_SQL.ddl_lock_timeout.format(ms=int(_DDL_LOCK_TIMEOUT * 1000)))
                    conn.execute(_SQL.lock, (_lock_id(self.table, "schema"),))
                    if self._schema_ready(conn):  # another process made it meanwhile
                        return
                    for statement in _SQL.schema:
                        conn.execute(_sql(statement, self.table))
                    for name in self._schema_state(conn).old:
                        conn.execute(_SQL.drop_index.format(name=name))
                    if not self._schema_ready(conn):
                        raise StoreError(
                            f"cannot create the outbox schema: {self.table!r} or one of its "
                            "indexes is still missing"
                        )
        except psycopg.errors.LockNotAvailable as exc:
            raise StoreError(
                f"cannot create the outbox schema: table {self.table!r} was not free within "
                f"{_DDL_LOCK_TIMEOUT:g}s (a transaction is using it); try again: {exc}"
            ) from exc
        except psycopg.Error as exc:
            raise StoreError(f"cannot create the outbox schema: {exc}") from exc

    def _schema_state(self, conn: psycopg.Connection[Any]) -> _SchemaState:
        t = self.table
        ours = {f"{t}_{suffix}" for suffix in _SQL.indexes}
        old = {f"{t}_{suffix}" for suffix in _SQL.old_indexes}
        rows = conn.execute(
            _SQL.schema_state, {"table": t, "slots": f"{t}_slots", "names": sorted(ours | old)}
        ).fetchall()
        state = _SchemaState(table=bool(rows[0][0]), slots=bool(rows[0][1]))
        for _, _, name, on_table, qualified in rows:
            if name is None:
                continue
            if on_table:
                if name in old:
                    state.old.add(qualified)
                else:
                    state.present.add(name)
            elif name in ours:
                state.foreign.add(qualified)
        return state

    def _schema_ready(self, conn: psycopg.Connection[Any]) -> bool:
        """True if the table, its slot table and its indexes all exist (and no old one)."""
        state = self._schema_state(conn)
        if state.foreign:
            raise StoreError(
                f"cannot use outbox table {self.table!r}: {', '.join(sorted(state.foreign))} "
                "already exists and is not an index on it (index names are per schema); "
                "choose another table name"
            )
        expected = {f"{self.table}_{suffix}" for suffix in _SQL.indexes}
        return state.table and state.slots and state.present == expected and not state.old

    def drop_schema(self) -> None:
        """Drop the table and its slot table (tests, benchmarks). Irreversible."""
        try:
            with self._psycopg.connect(self.conninfo, autocommit=True) as conn:
                conn.execute(f"DROP TABLE IF EXISTS {self.table}, {self.table}_slots")
        except self._psycopg.Error as exc:
            raise StoreError(f"cannot drop the outbox schema: {exc}") from exc

    # -------------------------------------------------------------------- enqueue

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

        ``conn`` is the application's ``psycopg.Connection``: the row
        commits or rolls back with its transaction (in autocommit mode the
        call runs in a transaction of its own). Every argument is checked
        before anything is written: ``TypeError``/``ValueError`` for a bad
        key, type, dedupe key, delay, a NUL character in any of them or in
        the payload, or a payload that is not JSON-serializable or over
        ``max_payload_bytes``. Raises :class:`~outbound.errors.OutboxFull`
        when ``max_pending`` rows are unfinished,
        :class:`~outbound.errors.DuplicateMessage` when an unfinished row
        has ``dedupe_key``, :class:`~outbound.errors.StoreError` when the
        database fails. In each case nothing was written and the caller's
        transaction stays usable (the statements run in a savepoint when
        the caller is inside a transaction).

        With ``max_pending``, concurrent writers are serialized by an
        advisory lock held until the caller's transaction ends: keep those
        transactions short. The caller's transaction must be READ COMMITTED
        (PostgreSQL's default), or the count could miss a concurrent
        commit: another level raises ``StoreError``. Blocks on the database.
        """
        row = check_row(key, type, payload, dedupe_key, delay, self.max_payload_bytes)
        psycopg = self._psycopg
        if not isinstance(conn, psycopg.Connection):
            raise TypeError(f"conn must be a psycopg.Connection, not {conn.__class__.__name__}")
        params = {
            "key": row.key,
            "type": row.type,
            "payload": row.payload,
            "dedupe_key": row.dedupe_key,
            "delay": row.delay,
            "max_pending": self.max_pending,
            "channel": self.channel if self.notify else "",
        }
        if conn.closed:
            raise StoreError("enqueue failed: the connection is closed")
        status = conn.info.transaction_status
        statuses = psycopg.pq.TransactionStatus
        # Autocommit and idle: a transaction of its own. Inside the caller's
        # transaction: a savepoint, so that a database error undoes only this
        # call and leaves the caller's transaction usable. Not autocommit and
        # idle: these statements open the caller's transaction, rolled back
        # if they fail (it holds nothing else). Otherwise (aborted, busy):
        # as they are, and the server says why they fail.
        opens = status == statuses.IDLE and not conn.autocommit
        scoped = status == statuses.INTRANS or (status == statuses.IDLE and conn.autocommit)
        scope = conn.transaction() if scoped else contextlib.nullcontext()
        try:
            with scope:
                if self.max_pending is not None:
                    _, isolation = conn.execute(
                        _SQL.lock_and_isolation, (self._pending_lock,)
                    ).fetchone() or (None, None)
                    if isolation != "read committed":
                        raise StoreError(
                            "enqueue with max_pending needs a READ COMMITTED transaction, "
                            f"not {isolation!r}"
                        )
                found = conn.execute(self._enqueue_sql, params).fetchone()
        except (psycopg.Error, StoreError) as exc:
            if opens and not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    conn.rollback()
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"enqueue failed: {exc}") from exc
        if self.max_pending is None:
            if found is not None:
                return int(found[0])
        else:
            assert found is not None
            row_id, unfinished = found[0], found[1]
            if row_id is not None:
                return int(row_id)
            if unfinished >= self.max_pending:
                raise OutboxFull(
                    f"the outbox {self.table!r} already holds {self.max_pending} pending rows"
                )
        raise DuplicateMessage(
            f"an unfinished outbox row already has dedupe_key {row.dedupe_key!r}"
        )

    # --------------------------------------------------------------------- relays

    def session(self) -> _PostgresSession:
        """Open a relay :class:`Session`: one connection taken from the pool."""
        session = _PostgresSession(self, self._get_pool())
        session.connect(30.0)
        return session

    def listener(self, wake: Callable[[], object]) -> _Listener | None:
        """A thread that calls ``wake()`` on every NOTIFY of this table; None if off."""
        if not self.notify:
            return None
        return _Listener(self, wake)

    # ---------------------------------------------------------------- command line

    def status(self) -> OutboxStatus:
        """Counts by status and the age of the oldest pending row. Blocks on the database."""
        with self._conn() as conn:
            counts = dict.fromkeys(("pending", "processing", "sent", "dead"), 0)
            for status, count in conn.execute(_sql(_SQL.counts, self.table)):
                counts[str(status)] = int(count)
            found = conn.execute(_sql(_SQL.oldest_pending, self.table)).fetchone()
        age = None if found is None or found[0] is None else max(0.0, float(found[0]))
        return OutboxStatus(counts, age)

    def rows(self, *, status: str | None = None, limit: int = 50) -> list[RowInfo]:
        """Up to ``limit`` rows of ``status`` (or all), newest first."""
        check_list_status(status)
        check_positive_int("limit", limit)
        where = "" if status is None else "WHERE status = %(status)s"
        with self._conn() as conn:
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
        with self._conn() as conn, conn.transaction():
            conn.execute(_SQL.lock, (self._heads_lock,))
            if ids is None:
                targets = [int(r[0]) for r in conn.execute(_sql(_SQL.dead_ids, self.table))]
            else:
                targets = sorted(int(i) for i in ids)
            done = 0
            for row_id in targets:
                done += conn.execute(revive, {"id": row_id}).rowcount
        return done

    def purge(self, *, statuses: Sequence[str] = ("sent",), older_than: float = 0.0) -> int:
        """Delete rows of ``statuses`` (finished only) not updated for ``older_than`` seconds."""
        wanted = check_purge_statuses(statuses)
        older_than = check_seconds("older_than", older_than, zero=True)
        with self._conn() as conn:
            cur = conn.execute(
                _sql(_SQL.purge, self.table), {"statuses": wanted, "older_than": older_than}
            )
            return cur.rowcount

    def close(self) -> None:
        """Close the pool (waiting for its threads). Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


class _PostgresSession(Session):
    """A relay's pooled connection. Confined to one thread at a time."""

    def __init__(self, store: PostgresStore, pool: psycopg_pool.ConnectionPool[Any]) -> None:
        self._store = store
        self._pool = pool
        # The connection; None until connect(), or after it died and no new
        # one could be had (the next call tries again).
        self._conn: psycopg.Connection[Any] | None = None
        self._closed = False
        self._error: type[Exception] = store._psycopg.Error
        t = store.table
        self._sql = {
            name: _sql(getattr(_SQL, name), t)
            for name in (
                "sequence",
                "ensure_slots",
                "take_slots",
                "free_slots",
                "free_owner_slots",
                "claim",
                "finish",
                "retry",
                "promote",
                "renew",
                "renew_slots",
            )
        }

    def connect(self, timeout: float) -> psycopg.Connection[Any]:
        """The session's connection: a new one if it has none or it died.

        A connection dies with its server (a restart, a failover) or its
        backend (``pg_terminate_backend``); the pool drops it when given
        back. Waits up to ``timeout`` seconds for a new one, then raises
        ``StoreError`` (the next call tries again).
        """
        if self._closed:
            raise StoreError("the session is closed")
        conn = self._conn
        idle = self._store._psycopg.pq.TransactionStatus.IDLE
        if conn is not None:
            if not conn.closed and conn.info.transaction_status == idle:
                return conn
            self._conn = None
            self._pool.putconn(conn)  # dropped if closed, rolled back if not idle
        try:
            conn = cast("psycopg.Connection[Any]", self._pool.getconn(timeout=timeout))
        except self._error as exc:  # PoolTimeout and PoolClosed are psycopg errors
            raise StoreError(f"cannot get a connection to the outbox database: {exc}") from exc
        try:
            conn.execute("SET synchronous_commit = off")
        except self._error as exc:
            self._pool.putconn(conn)
            raise StoreError(f"cannot configure the connection: {exc}") from exc
        self._conn = conn
        return conn

    @contextlib.contextmanager
    def _tx(self) -> Iterator[psycopg.Connection[Any]]:
        conn = self.connect(_RECONNECT_TIMEOUT)
        try:
            with conn.transaction():
                yield conn
        except self._error as exc:
            raise StoreError(f"outbox database error: {exc}") from exc

    def ensure_slots(self, count: int) -> None:
        with self._tx() as conn:
            conn.execute(self._sql["ensure_slots"], {"count": count})

    def claim(
        self, owner: str, limit: int, lease: float, max_concurrency: int | None
    ) -> list[Claimed]:
        sql = self._sql
        with self._tx() as conn:
            conn.execute(_SQL.lock, (self._store._heads_lock,))
            conn.execute(sql["sequence"], {"limit": max(100, 2 * limit)})
            slots: list[int] = []
            if max_concurrency is not None:
                slots = sorted(
                    int(r[0])
                    for r in conn.execute(
                        sql["take_slots"],
                        {"owner": owner, "lease": lease, "max": max_concurrency, "limit": limit},
                    )
                )
                limit = len(slots)
                if not limit:
                    return []
            found = conn.execute(
                sql["claim"], {"owner": owner, "lease": lease, "limit": limit}
            ).fetchall()
            if len(slots) > len(found):
                conn.execute(sql["free_slots"], {"slots": slots[len(found) :], "owner": owner})
        found.sort(key=lambda r: r[0])
        claimed = []
        for i, (row_id, key, type_, payload, dedupe_key, attempts, claims, created) in enumerate(
            found
        ):
            message = OutboxMessage(
                int(row_id), key, type_, payload, int(attempts), dedupe_key, float(created)
            )
            claimed.append(Claimed(message, int(claims), slots[i] if slots else None))
        return claimed

    def finish(self, owner: str, outcomes: Sequence[Outcome]) -> int:
        mutex = self._store.ordering == "mutex"
        done = [o for o in outcomes if o.kind in ("sent", "dead")]
        again = [o for o in outcomes if o.kind in ("retry", "requeue")]
        slots = [o.slot for o in outcomes if o.slot is not None]
        to_back = [mutex and o.kind == "retry" for o in again]
        updated = 0
        sql = self._sql
        with self._tx() as conn:
            if done or any(to_back):
                conn.execute(_SQL.lock, (self._store._heads_lock,))
            if done:
                found = conn.execute(
                    sql["finish"],
                    {
                        "owner": owner,
                        "ids": [o.id for o in done],
                        "claims": [o.claims for o in done],
                        "statuses": [o.kind for o in done],
                        "errors": [o.error for o in done],
                    },
                ).fetchone()
                updated += int(found[0]) if found else 0
            if again:
                back = conn.execute(
                    sql["retry"],
                    {
                        "owner": owner,
                        "ids": [o.id for o in again],
                        "claims": [o.claims for o in again],
                        "delays": [o.delay for o in again],
                        "refunds": [1 if o.kind == "requeue" else 0 for o in again],
                        "errors": [o.error for o in again],
                        "to_back": to_back,
                    },
                ).fetchall()
                updated += len(back)
                keys = [key for key, moved in back if moved]
                if keys:
                    conn.execute(sql["promote"], {"keys": keys})
            if slots:
                conn.execute(sql["free_slots"], {"slots": slots, "owner": owner})
        return updated

    def renew(self, owner: str, lease: float) -> None:
        params = {"owner": owner, "lease": lease}
        with self._tx() as conn:
            conn.execute(self._sql["renew"], params)
            conn.execute(self._sql["renew_slots"], params)

    def release_slots(self, owner: str) -> None:
        with self._tx() as conn:
            conn.execute(self._sql["free_owner_slots"], (owner,))

    def close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if not conn.closed:
                conn.execute("RESET synchronous_commit")
        except self._error:
            pass
        self._pool.putconn(conn)


class _Listener:
    """A thread that LISTENs on the store's channel and calls ``wake()`` per notification.

    Its connection is its own (not pooled) and confined to its thread.
    :meth:`stop` returns within about ``_POLL`` seconds.
    """

    _POLL = 0.2

    def __init__(self, store: PostgresStore, wake: Callable[[], object]) -> None:
        self._store = store
        self._wake = wake
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"outbound-listen-{store.table}", daemon=True
        )

    def start(self) -> None:
        """Start listening; block until LISTEN is in place (up to 10 s)."""
        self._thread.start()
        self._ready.wait(10.0)

    def _run(self) -> None:
        psycopg = self._store._psycopg
        log = logging.getLogger("outbound")
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._store.conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {self._store.channel}")
                    self._ready.set()
                    self._wake()  # anything committed before LISTEN is seen by the next claim
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=self._POLL):
                            self._wake()
            except psycopg.Error as exc:
                log.warning("outbound: outbox listener error, reconnecting: %s", exc)
                self._ready.set()
                self._stop.wait(1.0)

    def stop(self, timeout: float | None = None) -> None:
        """Stop listening and wait up to ``timeout`` for the thread. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
