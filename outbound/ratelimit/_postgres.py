"""One bot's budget in PostgreSQL: :class:`PostgresRateLimiter` (extra ``postgres``).

For deployments whose only shared service is the outbox database. Each
decision is one call of a PL/pgSQL function (one round trip), which takes
transaction-scoped advisory locks on the chat's, the group's and the
overall bucket, always in that order (so no two decisions deadlock), reads
and writes one small table, and commits; the clock is the server's
``clock_timestamp()``, the same for every process and host. The tables and
the functions are created idempotently on first use.

Every call is bounded on both sides: the server cancels a statement after
``timeout`` (``statement_timeout``, set when the connection is made), and
the client never waits longer than ``timeout`` for a connect or an answer
either: it drives libpq without blocking (psycopg's ``pq`` layer) and
gives up at the deadline, so a server that stops answering (a stalled host,
a SIGSTOP, a dead link) fails over to the local share within ``timeout``.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import select
import socket
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final

from outbound._fair import FairLock
from outbound._fork import renewed_after_fork
from outbound._secret import driver_error

from ._core import EARLY, Scope
from ._limits import RateLimits
from ._shared import (
    ConnectGate,
    Entry,
    SharedRateLimiter,
    StoreClosed,
    call_deadline,
    chat_text,
    check_name,
    check_timeout,
    connect_by,
    encodes,
)

__all__ = ["PostgresRateLimiter"]

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,40}")
#: The table's own name in _SCHEMA ({t} not followed by a suffix).
_BARE_TABLE = re.compile(r"\{t\}(?![a-z0-9_])")

#: Seconds between two sweeps of passed buckets and bans from the table.
_SWEEP_EVERY: Final = 60.0
#: Seconds past its value (past its hold, for a booking) that the sweep leaves a row.
_SWEEP_AFTER: Final = 60.0

# Connections inherited from a parent process: never used, never closed (closing
# would end the parent's session on the shared socket), kept from the collector.
_INHERITED: list[Any] = []

# The schema, step by step the same decision as RateLimiter._decide_locked
# and the Lua scripts of RedisRateLimiter. {t} is the table's name.
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS {t} (
    key text PRIMARY KEY,
    value double precision NOT NULL
);

CREATE TABLE IF NOT EXISTS {t}_recent (
    name text NOT NULL,
    chat text NOT NULL,
    at double precision NOT NULL,
    PRIMARY KEY (name, chat)
);

CREATE OR REPLACE FUNCTION {t}_put(p_key text, p_value double precision) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO {t} (key, value) VALUES (p_key, p_value)
    ON CONFLICT (key) DO UPDATE SET value = excluded.value
$$;

-- p_base + p_step, never less than p_step later (see _after in _core.py);
-- t + |t| * (2^-53 + 2^-105) is the next double up, as math.nextafter says.
CREATE OR REPLACE FUNCTION {t}_after(p_base double precision, p_step double precision)
RETURNS double precision LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN (p_base - (t - (t - p_base))) + (p_step - (t - p_base)) > 0
                THEN t + abs(t) * (power(2::float8, -53) + power(2::float8, -105)) ELSE t END
    FROM (SELECT p_base + p_step AS t) AS sum_
$$;

CREATE OR REPLACE FUNCTION {t}_ban(p_now double precision, p_key text, p_seconds double precision)
RETURNS void LANGUAGE sql AS $$
    INSERT INTO {t} (key, value)
    VALUES (p_key, coalesce(p_now, extract(epoch FROM clock_timestamp())) + p_seconds)
    ON CONFLICT (key) DO UPDATE SET value = greatest({t}.value, excluded.value)
$$;

-- A 429: infer its scope if p_scope is NULL (as RateLimiter._infer), ban, return the scope.
CREATE OR REPLACE FUNCTION {t}_record(
    p_now double precision, p_base text, p_chat text, p_seconds double precision,
    p_scope text, p_infer_chats integer, p_window double precision
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    now_ double precision;
    scope_ text := p_scope;
    chats integer;
BEGIN
    IF scope_ IS NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_base || 'recent429', 0));
    END IF;
    now_ := coalesce(p_now, extract(epoch FROM clock_timestamp()));  -- after the lock
    IF scope_ IS NULL THEN
        DELETE FROM {t}_recent WHERE name = p_base AND at < now_ - p_window;
        INSERT INTO {t}_recent (name, chat, at) VALUES (p_base, p_chat, now_)
        ON CONFLICT (name, chat) DO UPDATE SET at = excluded.at;
        SELECT count(*) INTO chats FROM {t}_recent WHERE name = p_base;
        scope_ := CASE WHEN chats >= p_infer_chats THEN 'global' ELSE 'chat' END;
    END IF;
    PERFORM {t}_ban(
        now_,
        CASE WHEN scope_ = 'global' THEN p_base || 'ban' ELSE p_base || 'ban:' || p_chat END,
        p_seconds
    );
    RETURN scope_;
END
$$;

-- The later of the two values for each key (seconds from now), under the
-- locks a decision takes, in its order: chats, groups, overall. The rows are
-- written in key order: two processes writing their bans back at once, each
-- listing them in its own order, took the rows' locks in opposite orders.
CREATE OR REPLACE FUNCTION {t}_handover(
    p_now double precision, p_base text, p_keys text[], p_left double precision[]
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    now_ double precision;
    k text;
BEGIN
    FOR k IN SELECT x FROM unnest(p_keys) AS x
             WHERE starts_with(x, p_base || 'chat:') ORDER BY x LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(k, 0));
    END LOOP;
    FOR k IN SELECT x FROM unnest(p_keys) AS x
             WHERE starts_with(x, p_base || 'group:') ORDER BY x LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(k, 0));
    END LOOP;
    IF (p_base || 'overall') = ANY (p_keys) OR (p_base || 'plan') = ANY (p_keys) THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_base || 'overall', 0));
    END IF;
    now_ := coalesce(p_now, extract(epoch FROM clock_timestamp()));  -- after the locks
    INSERT INTO {t} (key, value)
    SELECT x, now_ + l FROM unnest(p_keys, p_left) AS u(x, l) ORDER BY x
    ON CONFLICT (key) DO UPDATE SET value = greatest({t}.value, excluded.value);
END
$$;

CREATE OR REPLACE FUNCTION {t}_decide(
    p_now double precision, p_base text, p_chat text,
    p_has_chat boolean, p_has_group boolean, p_has_overall boolean,
    ci double precision, ct double precision, gi double precision, gt double precision,
    oi double precision, ot double precision,
    p_hold double precision, p_book boolean, p_slack double precision, p_early double precision,
    OUT wait double precision, OUT global_ban double precision, OUT chat_ban double precision
) LANGUAGE plpgsql AS $$
DECLARE
    now_ double precision;
    k_chat text := p_base || 'chat:' || p_chat;
    k_group text := p_base || 'group:' || p_chat;
    k_over text := p_base || 'overall';
    k_plan text := p_base || 'plan';
    sent double precision;
    plan double precision;
    avail double precision;
    guard boolean;
    chat_tat double precision;
    group_tat double precision;
    booked double precision;
    k_book text := p_base || 'book:' || p_chat;
BEGIN
    wait := 0;
    global_ban := 0;
    chat_ban := 0;
    IF p_has_chat THEN PERFORM pg_advisory_xact_lock(hashtextextended(k_chat, 0)); END IF;
    IF p_has_group THEN PERFORM pg_advisory_xact_lock(hashtextextended(k_group, 0)); END IF;
    IF p_has_overall THEN PERFORM pg_advisory_xact_lock(hashtextextended(k_over, 0)); END IF;
    -- The time of the decision is after the waits for the locks: read before
    -- them, a decision that waited would be judged as if made that much
    -- earlier, and grant a send a whole wait too soon.
    now_ := coalesce(p_now, extract(epoch FROM clock_timestamp()));
    SELECT greatest(max(value) - now_, 0) INTO global_ban FROM {t} WHERE key = p_base || 'ban';
    SELECT greatest(max(value) - now_, 0) INTO chat_ban FROM {t}
        WHERE key = p_base || 'ban:' || p_chat;
    global_ban := coalesce(global_ban, 0);
    chat_ban := coalesce(chat_ban, 0);
    IF global_ban > 0 OR chat_ban > 0 THEN
        wait := greatest(global_ban, chat_ban);
        RETURN;
    END IF;
    IF p_has_chat THEN
        SELECT value INTO chat_tat FROM {t} WHERE key = k_chat;
        IF chat_tat IS NOT NULL THEN wait := greatest(wait, chat_tat - ct - now_); END IF;
    END IF;
    IF p_has_group THEN
        SELECT value INTO group_tat FROM {t} WHERE key = k_group;
        IF group_tat IS NOT NULL THEN wait := greatest(wait, group_tat - gt - now_); END IF;
    END IF;
    IF wait > 0 THEN RETURN; END IF;
    IF p_has_overall THEN
        IF p_book THEN SELECT value INTO booked FROM {t} WHERE key = k_book; END IF;
        IF booked IS NOT NULL AND booked + p_hold < now_ THEN booked := NULL; END IF;
        IF booked IS NOT NULL AND now_ < booked - p_early THEN
            wait := booked - now_;
            RETURN;
        END IF;
        IF booked IS NOT NULL THEN DELETE FROM {t} WHERE key = k_book; END IF;
        SELECT value INTO sent FROM {t} WHERE key = k_over;
        SELECT value INTO plan FROM {t} WHERE key = k_plan;
        guard := sent IS NULL OR sent - ot - p_slack <= now_;
        IF booked IS NULL AND plan IS NOT NULL AND plan - ot > now_ THEN guard := false; END IF;
        IF NOT guard THEN
            avail := greatest(now_, plan - ot, sent - ot - p_slack);
            wait := avail - now_;
            IF NOT p_book THEN RETURN; END IF;
            PERFORM {t}_put(k_plan, {t}_after(greatest(coalesce(plan, avail), avail), oi));
            PERFORM {t}_put(k_book, avail);
            RETURN;
        END IF;
        PERFORM {t}_put(k_over, {t}_after(greatest(coalesce(sent, now_), now_), oi));
        IF booked IS NULL THEN
            PERFORM {t}_put(k_plan, {t}_after(greatest(coalesce(plan, now_), now_), oi));
        END IF;
    END IF;
    IF p_has_chat THEN
        PERFORM {t}_put(k_chat, {t}_after(greatest(coalesce(chat_tat, now_), now_), ci));
    END IF;
    IF p_has_group THEN
        PERFORM {t}_put(k_group, {t}_after(greatest(coalesce(group_tat, now_), now_), gi));
    END IF;
    wait := 0;
END
$$;
"""


def _wait_for(fd: int, write: bool, deadline: float) -> None:
    """Block until ``fd`` is ready to read (or write), at most until ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0.0:
        raise TimeoutError("no answer from the PostgreSQL server within the timeout")
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLOUT if write else select.POLLIN)
        ready = bool(poller.poll(math.ceil(left * 1000)))
    else:  # pragma: no cover - Windows
        ready = any(select.select([] if write else [fd], [fd] if write else [], [], left)[:2])
    if not ready:
        raise TimeoutError("no answer from the PostgreSQL server within the timeout")


def _text(value: float | bool | str | None) -> bytes | None:
    """A query parameter in PostgreSQL's text format."""
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    return (value if isinstance(value, str) else repr(value)).encode()


def _array(values: Sequence[float | str]) -> bytes:
    """A one-dimensional array literal of texts or numbers."""
    items = []
    for value in values:
        text = value if isinstance(value, str) else repr(value)
        items.append('"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return ("{" + ",".join(items) + "}").encode()


#: One host of a conninfo's list: its name (or socket directory), its address
#: (hostaddr; "" if none), its port ("" if the list has one for all).
_Host = tuple[str, str, str]


def _looked_up(host: str) -> bool:
    """Whether libpq would look ``host`` up (a name: not an address or a socket's
    directory, nor empty, the default socket)."""
    if not host or host.startswith(("/", "@")):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def _hosts_of(given: dict[str, Any]) -> tuple[list[_Host], bool] | None:
    """The hosts of a conninfo (its own, else ``PGHOST``, ``PGHOSTADDR`` and
    ``PGPORT``), and whether each has its port; None if libpq would look none of
    them up, or they cannot be told here (a service file's) or libpq refuses
    them (lists of different lengths)."""
    if given.get("service") or os.environ.get("PGSERVICE"):
        return None
    env = os.environ
    host = given["host"] if "host" in given else env.get("PGHOST")
    if not isinstance(host, str) or not host:
        return None
    names = host.split(",")
    address = given["hostaddr"] if "hostaddr" in given else env.get("PGHOSTADDR")
    addresses = str(address).split(",") if address else [""] * len(names)
    port = given["port"] if "port" in given else env.get("PGPORT")
    ports = str(port).split(",") if port else []
    each = len(ports) > 1
    if len(addresses) != len(names) or (each and len(ports) != len(names)):
        return None
    hosts = [
        (n, a, ports[i] if each else "")
        for i, (n, a) in enumerate(zip(names, addresses, strict=True))
    ]
    if not any(not a and _looked_up(n) for n, a, _ in hosts):
        return None
    return hosts, each


def _addresses(hosts: list[_Host]) -> list[_Host]:
    """``hosts``, each name libpq would look up (no address given) in its stead
    once per address of its, in the resolver's order (none for a name that does
    not resolve). Blocks on the resolver; ``OSError`` (``socket.gaierror``) if
    no host is left."""
    found: list[_Host] = []
    first: OSError | None = None
    for name, address, port in hosts:
        if address or not _looked_up(name):
            found.append((name, address, port))
            continue
        mine: list[str] = []
        try:
            for *_, sockaddr in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM):
                if str(sockaddr[0]) not in mine:
                    mine.append(str(sockaddr[0]))
        except OSError as exc:
            first = first or exc
        found += [(name, each, port) for each in mine]
    if not found and first is not None:
        raise first
    return found


def _nothing(_: object) -> None:
    """Nothing to close: a lookup's answer that came too late."""


class _Session:
    """One libpq connection driven without blocking: each call ends by its deadline.

    Not locked itself: its owner holds a lock around every use. A call that
    fails or runs out of time leaves the connection closed.
    """

    def __init__(
        self,
        pq: Any,
        conninfo: bytes,
        hosts: list[_Host] | None = None,
        addressed: Callable[[list[_Host]], bytes] | None = None,
        given: str = "",
    ) -> None:
        # hosts: those to look up first, within the deadline (libpq looks a
        # name up with no timeout); addressed: the conninfo with them, looked up.
        self._pq = pq
        self._conninfo = conninfo
        self._hosts = hosts
        self._addressed = addressed
        self._gate = ConnectGate()
        # The conninfo as given, whose passwords libpq's messages must not show
        # (libpq's own reading may have split one: see _message).
        self._given = given
        self._pgconn: Any = None
        self._pid = 0

    @property
    def connected(self) -> bool:
        return self._pgconn is not None and self._pid == os.getpid()

    def connect(self, deadline: float) -> None:
        pq = self._pq
        self.drop()
        conninfo = self._conninfo
        hosts, addressed = self._hosts, self._addressed
        if hosts is not None and addressed is not None:
            # In a thread of its own, waited for until the deadline: libpq
            # looks a host name up with no timeout (connect_timeout starts
            # after), so it is given the addresses (hostaddr) instead.
            found = connect_by(lambda: _addresses(hosts), deadline, _nothing, self._gate)
            conninfo = addressed(found)
        pgconn = pq.PGconn.connect_start(conninfo)
        try:
            if pgconn.status == pq.ConnStatus.BAD:
                raise OSError(self._message(pgconn.error_message))
            status = pq.PollingStatus.WRITING
            while status != pq.PollingStatus.OK:
                if status == pq.PollingStatus.FAILED:
                    raise OSError(self._message(pgconn.error_message))
                _wait_for(pgconn.socket, status == pq.PollingStatus.WRITING, deadline)
                status = pgconn.connect_poll()
            pgconn.nonblocking = 1
        except BaseException:
            pgconn.finish()
            raise
        self._pgconn = pgconn
        self._pid = os.getpid()

    def ended_by_server(self) -> bool:
        """True if the server ended the connection while it was idle (a terminated
        backend, ``idle_session_timeout``, a pooler's restart): its socket has
        something to read when no query runs. Such a connection is dropped.
        Never blocks."""
        pgconn = self._pgconn
        try:
            fd = pgconn.socket
            if hasattr(select, "poll"):
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                readable = bool(poller.poll(0))
            else:  # pragma: no cover - Windows
                readable = bool(select.select([fd], [], [], 0)[0])
            if not readable:
                return False
            pgconn.consume_input()  # (the server's last words, or a notice)
            ended = bool(pgconn.status != self._pq.ConnStatus.OK)
        except Exception:
            ended = True
        if ended:
            self.drop()
        return ended

    def query(
        self, sql: bytes, params: Sequence[bytes | None] | None, deadline: float
    ) -> list[list[bytes | None]]:
        """Run ``sql`` (several statements when ``params`` is None); the rows of the last result."""
        pq = self._pq
        pgconn = self._pgconn
        try:
            if params is None:
                pgconn.send_query(sql)
            else:
                pgconn.send_query_params(sql, list(params))
            while pgconn.flush():
                _wait_for(pgconn.socket, True, deadline)
            rows: list[list[bytes | None]] = []
            error: str | None = None
            while True:
                while pgconn.is_busy():
                    _wait_for(pgconn.socket, False, deadline)
                    pgconn.consume_input()
                result = pgconn.get_result()
                if result is None:
                    break
                if result.status == pq.ExecStatus.TUPLES_OK:
                    rows = [
                        [result.get_value(r, c) for c in range(result.nfields)]
                        for r in range(result.ntuples)
                    ]
                elif result.status != pq.ExecStatus.COMMAND_OK and error is None:
                    error = self._message(result.error_message)
        except BaseException:
            self.drop()
            raise
        if error is not None:
            self.drop()
            raise OSError(f"PostgreSQL: {error}")
        return rows

    def drop(self) -> None:
        pgconn, self._pgconn = self._pgconn, None
        if pgconn is None:
            return
        if self._pid != os.getpid():
            _INHERITED.append(pgconn)
        else:
            pgconn.finish()

    def _message(self, raw: bytes | None) -> str:
        # (Without the password: libpq quotes the host, which holds the rest of a
        # password written with an unencoded "@".)
        said = (raw or b"").decode("utf-8", "replace").strip() or "unknown error"
        return driver_error(said, self._given)


class PostgresRateLimiter(SharedRateLimiter):
    """A :class:`~outbound.ratelimit.RateLimiter` whose state lives in PostgreSQL.

    ``conninfo`` is a libpq connection string or URL. ``limits`` are the
    bot's limits, shared by every process that uses the same ``name``
    (one per bot token) in the same ``table`` (created if missing, with a
    ``<table>_recent`` table and the functions ``<table>_decide``,
    ``<table>_record``, ``<table>_handover``, ``<table>_ban`` and
    ``<table>_put``). ``timeout``: seconds a connect or a call may take
    before this process falls back to its local share, enforced by the
    server (``statement_timeout``, passed as the connection's ``options``
    with ``default_transaction_isolation`` set to read committed, which the
    decisions need whatever the server's default, after the conninfo's own
    options or ``PGOPTIONS``; a service file's options are replaced: behind
    PgBouncer, list ``options`` in its ``ignore_startup_parameters``)
    and by the client alike; a number in [0.001, 3600). The other keyword
    options are those of
    :class:`~outbound.ratelimit.RedisRateLimiter`.

    One round trip per :meth:`acquire` and :meth:`record_429` (none for a
    chat under a ban this process knows of), on one connection per limiter
    (decisions of one process take turns on it, each waiting at most
    ``timeout`` in all); when the server is unreachable, decides locally at
    ``fallback_share`` of every limit and logs an error
    (``outbound.ratelimit``). Thread-safe; fork-safe (a child opens its own
    connection).
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
            import psycopg.pq  # noqa: PLC0415
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "PostgresRateLimiter needs psycopg 3: pip install 'outbound-dispatcher[postgres]'"
            ) from exc
        if not isinstance(conninfo, str) or not conninfo:
            raise TypeError("conninfo must be a non-empty str (a libpq connection string or URL)")
        if not isinstance(table, str) or not _IDENTIFIER.fullmatch(table):
            raise ValueError(
                "table must be a lowercase SQL identifier of 1 to 41 characters (a-z, 0-9, _; "
                f"its tables and functions add a suffix of up to 9), not {table!r}"
            )
        if table.startswith("pg_"):
            # (pg_catalog comes first on every search path: "pg_class" was the
            # catalog's, and the limiter ran on its local share for good.)
            raise ValueError(
                f"table must not begin with pg_ (PostgreSQL's own names), not {table!r}"
            )
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, not {name!r}")
        if "\x00" in name or not encodes(name):
            # PostgreSQL's text holds no NUL: "x\x00a" and "x\x00b" were one budget.
            raise ValueError(f"name must be text PostgreSQL can hold (no NUL), not {name!r}")
        check_name(name)
        seconds = check_timeout(timeout)
        try:
            given = psycopg.conninfo.conninfo_to_dict(conninfo)
        except psycopg.Error as exc:
            raise ValueError(
                "not a PostgreSQL connection string: " + driver_error(str(exc), conninfo)
            ) from None
        super().__init__(limits, **options)
        self._store_errors = (psycopg.Error, OSError)
        # The decision's function locks, then reads: READ COMMITTED, whatever the
        # server's default (under REPEATABLE READ a decision that waited for
        # another failed to serialize, and was taken for an outage).
        settings = (
            f"-c statement_timeout={math.ceil(seconds * 1000)} "
            "-c default_transaction_isolation=read\\ committed"
        )
        # (Given, options replace PGOPTIONS': kept here. A service file's are
        # not read here, and are replaced.)
        extra = given.get("options")
        if extra is None and "service" not in given:
            extra = os.environ.get("PGOPTIONS")
        full = psycopg.conninfo.make_conninfo(
            conninfo, options=f"{extra} {settings}" if extra else settings
        )
        self._table: Final = table
        self._timeout: Final = seconds
        # Every key of this limiter begins with its name, a colon in it
        # (and a backslash) escaped: no name's prefix is another's ("bot:"
        # began every key of "bot:eu", whose bookings the sweep of "bot"
        # deleted, and whose "overall" was the key of chat "overall" of a
        # limiter "bot:chat"). A name without either keeps the keys it had.
        self._name: Final = name
        self._base: Final = name.replace("\\", "\\\\").replace(":", "\\:") + ":"
        plan = _hosts_of(given)
        each_port = plan is not None and plan[1]

        def addressed(found: list[_Host]) -> bytes:
            # Each name once per address of its (the name for TLS and .pgpass),
            # and its port, if each host has one.
            more = {"port": ",".join(p for _, _, p in found)} if each_port else {}
            return psycopg.conninfo.make_conninfo(
                full,
                host=",".join(n for n, _, _ in found),
                hostaddr=",".join(a for _, a, _ in found),
                **more,
            ).encode()

        self._session: Final = _Session(
            psycopg.pq,
            full.encode(),
            plan[0] if plan is not None else None,
            addressed,
            given=conninfo,
        )
        cast = ", ".join(
            f"${i + 1}::{kind}"
            for i, kind in enumerate(
                ["float8", "text", "text", "bool", "bool", "bool"]
                + ["float8"] * 7
                + ["bool", "float8", "float8"]
            )
        )
        self._decide_sql: Final = f"SELECT * FROM {table}_decide({cast})".encode()
        self._record_sql: Final = (
            f"SELECT {table}_record($1::float8, $2::text, $3::text, $4::float8, $5::text, "
            "$6::int4, $7::float8)"
        ).encode()
        self._handover_sql: Final = (
            f"SELECT {table}_handover($1::float8, $2::text, $3::text[], $4::float8[])"
        ).encode()
        self._schema_sql: Final = (
            "BEGIN; SELECT pg_advisory_xact_lock(hashtext('"
            + table
            + "')); "
            # The table itself quoted ("user" is a reserved word); the names made
            # from it (user_decide) are never reserved.
            + _BARE_TABLE.sub(f'"{table}"', _SCHEMA).replace("{t}", table)
            + "; COMMIT;"
        ).encode()
        # The rows no decision uses any more, but those another transaction
        # holds: the sweep waits for no one (it took no advisory lock, and
        # row locks in the table's order: waiting, it deadlocked with a
        # decision or a handover writing those rows again in theirs). A
        # booking counts for slack + stale_after past its slot (as it does
        # in the other limiters): kept that long, and a minute more.
        self._sweep_sql: Final = (
            f'DELETE FROM "{table}" WHERE key = ANY(ARRAY('
            f'SELECT key FROM "{table}" WHERE starts_with(key, $1::text) AND value < '
            "coalesce($2::float8, extract(epoch FROM clock_timestamp())) - "
            f"{_SWEEP_AFTER + self._hold!r} FOR UPDATE SKIP LOCKED))"
        ).encode()  # ($2: the clock given to the limiter, which wrote the values)
        gcras = [
            (0.0, 0.0) if g is None else (g.interval, g.tolerance)
            for g in (self._chat, self._group, self._overall)
        ]
        self._rates: Final = [value for pair in gcras for value in pair]
        # Guards _session, _closed and _swept: one statement at a time on the
        # connection. A decision waits for it no longer than its own timeout,
        # in turn (threading.Lock would let a thread that just released it
        # take it again ahead of waiters, which then time out).
        self._conn_lock: Final = renewed_after_fork(FairLock())
        self._closed = False
        self._swept = time.monotonic()
        try:
            self._run(b"SELECT 1", [])
        except self._store_errors as exc:  # unreachable now: start at the local share
            self._store_failed(exc)

    @property
    def timeout(self) -> float:
        """Seconds one decision may wait for the server, its connect included."""
        return self._timeout

    def _run(self, sql: bytes, params: Sequence[bytes | None]) -> list[list[bytes | None]]:
        """Run one statement on the connection (made first if needed), by the deadline."""
        deadline = call_deadline(self._timeout)  # the decision's, if one is running
        left = deadline - time.monotonic()
        if left <= 0.0 or not self._conn_lock.acquire(left):
            raise TimeoutError("the connection stayed busy for the whole timeout")
        try:
            if self._closed:
                self._session.drop()  # if close() found the connection busy
                raise StoreClosed("this PostgresRateLimiter is closed")
            session = self._session
            # A connection the server ended while it was idle (a terminated
            # backend, idle_session_timeout, a pooler's restart) is made anew
            # within this deadline: the server answers, no outage. Found before
            # the statement if its end has come in, else by the statement's
            # failure, which is then run once more on a new connection (a
            # decision run twice can only count a send not made: the safe side).
            fresh = not session.connected or session.ended_by_server()
            if fresh:
                self._reconnect(session, deadline)
            try:
                rows = session.query(sql, params, deadline)
            except TimeoutError:
                raise
            except self._store_errors:
                if fresh or deadline <= time.monotonic():
                    raise
                self._reconnect(session, deadline)
                rows = session.query(sql, params, deadline)
            now = time.monotonic()
            if now - self._swept >= _SWEEP_EVERY:
                self._swept = now
                try:  # within the same deadline; the decision stands if it fails
                    now_given = self._now()
                    given = None if now_given is None else repr(now_given).encode()
                    session.query(self._sweep_sql, [self._base.encode(), given], deadline)
                except self._store_errors:
                    pass  # the connection is dropped; the next call makes another
        finally:
            if self._closed:  # close() found the connection busy: it ends with this call
                self._session.drop()
            self._conn_lock.release()
        return rows

    def _reconnect(self, session: _Session, deadline: float) -> None:
        """Connect ``session`` (and see to the schema) by ``deadline``, if this thread may."""
        if not self._may_connect():
            raise OSError("the PostgreSQL server is unreachable; not connecting again yet")
        session.connect(deadline)
        session.query(self._schema_sql, None, deadline)

    def _store_decide(
        self, now: float | None, chat_id: Hashable, group: bool, book: bool
    ) -> tuple[float, float, float]:
        values: list[float | bool | str | None] = [
            now,
            self._base,
            chat_text(chat_id),
            self._chat is not None,
            group and self._group is not None,
            self._overall is not None,
            *self._rates,
            self._hold,
            book,
            self._slack,
            EARLY,
        ]
        rows = self._run(self._decide_sql, [_text(v) for v in values])
        try:
            wait, global_ban, chat_ban = (max(0.0, float(v or b"0")) for v in rows[0])
        except (IndexError, ValueError) as exc:
            raise OSError(f"the rate-limit function answered {rows!r}") from exc
        return wait, global_ban, chat_ban

    def _store_record(
        self, now: float | None, chat_id: Hashable, seconds: float, scope: Scope | None
    ) -> Scope:
        values: list[float | bool | str | None] = [
            now,
            self._base,
            chat_text(chat_id),
            seconds,
            scope,
            str(self._infer_chats),
            self._infer_window,
        ]
        rows = self._run(self._record_sql, [_text(v) for v in values])
        applied = rows[0][0] if rows and rows[0] else None
        if applied not in (b"chat", b"global"):
            raise OSError(f"the rate-limit function answered {rows!r}")
        return "global" if applied == b"global" else "chat"

    def _entry_key(self, kind: str, chat_id: Hashable) -> str:
        if kind == "global_ban":
            return self._base + "ban"
        if kind in ("overall", "plan"):
            return self._base + kind
        return f"{self._base}{kind}:{chat_text(chat_id)}"

    def _store_handover(self, now: float | None, entries: Sequence[Entry]) -> None:
        if not entries:
            self._run(b"SELECT 1", [])
            return
        keys = [self._entry_key(kind, chat) for kind, chat, _ in entries]
        params = [
            _text(now),
            self._base.encode(),
            _array(keys),
            _array([left for _, _, left in entries]),
        ]
        self._run(self._handover_sql, params)

    def close(self) -> None:
        """Close the connection; later decisions use the local share. Idempotent.

        Waits for a call in progress, at most ``timeout``; past it, that
        call closes the connection when it ends.
        """
        acquired = self._conn_lock.acquire(self._timeout)
        try:
            self._closed = True
            if acquired:
                self._session.drop()
        finally:
            if acquired:
                self._conn_lock.release()

    def __repr__(self) -> str:
        state = "fallback" if self.degraded else "shared"
        return f"<PostgresRateLimiter table={self._table} name={self._name!r} {state}>"
