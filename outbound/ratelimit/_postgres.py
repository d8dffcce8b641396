"""One bot's budget in PostgreSQL: :class:`PostgresRateLimiter` (extra ``postgres``).

For deployments whose only shared service is the outbox database. Each
decision is one call of a PL/pgSQL function (one round trip), which takes
transaction-scoped advisory locks on the chat's, the group's and the
overall bucket, always in that order (so no two decisions deadlock), reads
and writes one small table, and commits; the clock is the server's
``clock_timestamp()``, the same for every process and host. The table and
the functions are created idempotently on first use.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Hashable
from typing import Any, Final

from ._core import EARLY
from ._limits import RateLimits
from ._shared import SharedRateLimiter

__all__ = ["PostgresRateLimiter"]

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,40}")

#: Seconds between two sweeps of passed buckets and bans from the table.
_SWEEP_EVERY: Final = 60.0

# The schema, step by step the same decision as RateLimiter._decide_locked
# and the Lua script of RedisRateLimiter. {t} is the table's name.
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS {t} (
    key text PRIMARY KEY,
    value double precision NOT NULL
);

CREATE OR REPLACE FUNCTION {t}_put(p_key text, p_value double precision) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO {t} (key, value) VALUES (p_key, p_value)
    ON CONFLICT (key) DO UPDATE SET value = excluded.value
$$;

CREATE OR REPLACE FUNCTION {t}_ban(p_now double precision, p_key text, p_seconds double precision)
RETURNS void LANGUAGE sql AS $$
    INSERT INTO {t} (key, value)
    VALUES (p_key, coalesce(p_now, extract(epoch FROM clock_timestamp())) + p_seconds)
    ON CONFLICT (key) DO UPDATE SET value = greatest({t}.value, excluded.value)
$$;

CREATE OR REPLACE FUNCTION {t}_acquire(
    p_now double precision, p_base text, p_chat text,
    p_has_chat boolean, p_has_group boolean, p_has_overall boolean,
    ci double precision, ct double precision, gi double precision, gt double precision,
    oi double precision, ot double precision,
    p_hold double precision, p_book boolean, p_slack double precision, p_early double precision
) RETURNS double precision LANGUAGE plpgsql AS $$
DECLARE
    now_ double precision := coalesce(p_now, extract(epoch FROM clock_timestamp()));
    k_chat text := p_base || 'chat:' || p_chat;
    k_group text := p_base || 'group:' || p_chat;
    k_over text := p_base || 'overall';
    k_plan text := p_base || 'plan';
    ban double precision;
    sent double precision;
    plan double precision;
    avail double precision;
    guard boolean;
    wait double precision := 0;
    chat_tat double precision;
    group_tat double precision;
    booked double precision;
    k_book text := p_base || 'book:' || p_chat;
BEGIN
    IF p_has_chat THEN PERFORM pg_advisory_xact_lock(hashtextextended(k_chat, 0)); END IF;
    IF p_has_group THEN PERFORM pg_advisory_xact_lock(hashtextextended(k_group, 0)); END IF;
    IF p_has_overall THEN PERFORM pg_advisory_xact_lock(hashtextextended(k_over, 0)); END IF;
    SELECT max(value) INTO ban FROM {t} WHERE key IN (p_base || 'ban', p_base || 'ban:' || p_chat);
    IF ban IS NOT NULL AND ban > now_ THEN RETURN ban - now_; END IF;
    IF p_has_chat THEN
        SELECT value INTO chat_tat FROM {t} WHERE key = k_chat;
        IF chat_tat IS NOT NULL THEN wait := greatest(wait, chat_tat - ct - now_); END IF;
    END IF;
    IF p_has_group THEN
        SELECT value INTO group_tat FROM {t} WHERE key = k_group;
        IF group_tat IS NOT NULL THEN wait := greatest(wait, group_tat - gt - now_); END IF;
    END IF;
    IF wait > 0 THEN RETURN wait; END IF;
    IF p_has_overall THEN
        IF p_book THEN SELECT value INTO booked FROM {t} WHERE key = k_book; END IF;
        IF booked IS NOT NULL AND booked + p_hold < now_ THEN booked := NULL; END IF;
        IF booked IS NOT NULL AND now_ < booked - p_early THEN
            RETURN booked - now_;
        END IF;
        IF booked IS NOT NULL THEN DELETE FROM {t} WHERE key = k_book; END IF;
        SELECT value INTO sent FROM {t} WHERE key = k_over;
        SELECT value INTO plan FROM {t} WHERE key = k_plan;
        guard := sent IS NULL OR sent - ot - p_slack <= now_;
        IF booked IS NULL AND plan IS NOT NULL AND plan - ot > now_ THEN guard := false; END IF;
        IF NOT guard THEN
            avail := greatest(now_, plan - ot, sent - ot - p_slack);
            IF NOT p_book THEN RETURN avail - now_; END IF;
            PERFORM {t}_put(k_plan, greatest(coalesce(plan, avail), avail) + oi);
            PERFORM {t}_put(k_book, avail);
            RETURN avail - now_;
        END IF;
        PERFORM {t}_put(k_over, greatest(coalesce(sent, now_), now_) + oi);
        IF booked IS NULL THEN
            PERFORM {t}_put(k_plan, greatest(coalesce(plan, now_), now_) + oi);
        END IF;
    END IF;
    IF p_has_chat THEN
        PERFORM {t}_put(k_chat, greatest(coalesce(chat_tat, now_), now_) + ci);
    END IF;
    IF p_has_group THEN
        PERFORM {t}_put(k_group, greatest(coalesce(group_tat, now_), now_) + gi);
    END IF;
    RETURN 0;
END
$$;
"""


class PostgresRateLimiter(SharedRateLimiter):
    """A :class:`~outbound.ratelimit.RateLimiter` whose state lives in PostgreSQL.

    ``conninfo`` is a libpq connection string or URL. ``limits`` are the
    bot's limits, shared by every process that uses the same ``name``
    (one per bot token) in the same ``table`` (created if missing, with its
    functions ``<table>_acquire``, ``<table>_ban`` and ``<table>_put``).
    ``timeout``: seconds a connect or a decision may take before this
    process falls back to its local share. The other keyword options are
    those of :class:`~outbound.ratelimit.RedisRateLimiter`.

    One round trip per :meth:`acquire` and :meth:`record_429`, on one
    connection per limiter (decisions of one process take turns on it);
    when the server is unreachable, decides locally at ``fallback_share``
    of every limit and logs an error (``outbound.ratelimit``). Thread-safe.
    """

    _store_name = "PostgreSQL server"

    def __init__(
        self,
        conninfo: str,
        limits: RateLimits,
        *,
        name: str = "default",
        table: str = "outbound_ratelimit",
        timeout: float = 2.0,
        **options: Any,
    ) -> None:
        try:
            import psycopg  # noqa: PLC0415  (an optional dependency)
            import psycopg.conninfo  # noqa: PLC0415
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "PostgresRateLimiter needs psycopg 3: pip install 'outbound-dispatcher[postgres]'"
            ) from exc
        if not isinstance(conninfo, str) or not conninfo:
            raise TypeError("conninfo must be a non-empty str (a libpq connection string or URL)")
        if not _IDENTIFIER.fullmatch(table):
            raise ValueError(f"table must be a lowercase SQL identifier, not {table!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, not {name!r}")
        if not 0 < timeout < 3600:
            raise ValueError(f"timeout must be a number of seconds in (0, 3600), not {timeout!r}")
        super().__init__(limits, **options)
        self._psycopg: Final = psycopg
        self._store_errors = (psycopg.Error, OSError)
        self._conninfo: Final = conninfo
        self._table: Final = table
        self._timeout: Final = float(timeout)
        self._base: Final = f"{name}:"
        self._acquire_sql: Final = f"SELECT {table}_acquire({', '.join(['%s'] * 16)})"
        self._ban_sql: Final = f"SELECT {table}_ban(%s, %s, %s)"
        gcras = [
            (0.0, 0.0) if g is None else (g.interval, g.tolerance)
            for g in (self._chat, self._group, self._overall)
        ]
        self._rates: Final = [value for pair in gcras for value in pair]
        # Guards _conn, _closed and _swept: one statement at a time on the
        # connection. Sending threads wait on it for one round trip.
        self._conn_lock: Final = threading.Lock()
        self._conn: Any = None
        self._closed = False
        self._swept = time.monotonic()
        try:
            psycopg.conninfo.conninfo_to_dict(conninfo)
        except psycopg.Error as exc:
            raise ValueError(f"not a PostgreSQL connection string: {exc}") from None
        try:
            with self._conn_lock:
                self._connect_locked()
        except self._store_errors as exc:  # unreachable now: start at the local share
            self._store_failed(exc)

    def _connect_locked(self) -> Any:
        if self._closed:
            raise OSError("this PostgresRateLimiter is closed")
        if self._conn is None or self._conn.closed:
            if not self._may_connect():
                raise OSError("the PostgreSQL server is unreachable; not connecting again yet")
            conn = self._psycopg.connect(
                self._conninfo, autocommit=True, connect_timeout=max(1, round(self._timeout))
            )
            try:
                conn.execute(f"SET statement_timeout = {int(self._timeout * 1000)}")
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self._table,))
                    conn.execute(_SCHEMA.replace("{t}", self._table))
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _run(self, sql: str, params: list[Any]) -> Any:
        with self._conn_lock:
            try:
                conn = self._connect_locked()
                row = conn.execute(sql, params).fetchone()
                now = time.monotonic()
                if now - self._swept >= _SWEEP_EVERY:
                    self._swept = now
                    conn.execute(
                        f"DELETE FROM {self._table} WHERE key LIKE %s AND value < "
                        "extract(epoch FROM clock_timestamp()) - 60",
                        (self._base.replace("%", r"\%").replace("_", r"\_") + "%",),
                    )
            except BaseException:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                raise
        return row

    def _store_decide(self, now: float | None, chat_id: Hashable, group: bool, book: bool) -> float:
        row = self._run(
            self._acquire_sql,
            [
                now,
                self._base,
                repr(chat_id),
                self._chat is not None,
                group and self._group is not None,
                self._overall is not None,
                *self._rates,
                self._hold,
                book,
                self._slack,
                EARLY,
            ],
        )
        return max(0.0, float(row[0]))

    def _store_ban(self, now: float | None, chat_id: Hashable | None, seconds: float) -> None:
        key = self._base + ("ban" if chat_id is None else f"ban:{chat_id!r}")
        self._run(self._ban_sql, [now, key, seconds])

    def close(self) -> None:
        """Close the connection; later decisions use the local share. Idempotent."""
        with self._conn_lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __repr__(self) -> str:
        state = "fallback" if self.degraded else "shared"
        return f"<PostgresRateLimiter table={self._table} name={self._base[:-1]!r} {state}>"
