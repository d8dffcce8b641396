"""The shared limiters take only what they can work with, and work whatever the
server's defaults: a PostgreSQL server whose sessions default to REPEATABLE READ,
an asyncio Redis client, a table name too long for its suffixes."""

from __future__ import annotations

import gc
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from interrupts import interrupt_after_call
from ratelimit_stores import (
    POSTGRES_URL,
    REDIS_URL,
    FakeClock,
    drop_postgres_table,
    limiter_on,
    redis_client,
    wait_until,
)

from outbound.ratelimit import (
    PostgresRateLimiter,
    Rate,
    RateLimiter,
    RateLimits,
    RedisRateLimiter,
)
from outbound.ratelimit._shared import ConnectGate, connect_by


def test_a_postgres_limiter_decides_under_a_server_default_of_repeatable_read() -> None:
    # The decision's function takes its advisory locks, then reads the
    # buckets. Under REPEATABLE READ its snapshot was taken before the lock
    # wait: a decision that waited for another one failed to serialize, and
    # the limiter fell back to its local share, the server answering.
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    import psycopg  # noqa: PLC0415

    table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
    name = f"rr-{uuid.uuid4().hex[:8]}"
    options = "?options=-c%20default_transaction_isolation%3Drepeatable%5C%20read"
    limiter = PostgresRateLimiter(
        POSTGRES_URL + options, RateLimits(overall=Rate(1000)), name=name, table=table
    )
    other = psycopg.connect(POSTGRES_URL, autocommit=True)
    try:
        assert limiter.acquire(1) == 0.0  # (the bucket's row is there)
        other.execute("BEGIN")
        other.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{name}:overall",))
        result: list[float] = []
        deciding = threading.Thread(target=lambda: result.append(limiter.acquire(2)))
        deciding.start()
        decisions = (
            "SELECT pid, wait_event_type = 'Lock' FROM pg_stat_activity "
            "WHERE query LIKE %s AND pid <> pg_backend_pid()"
        )

        def deciders() -> list[tuple[int, bool]]:
            with psycopg.connect(POSTGRES_URL, autocommit=True) as look:
                return look.execute(decisions, (f"%{table}_decide(%",)).fetchall()

        assert wait_until(lambda: any(w for _, w in deciders())), "no decision waited"
        ((waited, _),) = deciders()
        other.execute(
            f"UPDATE {table} SET value = value + 0.001 WHERE key = %s", (f"{name}:overall",)
        )
        other.execute("COMMIT")
        deciding.join(30)
        assert not deciding.is_alive()
        assert len(result) == 1
        assert not limiter.degraded
        # Decided on its first try: no failure, no new connection for a second.
        assert [pid for pid, _ in deciders()] == [waited]
    finally:
        other.close()
        limiter.close()
        drop_postgres_table(POSTGRES_URL, table)


def test_an_asyncio_redis_client_is_refused_at_construction() -> None:
    # Accepted, every script call returned a coroutine never awaited: the
    # limiter sat at its local share for good, blaming the server.
    redis_asyncio = pytest.importorskip("redis.asyncio")
    client = redis_asyncio.Redis.from_url(REDIS_URL or "redis://127.0.0.1:6379/0")
    with pytest.raises(TypeError, match=r"synchronous redis-py client .* not an asyncio one"):
        RedisRateLimiter(client, RateLimits(overall=Rate(10)))


@pytest.mark.parametrize("table", ["t" * 42, "a" * 63])
def test_a_table_name_too_long_is_refused_naming_the_length(table: str) -> None:
    pytest.importorskip("psycopg")
    with pytest.raises(ValueError, match="of 1 to 41 characters"):
        PostgresRateLimiter("postgresql://127.0.0.1:9/x", RateLimits(overall=Rate(10)), table=table)


def test_the_postgres_sweep_goes_by_the_clock_given_to_the_limiter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The values are written on the given clock; the sweep deleted rows older
    # than the server's time less 60 s: on a clock that is not Unix time,
    # every pace and ban, at the first sweep (a minute in).
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    import psycopg  # noqa: PLC0415

    from outbound.ratelimit import _postgres  # noqa: PLC0415

    monkeypatch.setattr(_postgres, "_SWEEP_EVERY", 0.0)  # a sweep after every call
    table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
    name = f"sw-{uuid.uuid4().hex[:8]}"
    now = [1000.0]
    limits = RateLimits(per_chat=Rate(1, 3600.0))

    def limiter() -> PostgresRateLimiter:
        return PostgresRateLimiter(
            POSTGRES_URL or "", limits, name=name, table=table, clock=lambda: now[0]
        )

    def rows() -> int:
        with psycopg.connect(POSTGRES_URL or "", autocommit=True) as look:
            found = look.execute(f"SELECT count(*) FROM {table}").fetchone()
        return -1 if found is None else int(found[0])

    first = limiter()
    try:
        assert first.acquire(7) == 0.0  # the chat's next send: an hour on
        first.record_429(8, 86400.0, "chat")  # the chat banned for a day
        assert first.acquire(99) == 0.0  # (and swept)
        second = limiter()  # (another process: no ban of its own)
        try:
            assert second.acquire(7) > 3000.0
            assert second.acquire(8) > 80000.0
            kept = rows()
            now[0] += 2 * 86400.0  # every pace and ban passed: swept
            assert second.acquire(99) == 0.0
            assert rows() < kept
        finally:
            second.close()
    finally:
        first.close()
        drop_postgres_table(POSTGRES_URL, table)


class _Made:
    """A connection stand-in: closed by discard, or kept by the caller."""

    def __init__(self) -> None:
        self.closed = threading.Event()


def test_connect_by_returns_raises_and_times_out() -> None:
    made = _Made()
    assert (
        connect_by(lambda: made, time.monotonic() + 5, lambda m: m.closed.set(), ConnectGate())
        is made
    )

    def refused() -> _Made:
        raise ConnectionRefusedError("refused")

    with pytest.raises(ConnectionRefusedError):
        connect_by(refused, time.monotonic() + 5, lambda m: m.closed.set(), ConnectGate())
    # Past its deadline: TimeoutError, and what the connect makes later is closed.
    go = threading.Event()

    def slow() -> _Made:
        assert go.wait(10)
        return made

    with pytest.raises(TimeoutError):
        connect_by(slow, time.monotonic() + 0.05, lambda m: m.closed.set(), ConnectGate())
    go.set()
    assert made.closed.wait(10)


def test_a_ctrl_c_anywhere_in_connect_by_leaves_no_connection_open() -> None:
    # Whatever call a Ctrl-C comes out of, a connection made is the caller's
    # (it returned) or closed.
    fired_at: list[str] = []
    n = 0
    while True:
        n += 1
        made = _Made()
        ran = threading.Event()

        def connect(made: _Made = made, ran: threading.Event = ran) -> _Made:
            ran.set()
            return made

        profile, fired = interrupt_after_call(connect_by.__code__, n)
        got: list[_Made] = []
        gc.disable()  # (no collector's callback run inside, to take the Ctrl-C)
        sys.setprofile(profile)
        try:
            got.append(
                connect_by(connect, time.monotonic() + 5, lambda m: m.closed.set(), ConnectGate())
            )
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
            gc.enable()
        for thread in threading.enumerate():
            if thread.name == "outbound-connect":
                thread.join(10)
        if not fired:
            assert got == [made]
            break
        fired_at += fired
        if ran.is_set() and not got:
            assert made.closed.is_set(), f"left open by a Ctrl-C after {fired}"
    assert len(fired_at) >= 4


def test_a_postgres_limiter_keeps_pgoptions(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its settings went in the connection's options, which replaced PGOPTIONS':
    # a search_path given there was lost (the table made in another schema).
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    import psycopg  # noqa: PLC0415

    schema = f"rl_s_{uuid.uuid4().hex[:8]}"
    table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    monkeypatch.setenv("PGOPTIONS", f"-c search_path={schema}")
    limiter = PostgresRateLimiter(POSTGRES_URL, RateLimits(overall=Rate(10)), table=table)
    try:
        assert limiter.acquire(1) == 0.0
        assert not limiter.degraded
        with psycopg.connect(POSTGRES_URL, autocommit=True) as look:
            found = look.execute(
                "SELECT schemaname FROM pg_tables WHERE tablename = %s", (table,)
            ).fetchall()
        assert found == [(schema,)]
    finally:
        limiter.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


def test_one_connect_at_a_time_per_store() -> None:
    # A resolver that never answers held a thread per try of the store (one a
    # retry_interval), which piled up until no thread could start. A connect
    # waits for the one in flight instead, until its own deadline.
    gate = ConnectGate()
    release = threading.Event()
    first = _Made()
    firsts: list[_Made | BaseException] = []

    def stuck() -> _Made:
        assert release.wait(10)
        return first

    def try_first() -> None:
        try:
            firsts.append(
                connect_by(stuck, time.monotonic() + 0.05, lambda m: m.closed.set(), gate)
            )
        except TimeoutError as exc:
            firsts.append(exc)

    trying = threading.Thread(target=try_first)
    trying.start()
    trying.join(10)
    assert isinstance(firsts[0], TimeoutError)
    before = {t for t in threading.enumerate() if t.name == "outbound-connect"}
    assert len(before) == 1  # the lookup in flight
    second = _Made()
    with pytest.raises(TimeoutError, match="still runs"):
        connect_by(lambda: second, time.monotonic() + 0.05, lambda m: m.closed.set(), gate)
    assert {t for t in threading.enumerate() if t.name == "outbound-connect"} == before
    release.set()
    assert first.closed.wait(10)  # (came late: closed)
    assert (
        connect_by(lambda: second, time.monotonic() + 5, lambda m: m.closed.set(), gate) is second
    )


def test_a_connect_that_cannot_start_a_thread_is_a_store_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (RuntimeError "can't start new thread" went up to acquire()'s caller:
    # not a store error, so no fallback.)
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(OSError, match="can't start new thread"):
        connect_by(_Made, time.monotonic() + 5, lambda m: m.closed.set(), ConnectGate())


def test_a_postgres_limiter_connects_to_pghostaddr_without_looking_pghost_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # PGHOST names the server for TLS and .pgpass only, PGHOSTADDR is where it
    # is: libpq never looks the name up. The limiter did, failed, and stayed
    # on its local share for good.
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    from urllib.parse import urlsplit  # noqa: PLC0415

    url = urlsplit(POSTGRES_URL)
    if url.hostname is None or not url.hostname[0].isdigit():
        pytest.skip("OUTBOUND_TEST_POSTGRES names its host: no address to give as PGHOSTADDR")
    monkeypatch.setenv("PGHOST", "db.outbound-test.invalid")
    monkeypatch.setenv("PGHOSTADDR", url.hostname)
    monkeypatch.setenv("PGPORT", str(url.port or 5432))
    table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
    limiter = PostgresRateLimiter(
        f"dbname={url.path.lstrip('/')} user={url.username or 'postgres'}",
        RateLimits(overall=Rate(10)),
        table=table,
    )
    try:
        assert limiter.acquire(1) == 0.0
        assert not limiter.degraded
    finally:
        limiter.close()
        drop_postgres_table(POSTGRES_URL, table)


def test_a_postgres_limiter_logs_no_piece_of_a_password_holding_an_at_sign(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # libpq takes what follows the password's "@" for the host, and quotes it
    # when it cannot look it up ("could not translate host name ..."): here
    # libpq's own lookup (a service named: the limiter leaves those to libpq).
    pytest.importorskip("psycopg")
    services = tmp_path / "pg_service.conf"
    services.write_text("[outbound_test]\ndbname=x\n")
    monkeypatch.setenv("PGSERVICEFILE", str(services))
    with caplog.at_level("DEBUG", logger="outbound"):
        limiter = PostgresRateLimiter(
            "postgresql://app:hunter@2-SECRET-TAIL@127.0.0.1:1/x?service=outbound_test",
            RateLimits(overall=Rate(10)),
            timeout=1.0,
        )
        try:
            assert limiter.acquire(1) >= 0.0
            assert limiter.degraded
        finally:
            limiter.close()
    assert "unreachable" in caplog.text
    assert "SECRET" not in caplog.text, caplog.text


@pytest.mark.parametrize("store", ["redis", "postgres"])
def test_a_booking_outlives_the_sweep_as_long_as_in_the_local_limiter(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The PostgreSQL sweep deleted every row a minute past its value, the
    # bookings too, which the other limiters keep for slack + stale_after: a
    # chat 99 s late (stale_after=600) went at once on those, and was booked
    # again behind the queue on PostgreSQL.
    from outbound.ratelimit import _postgres  # noqa: PLC0415

    monkeypatch.setattr(_postgres, "_SWEEP_EVERY", 0.0)  # a sweep after every call
    limits = RateLimits(overall=Rate(1, 1.0))

    def run(limiter: Any, clock: FakeClock) -> list[float]:
        waits = [limiter.acquire("A"), limiter.acquire("B")]  # B books the next slot
        clock.now = 1100.0  # B's caller comes back 99 s late
        waits += [limiter.acquire(chat) for chat in "CDE"]  # C sends, D and E book ahead
        clock.now = 1101.01
        waits += [limiter.acquire("Z"), limiter.acquire("B")]  # (swept meanwhile)
        return waits

    local_clock = FakeClock(1000.0)
    expected = run(RateLimiter(limits, clock=local_clock, stale_after=600.0), local_clock)
    assert expected[-1] == 0.0  # B's booking still counts: it goes at once
    clock = FakeClock(1000.0)
    with limiter_on(store, limits, clock=clock, stale_after=600.0) as limiter:
        assert run(limiter, clock) == expected


def test_redis_keys_outlive_their_values_by_a_day_on_a_callers_clock() -> None:
    # Lifetimes run at Redis's pace: a caller's clock slower than that (a
    # test's) found its buckets expired and granted a second send of Rate(1)
    # within one period on its clock (0.5 s on, 6.5 s later on Redis's).
    if not REDIS_URL:
        pytest.skip("OUTBOUND_TEST_REDIS is not set: no Redis server to test against")
    clock = FakeClock(1000.0)
    limits = RateLimits(per_chat=Rate(1), overall=Rate(10))
    with limiter_on("redis", limits, clock=clock) as limiter:
        assert isinstance(limiter, RedisRateLimiter)
        assert limiter.acquire(1) == 0.0
        limiter.record_429(2, 5.0, "chat")
        limiter.record_429(3, 5.0)  # (scope inferred: the recent 429s' set)
        client = redis_client()
        try:
            keys = list(client.scan_iter(match=limiter.key_prefix + "*"))
            assert len(keys) >= 5, keys
            assert all(client.pttl(k) > 86_000_000 for k in keys), {k: client.pttl(k) for k in keys}
        finally:
            client.close()
        clock.advance(0.5)
        assert limiter.acquire(1) == pytest.approx(0.52)  # (+ slack)


@pytest.mark.parametrize("interval", [3600.5, 1e308, 2**63])
def test_a_retry_interval_past_an_hour_is_refused_naming_it(interval: float) -> None:
    # 1e308 was taken: one stall of the store, and it was never asked again.
    pytest.importorskip("psycopg")
    with pytest.raises(ValueError, match="retry_interval must be at most 3600 seconds"):
        PostgresRateLimiter(
            "postgresql://127.0.0.1:9/x", RateLimits(overall=Rate(10)), retry_interval=interval
        )


@pytest.mark.parametrize("table", ["pg_class", "pg_limits"])
def test_a_table_named_as_the_systems_is_refused(table: str) -> None:
    # pg_catalog comes first on the search path: "pg_class" was the catalog's
    # table, every decision failed, and the limiter ran on its local share
    # for good, logging the server "unreachable".
    pytest.importorskip("psycopg")
    with pytest.raises(ValueError, match="must not begin with pg_"):
        PostgresRateLimiter("postgresql://127.0.0.1:9/x", RateLimits(overall=Rate(10)), table=table)


def test_one_names_sweep_leaves_anothers_rows_whose_name_it_begins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every key of "bot:eu" began "bot:", so the sweep of "bot" (with its own
    # hold) deleted the bookings of "bot:eu": a caller back within its
    # stale_after was refused for a whole interval and booked again.
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    from outbound.ratelimit import _postgres  # noqa: PLC0415

    monkeypatch.setattr(_postgres, "_SWEEP_EVERY", 0.0)  # a sweep after every call
    table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
    clock = FakeClock(1000.0)
    limits = RateLimits(overall=Rate(1, 1000.0))

    def limiter(name: str, stale_after: float) -> PostgresRateLimiter:
        return PostgresRateLimiter(
            POSTGRES_URL or "", limits, name=name, table=table, clock=clock, stale_after=stale_after
        )

    eu, bot = limiter("bot:eu", 600.0), limiter("bot", 1.0)
    try:
        assert eu.acquire(1) == 0.0
        wait = eu.acquire(2)  # booked: back in about 1000 s
        assert 999.0 < wait <= 1001.0
        clock.advance(wait + 100.0)  # 100 s after its slot: within its stale_after
        assert bot.acquire(99) == 0.0  # (and bot swept)
        assert eu.acquire(2) == 0.0
        assert "name='bot:eu'" in repr(eu)
    finally:
        bot.close()
        eu.close()
        drop_postgres_table(POSTGRES_URL, table)
