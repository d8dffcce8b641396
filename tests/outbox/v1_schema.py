"""The outbox schema as version 1 of the library made it (no version table): to test migrations.

Copied from the stores' SQL of that release; each store's rows are written
the way that version wrote them.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

POSTGRES = (
    """
    CREATE TABLE {t} (
        id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        key              text        NOT NULL,
        type             text        NOT NULL,
        payload          jsonb       NOT NULL,
        dedupe_key       text,
        status           text        NOT NULL DEFAULT 'pending'
                         CHECK (status IN ('pending', 'processing', 'sent', 'dead')),
        head             boolean     NOT NULL DEFAULT false,
        seq              bigint,
        attempts         integer     NOT NULL DEFAULT 0,
        claims           integer     NOT NULL DEFAULT 0,
        available_at     timestamptz NOT NULL DEFAULT now(),
        lease_owner      text,
        lease_expires_at timestamptz,
        last_error       text,
        created_at       timestamptz NOT NULL DEFAULT now(),
        updated_at       timestamptz NOT NULL DEFAULT now()
    )
    """,
    "CREATE INDEX {t}_ready ON {t} (available_at, id) WHERE head AND status = 'pending'",
    "CREATE INDEX {t}_lease ON {t} (lease_expires_at) WHERE status = 'processing'",
    "CREATE INDEX {t}_new ON {t} (id) WHERE seq IS NULL",
    """
    CREATE UNIQUE INDEX {t}_head ON {t} (key)
        WHERE head AND status IN ('pending', 'processing')
    """,
    """
    CREATE INDEX {t}_waiting ON {t} (key, seq)
        WHERE NOT head AND status = 'pending' AND seq IS NOT NULL
    """,
    """
    CREATE UNIQUE INDEX {t}_dedupe ON {t} (dedupe_key)
        WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
    """,
    "CREATE INDEX {t}_state ON {t} (status, created_at) WHERE status <> 'processing'",
    "CREATE TABLE {t}_slots (slot integer PRIMARY KEY, owner text, expires_at timestamptz)",
)

SQLITE = (
    """
    CREATE TABLE {t} (
        id               INTEGER PRIMARY KEY,
        key              TEXT    NOT NULL,
        type             TEXT    NOT NULL,
        payload          TEXT    NOT NULL,
        dedupe_key       TEXT,
        status           TEXT    NOT NULL DEFAULT 'pending'
                         CHECK (status IN ('pending', 'processing', 'sent', 'dead')),
        head             INTEGER NOT NULL DEFAULT 0,
        seq              INTEGER NOT NULL,
        attempts         INTEGER NOT NULL DEFAULT 0,
        claims           INTEGER NOT NULL DEFAULT 0,
        available_at     REAL    NOT NULL,
        lease_owner      TEXT,
        lease_expires_at REAL,
        last_error       TEXT,
        created_at       REAL    NOT NULL,
        updated_at       REAL    NOT NULL
    )
    """,
    "CREATE INDEX {t}_ready ON {t} (available_at, id) WHERE head = 1 AND status = 'pending'",
    "CREATE INDEX {t}_lease ON {t} (lease_expires_at) WHERE status = 'processing'",
    """
    CREATE UNIQUE INDEX {t}_head ON {t} (key)
        WHERE head = 1 AND status IN ('pending', 'processing')
    """,
    "CREATE INDEX {t}_waiting ON {t} (key, seq) WHERE head = 0 AND status = 'pending'",
    """
    CREATE UNIQUE INDEX {t}_dedupe ON {t} (dedupe_key)
        WHERE dedupe_key IS NOT NULL AND status IN ('pending', 'processing')
    """,
    "CREATE INDEX {t}_status ON {t} (status, created_at)",
    "CREATE TABLE {t}_slots (slot INTEGER PRIMARY KEY, owner TEXT, expires_at REAL)",
)

#: (key, status, head, attempts, last_error) of the rows written by
#: :func:`fill`, in id order: a key with a sent row, a head and one waiting;
#: a key whose head is processing (a relay of version 1 holds it); a dead
#: row; a key with a head in backoff and one waiting.
ROWS = (
    ("a", "sent", True, 1, None),
    ("a", "pending", True, 0, None),
    ("a", "pending", False, 0, None),
    ("b", "processing", True, 1, None),
    ("c", "dead", True, 3, "ValueError: bad"),
    ("d", "pending", True, 2, "RuntimeError: flaky"),
    ("d", "pending", False, 0, None),
)


def create_postgres(conn: Any, table: str) -> None:
    """Make a version 1 table with :data:`ROWS` on an autocommit psycopg connection."""
    for statement in POSTGRES:
        conn.execute(statement.replace("{t}", table))
    for n, (key, status, head, attempts, error) in enumerate(ROWS, 1):
        backoff = "now() + interval '1 hour'" if error and status == "pending" else "now()"
        lease = "now() + interval '1 hour'" if status == "processing" else "NULL"
        conn.execute(
            f"INSERT INTO {table} (key, type, payload, status, head, seq, attempts, claims, "
            "available_at, lease_owner, lease_expires_at, last_error) "
            f"VALUES (%s, 't', %s, %s, %s, %s, %s, %s, {backoff}, %s, {lease}, %s)",
            (
                key,
                f'{{"n": {n}}}',
                status,
                head,
                n,
                attempts,
                attempts,
                "old-relay" if status == "processing" else None,
                error,
            ),
        )


def create_sqlite(path: str, table: str) -> None:
    """Make a version 1 table with :data:`ROWS` in the SQLite file ``path``."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in SQLITE:
            conn.execute(statement.replace("{t}", table))
        now = time.time()
        for n, (key, status, head, attempts, error) in enumerate(ROWS, 1):
            conn.execute(
                f"INSERT INTO {table} (key, type, payload, status, head, seq, attempts, claims, "
                "available_at, lease_owner, lease_expires_at, last_error, created_at, updated_at) "
                "VALUES (?, 't', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    f'{{"n": {n}}}',
                    status,
                    int(head),
                    n,
                    attempts,
                    attempts,
                    now + 3600 if error and status == "pending" else now,
                    "old-relay" if status == "processing" else None,
                    now + 3600 if status == "processing" else None,
                    error,
                    now,
                    now,
                ),
            )
    finally:
        conn.close()
