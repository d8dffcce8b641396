"""The PostgreSQL outbox store: :class:`PostgresStore` (psycopg 3, extra ``postgres``).

For many processes on many machines. psycopg and psycopg_pool are imported
when a store is built, with an error naming the extra when missing.

How concurrency is handled. There is no global lock, and no relay ever
waits on another relay's open transaction:

- Every step of a relay is one statement in a transaction of its own, so
  a relay that stalls between two round trips (a GC pause, SIGSTOP, a
  frozen VM) holds no lock at all; only its leased rows wait, until the
  lease ends. A round is two statements: ``finish`` (write the outcomes,
  move each finished key's line up, claim some of the rows moved up) and
  ``claim`` (make heads for keys that have none, then claim); ``renew`` now
  and then. A relay claims on a connection of its own
  (:meth:`PostgresStore.claim_session`), beside its writes: the server
  runs the two at once.
- Rows are taken with ``FOR NO KEY UPDATE SKIP LOCKED``: a row another
  statement holds at that moment is left for the next round.
- A key's line is its head (the one row that may be claimed) and the rows
  behind it: new rows in id order, and rows sent to the back (``seq``).
  A new row is written only when it becomes head: the statement that
  finishes the head before it finds it by key and takes it (or makes it
  head) in the same write; nothing is written for a row while it waits.
  Keys with no head (a first row, or a row its head's finisher did not
  see) get one from a claim's *look*: the rows past the last look of any
  relay (by primary key) and a sweep, in key order, of the keys that have
  new rows, going on from where the last look stopped (one row, ``{t}_look``).
  One statement looks at a time, under a transaction-scoped advisory lock
  that is tried, never waited for (a claim that cannot take it claims the
  rest as usual). The unique index on heads makes two heads for one key
  impossible: of two statements that made them at once, one fails and
  claims again without looking. Operators lock a key's head before they
  change its line, and a finisher moves a line up only if its head is the
  version its snapshot read.
- Every relay statement reaches its rows through an index, by id or in
  index order; relay connections run with bitmap scans off so that a new
  table, before it has statistics, gets the same plans. The statements
  are sent compacted (psycopg caches the parse of texts up to 4 KB).
- ``enqueue`` writes only the row (new, ``seq IS NULL``) and one
  counter shard, so no application transaction waits for a relay; without
  ``max_pending`` none waits for another either (when open transactions
  hold the 15 shards of writers, a transaction adds a shard of its own). With
  ``max_pending``, writers serialize on counter shard 0 (the count-then-
  insert race under READ COMMITTED) until their transaction ends: keep
  those short. The count is a sum over 32 shard rows: constant time.
- Capacity (``max_concurrency``) is a table of slot rows, taken in the
  claim statement and held under the relay's lease.
- A relay whose connection died (a server restart, a terminated backend)
  opens a new one at its next statement (not from the pool) and then releases
  the leases it holds but no longer tracks (see :meth:`Session.reconcile`).
- ``create_schema`` (run by every ``PostgresStore(...)``) reads the schema
  version first and takes no lock when it is current.

Durability: a relay's statements commit with the server's
``synchronous_commit`` setting. Asynchronous commit is an opt-in, made in
``conninfo`` (``?options=-c%20synchronous_commit%3Doff``, for the store's
own connections only; ``enqueue`` uses the caller's). A server crash may
then lose the last few hundred milliseconds of a relay's statements: a lost
claim returns its row to pending, a lost outcome leaves its row processing
until the relay reconciles after reconnecting (or its lease expires);
either way the row is delivered again (at least once). Per-key order does
not hold across such a crash: the outcome of a key's row and the claim of
its next row commit together and the next row is dispatched at once; lost
together, the first row goes out again after the next.

Schema version 4 (``{t}`` is the table name)::

    {t}          the rows (see _SQL.schema)
    {t}_slots    one row per capacity slot: owner and expiry
    {t}_counts   32 signed shards, and a few of single transactions (negative
                 ids), whose sum is the number of unfinished rows
    {t}_schema   the schema versions applied
    {t}_look     where the next look for keys without a head starts
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import math
import os
import random
import re
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from outbound._fork import renewed_after_fork
from outbound._log import Streaks
from outbound._log import quiet as _log
from outbound._secret import driver_error
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

if TYPE_CHECKING:
    import psycopg
    import psycopg_pool

__all__ = ["PostgresStore"]


# Counter shards: 0 for writers with max_pending (they serialize on it),
# 1..15 for the others, 16..31 for relays and operators.
_SHARDS = 32

#: Percent of each page of the outbox table that inserts fill. A row is
#: written twice after its insert (taken, then its outcome), and no write
#: can be a HOT update (status is in the partial indexes' predicates):
#: with room left, the new versions stay on their page, the WAL logs only
#: what changed (about 11% less per message), and pruning reuses the room
#: of the versions that died. Measured: one relay process 5 to 6% faster
#: (two: within the noise), a smaller table once delivered, enqueue_many
#: about 3% slower (it fills more pages).
_FILLFACTOR = 60

#: Keys with new rows a look sweeps (see _SQL.place): while the relay is
#: busy (its last claim was full), and otherwise (a relay that is not busy
#: has time to look further: a row that committed behind the front, or a
#: new key behind long lines, waits a poll for every _SWEEP_KEYS_IDLE keys
#: with new rows, those waiting behind a head included: a poll or two with
#: a few thousand, more with more; see the README's "What a relay message costs").
_SWEEP_KEYS = 32
_SWEEP_KEYS_IDLE = 2048

#: Seconds between two wide looks of one relay (_SWEEP_KEYS_IDLE keys,
#: _SEQUENCE_IDLE rows): a relay that is not busy but claims often (woken
#: by every enqueue while its keys wait on rate limits) looks wide only
#: this often, so that its claims stay cheap.
_WIDE_EVERY = 0.5


class _SQL:
    """Every statement of the PostgreSQL store. ``{t}`` is the table name."""

    # ---------------------------------------------------------- schema v2

    schema = (
        """
        CREATE TABLE {t} (
            id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            key              text        NOT NULL,
            type             text        NOT NULL,
            payload          json        NOT NULL, -- the text as enqueued
            dedupe_key       text,
            status           text        NOT NULL DEFAULT 'pending'
                             CONSTRAINT {t}_status_check
                             CHECK (status IN ('pending', 'processing', 'sent', 'dead',
                                               'cancelled')),
            head             boolean     NOT NULL DEFAULT false, -- the claimable row of its key
            seq              bigint,                             -- order in the key; NULL: new
            attempts         integer     NOT NULL DEFAULT 0,
            available_at     timestamptz NOT NULL DEFAULT now(),
            lease_owner      text,
            lease_token      bigint,                             -- fencing token of the claim
            lease_expires_at timestamptz,
            last_error       text,
            created_at       timestamptz NOT NULL DEFAULT now(),
            updated_at       timestamptz NOT NULL DEFAULT now()
        ) WITH (fillfactor = {fillfactor})
        """,
        # The claim: due heads, oldest first.
        """
        CREATE INDEX {t}_ready ON {t} (available_at, id) WHERE head AND status = 'pending'
        """,
        # The claim: expired leases; renewals; leases by owner.
        "CREATE INDEX {t}_lease ON {t} (lease_expires_at) WHERE status = 'processing'",
        # New rows (not yet their key's head, nor placed behind it), by key:
        # the first of a key's line; the keys a sweep looks at.
        "CREATE INDEX {t}_new ON {t} (key, id) WHERE seq IS NULL",
        # At most one head per key; "has this key a head?" in a look.
        """
        CREATE UNIQUE INDEX {t}_head ON {t} (key)
            WHERE head AND status IN ('pending', 'processing')
        """,
        # Placed rows waiting behind a head (sent to the back, or revived):
        # with {t}_new, the next row of a key when its head finishes.
        """
        CREATE INDEX {t}_waiting ON {t} (key, seq)
            WHERE NOT head AND status = 'pending' AND seq IS NOT NULL
        """,
        """
        CREATE UNIQUE INDEX {t}_dedupe ON {t} (dedupe_key)
            WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
        """,
        # The command line's counts, oldest pending, purge. Processing rows
        # are left out: they are found by id (the fence) or through
        # {t}_lease, and a claim adds no entry here.
        """
        CREATE INDEX {t}_state ON {t} (status, created_at) WHERE status <> 'processing'
        """,
        """
        CREATE TABLE {t}_slots (
            slot       integer PRIMARY KEY,
            owner      text,
            expires_at timestamptz
        )
        """,
    )

    # Room left in each page of {t} as rows are inserted (see _FILLFACTOR);
    # for a table of an older version, it applies to the pages written from
    # now on.
    storage = ("ALTER TABLE {t} SET (fillfactor = {fillfactor})",)

    # Shared by creation and the migration from version 1.
    counts_and_version = (
        "CREATE TABLE {t}_counts (shard bigint PRIMARY KEY, n bigint NOT NULL DEFAULT 0)",
        f"INSERT INTO {{t}}_counts (shard) SELECT generate_series(0, {_SHARDS - 1})",
        """
        UPDATE {t}_counts
        SET n = (SELECT count(*) FROM {t} WHERE status IN ('pending', 'processing'))
        WHERE shard = 0
        """,
        """
        CREATE TABLE {t}_schema (
            version    integer PRIMARY KEY,
            applied_at timestamptz NOT NULL DEFAULT now()
        )
        """,
        f"INSERT INTO {{t}}_schema (version) VALUES ({SCHEMA_VERSION})",
    )

    # Version 1 fenced with a claim counter (reused after a crash lost a
    # claim), had no 'cancelled' status and counted unfinished rows by
    # scanning. Its rows keep their ids, places and heads.
    migrate_1 = (
        "ALTER TABLE {t} ADD COLUMN lease_token bigint",
        "ALTER TABLE {t} DROP COLUMN claims",
        "ALTER TABLE {t} DROP CONSTRAINT IF EXISTS {t}_status_check",
        # Every version 1 row satisfies it: no need to scan the table.
        """
        ALTER TABLE {t} ADD CONSTRAINT {t}_status_check
            CHECK (status IN ('pending', 'processing', 'sent', 'dead', 'cancelled')) NOT VALID
        """,
    )

    # Version 2 had smallint shards: no room for a transaction's own shard
    # (see app_count).
    migrate_2 = ("ALTER TABLE {t}_counts ALTER COLUMN shard TYPE bigint",)

    # Versions 1 and 2 kept the payload as jsonb, which changes it (numbers
    # as numeric: 1e16 read back as an int, -0.0 as 0.0; keys reordered).
    # json keeps the text as enqueued. Rewrites the table.
    payload_json = ("ALTER TABLE {t} ALTER COLUMN payload TYPE json USING payload::json",)

    # Version 3 placed every new row in its key's line (a write per row) and
    # found new rows by id; version 4 leaves a new row where it is until it
    # becomes head, and finds new rows by key.
    migrate_3 = (
        "DROP INDEX IF EXISTS {t}_new",
        "CREATE INDEX {t}_new ON {t} (key, id) WHERE seq IS NULL",
    )

    # Where the next look for keys without a head starts (see ``place``):
    # one row, shared by every relay, written by the look that holds the
    # lock. A new look reads from the lowest new row.
    look_table = (
        """
        CREATE TABLE {t}_look (
            one   boolean PRIMARY KEY DEFAULT true CHECK (one),
            hint  bigint  NOT NULL,  -- the front: the highest id looked at
            sweep text    NOT NULL   -- the last key swept ('' : start again)
        )
        """,
        """
        INSERT INTO {t}_look (hint, sweep)
        SELECT coalesce((SELECT min(id) - 1 FROM {t} WHERE seq IS NULL),
                        (SELECT max(id) FROM {t}), 0), ''
        """,
    )

    record_version = f"INSERT INTO {{t}}_schema (version) VALUES ({SCHEMA_VERSION})"

    # Which version is there? Reads the catalog and {t}_schema only: takes
    # no lock on {t}, so a process may start while transactions use it.
    relations = """
        SELECT (SELECT relkind FROM pg_class WHERE oid = to_regclass(%(table)s)),
               to_regclass(%(schema)s) IS NOT NULL
    """
    version = "SELECT max(version) FROM {t}_schema"
    columns = """
        SELECT attname FROM pg_attribute
        WHERE attrelid = to_regclass(%(table)s) AND attnum > 0 AND NOT attisdropped
    """

    lock_timeout = "SET lock_timeout = '{ms}ms'"

    session_lock = "SELECT pg_advisory_lock(%s)"
    session_unlock = "SELECT pg_advisory_unlock(%s)"

    # ------------------------------------------------------------- enqueue

    # Picking a counter shard. A CTE, joined by the UPDATE: a sub-select in
    # the UPDATE's WHERE would be run again if the shard row changed since
    # the statement's snapshot (READ COMMITTED's recheck), pick another
    # shard, and update none.
    # For writers without max_pending (CTEs after ``ins``; {delta} is the
    # number of rows written): the first free shard of 1..15. When open
    # transactions hold all of them, a shard of the transaction's own,
    # -txid_current(): no other transaction ever writes it (it is not
    # visible to them before it commits), so the enqueue waits for no
    # unrelated transaction. Such a shard folds into itself up to 8 earlier
    # ones that no transaction holds, so they stay few (relays fold them
    # too, see finish). The count is the sum of every shard.
    # A transaction of REPEATABLE READ or SERIALIZABLE (the application's)
    # writes its own shard at once, and folds none: a shared shard, or one
    # folded, changed since its snapshot would fail it to serialize, for a
    # reason that is not the application's.
    app_count = """
        pick AS (
            SELECT shard FROM {t}_counts
            WHERE current_setting('transaction_isolation') = 'read committed'
              AND shard BETWEEN 1 AND 15
            ORDER BY shard LIMIT 1 FOR UPDATE SKIP LOCKED
        ), counted AS (
            UPDATE {t}_counts AS c SET n = c.n + {delta}
            FROM pick WHERE c.shard = pick.shard AND EXISTS (SELECT 1 FROM ins)
        ), folded AS (
            -- (The isolation tested outside the sub-select too: a plan that
            -- scans the table, even to delete nothing, reads every row, which
            -- under SERIALIZABLE conflicts with every other enqueue's shard.)
            DELETE FROM {t}_counts
            WHERE current_setting('transaction_isolation') = 'read committed'
              AND shard IN (SELECT f.shard FROM {t}_counts AS f
                            WHERE current_setting('transaction_isolation') = 'read committed'
                              AND f.shard < 0 AND f.shard <> -txid_current()
                              AND NOT EXISTS (SELECT 1 FROM pick)
                              AND EXISTS (SELECT 1 FROM ins)
                            ORDER BY f.shard LIMIT 8 FOR UPDATE SKIP LOCKED)
            RETURNING n
        ), own AS (
            INSERT INTO {t}_counts AS c (shard, n)
            SELECT -txid_current(), {delta} + (SELECT coalesce(sum(n), 0) FROM folded)
            WHERE NOT EXISTS (SELECT 1 FROM pick) AND EXISTS (SELECT 1 FROM ins)
            ON CONFLICT (shard) DO UPDATE SET n = c.n + excluded.n
        )
    """

    # For relays and operators.
    relay_shard = """
        SELECT coalesce((SELECT shard FROM {t}_counts WHERE shard >= 16
                         ORDER BY shard LIMIT 1 FOR UPDATE SKIP LOCKED),
                        16 + pg_backend_pid() %% 16) AS shard
    """

    notify = "CASE WHEN %(channel)s <> '' THEN pg_notify(%(channel)s, '') END"

    unfinished_dedupe = """
        EXISTS (SELECT 1 FROM {t}
                WHERE dedupe_key = %(dedupe_key)s AND status IN ('pending', 'processing'))
    """

    enqueue = f"""
        WITH ins AS (
            INSERT INTO {{t}} (key, type, payload, dedupe_key, available_at)
            VALUES (%(key)s, %(type)s, %(payload)s::json, %(dedupe_key)s,
                    now() + %(delay)s * interval '1 second')
            ON CONFLICT (dedupe_key)
                WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
                DO NOTHING
            RETURNING id
        ), {app_count.replace("{delta}", "1")}
        SELECT (SELECT id FROM ins), NULL::boolean, (SELECT {notify} FROM ins)
    """

    # Shard 0 is locked until the caller's transaction ends, first by a
    # statement of its own (lock_counter): the next writer with max_pending
    # waits there, and only then runs the counting statement, whose
    # snapshot is taken after the wait. (In one statement the wait would
    # re-read shard 0 but not the other shards: every row finished during
    # the wait would still count, and writers queued behind a long
    # transaction were refused far below max_pending.) Relays only lower
    # the other shards, so what they finish meanwhile errs on the side of
    # refusing, by at most what finished during one statement.
    lock_counter = "SELECT 1 FROM {t}_counts WHERE shard = 0 FOR UPDATE"

    enqueue_limited = f"""
        WITH counted AS (
            UPDATE {{t}}_counts SET n = n + 1
            WHERE shard = 0
              AND n + 1 + (SELECT coalesce(sum(n), 0) FROM {{t}}_counts WHERE shard <> 0)
                  <= %(max_pending)s
              AND NOT {unfinished_dedupe}
            RETURNING n
        ), ins AS (
            INSERT INTO {{t}} (key, type, payload, dedupe_key, available_at)
            SELECT %(key)s, %(type)s, %(payload)s::json, %(dedupe_key)s,
                   now() + %(delay)s * interval '1 second'
            WHERE EXISTS (SELECT 1 FROM counted)
            RETURNING id
        )
        SELECT (SELECT id FROM ins), {unfinished_dedupe},
               (SELECT {notify} FROM ins)
    """

    batch = """
        SELECT * FROM unnest(%(keys)s::text[], %(types)s::text[], %(payloads)s::text[],
                             %(dedupe_keys)s::text[], %(delays)s::float8[])
                      WITH ORDINALITY AS m(key, type, payload, dedupe_key, delay, ord)
    """

    batch_duplicate = """
        SELECT u.dedupe_key FROM {t} AS u JOIN m ON u.dedupe_key = m.dedupe_key
        WHERE u.status IN ('pending', 'processing') LIMIT 1
    """

    batch_insert = """
        INSERT INTO {t} (key, type, payload, dedupe_key, available_at)
        SELECT key, type, payload::json, dedupe_key, now() + delay * interval '1 second'
        FROM m WHERE {condition}
        ORDER BY ord
        RETURNING id
    """

    enqueue_many = f"""
        WITH m AS ({batch}), dup AS ({batch_duplicate}),
        ins AS ({batch_insert.replace("{condition}", "NOT EXISTS (SELECT 1 FROM dup)")}),
        {app_count.replace("{delta}", "(SELECT count(*) FROM ins)")}
        SELECT (SELECT array_agg(id) FROM ins), (SELECT dedupe_key FROM dup),
               (SELECT {notify} FROM (SELECT 1 FROM ins LIMIT 1) AS one)
    """

    enqueue_many_limited = f"""
        WITH m AS ({batch}), dup AS ({batch_duplicate}),
        counted AS (
            UPDATE {{t}}_counts SET n = n + %(n)s
            WHERE shard = 0
              AND n + %(n)s + (SELECT coalesce(sum(n), 0) FROM {{t}}_counts WHERE shard <> 0)
                  <= %(max_pending)s
              AND NOT EXISTS (SELECT 1 FROM dup)
            RETURNING n
        ),
        ins AS ({batch_insert.replace("{condition}", "EXISTS (SELECT 1 FROM counted)")})
        SELECT (SELECT array_agg(id) FROM ins), (SELECT dedupe_key FROM dup),
               (SELECT {notify} FROM (SELECT 1 FROM ins LIMIT 1) AS one)
    """

    # -------------------------------------------------------------- relays

    # Each relay statement is a transaction of its own: now() is its time.
    # Every relay statement finds its rows by id, through a partial index
    # or by key through {t}_head / {t}_waiting, and reads per-row values from
    # arrays by position: no plan joins two sets of rows by a nested loop,
    # whatever the table's statistics (a new table has none).

    # The first row of key ``{k}``'s line that is not its head: the lower
    # of its first new row (by id, through {t}_new) and its first placed
    # waiting row (by seq, through {t}_waiting; a row sent to the back, or
    # revived). Two index probes. (A new row is never head: every write that
    # makes a row head gives it its seq.) Each probe reads the key's range
    # of its index, in the index's order: with "key = {k} ORDER BY id" (the
    # planner drops an ordering by a column it knows is constant) a generic
    # plan made on statistics of a few keys read the primary key from the
    # oldest row (sent rows and the other keys' rows: the whole table, at
    # every finish); with "key >= {k}" alone a key whose line ended read on
    # through the other keys' entries (every row made head since the last
    # vacuum, while an old snapshot keeps them).
    line_first = """
        SELECT id, key, available_at FROM (
            (SELECT id, key, available_at, id AS o FROM {t}
             WHERE key >= {k} AND key <= {k} AND seq IS NULL AND status = 'pending'
             ORDER BY key, id LIMIT 1)
            UNION ALL
            (SELECT id, key, available_at, seq FROM {t}
             WHERE key >= {k} AND key <= {k} AND NOT head AND status = 'pending'
             AND seq IS NOT NULL ORDER BY key, seq LIMIT 1)
        ) AS u ORDER BY o LIMIT 1
    """

    # Make heads for keys that have none: the first part of ``claim`` and of
    # ``sequence``. A new row (``seq IS NULL``) stays where it is until it
    # becomes its key's head: a finisher finds it by key (``line_first``)
    # and takes or promotes it in the write that finishes the head before
    # it; nothing is written for a row that waits behind a head. Only keys
    # without a head need a statement of their own, and one statement at a
    # time looks for them, under a transaction-scoped advisory lock that is
    # tried, never waited for. It looks at:
    # - the front: rows above ``hint``, the highest id the relay's previous
    #   look reached, by primary key (new rows arrive there);
    # - the sweep: up to ``sweep_limit`` keys that have new rows, after
    #   ``sweep`` in key order (a loose scan of {t}_new), so that every such
    #   key is looked at again in turn: a row that committed after the
    #   front had passed its id, or whose head's finisher did not see it,
    #   gets its head this way.
    # For each key seen with no head, its first line row is locked (SKIP
    # LOCKED, rechecked) and made head: claimed by the statement or left
    # pending as head. Two statements that made a head for one key at once
    # (the unique {t}_head index) fail one of them; it claims again without
    # looking (see claim()).
    place = """
        look AS (   -- under the look's lock, or nothing (volatile: run once)
            SELECT hint, sweep FROM {t}_look
            WHERE %(seq_limit)s > 0 AND pg_try_advisory_xact_lock(%(seq_lock)s)
        ), front AS MATERIALIZED (
            SELECT id, key, seq FROM {t}
            WHERE id > (SELECT hint FROM look)
            ORDER BY id LIMIT %(seq_limit)s
        ), swept (key, n) AS (
            (SELECT key, 1 FROM {t}
             WHERE seq IS NULL AND key > (SELECT sweep FROM look)
             ORDER BY key LIMIT 1)
            UNION ALL
            SELECT nx.key, s.n + 1 FROM swept AS s, LATERAL (
                SELECT key FROM {t} WHERE seq IS NULL AND key > s.key ORDER BY key LIMIT 1
            ) AS nx
            WHERE s.n < %(sweep_limit)s
        ), seen AS MATERIALIZED (   -- the keys seen that have no head
            SELECT key FROM (SELECT key FROM front WHERE seq IS NULL
                             UNION SELECT key FROM swept) AS k
            WHERE NOT EXISTS (   -- a probe per key ("OFFSET 0": not a join)
                SELECT FROM {t} AS h
                WHERE h.key = k.key AND h.head AND h.status IN ('pending', 'processing')
                OFFSET 0
            )
        ), placed AS MATERIALIZED (   -- their first rows, locked, at their latest version
            -- (each by its id: "IS NOT DISTINCT FROM" keeps the planner from
            -- reading every pending row of {t}_state instead)
            SELECT o.* FROM seen AS k, LATERAL ({line_first_k}) AS f, LATERAL (
                SELECT id, key, available_at FROM {t}
                WHERE id = f.id AND NOT head AND status IS NOT DISTINCT FROM 'pending'
                FOR NO KEY UPDATE SKIP LOCKED
            ) AS o
        ), looked AS (   -- where the next look starts (another may have gone further)
            UPDATE {t}_look
            SET hint = greatest(hint, coalesce((SELECT max(id) FROM front), hint)),
                -- a sweep that found fewer keys reached the last: start again
                sweep = coalesce((SELECT key FROM swept WHERE n = %(sweep_limit)s), '')
            WHERE EXISTS (SELECT FROM look)
        )
    """.replace("{line_first_k}", line_first.replace("{k}", "k.key"))

    # The writes of ``place``; ``{claimed}`` is the set of rows the same
    # statement claims (they are written by the claim instead). Heads made
    # and not claimed here can be claimed by any relay: ``{woke}`` is
    # ``RETURNING pg_notify(channel)`` when the store notifies (one
    # notification at commit, however many rows), so that relays that
    # found nothing while this statement held the look's lock claim them
    # now, not at their next poll.
    place_writes = """
        heads AS (
            UPDATE {t} AS o SET head = true, seq = coalesce(o.seq, o.id)
            WHERE o.id = ANY(ARRAY(
                SELECT id FROM placed WHERE id <> ALL(ARRAY(SELECT id FROM {claimed}))
            ))
            {woke}
        )
    """

    # Make heads, claiming nothing (benchmarks and tests).
    sequence = f"""
        WITH RECURSIVE {place}, nothing AS (SELECT NULL::bigint AS id WHERE false),
        {place_writes.replace("{claimed}", "nothing")}
        SELECT count(*) FROM placed
    """

    ensure_slots = """
        INSERT INTO {t}_slots (slot) SELECT generate_series(1, %(count)s)
        ON CONFLICT (slot) DO NOTHING
    """

    lease_until = "now() + %(lease)s * '1s'::interval"

    expired = """
        SELECT id FROM {t}
        WHERE status = 'processing' AND lease_expires_at < now()
          AND key <> ALL(%(held)s::text[])
        ORDER BY lease_expires_at LIMIT {limit}
        FOR NO KEY UPDATE SKIP LOCKED
    """

    ready = """
        SELECT id FROM {t}
        WHERE head AND status = 'pending' AND available_at <= now()
          AND key <> ALL(%(skip)s::text[])
        ORDER BY available_at, id LIMIT {limit}
        FOR NO KEY UPDATE SKIP LOCKED
    """

    # The rows the relay put back that are due now or within ``ahead``
    # seconds (``first``, by id; the relay passes no more than it claims),
    # claimed before the other due heads, which leave them out. ``claim``
    # returns how long each row it claims has until it is due, as of the
    # end of the statement (see Claimed.wait). With capacity slots (``claim_slots``)
    # due heads are taken oldest first only: that statement would no longer
    # fit psycopg's parse cache. The rows are found by id only: a status
    # test no partial index can prove (a plan made on a near-empty table
    # read every pending row through the status index, at each claim).
    due_back = """
        SELECT id FROM {t}
        WHERE id = ANY(%(first)s::bigint[]) AND head
          AND status IS NOT DISTINCT FROM 'pending'
          AND available_at <= now() + %(ahead)s * '1s'::interval
          AND key <> ALL(%(skip)s::text[])
        FOR NO KEY UPDATE SKIP LOCKED
    """
    ready_after_back = ready.replace("ORDER BY", "AND id <> ALL(%(first)s::bigint[]) ORDER BY")

    # A claim's write: a ready head, an expired lease, or a new row made head.
    claim_set = f"""
        SET status = 'processing', head = true, seq = coalesce(o.seq, o.id),
            lease_owner = %(owner)s, lease_token = %(token)s,
            lease_expires_at = {lease_until},
            attempts = o.attempts + 1, updated_at = now()
    """

    # A payload over %(cap)s bytes is not in the answer (NULL: the relay reads
    # it next, see ``payloads``): a relay stopped while the answer is on its
    # way (SIGSTOP, a paused VM) would leave the server blocked sending it,
    # and the statement uncommitted, its rows and the look's lock held until
    # it runs again. Capped, a batch's answer fits in the sockets' buffers:
    # the statement commits, and the leases run out as usual.
    claim_returning = """
        RETURNING o.id, o.key, o.type,
                  CASE WHEN octet_length(o.payload::text)<=%(cap)s THEN o.payload::text END,
                  o.dedupe_key, o.attempts, extract(epoch FROM o.created_at)::float8
    """

    # Make heads, then claim: expired leases first, then due heads, oldest
    # first, then the rows just made head.
    claim = f"""
        WITH RECURSIVE {place},
        expired AS MATERIALIZED ({expired.replace("{limit}", "%(limit)s")}),
        due_back AS MATERIALIZED ({due_back}),
        ready AS MATERIALIZED ({ready_after_back.replace("{limit}", "%(limit)s")}),
        picked AS MATERIALIZED (
            (SELECT id FROM expired) UNION ALL (SELECT id FROM due_back)
            UNION ALL (SELECT id FROM ready) LIMIT %(limit)s
        ), fresh AS MATERIALIZED (
            SELECT id FROM placed
            WHERE available_at <= now() AND key <> ALL(%(skip)s::text[])
            ORDER BY id LIMIT greatest(0, %(limit)s - (SELECT count(*) FROM picked))
        ), claiming AS MATERIALIZED (
            (SELECT id FROM picked) UNION ALL (SELECT id FROM fresh)
        ),
        {place_writes.replace("{claimed}", "claiming")},
        claimed AS (
            UPDATE {{t}} AS o {claim_set}
            WHERE o.id = ANY(ARRAY(SELECT id FROM claiming))
            {claim_returning}, extract(epoch FROM o.available_at - clock_timestamp())::float8
        )
        SELECT *, NULL::integer FROM claimed
    """

    # With capacity slots: as many rows as free slots, each paired with one
    # (``p``), never a slot of the relay's own rows (``mine``), even past their
    # expiry: their outcomes free them by slot and owner. (Terse: the text
    # must fit psycopg's parse cache with a table name of 40 characters.)
    claim_slots = f"""
        WITH RECURSIVE {place},
        free AS MATERIALIZED (
            SELECT slot FROM {{t}}_slots
            WHERE slot<=%(max)s AND (owner IS NULL OR expires_at<now())
              AND slot<>ALL(%(mine)s::int[])
            ORDER BY slot LIMIT %(limit)s
            FOR NO KEY UPDATE SKIP LOCKED
        ),
        expired AS MATERIALIZED ({expired.replace("{limit}", "(SELECT count(*) FROM free)")}),
        ready AS MATERIALIZED ({ready.replace("{limit}", "(SELECT count(*) FROM free)")}),
        picked AS MATERIALIZED (
            (SELECT id FROM expired) UNION ALL (SELECT id FROM ready)
            LIMIT (SELECT count(*) FROM free)
        ), fresh AS MATERIALIZED (
            SELECT id FROM placed
            WHERE available_at <= now() AND key <> ALL(%(skip)s::text[])
            ORDER BY id
            LIMIT greatest(0, (SELECT count(*) FROM free) - (SELECT count(*) FROM picked))
        ), claiming AS MATERIALIZED (
            (SELECT id FROM picked) UNION ALL (SELECT id FROM fresh)
        ), p AS MATERIALIZED (
            SELECT unnest(ARRAY(SELECT slot FROM free ORDER BY slot)) AS slot,
                   unnest(ARRAY(SELECT id FROM claiming ORDER BY id)) AS id
        ), taken AS (
            UPDATE {{t}}_slots AS s SET owner = %(owner)s, expires_at = {lease_until}
            FROM p WHERE s.slot = p.slot AND p.id IS NOT NULL
            RETURNING s.slot, p.id
        ),
        {place_writes.replace("{claimed}", "claiming")},
        claimed AS (
            UPDATE {{t}} AS o {claim_set}
            FROM taken WHERE o.id = taken.id
            {claim_returning}, taken.slot
        )
        SELECT * FROM claimed
    """
    # (Room for the text under psycopg's parse cache: a CTE referenced more
    # than once is materialized without the word.)
    claim_slots = (
        claim_slots.replace("free AS MATERIALIZED", "free AS")
        .replace("picked AS MATERIALIZED", "picked AS")
        .replace("claiming AS MATERIALIZED", "claiming AS")
        .replace("placed AS MATERIALIZED", "placed AS")
        .replace("front AS MATERIALIZED", "front AS")
    )

    # The server's clock, which stamps created_at (see Session.now).
    now = "SELECT extract(epoch FROM clock_timestamp())::float8"

    # The payloads the claiming statements left out (over ``cap`` bytes),
    # read after they committed: a payload never changes.
    payloads = "SELECT id, payload::text FROM {t} WHERE id = ANY(%(ids)s::bigint[])"

    # The fence of a relay's row: still processing, under its owner and the
    # token of its claim (``p.token``).
    fence = """
        o.status IS NOT DISTINCT FROM 'processing' AND o.lease_owner = %(owner)s
        AND o.lease_token = p.token
    """

    # Every outcome of a batch in one statement, fenced by owner and token;
    # a row another statement holds is left for the next try ("later"). An
    # outcome that ends the row's time as its key's head (sent, dead, a
    # "mutex" retry) moves the line up as this statement's snapshot sees
    # it: only if the locked row is the version the snapshot read (an
    # operator updates the head whenever it changes the line behind it). Up
    # to ``take`` of the rows moved up that are due are claimed at once by
    # this relay, under a new token: one write makes them head and
    # processing.
    # The outcomes come as parallel arrays (delays, errors and to_back are
    # empty when all are 0, NULL and false), read in one pass by unnest;
    # each row is read by its id twice, as the snapshot sees it and
    # locked, in a loop over the outcomes (a probe of the primary key
    # each: no search of the arrays per row).
    finish = f"""
        WITH snap AS MATERIALIZED (
            SELECT s.id, s.key, p.kind, coalesce(p.delay, 0) AS delay, p.error,
                   coalesce(p.to_back, false) AS to_back,
                   l.v IS NOT NULL AS locked, l.v = s.v AS same
            FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(kinds)s::text[],
                        %(delays)s::float8[], %(errors)s::text[], %(to_back)s::bool[])
                 AS p(id, token, kind, delay, error, to_back)
            CROSS JOIN LATERAL (
                SELECT o.id, o.key, o.xmin AS v FROM {{t}} AS o WHERE o.id = p.id AND {fence}
            ) AS s
            LEFT JOIN LATERAL (
                SELECT o.xmin AS v FROM {{t}} AS o WHERE o.id = p.id AND {fence}
                FOR NO KEY UPDATE OF o SKIP LOCKED
            ) AS l ON true
        ), go AS MATERIALIZED (
            SELECT * FROM snap
            WHERE locked AND (NOT (kind IN ('sent', 'dead') OR to_back) OR same)
        ), nexts AS MATERIALIZED (   -- as the snapshot sees the lines: a row sent back is head
            SELECT nx.* FROM (SELECT DISTINCT key FROM go
                              WHERE kind IN ('sent', 'dead') OR to_back) AS k
            CROSS JOIN LATERAL ({line_first.replace("{k}", "k.key")}) AS nx
        ), done AS (
            UPDATE {{t}} AS o
            SET status = CASE WHEN go.kind IN ('sent', 'dead') THEN go.kind ELSE 'pending' END,
                last_error = CASE WHEN go.kind IN ('sent', 'dead') THEN go.error
                                  ELSE coalesce(go.error, o.last_error) END,
                available_at = CASE WHEN go.kind IN ('sent', 'dead') THEN o.available_at
                                    ELSE now() + go.delay * interval '1 second'
                               END,
                attempts = o.attempts - (go.kind = 'requeue')::int,
                -- A row sent back (a head) stays head if none waits behind it.
                head = o.head AND NOT (go.to_back AND o.key IN (SELECT key FROM nexts)),
                seq = CASE WHEN go.to_back THEN nextval(pg_get_serial_sequence('{{t}}', 'id'))
                           ELSE o.seq END,
                lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
                updated_at = now()
            FROM go WHERE o.id = go.id
            RETURNING o.id, go.kind
        ), taken AS MATERIALIZED (
            SELECT id FROM nexts
            WHERE available_at <= now() AND key <> ALL(%(skip)s::text[])
            ORDER BY available_at, id LIMIT %(take)s
        ),
        -- Nothing else changes a waiting row while its key's head is locked
        -- (operators lock the head first), so these need no recheck.
        promoted AS (
            -- (the rows not taken, each probed by its id: not every row
            -- moved up, read and then left out)
            UPDATE {{t}} AS w SET head = true, seq = coalesce(w.seq, w.id)
            WHERE w.id = ANY(ARRAY(SELECT id FROM nexts
                                   WHERE id <> ALL(ARRAY(SELECT id FROM taken))))
        ), took AS (
            UPDATE {{t}} AS o {claim_set}
            WHERE o.id = ANY(ARRAY(SELECT id FROM taken))
            {claim_returning}
        ), pick AS ({relay_shard}), folded AS (
            -- Shards of transactions that ended (see app_count), a few a batch.
            DELETE FROM {{t}}_counts
            WHERE shard IN (SELECT f.shard FROM {{t}}_counts AS f WHERE f.shard < 0
                            ORDER BY f.shard LIMIT 8 FOR UPDATE SKIP LOCKED)
            RETURNING n
        ), counted AS (
            UPDATE {{t}}_counts AS c
            SET n = c.n - (SELECT count(*) FROM done WHERE kind IN ('sent', 'dead'))
                        + (SELECT coalesce(sum(n), 0) FROM folded)
            FROM pick
            WHERE c.shard = pick.shard
        ), freed AS (
            UPDATE {{t}}_slots SET owner = NULL, expires_at = NULL
            WHERE slot = ANY(%(slots)s::integer[]) AND owner = %(owner)s
        )
        SELECT ARRAY(SELECT id FROM done), ARRAY(SELECT id FROM snap),
               NULL, NULL, NULL, NULL, NULL, NULL, NULL   -- typed by the rows below
        UNION ALL
        SELECT NULL, NULL, * FROM took
    """

    renew = f"""
        WITH d AS (SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token)),
        renewed AS (
            UPDATE {{t}} AS o SET lease_expires_at = {lease_until}
            FROM d
            WHERE o.id = d.id AND o.lease_token = d.token AND o.lease_owner = %(owner)s
              AND o.status IS NOT DISTINCT FROM 'processing'   -- by id, not the lease index
              -- a row an operator holds is left (it is being closed): the
              -- others are renewed without waiting for it
              AND o.id = ANY(ARRAY(SELECT id FROM {{t}} WHERE id = ANY(%(ids)s::bigint[])
                                   FOR NO KEY UPDATE SKIP LOCKED))
            RETURNING 1
        ), slots AS (
            UPDATE {{t}}_slots SET expires_at = {lease_until}
            WHERE slot = ANY(%(slots)s::integer[]) AND owner = %(owner)s
        )
        SELECT count(*) FROM renewed
    """

    # A row claimed under an ``unseen`` token (a claiming statement whose
    # answer never came: it committed, the connection died before the rows
    # reached the relay) was never delivered: its attempt is taken back,
    # once (the token goes with it: a reconcile whose own answer was lost
    # runs again). Rows and slots another transaction holds are left (an
    # operator closing the row, a relay claiming an expired lease): the
    # relay claims nothing until its reconcile is through, so it must not
    # wait for anyone. Counts the rows whose lease was still running, or
    # whose attempt it takes back: not a row released already (by the
    # reconcile of the relay's other session, or one whose answer was lost).
    reconcile = """
        WITH d AS (SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token)),
        r AS MATERIALIZED (
            SELECT l.id, l.lease_expires_at > now()
                         OR coalesce(l.lease_token = ANY(%(unseen)s::bigint[]), false) AS counted
            FROM {t} AS l
            WHERE l.status = 'processing' AND l.lease_owner = %(owner)s
              AND NOT EXISTS (SELECT 1 FROM d WHERE d.id = l.id AND d.token = l.lease_token)
            FOR NO KEY UPDATE SKIP LOCKED
        ), released AS (
            UPDATE {t} AS o
            SET lease_expires_at = now(),
                attempts = o.attempts
                           - coalesce(o.lease_token = ANY(%(unseen)s::bigint[]), false)::int,
                lease_token = CASE WHEN o.lease_token = ANY(%(unseen)s::bigint[]) THEN NULL
                                   ELSE o.lease_token END
            WHERE o.id = ANY(ARRAY(SELECT id FROM r))
              AND o.status = 'processing' AND o.lease_owner = %(owner)s
            RETURNING o.id
        ), slots AS (
            UPDATE {t}_slots SET owner = NULL, expires_at = NULL
            WHERE slot = ANY(ARRAY(
                    SELECT slot FROM {t}_slots
                    WHERE owner = %(owner)s AND NOT (slot = ANY(%(slots)s::integer[]))
                    FOR NO KEY UPDATE SKIP LOCKED))
              AND owner = %(owner)s
        )
        SELECT count(*) FROM r WHERE counted AND id = ANY(ARRAY(SELECT id FROM released))
    """

    free_owner_slots = "UPDATE {t}_slots SET owner = NULL, expires_at = NULL WHERE owner = %s"

    # The server processes of connections dropped with a statement on them
    # (the watchdog gave up on its answer, or the connection died): the
    # statement may still run there, and commit after the relay went on
    # over a new connection: a claim under a token the relay no longer
    # keeps, a reconcile that expires leases of rows claimed since. Each one
    # still there (the same pid and start: never a process that took the
    # pid since) is told to end; returns how many were still there.
    end_orphans = """
        SELECT count(pg_terminate_backend(a.pid))
        FROM pg_stat_activity AS a
        JOIN unnest(%(pids)s::integer[], %(starts)s::bigint[]) AS o(pid, started)
          ON a.pid = o.pid
         AND (extract(epoch FROM a.backend_start) * 1000000)::bigint = o.started
        WHERE a.pid <> pg_backend_pid()
    """

    # The start of the connection's server process, in microseconds (read
    # as a number: no date style to parse), and the address and port the
    # server took the connection on (NULL, NULL over a Unix-domain socket).
    # Needs the view, which a hardened database may not grant: then the
    # relay does without.
    backend_start = """
        SELECT (extract(epoch FROM backend_start) * 1000000)::bigint,
               host(inet_server_addr()), inet_server_port()
        FROM pg_stat_activity WHERE pid = pg_backend_pid()
    """

    # ----------------------------------------------------------- operators

    row_columns = """
        id, key, type, status, attempts, extract(epoch FROM created_at)::float8, last_error,
        extract(epoch FROM updated_at)::float8, extract(epoch FROM available_at)::float8,
        head AND status IN ('pending', 'processing'), dedupe_key, lease_owner,
        extract(epoch FROM lease_expires_at)::float8
    """

    # The rows waiting behind head ``h``: new ones (by key in {t}_new) and placed ones.
    waiting_of_h = """
        SELECT 1 FROM {t} AS w
        WHERE w.key = h.key AND w.seq IS NULL AND NOT w.head AND w.status = 'pending'
        UNION ALL
        SELECT 1 FROM {t} AS w
        WHERE w.key = h.key AND NOT w.head AND w.status = 'pending' AND w.seq IS NOT NULL
    """

    admin: ClassVar[Mapping[str, str]] = {
        "counts": "SELECT status, count(*) FROM {t} GROUP BY status",
        "oldest_pending": """
            SELECT extract(epoch FROM statement_timestamp() - min(created_at))::float8
            FROM {t} WHERE status = 'pending'
        """,
        "unfinished": "SELECT sum(n) FROM {t}_counts",
        "rows": """
            SELECT {cols} FROM {t}
            WHERE (%(status)s::text IS NULL OR status = %(status)s)
              AND (%(key)s::text IS NULL OR key = %(key)s)
            ORDER BY id DESC LIMIT %(limit)s
        """,
        "row": "SELECT {cols} FROM {t} WHERE id = %(id)s",
        "blocked": f"""
            SELECT {{cols}}, h.key, (SELECT count(*) FROM ({waiting_of_h}) AS w) AS waiting
            FROM {{t}} AS h
            WHERE h.head AND h.status IN ('pending', 'processing')
              AND (h.status = 'processing' OR h.available_at > statement_timestamp())
              AND (h.last_error IS NOT NULL OR EXISTS ({waiting_of_h}))
            ORDER BY h.created_at, h.id LIMIT %(limit)s
        """,
        "leases": """
            SELECT lease_owner, count(*), extract(epoch FROM min(lease_expires_at))::float8
            FROM {t} WHERE status = 'processing' GROUP BY lease_owner
        """,
        "slot_owners": """
            SELECT owner, count(*) FROM {t}_slots
            WHERE owner IS NOT NULL AND expires_at >= statement_timestamp() GROUP BY owner
        """,
        # The lease each relay set last: it moves forward at every claim and renewal.
        "lease_ends": """
            SELECT lease_owner, extract(epoch FROM max(lease_expires_at))::float8
            FROM {t} WHERE status = 'processing' GROUP BY lease_owner
        """,
        # Times come from the server's clock.
        "clock": "SELECT extract(epoch FROM statement_timestamp())::float8",
        # Rows marked sent per bucket of %(bucket)s seconds from %(start)s (a
        # sent row's updated_at is when it was marked sent).
        "sent_since": """
            SELECT floor((extract(epoch FROM updated_at) - %(start)s) / %(bucket)s)::bigint,
                   count(*)
            FROM {t}
            WHERE status = 'sent'
              AND updated_at >= to_timestamp(%(start)s) AND updated_at < to_timestamp(%(end)s)
            GROUP BY 1
        """,
        "slots": """
            SELECT slot, CASE WHEN expires_at >= statement_timestamp() THEN owner END,
                   CASE WHEN expires_at >= statement_timestamp()
                        THEN extract(epoch FROM expires_at)::float8 END
            FROM {t}_slots ORDER BY slot
        """,
        "dead_ids": "SELECT id FROM {t} WHERE status = 'dead' ORDER BY id",
        "row_state": "SELECT key, status, head, dedupe_key FROM {t} WHERE id = %(id)s",
        # The lock of the looks that make heads (see ``place``): waited for.
        "lock_lines": "SELECT pg_advisory_xact_lock(%(look_lock)s)",
        "lock_head": """
            SELECT id FROM {t}
            WHERE key = %(key)s AND head AND status IN ('pending', 'processing')
            FOR NO KEY UPDATE
        """,
        "head_of": """
            SELECT id FROM {t} WHERE key = %(key)s AND head AND status IN ('pending', 'processing')
        """,
        "lock_row": """
            SELECT id, key, head FROM {t} WHERE id = %(id)s AND status = ANY(%(statuses)s)
            FOR NO KEY UPDATE
        """,
        "duplicate": """
            SELECT 1 FROM {t}
            WHERE dedupe_key = %(dedupe_key)s AND status IN ('pending', 'processing')
        """,
        "revive": """
            UPDATE {t}
            SET status = 'pending', attempts = 0, available_at = statement_timestamp(),
                updated_at = statement_timestamp(), created_at = statement_timestamp(),
                head = false,
                seq = nextval(pg_get_serial_sequence('{t}', 'id')),
                lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
            WHERE id = %(id)s AND status = 'dead'
        """,
        "close": """
            UPDATE {t}
            SET status = %(status)s, last_error = %(error)s, updated_at = statement_timestamp(),
                seq = coalesce(seq, id),
                lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
            WHERE id = %(id)s AND status IN ('pending', 'processing')
        """,
        "promote": f"""
            UPDATE {{t}} SET head = true, seq = coalesce(seq, id)
            WHERE id = (SELECT nx.id FROM ({line_first.replace("{k}", "%(key)s")}) AS nx)
              AND NOT EXISTS (SELECT FROM {{t}} AS h WHERE h.key = %(key)s AND h.head
                                AND h.status IN ('pending', 'processing'))
        """,
        "touch": "UPDATE {t} SET seq = seq WHERE id = %(id)s",
        "count": f"""
            WITH pick AS ({relay_shard})
            UPDATE {{t}}_counts AS c SET n = c.n + %(delta)s FROM pick WHERE c.shard = pick.shard
        """,
        "purge": """
            DELETE FROM {t}
            WHERE status = ANY(%(statuses)s)
              AND updated_at < statement_timestamp() - %(older_than)s * interval '1 second'
        """,
    }


def _sql(text: str, table: str) -> str:
    return (
        text.replace("{cols}", _SQL.row_columns)
        .replace("{fillfactor}", str(_FILLFACTOR))
        .replace("{t}", table)
    )


def _compact(text: str) -> str:
    """``text`` without comments, runs of blanks, and blanks inside parentheses or
    beside commas: short enough for psycopg to cache its parse of the query (it
    parses texts over 4 KB again at every execution)."""
    text = " ".join(_COMMENT.sub("", text).split())
    return text.replace("( ", "(").replace(" )", ")").replace(" ,", ",").replace(", ", ",")


# A comment to the end of the line. (The relay's SQL has no "--", no run of
# blanks, and no blank beside a parenthesis or a comma in a literal.)
_COMMENT = re.compile(r"--[^\n]*")

#: The statements of a relay session (see _statements).
_SESSION_STATEMENTS = (
    "sequence",
    "ensure_slots",
    "claim",
    "claim_slots",
    "finish",
    "renew",
    "reconcile",
    "free_owner_slots",
    "end_orphans",
    "payloads",
    "now",
)


def _statements(table: str, *, notify: bool) -> dict[str, str]:
    """A relay session's statements on ``table``, compacted, as they are sent.

    With ``notify``, a look that makes heads it does not claim sends NOTIFY
    (``{woke}`` in ``_SQL.place_writes``).
    """
    woke = "RETURNING pg_notify(%(channel)s, '')" if notify else ""
    return {
        name: _compact(_sql(getattr(_SQL, name), table).replace("{woke}", woke))
        for name in _SESSION_STATEMENTS
    }


def _ints(values: Iterable[int]) -> str:
    """An array literal of ints, sent as one text parameter (a list is dumped per item)."""
    return "{" + ",".join(map(str, values)) + "}"


def _texts(values: Iterable[str]) -> str:
    """An array literal of strings, each quoted, sent as one text parameter (see _ints)."""
    return (
        "{"
        + ",".join(['"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values])
        + "}"
    )


#: The longest payload (bytes of JSON text) a claiming statement returns; the
#: longer ones are read by a statement of their own once it committed (see
#: _SQL.claim_returning): a batch of 100 answers in under 70 KB.
_PAYLOAD_IN_ANSWER = 512

#: Pools a forked child found open in its stores: the parent's connections,
#: never used nor closed in the child (closing one would end the parent's
#: session), kept so that nothing finalizes them before the child exits.
_INHERITED_POOLS: list[Any] = []

#: Tokens of unanswered claiming statements a session keeps for its next
#: reconcile (a reconnect comes after each such failure, so a few suffice).
_UNSEEN_KEPT = 64

#: Rows past the front a claim looks at, per row it may claim (at least
#: _SEQUENCE_MIN; _SEQUENCE_IDLE when the relay is not busy): ahead of what
#: the relays take, so that new keys get their heads before they are due.
_SEQUENCE_PER_CLAIM = 4
_SEQUENCE_MIN = 200
_SEQUENCE_IDLE = 4000

#: Seconds the schema's DDL waits for a lock on the table before it gives up.
_DDL_LOCK_TIMEOUT = 5.0

#: Seconds a relay waits for a new connection when its own died.
_RECONNECT_TIMEOUT = 5.0

#: Seconds an operator's statement waits for a row a relay is updating.
_ADMIN_LOCK_TIMEOUT = 5.0

#: Seconds a reconcile waits for the server processes of dropped connections
#: to end (see _SQL.end_orphans) before it goes on: one that does not end
#: (paused, or stuck in the kernel) has been told to, and ends as soon as it
#: runs again, before it reads another statement.
_ORPHAN_WAIT = 1.0

#: Seconds between two looks at such a process that had not ended: one
#: caught in its commit (a storage stall) cannot be ended, and commits when
#: it runs again. The reconciles that look keep the tokens of the claims
#: that failed, so the one after it ended releases what it claimed.
_ORPHAN_RECHECK = 1.0

#: Seconds the relay claims nothing while such a process has not ended (its
#: claims would take back what it commits as expired leases, counting an
#: attempt); past them it claims again, and says so.
_ORPHAN_PATIENCE = 30.0

#: SQLSTATE classes of errors that pass with time, not with other data:
#: connection exceptions, serialization failures and deadlocks, insufficient
#: resources, lock timeouts and objects in use, operator intervention
#: (cancels, shutdowns), system errors.
_PASSING_ERRORS = frozenset({"08", "40", "53", "55", "57", "58"})

#: Set on every relay connection. A relay's statements wait for no other
#: relay; the bound is for the rare waits that remain (a unique index
#: entry another statement is writing, an operator's transaction).
_RELAY_LOCK_TIMEOUT = "2s"

#: A relay never leaves a transaction open between statements; if a
#: driver bug ever did, the server ends it after this long.
_RELAY_IDLE_IN_TRANSACTION = "10s"


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


class _Watchdog:
    """Drops the connection of a statement that outlived its deadline.

    A connection whose peer stops answering without resetting it (NAT or
    firewall state lost, a failover without RST, a frozen proxy, a paused
    VM) would keep a blocked call waiting with no limit: TCP keepalives do
    not help while the peer's kernel still acknowledges. The watchdog shuts
    the socket down (a duplicate of its descriptor, so psycopg still owns
    the original): the blocked call then fails at once and the connection
    is closed, so the caller's normal error path (a relay reconnects)
    takes over. Thread-safe; one daemon thread per process while
    statements run (it ends after ``_WATCHDOG_IDLE`` seconds with none).
    Arming and disarming only take a lock: the thread looks at least every
    ``_WATCHDOG_IDLE`` seconds, so it is woken only for a deadline before
    its next look (a relay's statements are bounded by many seconds, and
    waking a thread per statement would make it compete for the GIL with
    the relay's loop).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._armed: dict[int, tuple[float, Any, list[bool]]] = {}
        self._ids = itertools.count()
        self._next = math.inf  # when the thread looks next (it waits until then)
        self._used = False  # a statement was armed since the thread's last look
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def bound(self, conn: Any, seconds: float) -> Iterator[Callable[[], bool]]:
        """Drop ``conn`` if the block takes over ``seconds``; yields "was it dropped?".

        Once the block is left (also by an exception, or a Ctrl-C landing
        while this waits for the watchdog's lock) ``conn`` is never dropped.
        """
        token = next(self._ids)
        deadline = time.monotonic() + seconds
        fired = [False]
        try:
            with self._cond:
                self._armed[token] = (deadline, conn, fired)
                self._used = True
                if self._thread is None:
                    self._start()
                if deadline < self._next:
                    self._cond.notify()
            yield lambda: fired[0]
        finally:
            self._disarm(token)
            if fired[0]:
                # Logged here, by the statement's thread: a slow or failing
                # log handler delays no other deadline.
                _log.warning(
                    "outbound: an outbox database connection did not answer in %gs; dropped it",
                    seconds,
                )

    def _disarm(self, token: int) -> None:
        """Forget ``token``. An interruption while this waits for the lock is
        raised once it is done, so that no deadline outlives its block."""
        interrupted: BaseException | None = None
        while True:
            try:
                with self._cond:
                    self._armed.pop(token, None)
                break
            except BaseException as exc:  # a Ctrl-C in the lock's acquire: try again
                interrupted = exc
        if interrupted is not None:
            raise interrupted

    def _start(self) -> None:
        """Start the thread (``self._cond`` held).

        A thread that cannot start (no threads left) leaves this statement
        unbounded, logged, and the next statement tries again; an
        interruption (Ctrl-C) in the start propagates (bound() disarms).
        """
        thread = threading.Thread(target=self._run, name="outbound-pg-watchdog", daemon=True)
        self._thread = thread
        try:
            thread.start()
        except Exception:
            self._thread = None
            _log.warning(
                "outbound: cannot start the outbox connection watchdog; "
                "this statement runs without a deadline",
                exc_info=True,
            )
        except BaseException:
            # The thread may have started after all: at its first look it
            # takes over if no other was started meanwhile, else it ends.
            self._thread = None
            raise

    def _reset_after_fork(self) -> None:
        """In a forked child: the parent's thread is gone and its lock may be held."""
        self._cond = threading.Condition(threading.Lock())
        self._armed = {}
        self._next = math.inf
        self._used = False
        self._thread = None

    def _run(self) -> None:
        me = threading.current_thread()
        try:
            self._watch(me)
        finally:
            # Ended by an error (never expected): the next statement starts
            # another thread.
            with self._cond:
                if self._thread is me:
                    self._thread = None
                    self._next = math.inf

    def _watch(self, me: threading.Thread) -> None:
        """The thread's loop. Sockets are shut down under the lock: a block
        that has been left is never dropped."""
        last_used = time.monotonic()
        with self._cond:
            while True:
                if self._thread is not me:
                    if self._thread is not None:
                        return  # its start was interrupted, and another replaced it
                    self._thread = me  # its start was interrupted: it takes over
                now = time.monotonic()
                for token, (deadline, conn, fired) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[token]
                        fired[0] = True
                        _drop(conn)
                if self._armed or self._used:
                    self._used = False
                    last_used = now
                elif now - last_used >= _WATCHDOG_IDLE:
                    # No statement since a look at least _WATCHDOG_IDLE ago: end.
                    self._thread = None
                    self._next = math.inf
                    return
                # Look again at the first deadline, and at least every
                # _WATCHDOG_IDLE (statements that came and went meanwhile
                # did not wake this thread).
                self._next = min([now + _WATCHDOG_IDLE, *(a[0] for a in self._armed.values())])
                self._cond.wait(self._next - now)


def _drop(conn: Any) -> None:
    """Shut down ``conn``'s socket: a call blocked on it fails at once. Never raises."""
    try:
        copy = os.dup(conn.fileno())
    except Exception:  # closed meanwhile (or not a descriptor): nothing to drop
        return
    try:
        dup = socket.socket(fileno=copy)
    except Exception:  # not a socket: left alone
        os.close(copy)
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()


def _connect_failed(
    what: str, exc: BaseException, conninfo: str
) -> tuple[StoreError, BaseException | None]:
    """The error of a connect that failed with ``exc``, without the password (a
    malformed URL's can reach libpq's message: one with an unencoded "@" becomes
    part of the host it quotes), and what to chain it to: ``exc`` if nothing was
    masked, else nothing."""
    said = str(exc)
    masked = driver_error(said, conninfo)
    return StoreError(f"{what}: {masked}"), (exc if masked == said else None)


def _read_committed(conn: Any) -> None:
    """Make the store's own connection ``conn`` (autocommit) run READ COMMITTED,
    whatever the server's or the conninfo's default: the relays' and operators'
    statements lock rows, then read and write them (under REPEATABLE READ one
    that waited for another's lock would fail to serialize). A statement of its
    own, not the conninfo's ``options`` (given, they would replace PGOPTIONS'
    and a service file's). Blocks on the database."""
    conn.execute("SET default_transaction_isolation = 'read committed'")


def _close_quietly(conn: Any, *, drop: bool = True) -> None:
    """Close ``conn``, whatever state it is in; never raises an ``Exception``.

    ``drop``: shut its socket down first (see _drop), so that a peer that
    stopped answering cannot hold the goodbye up; for a connection that
    failed, or was left in a transaction. Without it the server is told
    goodbye (a session that ends).
    """
    if drop:
        _drop(conn)
    with contextlib.suppress(Exception):
        conn.close()


def _bounded_check(check: Callable[[Any], None], seconds: float) -> Callable[[Any], None]:
    """The pool's ``check`` of an idle connection, bounded by the watchdog.

    Half of connect_timeout, so that a new connection can still be had
    within a getconn() of twice connect_timeout. Holds no reference to the
    store: a store dropped without close() is collected, pool and all.
    """

    def bounded(conn: Any) -> None:
        with _WATCHDOG.bound(conn, seconds):
            check(conn)

    return bounded


_WATCHDOG_IDLE = 1.0
_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG._reset_after_fork)

#: libpq settings added to the store's own connections unless its conninfo
#: sets them: a dead peer is noticed by TCP within about a minute.
_TCP_SETTINGS = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60000,
}

#: Seconds a relay statement may take before its connection is dropped,
#: until the relay asks for a lease (then the lease, at least the store's
#: connect_timeout).
_STATEMENT_BOUND = 30.0


class _PostgresDb(Db):
    """The admin's connection, inside its transaction."""

    def __init__(self, conn: psycopg.Connection[Any], table: str) -> None:
        self._conn = conn
        self._table = table

    def all(self, name: str, **params: Any) -> list[tuple[Any, ...]]:
        if name == "lock_lines":
            params["look_lock"] = _lock_id(self._table, "sequence")
        return list(self._conn.execute(_sql(_SQL.admin[name], self._table), params).fetchall())

    def run(self, name: str, **params: Any) -> int:
        return self._conn.execute(_sql(_SQL.admin[name], self._table), params).rowcount


class PostgresStore(Store):
    """An outbox table in PostgreSQL, for any number of processes and machines.

    - ``conninfo``: a libpq URL or DSN (``postgresql://user@host/db``) for the
      store's own connections (relays, operators); checked at once.
    - ``table``: the table name (a lowercase identifier, in the search path).
    - ``max_pending``: ``enqueue`` refuses with
      :class:`~outbound.errors.OutboxFull` once this many rows are
      unfinished; ``None``: no limit. Every store of a table should agree.
    - ``max_payload_bytes``: the largest JSON payload accepted.
    - ``ordering``: ``"strict"`` (default) or ``"mutex"``.
    - ``notify``: ``enqueue`` sends ``NOTIFY`` on the table's channel so
      that listening relays wake at once.
    - ``pool_size``: the most connections the store's pool opens, for
      the status and operator calls (a relay opens three of its own: to
      write and renew, to claim beside its writes, and to listen).
    - ``connect_timeout``: seconds to wait for a new connection.
    - ``create``: create (or migrate) the schema now.

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
        connect_timeout: float = 10.0,
        create: bool = True,
    ) -> None:
        self._psycopg, self._psycopg_pool = _import_psycopg()
        if not isinstance(conninfo, str) or not conninfo:
            raise ValueError("conninfo must be a non-empty libpq URL or DSN string")
        try:
            given = self._psycopg.conninfo.conninfo_to_dict(conninfo)
        except self._psycopg.Error as exc:
            raise ValueError(
                "conninfo is not a valid PostgreSQL URL or DSN: " + driver_error(str(exc), conninfo)
            ) from None
        # TCP keepalives and tcp_user_timeout for the store's own connections,
        # unless conninfo sets them.
        self._tcp_settings: dict[str, Any] = {
            k: v for k, v in _TCP_SETTINGS.items() if k not in given
        }
        self.conninfo = conninfo
        self.table = check_table(table)
        self.max_pending = check_max_pending(max_pending)
        self.max_payload_bytes = check_positive_int("max_payload_bytes", max_payload_bytes)
        self.ordering = check_ordering(ordering)
        self.notify = bool(notify)
        self.pool_size = check_positive_int("pool_size", pool_size, maximum=1000)
        self.connect_timeout = check_seconds("connect_timeout", connect_timeout, maximum=3600.0)
        #: The LISTEN/NOTIFY channel of this table.
        self.channel = f"outbound_{self.table}"
        t = self.table
        self._enqueue_sql = _sql(
            _SQL.enqueue_limited if self.max_pending is not None else _SQL.enqueue, t
        )
        self._enqueue_many_sql = _sql(
            _SQL.enqueue_many_limited if self.max_pending is not None else _SQL.enqueue_many, t
        )
        self._lock_counter_sql = _sql(_SQL.lock_counter, t)
        # Guards _pool, _pool_pid and _closed; held only to create or close
        # the pool. Made new in a forked child (a parent thread may hold it).
        self._lock = renewed_after_fork(threading.Lock())
        self._pool: psycopg_pool.ConnectionPool[Any] | None = None
        self._pool_pid = 0  # the process that opened _pool
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
            if self._pool is not None and self._pool_pid != os.getpid():
                # Opened before a fork: its connections are the parent's
                # sockets (two processes on one would read each other's
                # answers), and its threads are gone. Left alone, never
                # closed here: closing would end the parent's sessions.
                _INHERITED_POOLS.append(self._pool)
                self._pool = None
            if self._pool is None:
                self._pool = self._new_pool(self.pool_size, f"outbound-{self.table}")
                self._pool_pid = os.getpid()
            return self._pool

    def _new_pool(self, size: int, name: str, workers: int = 3) -> psycopg_pool.ConnectionPool[Any]:
        """An open pool of up to ``size`` connections, each opened when first asked for."""
        pool: psycopg_pool.ConnectionPool[Any] = self._psycopg_pool.ConnectionPool(
            self.conninfo,
            min_size=0,
            max_size=size,
            kwargs={
                **self._tcp_settings,
                "autocommit": True,
                "connect_timeout": int(self.connect_timeout),
            },
            open=False,
            name=name,
            num_workers=workers,
            configure=_read_committed,
            # A connection the server dropped while it sat in the pool (a
            # restart) is replaced before it is handed out. Within
            # connect_timeout: a pooled connection whose peer stopped
            # answering is dropped, not waited on.
            check=_bounded_check(
                self._psycopg_pool.ConnectionPool.check_connection,
                self.connect_timeout / 2,
            ),
        )
        try:
            pool.open(wait=False)
        except self._psycopg.Error as exc:
            error, cause = _connect_failed("cannot open the connection pool", exc, self.conninfo)
            raise error from cause
        return pool

    def _direct(self) -> psycopg.Connection[Any]:
        """A connection of its own (autocommit), failing within ``connect_timeout``."""
        try:
            conn: psycopg.Connection[Any] = self._psycopg.connect(
                self.conninfo,
                autocommit=True,
                connect_timeout=max(1, int(self.connect_timeout)),
                **self._tcp_settings,
            )
        except self._psycopg.Error as exc:
            error, cause = _connect_failed(
                "cannot connect to the outbox database", exc, self.conninfo
            )
            raise error from cause
        try:
            _read_committed(conn)
        except self._psycopg.Error as exc:
            _close_quietly(conn)
            raise StoreError(f"cannot configure the connection: {exc}") from exc
        except BaseException:
            _close_quietly(conn)
            raise
        return conn

    def connect(self) -> psycopg.Connection[Any]:
        """A new connection for the application (not from the pool; close it yourself)."""
        try:
            conn: psycopg.Connection[Any] = self._psycopg.connect(self.conninfo)
        except self._psycopg.Error as exc:
            error, cause = _connect_failed("cannot connect", exc, self.conninfo)
            raise error from cause
        return conn

    # --------------------------------------------------------------------- schema

    def _version(self, conn: psycopg.Connection[Any]) -> int | None:
        t = self.table
        found = conn.execute(_SQL.relations, {"table": t, "schema": f"{t}_schema"}).fetchone()
        assert found is not None
        kind, has_schema = found
        if kind is None:
            return None
        if kind not in ("r", "p"):
            # (An index, a sequence, a view of that name: not an outbox of
            # an earlier version, which would be migrated.)
            raise StoreError(
                f"cannot use {t!r} as the outbox table: the database has an index, "
                f"sequence or view of that name; name the outbox otherwise"
            )
        # Whatever a {t}_schema beside it says: an application's table of
        # both names is not an outbox, nor is its {t}_schema ever written.
        columns = {str(r[0]) for r in conn.execute(_SQL.columns, {"table": t})}
        if not columns >= V1_COLUMNS:
            raise StoreError(not_an_outbox(t))
        if not has_schema:
            return 1
        beside = {str(r[0]) for r in conn.execute(_SQL.columns, {"table": f"{t}_schema"})}
        if not beside >= SCHEMA_COLUMNS:
            raise StoreError(not_an_outbox(t, beside))
        row = conn.execute(_sql(_SQL.version, t)).fetchone()
        return 1 if row is None or row[0] is None else int(row[0])

    def schema_version(self) -> int | None:
        """The version of the schema (None: no outbox table). Takes no lock on the table."""
        with self._direct() as conn, _WATCHDOG.bound(conn, 3 * self.connect_timeout):
            try:
                return self._version(conn)
            except self._psycopg.Error as exc:
                raise StoreError(f"cannot read the outbox schema: {exc}") from exc

    def create_schema(self) -> None:
        """Create the tables, or migrate them to the current version. Idempotent.

        When the schema is current it only reads its version: no lock, so a
        process may start while application transactions use the table.
        Otherwise the DDL waits at most ``_DDL_LOCK_TIMEOUT`` seconds for
        its locks (an open transaction on the table holds it back; the
        enqueues behind it wait meanwhile), then raises ``StoreError``.
        Serialized by an advisory lock, so processes may call it at once;
        all of it is one transaction. Stop the relays of an older version
        before migrating.
        """
        self._create_schema()

    def _create_schema(self) -> int | None:
        """:meth:`create_schema`; returns the version this call found under the
        lock (None: it created the schema; the current one: nothing done)."""
        psycopg = self._psycopg
        t = self.table
        try:
            with self._direct() as conn:
                if self._version(conn) == SCHEMA_VERSION:
                    return SCHEMA_VERSION
                # A session lock, taken before the transaction begins: a
                # transaction begun earlier would not see the catalog as the
                # process that held the lock left it.
                conn.execute(_SQL.lock_timeout.format(ms=int(_DDL_LOCK_TIMEOUT * 1000)))
                conn.execute(_SQL.session_lock, (_lock_id(t, "schema"),))
                try:
                    with conn.transaction():
                        version = self._version(conn)  # another process may have done it
                        if version == SCHEMA_VERSION:
                            return version
                        if version is not None and version > SCHEMA_VERSION:
                            raise StoreError(
                                f"the outbox table {t!r} has schema version {version}, newer "
                                f"than this code's {SCHEMA_VERSION}: upgrade outbound"
                            )
                        steps: tuple[str, ...]
                        if version is None:
                            steps = (*_SQL.schema, *_SQL.look_table, *_SQL.counts_and_version)
                        elif version == 1:
                            steps = (
                                *_SQL.migrate_1,
                                *_SQL.storage,  # before the rewrite: room in every page
                                *_SQL.payload_json,
                                *_SQL.migrate_3,
                                *_SQL.look_table,
                                *_SQL.counts_and_version,
                            )
                        elif version == 2:
                            # The outbox table first, then its counters: the
                            # order an enqueue takes them in (the other order
                            # deadlocks with enqueuers instead of making them wait).
                            steps = (
                                *_SQL.storage,  # before the rewrite: room in every page
                                *_SQL.payload_json,
                                *_SQL.migrate_3,
                                *_SQL.look_table,
                                *_SQL.migrate_2,
                                _SQL.record_version,
                            )
                        else:
                            steps = (
                                *_SQL.migrate_3,
                                *_SQL.storage,
                                *_SQL.look_table,
                                _SQL.record_version,
                            )
                        for statement in steps:
                            conn.execute(_sql(statement, t))
                    return version
                finally:
                    if not conn.closed:
                        conn.execute(_SQL.session_unlock, (_lock_id(t, "schema"),))
        except psycopg.errors.LockNotAvailable as exc:
            raise StoreError(
                f"cannot create the outbox schema: table {t!r} was not free within "
                f"{_DDL_LOCK_TIMEOUT:g}s (a transaction is using it); try again: {exc}"
            ) from exc
        except psycopg.errors.DuplicateTable as exc:
            # Never dropped nor taken over: an application's table, or another
            # outbox's, may have a name this outbox needs.
            raise StoreError(
                f"cannot create the outbox schema: {exc.diag.message_primary or exc}; "
                f"that table or index is not outbox {t!r}'s (it makes tables and indexes "
                f"named {t}_...): name the outbox otherwise, or move it"
            ) from exc
        except psycopg.Error as exc:
            raise StoreError(f"cannot create the outbox schema: {exc}") from exc

    def drop_schema(self) -> None:
        """Drop the outbox's tables (tests, benchmarks). Irreversible."""
        t = self.table
        try:
            with self._direct() as conn:
                conn.execute(
                    f"DROP TABLE IF EXISTS {t}, {t}_slots, {t}_counts, {t}_schema, {t}_look"
                )
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
        before anything is written (see
        :func:`~outbound.outbox._base.check_row`): ``TypeError`` or
        ``ValueError`` naming the problem (on a connection whose
        ``client_encoding`` is not UTF8, text past ASCII too). Raises
        :class:`~outbound.errors.OutboxFull` when ``max_pending`` rows are
        unfinished, :class:`~outbound.errors.DuplicateMessage` when an
        unfinished row has ``dedupe_key``,
        :class:`~outbound.errors.StoreError` when the database fails. In
        each case nothing was written and the caller's transaction stays
        usable (the statement runs in a savepoint when the caller is
        inside a transaction).

        One statement (two with ``max_pending``: the counter's lock first);
        the ``max_pending`` check costs the same whatever the backlog. With
        ``max_pending``, concurrent writers wait for each other's
        transactions (see the module's notes): keep them short. Blocks on
        the database.
        """
        row = check_row(key, type, payload, dedupe_key, delay, self.max_payload_bytes)
        params = {
            "key": row.key,
            "type": row.type,
            "payload": row.payload,
            "dedupe_key": row.dedupe_key,
            "delay": row.delay,
            "max_pending": self.max_pending,
            "channel": self.channel if self.notify else "",
        }
        found = self._write(conn, self._enqueue_sql, params, "enqueue", [row])
        assert found is not None
        row_id, duplicate = found[0], found[1]
        if row_id is not None:
            return int(row_id)
        if duplicate or self.max_pending is None:
            raise DuplicateMessage(
                f"an unfinished outbox row already has dedupe_key {row.dedupe_key!r}"
            )
        raise OutboxFull(f"the outbox {self.table!r} already holds {self.max_pending} pending rows")

    def enqueue_many(self, conn: Any, messages: Iterable[Mapping[str, Any]]) -> list[int]:
        """Write many pending rows in one statement on ``conn``; return their ids, in order.

        See :meth:`Store.enqueue_many`. One ``NOTIFY`` for the batch.
        """
        rows = check_messages(messages, self.max_payload_bytes)
        if not rows:
            self._check_conn(conn)
            return []
        params = _batch_params(rows)
        params["n"] = len(rows)
        params["max_pending"] = self.max_pending
        params["channel"] = self.channel if self.notify else ""
        found = self._write(conn, self._enqueue_many_sql, params, "enqueue_many", rows)
        assert found is not None
        ids, duplicate = found[0], found[1]
        if ids:
            if len(ids) != len(rows):  # cannot happen: one statement, one condition
                raise StoreError("enqueue_many wrote part of the batch")
            return sorted(int(i) for i in ids)
        if duplicate is not None:
            raise batch_duplicate(rows, str(duplicate))
        raise OutboxFull(
            f"the outbox {self.table!r} has no room for {len(rows)} more rows "
            f"(max_pending={self.max_pending})"
        )

    def _check_conn(self, conn: Any) -> None:
        if not isinstance(conn, self._psycopg.Connection):
            raise TypeError(f"conn must be a psycopg.Connection, not {conn.__class__.__name__}")
        if conn.closed:
            raise StoreError("enqueue failed: the connection is closed")

    def _write(
        self, conn: Any, sql: str, params: dict[str, Any], what: str, rows: Sequence[NewRow]
    ) -> tuple[Any, ...] | None:
        """Run one enqueue statement of ``rows`` on the caller's connection (see
        :meth:`enqueue`), once the connection and what it can carry are checked."""
        psycopg = self._psycopg
        self._check_conn(conn)
        _check_encodable(conn, rows, many=what == "enqueue_many")
        status = conn.info.transaction_status
        statuses = psycopg.pq.TransactionStatus
        # Autocommit and idle: the one statement is a transaction of its own.
        # Inside the caller's transaction: a savepoint, so that a database
        # error undoes only this call and leaves the caller's transaction
        # usable. Not autocommit and idle: the statement opens the caller's
        # transaction, rolled back if it fails (it holds nothing else).
        # Otherwise (aborted, busy): as it is; the server says why it fails.
        # With max_pending, two statements (the counter's lock, then the
        # write): in autocommit they need a transaction of their own.
        limited = self.max_pending is not None
        opens = status == statuses.IDLE and not conn.autocommit
        scope = (
            conn.transaction()
            if status == statuses.INTRANS or (limited and status == statuses.IDLE and not opens)
            else contextlib.nullcontext()
        )
        try:
            with scope:
                # Plain tuples, whatever the connection's row factory (a dict
                # factory would fail the answer after the row was written),
                # and %(name)s placeholders, whatever its cursor factory (a
                # RawCursor takes $1 only: the standard cursor instead).
                factory = conn.cursor_factory
                if issubclass(factory, psycopg.RawCursor):
                    factory = psycopg.Cursor
                with factory(conn, row_factory=psycopg.rows.tuple_row) as cursor:
                    if limited:
                        cursor.execute(self._lock_counter_sql)
                    found: tuple[Any, ...] | None = cursor.execute(sql, params).fetchone()
                return found
        except BaseException as exc:
            # (Whatever the error: one raised before the statement was sent, or
            # a Ctrl-C between the counter's lock and the write, would leave
            # the transaction it opened holding that lock, every writer waiting.)
            if opens and not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    conn.rollback()
            if not isinstance(exc, psycopg.Error):
                raise
            diag = getattr(exc, "diag", None)
            if isinstance(exc, psycopg.errors.NumericValueOutOfRange):
                # A shard of the transaction's own does not fit version 2's
                # smallint counters: new code on a table not yet migrated.
                raise StoreError(
                    f"{what} failed: the outbox table {self.table!r} is at an older schema "
                    "version; migrate it (python -m outbound outbox migrate, or Django's "
                    f"migrate): {exc}"
                ) from exc
            if (
                isinstance(exc, psycopg.errors.UniqueViolation)
                and diag is not None
                and diag.constraint_name == f"{self.table}_dedupe"
            ):
                detail = f": {diag.message_detail}" if diag.message_detail else ""
                raise DuplicateMessage(
                    f"{what}: an unfinished outbox row already has that dedupe_key "
                    f"(committed while this call ran){detail}"
                ) from exc
            raise StoreError(f"{what} failed: {exc}") from exc

    # --------------------------------------------------------------------- relays

    def session(self) -> _PostgresSession:
        """Open a relay :class:`Session`: a connection of its own (see _PostgresSession)."""
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
        session = _PostgresSession(self)
        session.connect(30.0)
        return session

    def claim_session(self, beside: Session) -> _PostgresSession | None:
        """Open a relay's second :class:`Session`, for its claims beside the writes
        of ``beside`` (its first): a connection of its own too. The two share
        their record of the statements that failed with no answer: a
        reconcile on either covers both. None if ``beside`` is not a session
        this store made (the relay then claims between its writes)."""
        if not isinstance(beside, _PostgresSession) or beside._store is not self:
            return None
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
        session = _PostgresSession(self, lost=beside._lost)
        try:
            session.connect(30.0)
        except BaseException:
            session.close()
            raise
        return session

    def listener(self, wake: Callable[[], object]) -> _Listener | None:
        """A thread that calls ``wake()`` on every NOTIFY of this table; None if off."""
        if not self.notify:
            return None
        return _Listener(self, wake)

    # ------------------------------------------------------------------ operators

    @contextlib.contextmanager
    def _admin(self, *, write: bool = False) -> Iterator[Db]:
        psycopg = self._psycopg
        # A read gets 3 * connect_timeout; a write (purge deletes
        # any number of rows) ten times that. Past it the connection is dropped.
        bound = 3 * self.connect_timeout * (10 if write else 1)
        dropped: Callable[[], bool] = lambda: False  # noqa: E731
        try:
            with (
                self._get_pool().connection(timeout=2 * self.connect_timeout) as conn,
                _WATCHDOG.bound(conn, bound) as dropped,
                conn.transaction(),
            ):
                conn.execute(f"SET LOCAL lock_timeout = '{int(_ADMIN_LOCK_TIMEOUT * 1000)}ms'")
                if not write:
                    conn.execute("SET TRANSACTION READ ONLY")
                else:
                    # An operator holds the relays' look lock and a key's
                    # head: a process frozen mid-operation (SIGSTOP, a paused
                    # VM) releases them when the server ends its session.
                    conn.execute(
                        "SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
                        (_RELAY_IDLE_IN_TRANSACTION,),
                    )
                yield _PostgresDb(conn, self.table)
        except psycopg.errors.LockNotAvailable as exc:
            raise StoreError(
                f"a row stayed locked for {_ADMIN_LOCK_TIMEOUT:g}s; try again: {exc}"
            ) from exc
        except (psycopg.Error, self._psycopg_pool.PoolTimeout) as exc:
            if dropped():
                raise StoreError(
                    f"the outbox database did not answer within {bound:g}s "
                    f"(the connection was dropped): {exc}"
                ) from exc
            raise StoreError(f"outbox database error: {exc}") from exc

    def _deadlocked(self, exc: StoreError) -> bool:
        return isinstance(exc.__cause__, self._psycopg.errors.DeadlockDetected)

    def close(self) -> None:
        """Close the pools (waiting for their threads). Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            inherited = self._pool_pid != os.getpid()
        if pool is not None:
            if inherited:  # a parent's (see _get_pool)
                _INHERITED_POOLS.append(pool)
            else:
                pool.close()


def _check_encodable(conn: Any, rows: Sequence[NewRow], *, many: bool) -> None:
    """Raise ``ValueError`` naming the field (and the message of a batch) holding a
    character past ASCII, before any statement, on a connection whose
    ``client_encoding`` is not UTF8: the server takes such text through its own
    conversion, which may change it without a word (SJIS and EUC_JP make a yen
    sign a backslash, a JSON escape in a payload; EUC_KR splits Hangul
    syllables) or refuse it; ASCII is the same in every client encoding."""
    # (Read raw: psycopg decodes it with the connection's encoding, and has no
    # codec for some, EUC_TW: then the statement fails, a StoreError.)
    raw = conn.pgconn.parameter_status(b"client_encoding")
    encoding = raw.decode("ascii", "replace") if raw is not None else "UTF8"
    if encoding.upper().replace("-", "") in ("UTF8", "UNICODE"):
        return
    for index, row in enumerate(rows):
        for name in ("key", "type", "payload", "dedupe_key"):
            value = getattr(row, name)
            if value is None or value.isascii():
                continue
            where = f"messages[{index}]: " if many else ""
            found = next(char for char in value if not char.isascii())
            raise ValueError(
                f"{where}{name} holds {found!r}, past ASCII, which this connection's "
                f"client_encoding ({encoding}) may not carry as it is; connect with "
                "client_encoding UTF8"
            )


def _batch_params(rows: Sequence[NewRow]) -> dict[str, Any]:
    return {
        "keys": [r.key for r in rows],
        "types": [r.type for r in rows],
        "payloads": [r.payload for r in rows],
        "dedupe_keys": [r.dedupe_key for r in rows],
        "delays": [r.delay for r in rows],
    }


class _Unanswered:
    """The statements of a relay's sessions that failed with no answer (they may
    have committed), shared by its loop session and its claim session, so that
    one reconcile covers both: the fencing tokens of claiming statements
    (claims, writes that take rows), the last _UNSEEN_KEPT, and the server
    processes (pid, start) of connections dropped with a statement on them
    (see ``_SQL.end_orphans``). Guarded by ``lock``: a session's thread adds
    to it, the reconciling one reads and trims it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.unseen: list[int] = []
        self.orphans: list[tuple[int, int]] = []
        # How many of orphans a reconcile has waited for already (they had
        # not ended), and when a reconcile should look at them again.
        self.orphans_waited = 0
        self.recheck_at = math.inf
        # Since when a reconcile has found such a process still there, and
        # whether the relay was told to claim again all the same.
        self.lingering_since: float | None = None
        self.gave_up = False


class _PostgresSession(Session):
    """A relay's connection, its own (not the pool's). Confined to one thread at a time.

    Not from the pool: a pool waits, growing pauses between tries (1 s, 2 s,
    4 s...), for a connection that passes its check, and for one of its
    workers to open a new one after failures. Behind a storm of killed
    connections or a restart, a relay's loop waited there past its lease
    (6 s, with the server back after 0.3 s), renewing nothing: its rows
    went to another relay and were delivered twice. A session connects
    itself, within ``connect_timeout``, and a failed try is the relay's to
    pace.
    """

    def __init__(self, store: PostgresStore, *, lost: _Unanswered | None = None) -> None:
        self._store = store
        # The connection; None until connect(), or after it died and no new
        # one could be had (the next call tries again).
        self._conn: psycopg.Connection[Any] | None = None
        self._closed = False
        # A connection was replaced since reconnected() last said so.
        self._replaced = False
        # Seconds a statement may take (see _run).
        self._bound = max(_STATEMENT_BOUND, store.connect_timeout)
        self._error: type[Exception] = store._psycopg.Error
        self._unique: type[Exception] = store._psycopg.errors.UniqueViolation
        self._seq_lock = _lock_id(store.table, "sequence")
        # The last claim was full: the next look stays short (see _SWEEP_KEYS);
        # and when the next look may be wide (see _WIDE_EVERY).
        self._busy = False
        self._wide_at = 0.0
        # Fencing tokens, one per claim: unguessable across sessions (seeded
        # from the OS), drawn without a system call (os.urandom gives up the
        # GIL, and getting it back costs the relay's loop up to a switch
        # interval while handlers run).
        self._tokens = random.Random(secrets.randbits(64))
        # The statements that failed with no answer (see _Unanswered):
        # shared with the relay's other session, if any.
        self._lost = lost if lost is not None else _Unanswered()
        # The server process of the connection (pid, start).
        self._backend: tuple[int, int] | None = None
        self._channel = store.channel
        self._sql = _statements(store.table, notify=store.notify)

    def connect(self, timeout: float) -> psycopg.Connection[Any]:
        """The session's connection: a new one if it has none or it died.

        A connection dies with its server (a restart, a failover) or its
        backend (``pg_terminate_backend``); it is closed, and a new one made.
        Waits up to ``timeout`` seconds for it (at most ``connect_timeout``,
        at least 1 s, each address tried), then raises ``StoreError`` (the
        next call tries again).
        """
        if self._closed:
            raise StoreError("the session is closed")
        conn = self._conn
        store = self._store
        idle = store._psycopg.pq.TransactionStatus.IDLE
        if conn is not None:
            if not conn.closed and conn.info.transaction_status == idle:
                return conn
            self._conn = None
            self._backend = None
            self._replaced = True
            _close_quietly(conn)  # broken, or left in a transaction: none of it stays
        if store._closed:  # unlocked read: a store closed meanwhile ends the next try
            raise StoreError("the store is closed")
        try:
            new: psycopg.Connection[Any] = store._psycopg.connect(
                store.conninfo,
                autocommit=True,
                connect_timeout=max(1, int(min(timeout, store.connect_timeout))),
                **store._tcp_settings,
            )
        except self._error as exc:
            error, cause = _connect_failed(
                "cannot connect to the outbox database", exc, store.conninfo
            )
            raise error from cause
        conn = new
        try:
            # The relay's statements reach every row through an index, by id
            # or in index order. With no sequential or bitmap scans the
            # planner keeps to that also where it misjudges the table's
            # size: a table with no statistics yet (a new one filled at
            # once), and the plans the server keeps for a prepared statement
            # made while the table was empty (a relay started before its
            # rows), which read the whole table at every claim. No JIT:
            # these are short statements, and the disabled scans' cost
            # penalty would otherwise make the server compile them.
            with _WATCHDOG.bound(conn, self._store.connect_timeout):
                self._configure(conn)
                started = self._backend_start(conn)
        except self._error as exc:
            _close_quietly(conn)
            raise StoreError(f"cannot configure the connection: {exc}") from exc
        except BaseException:
            _close_quietly(conn)
            raise
        self._conn = new
        if started is not None:
            self._backend = (new.info.backend_pid, started)
        return new

    def _backend_start(self, conn: psycopg.Connection[Any]) -> int | None:
        """When the server process of ``conn`` started (microseconds), or None if unknown.

        The pid and the start name the process, so that it can be ended
        should the connection be dropped with a statement on it (see
        ``_SQL.end_orphans``). A role that may not read ``pg_stat_activity``
        does without, and so does a connection through a pooler or a proxy
        (PgBouncer hands a server process it took back to another client).
        Raises the driver's error if the connection fails.
        """
        try:
            found = conn.execute(_SQL.backend_start).fetchone()
        except self._error:
            if conn.closed or conn.broken:
                raise
            _log.debug(
                "outbound: cannot read the start of the relay's server process", exc_info=True
            )
            return None
        if found is None or found[0] is None or not _direct(conn, found[1], found[2]):
            return None
        return int(found[0])

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        # Commits keep the server's durability setting (or the one the
        # conninfo's options give).
        conn.execute(
            "SELECT set_config('lock_timeout', %s, false), "
            "set_config('idle_in_transaction_session_timeout', %s, false), "
            "set_config('default_transaction_isolation', 'read committed', false), "
            "set_config('enable_bitmapscan', 'off', false), "
            "set_config('enable_seqscan', 'off', false), "
            "set_config('jit', 'off', false)",
            (_RELAY_LOCK_TIMEOUT, _RELAY_IDLE_IN_TRANSACTION),
        )

    def reconnected(self) -> bool:
        """True once after the connection was replaced, and whenever a reconcile is
        due to look again at a dropped connection's server process that had not
        ended (see :meth:`reconcile`)."""
        replaced, self._replaced = self._replaced, False
        lost = self._lost
        with lost.lock:
            if not replaced and lost.orphans and time.monotonic() >= lost.recheck_at:
                lost.recheck_at = math.inf  # the reconcile sets the next look
                return True
        return replaced

    def now(self) -> float:
        return float(self._run("now", None).fetchone()[0])

    def settled(self) -> bool:
        """False while a dropped connection's server process that a reconcile found
        still there may commit a claim, for up to ``_ORPHAN_PATIENCE`` seconds."""
        lost = self._lost
        with lost.lock:
            since = lost.lingering_since
            if since is None or not lost.orphans:
                return True
            if time.monotonic() < since + _ORPHAN_PATIENCE:
                return False
            told, lost.gave_up = lost.gave_up, True
        if not told:
            _log.warning(
                "outbound: a dropped connection's server process has not ended for %gs; "
                "claiming again (what it may still commit can be taken back later, "
                "its attempt counted)",
                _ORPHAN_PATIENCE,
            )
        return True

    def refused(self, exc: StoreError) -> bool:
        """True if the server answered ``exc`` with an error of the statement's own.

        Not a refusal: no answer (the connection could not be had, died or
        was dropped by the watchdog), a connection left closed or broken,
        and the classes of errors that pass (see ``_PASSING_ERRORS``).
        """
        cause = exc.__cause__
        if not isinstance(cause, self._error):
            return False
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            return False
        state = getattr(cause, "sqlstate", None)
        return isinstance(state, str) and state[:2] not in _PASSING_ERRORS

    def hold_to(self, lease: float) -> None:
        self._bound = max(float(lease), self._store.connect_timeout)

    def _run(self, name: str, params: Any) -> Any:
        """Run one statement of the session; return its cursor.

        A statement that takes longer than the relay's lease (at least the
        store's ``connect_timeout``; 30 s before a lease is asked for) has
        its connection dropped and raises ``StoreError``: the next call
        takes a new connection (see :class:`_Watchdog`).
        """
        if isinstance(params, dict) and params.get("lease"):
            self.hold_to(params["lease"])
        conn = self.connect(max(_RECONNECT_TIMEOUT, 2 * self._store.connect_timeout))
        with _WATCHDOG.bound(conn, self._bound) as dropped:
            try:
                return conn.execute(self._sql[name], params)
            except self._error as exc:
                if self._backend is not None and (conn.closed or conn.broken):
                    # No answer, and the connection is gone: the statement
                    # may still be on its server process (ended before the
                    # next reconcile).
                    with self._lost.lock:
                        self._lost.orphans.append(self._backend)
                        del self._lost.orphans[:-_UNSEEN_KEPT]
                    self._backend = None
                if dropped():
                    raise StoreError(
                        f"the outbox database did not answer within {self._bound:g}s; "
                        f"dropped the connection: {exc}"
                    ) from exc
                raise StoreError(f"outbox database error: {exc}") from exc

    def ensure_slots(self, count: int) -> None:
        self._run("ensure_slots", {"count": count})

    def sequence(self, limit: int) -> int:
        """Make heads for the keys without one among ``limit`` rows past the front and a
        sweep of keys; return how many (benchmarks and tests)."""
        params = {
            "seq_lock": self._seq_lock,
            "seq_limit": limit,
            "sweep_limit": _SWEEP_KEYS,
            "channel": self._channel,
        }
        return int(self._run("sequence", params).fetchone()[0])

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
        token = self._tokens.getrandbits(62)
        now = time.monotonic()
        wide = not self._busy and now >= self._wide_at
        if wide:
            self._wide_at = now + _WIDE_EVERY
        params = {
            "owner": owner,
            "token": token,
            "lease": lease,
            "limit": limit,
            "max": max_concurrency,
            "skip": _texts(skip_keys),
            "held": _texts([*skip_keys, *held_keys]),
            "first": _ints(first),
            "mine": _ints(held_slots),
            "ahead": CLAIM_AHEAD,
            "seq_lock": self._seq_lock,
            "channel": self._channel,
            "seq_limit": max(
                _SEQUENCE_IDLE if wide else _SEQUENCE_MIN, _SEQUENCE_PER_CLAIM * limit
            ),
            "sweep_limit": _SWEEP_KEYS_IDLE if wide else _SWEEP_KEYS,
            "cap": _PAYLOAD_IN_ANSWER,
        }
        name = "claim" if max_concurrency is None else "claim_slots"
        try:
            try:
                found = self._run(name, params).fetchall()
            except StoreError as exc:
                # Two statements made a head for one key at once (new rows
                # that became visible between their snapshots): this one
                # gives way and claims without placing new rows.
                if not isinstance(exc.__cause__, self._unique):
                    raise
                _log.debug("outbound: outbox sequencing gave way to another relay: %s", exc)
                params["seq_limit"] = 0
                found = self._run(name, params).fetchall()
        except StoreError as exc:
            self._unanswered(token, exc)
            raise
        self._busy = bool(limit) and len(found) >= limit
        waits = None
        if name == "claim":  # each row also says how long it has until it is due
            waits = {int(r[0]): float(r[7]) for r in found if r[7] is not None and r[7] > 0.0}
            found = [(*r[:7], r[8]) for r in found]
        try:
            return _claimed(self._read_payloads(found), token, waits)
        except StoreError:
            self._taken_unseen(token)
            raise

    def _taken_unseen(self, token: int) -> None:
        """The claiming statement of ``token`` committed, but its rows cannot be
        delivered (their payloads could not be read): they are this relay's,
        unseen. The reconcile that follows (:meth:`reconnected` asks for one)
        releases them, their attempts given back."""
        self._keep_unseen(token)
        self._replaced = True

    def _read_payloads(self, rows: list[Any]) -> list[Any]:
        """``rows`` (claimed: the id first, the payload's text fourth) with the
        payloads the claiming statement left out (over _PAYLOAD_IN_ANSWER) read
        now. A row deleted meanwhile (an operator cancelled and purged it)
        keeps None: it is undeliverable, and its outcome, refused by the
        fence, still frees its capacity slot. Raises ``StoreError``: the
        claim committed, its rows unseen."""
        missing = [int(r[0]) for r in rows if r[3] is None]
        if not missing:
            return rows
        texts = dict(self._run("payloads", {"ids": _ints(missing)}).fetchall())
        return [
            r if r[3] is not None else (r[0], r[1], r[2], texts.get(r[0]), *r[4:]) for r in rows
        ]

    def finish(
        self,
        owner: str,
        outcomes: Sequence[Outcome],
        *,
        take: int = 0,
        lease: float = 0.0,
        skip_keys: Sequence[str] = (),
    ) -> Finished:
        if not outcomes:
            return Finished(0, 0)
        if len({o.id for o in outcomes}) < len(outcomes):
            # One row twice (claimed again after an operator revived it):
            # the statement fences each row by its first token. Write the
            # first outcome of each row, then the others.
            seen: set[int] = set()
            first: list[Outcome] = []
            rest: list[Outcome] = []
            for o in outcomes:
                (rest if o.id in seen else first).append(o)
                seen.add(o.id)
            a = self.finish(owner, first, take=take, lease=lease, skip_keys=skip_keys)
            try:
                b = self.finish(owner, rest)
            except StoreError:
                # The first write went in, and may have claimed rows: they
                # are returned (to be held and renewed); the rest is written
                # again later.
                _log.warning(
                    "outbound: cannot write %d outbox outcomes; writing them again later",
                    len(rest),
                    exc_info=True,
                )
                return Finished(
                    a.written, a.lost, a.later + tuple(rest), a.claimed, a.lost_outcomes
                )
            return Finished(
                a.written + b.written,
                a.lost + b.lost,
                a.later + b.later,
                a.claimed + b.claimed,
                a.lost_outcomes + b.lost_outcomes,
            )
        mutex = self._store.ordering == "mutex"
        token = self._tokens.getrandbits(62)
        # Parallel arrays; delays, errors and to_back are sent empty when all
        # are 0, None and false (the statement reads a missing item so).
        delays = [o.delay for o in outcomes]
        errors = [o.error for o in outcomes]
        to_back = [mutex and o.kind == "retry" for o in outcomes]
        params = {
            "owner": owner,
            "ids": _ints(o.id for o in outcomes),
            "tokens": _ints(o.token for o in outcomes),
            "kinds": "{" + ",".join([o.kind for o in outcomes]) + "}",
            "delays": delays if any(delays) else [],
            "errors": errors if any(e is not None for e in errors) else [],
            "to_back": to_back if any(to_back) else [],
            "slots": _ints(o.slot for o in outcomes if o.slot is not None),
            "take": max(0, take) if lease > 0.0 else 0,
            "token": token,
            "lease": lease,
            "skip": _texts(skip_keys),
            "cap": _PAYLOAD_IN_ANSWER,
        }
        try:
            rows = self._run("finish", params).fetchall()
        except StoreError as exc:
            if params["take"]:
                self._unanswered(token, exc)
            raise
        # The first row carries the ids written and fenced; the others are
        # the rows claimed at once.
        try:
            took = self._read_payloads([(*r[2:], None) for r in rows if r[0] is None])
        except StoreError:
            # The outcomes are written: they count. The rows taken are
            # released by the reconcile that follows.
            _log.warning(
                "outbound: cannot read the payloads of the outbox rows a write took; "
                "they are released",
                exc_info=True,
            )
            self._taken_unseen(token)
            took = []
        head = next(r for r in rows if r[0] is not None)
        done, fenced = set(head[0]), set(head[1])
        later = tuple(
            Outcome(o.id, o.token, o.key, o.kind, o.delay, o.error, None)
            for o in outcomes
            if o.id in fenced and o.id not in done
        )
        claimed = _claimed(took, token)
        lost = tuple(o for o in outcomes if o.id not in done and o.id not in fenced)
        return Finished(len(done), len(lost), later, tuple(claimed), lost)

    def renew(self, owner: str, lease: float, held: Sequence[Claimed]) -> int:
        if not held:
            return 0
        params = {
            "owner": owner,
            "lease": lease,
            "ids": _ints(c.message.id for c in held),
            "tokens": _ints(c.token for c in held),
            "slots": _ints(c.slot for c in held if c.slot is not None),
        }
        return int(self._run("renew", params).fetchone()[0])

    def _unanswered(self, token: int, exc: StoreError) -> None:
        """Keep ``token``: its claiming statement failed with no answer, and may have
        committed (a statement the server refused did not)."""
        if not self.refused(exc):
            self._keep_unseen(token)

    def _keep_unseen(self, token: int) -> None:
        """Keep ``token`` for the next reconcile: rows it claimed may be this relay's,
        unseen (their attempts are given back)."""
        with self._lost.lock:
            self._lost.unseen.append(token)
            del self._lost.unseen[:-_UNSEEN_KEPT]

    def reconcile(self, owner: str, held: Sequence[Claimed]) -> int:
        """See :meth:`Session.reconcile`. Rows claimed by a statement whose answer
        was lost (it committed; the connection died before the rows came back)
        were never delivered: their attempt is not counted. First, the server
        processes of the connections dropped with a statement on them are
        told to end, and waited for up to ``_ORPHAN_WAIT`` seconds: one of
        them could still commit a claim, or an earlier reconcile, after
        this one. While one has not ended (caught in its commit, it cannot
        be), the tokens are kept and :meth:`reconnected` asks for another
        reconcile every ``_ORPHAN_RECHECK`` seconds, until one finds it gone.
        Covers the statements of the relay's other session too (they share
        their :class:`_Unanswered`)."""
        lost = self._lost
        with lost.lock:
            orphans = list(lost.orphans)
            unseen = list(lost.unseen)
            new = len(orphans) > lost.orphans_waited
        left = 0
        if orphans:
            left = self._end_orphans(orphans, _ORPHAN_WAIT if new else 0.0)
        params = {
            "owner": owner,
            "ids": _ints(c.message.id for c in held),
            "tokens": _ints(c.token for c in held),
            "slots": _ints(c.slot for c in held if c.slot is not None),
            "unseen": _ints(unseen),
        }
        released = int(self._run("reconcile", params).fetchone()[0])
        with lost.lock:
            if left:
                now = time.monotonic()
                lost.orphans_waited = len(orphans)
                lost.recheck_at = now + _ORPHAN_RECHECK
                if lost.lingering_since is None:
                    lost.lingering_since = now
            else:
                # (Those added meanwhile, by the other session, are kept.)
                done = set(unseen)
                lost.unseen[:] = [t for t in lost.unseen if t not in done]
                ended = set(orphans)
                lost.orphans[:] = [o for o in lost.orphans if o not in ended]
                lost.orphans_waited = 0
                lost.recheck_at = math.inf
                lost.lingering_since = None
                lost.gave_up = False
        return released

    def _end_orphans(self, orphans: Sequence[tuple[int, int]], patience: float) -> int:
        """Tell the server processes ``orphans`` to end; return how many are still there.

        Waits up to ``patience`` seconds for them to end. Raises
        ``StoreError`` if the database fails; a refusal (say, a role not
        allowed to end them) is logged, and counts as none left: looking
        again would be refused again.
        """
        params = {"pids": [pid for pid, _ in orphans], "starts": [start for _, start in orphans]}
        deadline = time.monotonic() + patience
        while True:
            try:
                left = int(self._run("end_orphans", params).fetchone()[0])
            except StoreError as exc:
                if not self.refused(exc):
                    raise
                _log.warning(
                    "outbound: cannot end the server processes of dropped connections; "
                    "a claim still running there may commit after the reconcile: %s",
                    exc,
                )
                return 0
            if not left or time.monotonic() >= deadline:
                if left and patience:
                    _log.warning(
                        "outbound: %d server processes of dropped connections have not ended "
                        "within %gs (one caught in its commit cannot be); looking again every "
                        "%gs, to release what they claim once they end",
                        left,
                        patience,
                        _ORPHAN_RECHECK,
                    )
                return left
            time.sleep(0.01)

    def release_slots(self, owner: str) -> None:
        self._run("free_owner_slots", (owner,))

    def close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            _close_quietly(conn, drop=conn.closed or conn.broken)


def _direct(conn: psycopg.Connection[Any], addr: str | None, port: int | None) -> bool:
    """``conn`` reaches its server process directly: the server took it where it was made.

    ``addr`` and ``port``: where the server says it took the connection (None
    over a Unix-domain socket). A pooler or a proxy in between listens
    elsewhere than the server, or over TCP where the client used a socket.
    """
    info = conn.info
    if addr is None or port is None:
        return info.host.startswith("/")
    try:
        hostaddr = info.hostaddr
    except Exception:  # a libpq before PostgreSQL 12 cannot tell
        return False
    return addr == hostaddr and port == info.port


def _claimed(
    found: list[Any], token: int, waits: Mapping[int, float] | None = None
) -> list[Claimed]:
    """Claimed rows, ordered by id, from the rows a claim returned (``waits``: the
    seconds until due of the rows not due yet, by id)."""
    found.sort(key=lambda r: r[0])
    claimed = []
    for row_id, key, type_, text, dedupe_key, attempts, created, slot in found:
        error: str | None
        if text is None:  # (see _PostgresSession._read_payloads)
            payload, error = None, "the row was deleted before its payload could be read"
        else:
            payload, error = decode_payload(text)
        message = OutboxMessage(
            int(row_id), key, type_, payload, int(attempts), dedupe_key, float(created)
        )
        wait = waits.get(message.id, 0.0) if waits else 0.0
        slot_ = None if slot is None else int(slot)
        claimed.append(Claimed(message, token, slot_, error, wait, text if error is None else None))
    return claimed


class _Listener:
    """A thread that LISTENs on the store's channel and calls ``wake()`` per notification.

    Its connection is its own (not pooled) and confined to its thread. Every
    3 x ``connect_timeout`` it runs ``SELECT 1`` (bounded by the watchdog),
    so that a connection that stopped answering is replaced.
    :meth:`stop` returns within about ``_POLL`` seconds.
    """

    _POLL = 0.2

    def __init__(self, store: PostgresStore, wake: Callable[[], object]) -> None:
        self._store = store
        self._wake = wake
        self._stop = threading.Event()
        self._ready = threading.Event()
        # An outage logs its first error, then one line a minute (see Streaks).
        self._streaks = Streaks()
        self._thread = threading.Thread(
            target=self._run, name=f"outbound-listen-{store.table}", daemon=True
        )

    def start(self) -> None:
        """Start listening; block until LISTEN is in place (up to 10 s)."""
        self._thread.start()
        self._ready.wait(10.0)

    def _run(self) -> None:
        psycopg = self._store._psycopg
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    self._store.conninfo,
                    autocommit=True,
                    connect_timeout=max(1, int(self._store.connect_timeout)),
                    **self._store._tcp_settings,
                ) as conn:
                    bound = self._store.connect_timeout
                    with _WATCHDOG.bound(conn, bound):
                        conn.execute(f"LISTEN {self._store.channel}")
                    self._streaks.ok("listen")
                    self._ready.set()
                    self._wake()  # anything committed before LISTEN is seen by the next claim
                    next_check = time.monotonic() + 3 * bound
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=self._POLL):
                            self._wake()
                        if time.monotonic() >= next_check:
                            # A connection that stopped answering brings no
                            # notification and no error: ask it something
                            # now and then (within connect_timeout).
                            with _WATCHDOG.bound(conn, bound):
                                conn.execute("SELECT 1")
                            next_check = time.monotonic() + 3 * bound
            except psycopg.Error as exc:
                line = "outbound: outbox listener error, reconnecting: %s"
                self._streaks.failed("listen", line, exc, exc_info=False)
                self._ready.set()
                self._stop.wait(1.0)

    def stop(self, timeout: float | None = None) -> None:
        """Stop listening and wait up to ``timeout`` for the thread. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
