"""The shared limiters against real Redis and PostgreSQL: same answers, one budget, fail-safe.

- Equivalence: random sequences of calls on a fake clock get exactly the
  answers of the local :class:`RateLimiter` (hypothesis, derandomized).
- One budget: two limiter objects on the same keys (two processes) share it.
- Fail-safe: with the store unreachable, decisions go on at the fallback
  share, never unlimited, with an error logged; a private Redis server is
  killed and restarted under a limiter, which goes back to it.
"""

from __future__ import annotations

import bisect
import enum
import logging
import math
import os
import random
import signal
import sys
import threading
import time
import uuid
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ratelimit_stores import (
    POSTGRES_URL,
    REDIS_URL,
    STORES,
    FakeClock,
    drop_postgres_table,
    drop_redis_keys,
    free_port,
    limiter_on,
    private_redis_fixture,  # noqa: F401  (the private_redis fixture)
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

LIMITS = RateLimits(overall=Rate(5, 1.0, burst=2), per_chat=Rate(2), per_group=Rate(3, 4.0))

Op = tuple[str, Any, Any, Any]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.floats(0.0, 1.5), st.none(), st.none()),
        st.tuples(st.just("acquire"), st.sampled_from([1, 2, -3, "@c"]), st.booleans(), st.none()),
        st.tuples(
            st.just("ban"),
            st.sampled_from([1, 2, -3]),
            st.floats(0.0, 2.0),
            st.sampled_from([None, "chat", "global"]),
        ),
    ),
    min_size=1,
    max_size=40,
)


def play(limiter: Any, clock: FakeClock, script: list[Op]) -> list[Any]:
    answers: list[Any] = []
    for kind, a, b, c in script:
        if kind == "advance":
            clock.advance(a)
        elif kind == "acquire":
            answers.append(round(limiter.acquire(a, book=b), 9))
        else:
            answers.append(limiter.record_429(a, b, c))
    return answers


@pytest.mark.parametrize("store", ["redis", "postgres"])
@settings(
    max_examples=15,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(script=ops)
def test_shared_limiters_answer_exactly_like_the_local_one(store: str, script: list[Op]) -> None:
    options: dict[str, Any] = {"slack": 0.02, "infer_window": 1.0}
    local_clock, shared_clock = FakeClock(), FakeClock()
    expected = play(RateLimiter(LIMITS, clock=local_clock, **options), local_clock, script)
    with limiter_on(store, LIMITS, clock=shared_clock, **options) as shared:
        assert play(shared, shared_clock, script) == expected
        assert not shared.degraded  # type: ignore[attr-defined]


@pytest.mark.parametrize("store", ["redis", "postgres"])
def test_two_processes_share_one_budget(store: str) -> None:
    clock = FakeClock()
    limits = RateLimits(overall=Rate(4), per_chat=Rate(1))
    with limiter_on(store, limits, clock=clock, slack=0.0) as first:
        if isinstance(first, RedisRateLimiter):
            second: Any = RedisRateLimiter(
                redis_client(),
                limits,
                prefix=first.key_prefix.split(":{")[0],
                clock=clock,
                slack=0.0,
            )
        else:
            assert isinstance(first, PostgresRateLimiter)
            second = PostgresRateLimiter(
                POSTGRES_URL or "", limits, table=first._table, clock=clock, slack=0.0
            )
        try:
            assert first.acquire("a") == 0.0
            assert second.acquire("a") == pytest.approx(1.0)  # the chat's slot is taken
            assert second.acquire("b") == pytest.approx(0.25, abs=1e-4)  # booked behind "a"
            assert first.acquire("c") == pytest.approx(0.5, abs=1e-4)
            first.record_429("d", 3.0, "chat")
            assert second.acquire("d") == pytest.approx(3.0)  # the ban is shared too
        finally:
            second.close()


@pytest.mark.parametrize("call", ["decide", "record"])
def test_a_postgres_decision_is_timed_after_its_wait_for_the_locks(call: str) -> None:
    """A decision (or a 429's record) that waited for another's lock (a stalled
    backend, a slow commit) reads the server's clock after the wait: read before
    it, the chat's next slot (or the ban's end) would count from that much
    earlier, and a send would go a whole wait too soon."""
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    import psycopg  # noqa: PLC0415

    limits = RateLimits(overall=Rate(1000), per_chat=Rate(1))
    with (
        limiter_on("postgres", limits) as limiter,
        psycopg.connect(POSTGRES_URL, autocommit=True) as admin,
        psycopg.connect(POSTGRES_URL) as holder,
    ):
        assert isinstance(limiter, PostgresRateLimiter)
        table = limiter._table
        assert limiter.acquire("warm") == 0.0  # the table and the functions
        (base,) = admin.execute(
            f"SELECT left(key, length(key) - length('overall')) FROM {table} "
            "WHERE key LIKE '%%overall'"
        ).fetchone() or (None,)
        assert base is not None
        # The lock the call takes: the overall bucket's (a decision's last),
        # or the recent 429s' (a record whose scope is inferred).
        lock = base + ("overall" if call == "decide" else "recent429")
        holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (lock,))
        answers: list[Any] = []

        def run() -> None:
            if call == "decide":
                answers.append(limiter.acquire(7))
            else:
                answers.append(limiter.record_429(7, 3.0, None))

        caller = threading.Thread(target=run, daemon=True)
        caller.start()
        held = (
            "SELECT count(*) FROM pg_locks AS w JOIN pg_locks AS h "
            "ON (w.classid, w.objid, w.objsubid) = (h.classid, h.objid, h.objsubid) "
            "WHERE w.locktype = 'advisory' AND h.locktype = 'advisory' "
            "AND NOT w.granted AND h.granted AND h.pid = %s"
        )

        def waiting() -> bool:
            row = admin.execute(held, (holder.info.backend_pid,)).fetchone()
            return row is not None and row[0] > 0

        assert wait_until(waiting, timeout=30.0), "the call never waited for the lock"
        (released,) = holder.execute(
            "SELECT extract(epoch FROM clock_timestamp())::float8"
        ).fetchone() or (None,)
        holder.commit()
        caller.join(30.0)
        assert not caller.is_alive()
        if call == "decide":
            assert answers == [0.0]
            key, after = base + "chat:7", 1.0  # the chat's next slot: one interval on
        else:
            assert answers == ["chat"]
            key, after = base + "ban:7", 3.0  # the ban's end
        (value,) = admin.execute(
            f"SELECT value FROM {table} WHERE key = %s", (key,)
        ).fetchone() or (None,)
        assert value is not None
        # Timed no earlier than the release of the lock it waited for.
        assert value - after >= released


def test_two_processes_writing_their_bans_back_at_once_never_deadlock() -> None:
    """Each process writes the bans it knows back to the store, listed in its own
    order (a 429 storm, recorded as each saw it). The rows were written in that
    order: one process holding the first ban's row while the other held the
    second's and waited for the first, PostgreSQL found a deadlock after a
    second (a decision answered from a local ban stalled, or timed out and
    took a healthy server for down). Played here step by step: the first
    write holds its row, the second waits, the first writes the other row."""
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    import psycopg  # noqa: PLC0415

    limits = RateLimits(per_chat=Rate(1))
    with (
        limiter_on("postgres", limits) as limiter,
        psycopg.connect(POSTGRES_URL, autocommit=True) as admin,
        psycopg.connect(POSTGRES_URL) as first,
        psycopg.connect(POSTGRES_URL, autocommit=True) as second,
    ):
        assert isinstance(limiter, PostgresRateLimiter)
        table = limiter._table
        assert limiter.acquire("warm") == 0.0  # the table and the functions
        base = "deadlock-test:"
        one, two = base + "ban:1", base + "ban:2"
        handover = f"SELECT {table}_handover(NULL, %s, %s::text[], %s::float8[])"
        admin.execute(handover, (base, [one, two], [60.0, 60.0]))  # both rows there
        first.execute("SET lock_timeout = '20s'")
        second.execute("SET lock_timeout = '20s'")
        first.execute(handover, (base, [one], [90.0]))  # holds ban:1's row
        failed: list[BaseException] = []

        def write_back() -> None:
            try:
                second.execute(handover, (base, [two, one], [90.0, 90.0]))
            except BaseException as exc:
                failed.append(exc)

        other = threading.Thread(target=write_back, daemon=True)
        other.start()

        def waiting() -> bool:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                (second.info.backend_pid,),
            ).fetchone()
            return row is not None and row[0] > 0

        assert wait_until(waiting, timeout=30.0), "the second write never waited"
        try:
            first.execute(handover, (base, [two], [90.0]))
        except psycopg.errors.DeadlockDetected:
            failed.append(AssertionError("the first write was chosen as a deadlock's victim"))
            first.rollback()
        else:
            first.commit()
        other.join(30.0)
        assert not other.is_alive()
        assert failed == []
        rows = admin.execute(
            f"SELECT count(*) FROM {table} WHERE key IN (%s, %s)", (one, two)
        ).fetchone()
        assert rows == (2,)


def test_the_sweep_of_old_rows_waits_for_no_row_another_transaction_holds() -> None:
    """The sweep deleted the rows no decision used for a minute, locking them in the
    table's order and waiting for any another transaction held: a decision or a
    handover of another process writing those rows again (in its own order)
    deadlocked with it. Rows held are left for the next sweep."""
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    import psycopg  # noqa: PLC0415

    limits = RateLimits(per_chat=Rate(1))
    with (
        limiter_on("postgres", limits, timeout=1.0) as limiter,
        psycopg.connect(POSTGRES_URL, autocommit=True) as admin,
        psycopg.connect(POSTGRES_URL) as holder,
    ):
        assert isinstance(limiter, PostgresRateLimiter)
        table, base = limiter._table, limiter._base
        assert limiter.acquire("warm") == 0.0  # the table and the functions
        old = [base + "chat:held", base + "chat:free"]
        admin.execute(
            f"INSERT INTO {table} (key, value) SELECT k, extract(epoch FROM now()) - 120 "
            "FROM unnest(%s::text[]) AS k",
            (old,),
        )
        holder.execute(f"SELECT 1 FROM {table} WHERE key = %s FOR UPDATE", (old[0],))
        limiter._swept = -math.inf  # the next call sweeps
        started = time.monotonic()
        assert limiter.acquire(7) == 0.0
        took = time.monotonic() - started
        holder.rollback()
        left = {
            key
            for (key,) in admin.execute(
                f"SELECT key FROM {table} WHERE key = ANY(%s)", (old,)
            ).fetchall()
        }
        assert left == {old[0]}, "the sweep waited for the held row, and deleted nothing"
        assert took < 0.9, f"the decision waited {took:.2f}s for the sweep"
        assert not limiter.degraded


# ------------------------------------------------------------------ fail-safe


def test_an_unreachable_redis_falls_back_to_the_local_share(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("redis")
    caplog.set_level(logging.WARNING, logger="outbound.ratelimit")
    client = redis_client(f"redis://127.0.0.1:{free_port()}/0")
    clock = FakeClock()
    limiter = RedisRateLimiter(
        client, RateLimits(overall=Rate(8)), clock=clock, fallback_share=0.25
    )
    # What the store allowed is unknown: the bot may have just used its budget,
    # so the first local send comes one (widened) interval plus slack later.
    first = limiter.acquire(0, book=False)
    assert first == pytest.approx(1 / 8 + (0.02 + 1e-6) / 8 + 0.02)
    assert degraded(limiter)
    assert limiter.stats().store == "fallback"
    clock.advance(first)
    reference = RateLimiter(RateLimits(overall=Rate(8, 4.0)), clock=clock)  # 8/s x 1/4
    got = [limiter.acquire(chat, book=False) for chat in range(1, 6)]
    assert got == pytest.approx([reference.acquire(chat, book=False) for chat in range(1, 6)])
    assert got[0] == 0.0
    assert got[1] > 0.0  # a quarter of 8/s: never unlimited
    limiter.record_429(1, 5.0, "chat")  # still recorded, locally
    clock.advance(1.0)
    assert limiter.acquire(1) == pytest.approx(4.0)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # loud once, not once per decision
    assert "unreachable" in errors[0].getMessage()
    client.close()


def test_an_unreachable_postgres_falls_back_to_the_local_share(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("psycopg")
    caplog.set_level(logging.ERROR, logger="outbound.ratelimit")
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/test"
    clock = FakeClock()
    limiter = PostgresRateLimiter(url, RateLimits(per_chat=Rate(1)), timeout=1.0, clock=clock)
    assert limiter.degraded  # found so at construction
    assert limiter.acquire(1) == pytest.approx(1.02)  # the chat may have just sent (+ slack)
    clock.advance(1.02)
    assert limiter.acquire(1) == 0.0
    assert limiter.acquire(1) == pytest.approx(4.02)  # 1/s at a quarter: 4 s (+ slack)
    assert any("unreachable" in r.getMessage() for r in caplog.records)
    limiter.close()
    with pytest.raises(ValueError):
        PostgresRateLimiter("not a = conninfo = at all", RateLimits())


def degraded(limiter: Any) -> bool:
    """``limiter.degraded`` read now (a call: type checkers keep no narrowing of it)."""
    return bool(limiter.degraded)


def test_a_redis_restart_is_survived_and_the_store_is_used_again(
    private_redis: tuple[int, Any], caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("redis")
    caplog.set_level(logging.WARNING, logger="outbound.ratelimit")
    port, start = private_redis
    server = start()
    client = redis_client(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.5)
    limiter = RedisRateLimiter(
        client, RateLimits(per_chat=Rate(1, 10.0)), retry_interval=0.05, prefix=uuid.uuid4().hex
    )
    assert limiter.acquire(1) == 0.0
    assert limiter.acquire(1) > 9.0
    assert not degraded(limiter)
    server.send_signal(signal.SIGKILL)
    server.wait(10)
    # Decided locally, as if chat 2 had just sent (the store's state is lost to
    # this process), then at a quarter of the rate: never unlimited.
    assert 9.0 < limiter.acquire(2) <= 10.02  # (+ slack)
    assert degraded(limiter)
    start()
    deadline = time.monotonic() + 10
    while degraded(limiter) and time.monotonic() < deadline:
        limiter.acquire(3)
        time.sleep(0.06)  # past retry_interval, so the next decision tries the store
    assert not degraded(limiter)
    assert limiter.acquire(4) == 0.0  # a fresh server: chat 4 is new to it
    messages = [r.getMessage() for r in caplog.records]
    assert any("unreachable" in m for m in messages)
    assert any("answers again" in m for m in messages)
    client.close()


def test_at_maxmemory_with_noeviction_every_script_still_decides(
    private_redis: tuple[int, Any],
) -> None:
    """Redis over maxmemory with noeviction (what the README advises) refuses a script
    whose first write could take memory. Each of the limiter's scripts writes the
    epoch key first, as the decision does: so a 429 recorded and a handover go on in
    the store too, and processes that share a limit do not split, one deciding in
    the store and one alone at its share (together over the limit)."""
    redis = pytest.importorskip("redis")
    port, start = private_redis
    start()
    admin = redis.Redis(port=port, socket_timeout=2)
    limits = RateLimits(per_chat=Rate(1))
    common: dict[str, Any] = {"prefix": uuid.uuid4().hex, "timeout": 0.5, "fallback_share": 0.5}
    a = RedisRateLimiter(redis.Redis(port=port, db=1), limits, **common)
    b = RedisRateLimiter(redis.Redis(port=port, db=1), limits, **common)
    try:
        assert a.acquire(1) == 0.0
        assert b.acquire(2) == 0.0
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # over it from now on
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            admin.set("other", "x")  # what Redis refuses meanwhile
        b.record_429(3, 5.0, "chat")  # the platform's 429, scope stated
        assert not degraded(b)
        assert 4.0 < a.acquire(3) <= 5.0  # B's 429 is A's, through the store
        b._store_handover(None, [("chat", 7, 5.0)])  # a handover back goes through
        assert 4.0 < a.acquire(7) <= 5.0
        a.acquire(8)  # decisions go on
        assert not degraded(a)
        assert not degraded(b)
    finally:
        admin.config_set("maxmemory", 0)
        a.close()
        b.close()
        admin.close()


def test_at_maxmemory_a_store_that_lost_its_epoch_decides_nothing(
    private_redis: tuple[int, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The other side: a Redis at maxmemory that lost its state (the epoch gone) can
    make no decision (the epoch's SET is refused), and so can record no 429 and take
    no handover either: the limiter stays at its share, and does not flap back to a
    store that decides nothing at each retry_interval."""
    redis = pytest.importorskip("redis")
    caplog.set_level(logging.WARNING, logger="outbound.ratelimit")
    port, start = private_redis
    start()
    admin = redis.Redis(port=port, socket_timeout=2)
    limiter = RedisRateLimiter(
        redis.Redis(port=port, db=2),
        RateLimits(per_chat=Rate(1)),
        prefix=uuid.uuid4().hex,
        timeout=0.5,
        retry_interval=0.01,
    )
    try:
        assert limiter.acquire(1) == 0.0
        redis.Redis(port=port, db=2).flushdb()  # the epoch is gone
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        limiter.acquire(2)
        assert degraded(limiter)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            limiter._store_handover(None, [("chat", 7, 5.0)])
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            limiter._store_record(None, 7, 5.0, "chat")
        for chat in range(100, 120):  # each past retry_interval: each tries the store
            limiter.acquire(chat)
            threading.Event().wait(0.02)
        assert degraded(limiter)
        assert not [r for r in caplog.records if "back to the shared budget" in r.getMessage()]
    finally:
        admin.config_set("maxmemory", 0)
        limiter.close()
        admin.close()


@pytest.mark.skipif(not POSTGRES_URL, reason="OUTBOUND_TEST_POSTGRES is not set")
@pytest.mark.parametrize("arrived", [True, False])
def test_a_postgres_connection_the_server_ended_is_made_anew(arrived: bool) -> None:
    """A backend terminated while idle (as idle_session_timeout or a pooler's restart
    end one) is no outage: the server answers. Whether its end came in before the
    next decision (found before the statement) or not yet (the statement fails, and
    runs once more on a new connection), the decision is the store's."""
    psycopg = pytest.importorskip("psycopg")
    assert POSTGRES_URL is not None
    app = f"outbound_test_{uuid.uuid4().hex[:12]}"
    url = psycopg.conninfo.make_conninfo(POSTGRES_URL, application_name=app)
    table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
    limiter = PostgresRateLimiter(url, RateLimits(per_chat=Rate(1)), table=table, timeout=30.0)
    try:
        assert limiter.acquire(1) == 0.0
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            pids = [
                row[0]
                for row in admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,)
                )
            ]
            assert len(pids) == 1
            admin.execute("SELECT pg_terminate_backend(%s)", (pids[0],))
            if arrived:  # its end came in: the process is gone
                assert wait_until(
                    lambda: (
                        not admin.execute(
                            "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pids[0],)
                        ).fetchall()
                    )
                )
        assert limiter.acquire(2) == 0.0  # a chat new to the store: not the local floor
        assert limiter.acquire(1) > 0.5  # chat 1's send is the store's, still
        assert not degraded(limiter)
    finally:
        limiter.close()
        drop_postgres_table(POSTGRES_URL, table)


def test_the_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # as if redis-py were not installed
    with pytest.raises(ImportError, match=r"outbound-dispatcher\[redis\]"):
        RedisRateLimiter(object(), RateLimits())
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(ImportError, match=r"outbound-dispatcher\[postgres\]"):
        PostgresRateLimiter("postgresql://x/y", RateLimits())


@pytest.mark.skipif(not REDIS_URL, reason="OUTBOUND_TEST_REDIS is not set")
def test_redis_keys_expire_with_their_buckets() -> None:
    client = redis_client()
    prefix = f"outbound-test:{uuid.uuid4().hex}"
    limiter = RedisRateLimiter(
        client, RateLimits(per_chat=Rate(10), overall=Rate(100)), prefix=prefix
    )
    try:
        for chat in range(50):
            limiter.acquire(chat)
        epoch = f"{limiter.key_prefix}epoch".encode()
        keys = [k for k in client.scan_iter(match=prefix + "*") if k != epoch]
        assert keys
        # Each key lives its bucket's time (a booking: its slot + 1 s), plus 5 s;
        # the epoch a day past the last decision.
        assert all(0 < client.pttl(k) <= 8000 for k in keys)
        assert 0 < client.pttl(epoch) <= 86_400_000
    finally:
        drop_redis_keys(client, prefix)
        client.close()


@pytest.mark.parametrize("table", ["user", "select", "order"])
def test_a_postgres_limiter_on_a_table_named_by_a_reserved_word_works(table: str) -> None:
    """Accepted at construction, the schema then failed on a syntax error and the
    limiter stayed on its local share for good."""
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    psycopg = pytest.importorskip("psycopg")
    schema = f"outbound_rl_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        try:
            url = psycopg.conninfo.make_conninfo(POSTGRES_URL, options=f"-c search_path={schema}")
            clock = FakeClock()
            limiter = PostgresRateLimiter(
                url, RateLimits(per_chat=Rate(1)), table=table, clock=clock
            )
            try:
                assert limiter.acquire(1) == 0.0
                assert limiter.acquire(1) == pytest.approx(1.02)  # (+ slack)
                assert not limiter.degraded
            finally:
                limiter.close()
            found = admin.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = %s AND tablename = %s",
                (schema, table),
            ).fetchone()
            assert found == (1,)
        finally:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.mark.parametrize("store", ["redis", "postgres"])
@pytest.mark.parametrize(
    "chat", [42.0, True, (4, 2), None, 2**64, "x" * 511, "\U0010ffff" * 52], ids=repr
)
def test_a_shared_limiter_refuses_a_chat_id_it_cannot_key_like_the_local_one(
    store: str, chat: object
) -> None:
    """42.0 was one chat with 42 in this process, two in the store (keyed by text)."""
    with limiter_on(store, RateLimits(per_chat=Rate(1))) as limiter:
        with pytest.raises((TypeError, ValueError), match="chat id"):
            limiter.acquire(chat)
        with pytest.raises((TypeError, ValueError), match="chat id"):
            limiter.record_429(chat, 1.0, "chat")
        assert limiter.acquire(42) == 0.0
        assert limiter.acquire("@name") == 0.0
        assert limiter.acquire(-(2**63)) == 0.0
        # The longest there are, decided in the store (not taken for an outage).
        assert limiter.acquire("x" * 509) == 0.0  # 511 bytes, quoted
        assert limiter.acquire("\U0010ffff" * 50) == 0.0
        assert not limiter.degraded  # type: ignore[attr-defined]


@pytest.mark.parametrize("store", ["redis", "postgres"])
def test_a_name_too_long_for_a_key_is_refused_at_construction(store: str) -> None:
    with pytest.raises(ValueError, match="name must be at most 512 bytes"):
        with limiter_on(store, RateLimits(per_chat=Rate(1)), name="\u00e9" * 257):
            pass
    with limiter_on(store, RateLimits(per_chat=Rate(1)), name="\u00e9" * 256) as limiter:
        assert limiter.acquire("\U0010ffff" * 50) == 0.0
        assert not limiter.degraded  # type: ignore[attr-defined]


class _Chat(enum.IntEnum):
    SUPPORT = 42


class _Channel(str, enum.Enum):
    GENERAL = "general"


@pytest.mark.parametrize("store", ["local", "redis", "postgres"])
def test_an_enum_chat_id_is_the_chat_of_its_value(store: str) -> None:
    """Keyed by repr, <_Chat.SUPPORT: 42> and 42 were two chats in the store (one
    in process): each went at once, past the chat's limit."""
    with limiter_on(store, RateLimits(per_chat=Rate(1, 10.0)), clock=FakeClock()) as limiter:
        assert limiter.acquire(42) == 0.0
        assert limiter.acquire(_Chat.SUPPORT) == pytest.approx(10.02)  # (+ slack)
        assert limiter.acquire(_Channel.GENERAL) == 0.0
        assert limiter.acquire("general") == pytest.approx(10.02)
        limiter.record_429(_Chat.SUPPORT, 30.0, "chat")
        assert limiter.acquire(42) == pytest.approx(30.0)


def test_bad_clients_and_names_are_refused() -> None:
    pytest.importorskip("redis")
    with pytest.raises(TypeError):
        RedisRateLimiter(object(), RateLimits())
    with pytest.raises(ValueError):
        RedisRateLimiter(redis_client("redis://127.0.0.1:1/0"), RateLimits(), name="a{b}")
    with pytest.raises(ValueError):
        RedisRateLimiter(redis_client("redis://127.0.0.1:1/0"), RateLimits(), fallback_share=0)
    with pytest.raises(ValueError):
        PostgresRateLimiter("postgresql://x/y", RateLimits(), table="Bad-Name")
    # PostgreSQL's text holds no NUL: "x\x00a" and "x\x00b" were one budget.
    with pytest.raises(ValueError, match="no NUL"):
        PostgresRateLimiter("postgresql://x/y", RateLimits(), name="x\x00a")
    with pytest.raises(ValueError, match="no NUL"):
        PostgresRateLimiter("postgresql://x/y", RateLimits(), name="x\ud800")
    with pytest.raises(ValueError, match="UTF-8"):
        RedisRateLimiter(redis_client("redis://127.0.0.1:1/0"), RateLimits(), name="x\ud800")
    with pytest.raises(ValueError, match="UTF-8"):
        RedisRateLimiter(redis_client("redis://127.0.0.1:1/0"), RateLimits(), prefix="\udc80")
    with pytest.raises(ValueError, match="retry_interval must be a finite number > 0, not an int"):
        RedisRateLimiter(
            redis_client("redis://127.0.0.1:1/0"), RateLimits(), retry_interval=10**400
        )
    assert os.environ.get("OUTBOUND_TEST_NOTHING") is None


#: What a store's clock reads (Redis's TIME, PostgreSQL's clock_timestamp()):
#: Unix time, where a double's resolution is some 0.24 µs.
_UNIX_NOW = 1.7e9


def _busiest(times: list[float], period: float) -> int:
    """The most of ``times`` (sorted) in any half-open window of ``period``, exactly."""
    return max(bisect.bisect_left(times, t + period) - i for i, t in enumerate(times))


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("limit", ["per_chat", "per_group", "overall"])
def test_no_window_holds_too_many_sends_on_a_clock_of_unix_time(store: str, limit: str) -> None:
    # Each send's `tat + interval` was rounded to the clock's resolution, down
    # by up to half of it, and a period's sends added up: 1,122 sends in a
    # window of Rate(1000, 0.00107), 10,011 of Rate(10000).
    rate = Rate(1000, 0.00107)
    clock = FakeClock(_UNIX_NOW)
    chat = -1001 if limit == "per_group" else 42
    sends: list[float] = []
    # (slack=0: the overall bucket's interval is the rate's own, not widened.)
    with limiter_on(store, RateLimits(**{limit: rate}), clock=clock, slack=0.0) as limiter:
        end = _UNIX_NOW + 2 * rate.period
        for _ in range(20 * rate.limit):  # bounded: some 2,000 sends and their waits
            if clock.now >= end:
                break
            wait = limiter.acquire(chat)
            if wait > 0.0:
                clock.now += wait  # back exactly when told
            else:
                sends.append(clock.now)
        assert clock.now >= end, "the limiter stalled"
    assert len(sends) >= rate.limit
    assert _busiest(sends, rate.period) <= rate.window_max


def test_an_unlabelled_429_is_the_bots_everywhere_when_this_process_saw_enough_chats(
    private_redis: tuple[int, Any],
) -> None:
    # A's 429 was recorded while the store was down (it got A's ban, not the
    # 429): the store inferred "chat" for B's, this process "global". It held
    # every chat here for 30 s and returned "chat"; other processes sent.
    pytest.importorskip("redis")
    port, start = private_redis
    clock = FakeClock(1000.0)
    options: dict[str, Any] = {
        "name": "scope",
        "clock": clock,
        "timeout": 2.0,
        "retry_interval": 0.5,
        "prefix": uuid.uuid4().hex,
    }
    limits = RateLimits(per_chat=Rate(1))
    url = f"redis://127.0.0.1:{port}/0"
    here = RedisRateLimiter(redis_client(url, socket_connect_timeout=0.5), limits, **options)
    there = RedisRateLimiter(redis_client(url, socket_connect_timeout=0.5), limits, **options)
    try:
        assert here.record_429("A", 30.0) == "chat"
        assert degraded(here)
        start()
        clock.advance(0.6)  # past retry_interval, within infer_window of A's 429
        assert here.acquire("C") == 0.0
        assert not degraded(here)
        assert here.record_429("B", 30.0) == "global"
        assert there.acquire("D") > 29.0  # another process of the bot is held too
        assert here.acquire("D") > 29.0
    finally:
        here.close()
        there.close()


@pytest.mark.parametrize("store", STORES)
def test_no_window_holds_too_many_sends_on_a_clock_below_the_interval(store: str) -> None:
    # The step's check was a rounded difference, itself rounded when the clock
    # reads less than the interval: 0.00592... + 0.1 came out below 0.1 later,
    # and two sends went in one window of Rate(1, 0.1).
    start = 0.005926409106271657
    rate = Rate(1, 0.1)
    clock = FakeClock(start)
    with limiter_on(store, RateLimits(per_chat=rate), clock=clock, slack=0.0) as limiter:
        assert limiter.acquire(7) == 0.0
        clock.now = start + 0.1  # as the float sum says: one step later
        wait = limiter.acquire(7)
        # (Exactly: a float's difference is rounded as the check was.)
        assert wait > 0.0 or Fraction(clock.now) - Fraction(start) >= Fraction(rate.period)


def test_a_step_is_never_rounded_below_its_interval() -> None:
    from outbound.ratelimit._core import _after  # noqa: PLC0415

    draw = random.Random(1)
    for _ in range(20_000):
        step = draw.choice([1e-6, 1e-3, 0.1, 1 / 30, 3.0, 60.0]) * draw.uniform(0.5, 2.0)
        base = draw.choice([draw.uniform(0, 4 * step), draw.uniform(0, 1e5), 1.7e9 + draw.random()])
        t = _after(base, step)
        assert Fraction(t) - Fraction(base) >= Fraction(step), (base, step)
        assert t <= math.nextafter(base + step, math.inf)


@pytest.mark.parametrize("start", [_UNIX_NOW, 2.0**31, 12.5, 0.005926409106271657])
def test_the_three_limiters_answer_alike_where_a_step_is_rounded(start: float) -> None:
    # A step rounded down is moved up to the next double: the Lua script and
    # the SQL function moved it two (|t| * 2**-52), and refused for a moment
    # what the local limiter granted.
    answers: dict[str, list[float]] = {}
    for store in STORES:
        clock = FakeClock(start)
        waits = []
        with limiter_on(store, RateLimits(per_chat=Rate(3, 1.0)), clock=clock, slack=0.0) as rl:
            for _ in range(7):
                wait = rl.acquire(9)
                waits.append(wait)
                clock.now += wait  # back exactly when told
        answers[store] = waits
    assert answers["local"].count(0.0) == 4  # granted, told to wait, granted...
    for store, waits in answers.items():
        assert waits == answers["local"], (store, answers)
