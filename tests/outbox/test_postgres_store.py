"""What only the PostgreSQL store does: reconnect, NOTIFY off, schema locks, savepoints."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbound.errors import StoreError
from outbound.outbox import EventBus, PostgresStore, Relay, RelayState, postgres
from outbound.outbox._base import SCHEMA_VERSION, Outcome

from . import v1_schema
from .conftest import enqueue_keys, unique_table, wait_for

psycopg = pytest.importorskip("psycopg")


@pytest.fixture
def tables(postgres_url: str) -> Iterator[list[str]]:
    """Table names for the test; each dropped afterwards, with its slot table."""
    made: list[str] = []
    yield made
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        for name in made:
            admin.execute(
                f"DROP TABLE IF EXISTS {name}, {name}_slots, {name}_counts, {name}_schema, "
                f"{name}_look"
            )


def new_table(tables: list[str]) -> str:
    name = unique_table()
    tables.append(name)
    return name


def exists(url: str, relation: str) -> bool:
    with psycopg.connect(url, autocommit=True) as admin:
        return admin.execute("SELECT to_regclass(%s)", (relation,)).fetchone()[0] is not None


def enqueue(store: PostgresStore, key: str, payload: Any = None) -> int:
    with store.connect() as conn:
        return store.enqueue(conn, key=key, type="t", payload=payload)


def _send_all(session: Any) -> None:
    """Claim every claimable row as "me" and write each one sent."""
    while claimed := session.claim("me", 100, 30.0, None):
        session.finish(
            "me", [Outcome(c.message.id, c.token, c.message.key, "sent") for c in claimed]
        )


@contextlib.contextmanager
def _relay_session(store: PostgresStore) -> Iterator[postgres._PostgresSession]:
    """A relay session of ``store``; the session, then the store, closed afterwards."""
    session = store.session()
    assert isinstance(session, postgres._PostgresSession)
    try:
        yield session
    finally:
        session.close()
        store.close()


def test_a_relay_reconnects_after_its_connection_is_terminated(
    postgres_url: str, tables: list[str]
) -> None:
    table = new_table(tables)
    store = PostgresStore(postgres_url, table=table)
    sent: list[int] = []
    bus = EventBus()
    bus.subscribe("t", lambda m: sent.append(m.payload))
    try:
        with Relay(store, bus, poll_interval=0.05) as relay:
            enqueue(store, "a", 1)
            wait_for(lambda: sent == [1])
            session = relay._session
            assert isinstance(session, postgres._PostgresSession)
            assert session._conn is not None
            pid = session._conn.info.backend_pid
            with psycopg.connect(postgres_url, autocommit=True) as admin:
                # The relay's connection, its listener's, and the store's
                # idle pooled ones (status() must be handed live ones).
                killed = admin.execute(
                    "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE pid <> pg_backend_pid() AND datname = current_database() "
                    "AND (pid = %s OR query LIKE %s)",
                    (pid, f"%{table}%"),
                ).fetchall()
            assert (pid, True) in killed
            assert len(killed) >= 2
            enqueue(store, "b", 2)
            wait_for(lambda: sent == [1, 2])
            # The handler ran; the relay writes the outcome just after.
            wait_for(lambda: store.status().counts["sent"] == 2)
            assert relay.state is RelayState.RUNNING
        assert relay.stats().errors >= 1  # the statement that found the connection dead
    finally:
        store.close()


def test_a_session_tells_a_refused_statement_from_a_failed_database(
    postgres_url: str, tables: list[str]
) -> None:
    # The relay writes an outcome the server refuses as a plain retry, but
    # keeps one whose write failed: a sent row written as a retry would be
    # delivered twice.
    store = PostgresStore(postgres_url, table=new_table(tables))
    with _relay_session(store) as session:
        enqueue(store, "k")
        (claimed,) = session.claim("me", 1, 30.0, None)
        message = claimed.message
        overflow = Outcome(message.id, claimed.token, message.key, "retry", 1e300, None, None)
        with pytest.raises(StoreError, match="interval") as refused:
            session.finish("me", [overflow])  # the server will not add that interval
        assert session.refused(refused.value)
        for passing in (
            psycopg.errors.QueryCanceled,  # a cancel, statement_timeout
            psycopg.errors.LockNotAvailable,  # lock_timeout
            psycopg.errors.SerializationFailure,
            psycopg.errors.DeadlockDetected,
            psycopg.errors.AdminShutdown,
            psycopg.errors.TooManyConnections,
            psycopg.errors.DiskFull,
            psycopg.OperationalError,  # no SQLSTATE: the client lost the server
        ):
            failed = StoreError("outbox database error")
            failed.__cause__ = passing("from the test")
            assert not session.refused(failed), passing
        assert not session.refused(StoreError("the session is closed"))  # no server answer
        conn = session.connect(10.0)
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        done = Outcome(message.id, claimed.token, message.key, "sent", 0.0, None, None)
        with pytest.raises(StoreError) as died:
            session.finish("me", [done])
        assert not session.refused(died.value)
        # The next statement has a new connection, and the write goes in.
        assert session.finish("me", [done]).lost == 0
        assert store.rows()[0].status == "sent"


def _backend(conn: Any) -> tuple[int, int]:
    """The server process of ``conn``: its pid and start, as a relay session keeps them."""
    found = conn.execute(
        "SELECT pid, (extract(epoch FROM backend_start) * 1000000)::bigint "
        "FROM pg_stat_activity WHERE pid = pg_backend_pid()"
    ).fetchone()
    return int(found[0]), int(found[1])


def _alive(url: str, pid: int) -> bool:
    with psycopg.connect(url, autocommit=True) as admin:
        found = admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
        return found.fetchone() is not None


def test_a_reconcile_ends_only_the_server_processes_of_its_dropped_connections(
    postgres_url: str, tables: list[str]
) -> None:
    # A process is named by its pid and its start: one that took the pid
    # of a process that ended (here, a start that does not match) is left
    # alone, and so is the session's own.
    store = PostgresStore(postgres_url, table=new_table(tables))
    with (
        _relay_session(store) as session,
        psycopg.connect(postgres_url, autocommit=True) as lost,
        psycopg.connect(postgres_url, autocommit=True) as other,
    ):
        lost_pid, lost_start = _backend(lost)
        other_pid, other_start = _backend(other)
        own = session.connect(10.0)
        assert session._backend == _backend(own)
        session._lost.orphans = [
            (lost_pid, lost_start),
            (other_pid, other_start - 1),
            session._backend,  # a pooler could hand it back: never the session's own
        ]
        assert session.reconcile("me", []) == 0
        assert not _alive(postgres_url, lost_pid)  # waited for: gone when reconcile returns
        assert other.execute("SELECT 1").fetchone() == (1,)
        assert session._lost.orphans == []
        assert session.connect(10.0) is own
        assert own.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.parametrize("sees", ["its own processes", "every process"])
def test_a_reconcile_leaves_the_processes_of_other_roles_and_goes_on(
    postgres_url: str, tables: list[str], caplog: pytest.LogCaptureFixture, sees: str
) -> None:
    # A role sees the start of its own processes only, so it names no
    # other. With pg_read_all_stats it sees them all, but may end only its
    # own (or with pg_signal_backend): the server refuses, the relay says
    # so, and reconciles.
    table = new_table(tables)
    PostgresStore(postgres_url, table=table).close()
    role = f"{table}_relay"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        try:
            for name in (
                table,
                f"{table}_slots",
                f"{table}_counts",
                f"{table}_schema",
                f"{table}_look",
            ):
                admin.execute(f"GRANT ALL ON {name} TO {role}")
            if sees == "every process":
                admin.execute(f"GRANT pg_read_all_stats TO {role}")
            url = psycopg.conninfo.make_conninfo(postgres_url, user=role)
            store = PostgresStore(url, table=table, create=False)
            with _relay_session(store) as session:
                pid, start = _backend(admin)  # a superuser's process
                session._lost.orphans = [(pid, start)]
                with caplog.at_level(logging.WARNING, logger="outbound"):
                    assert session.reconcile("me", []) == 0
                refused = "cannot end the server processes" in caplog.text
                assert refused == (sees == "every process")
                assert admin.execute("SELECT 1").fetchone() == (1,)
                assert session._lost.orphans == []
        finally:
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")


def test_a_relay_names_its_server_process_under_any_date_style(
    postgres_url: str, tables: list[str]
) -> None:
    # The start is read as a number: a date style psycopg cannot parse
    # (SQL, DMY here, set by the conninfo as a role's or a server's default
    # would) must not keep a relay from connecting.
    url = psycopg.conninfo.make_conninfo(postgres_url, options="-c datestyle=SQL,DMY")
    store = PostgresStore(url, table=new_table(tables))
    with _relay_session(store) as session:
        enqueue(store, "k")
        _send_all(session)
        assert store.rows()[0].status == "sent"
        conn = session._conn
        assert conn is not None
        assert session._backend == _backend(conn)


def test_a_relay_whose_role_cannot_read_the_activity_view_does_without(
    postgres_url: str,
) -> None:
    # A hardened database revokes pg_stat_activity from PUBLIC: the relay
    # cannot name its server process (nor end it after a drop), and works.
    name = unique_table()
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {name}_relay LOGIN")
        admin.execute(f"CREATE DATABASE {name} OWNER {name}_relay")
        try:
            hardened = psycopg.conninfo.make_conninfo(postgres_url, dbname=name)
            with psycopg.connect(hardened, autocommit=True) as conn:
                conn.execute("REVOKE SELECT ON pg_catalog.pg_stat_activity FROM PUBLIC")
            url = psycopg.conninfo.make_conninfo(hardened, user=f"{name}_relay")
            store = PostgresStore(url, table="outbox")
            with _relay_session(store) as session:
                enqueue(store, "k")
                _send_all(session)
                assert store.rows()[0].status == "sent"
                assert session._backend is None
        finally:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            admin.execute(f"DROP ROLE IF EXISTS {name}_relay")


def test_a_connection_whose_setup_raises_goes_back_to_the_pool(
    postgres_url: str, tables: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever the setup raises (not only the driver's errors), the pool
    # gets its connection back: a small pool would be empty for good.
    store = PostgresStore(postgres_url, table=new_table(tables), pool_size=2)
    with _relay_session(store) as session:

        def broken(self: Any, conn: Any) -> None:
            raise RuntimeError("setup failed (the test)")

        session.connect(10.0).close()  # the next call takes a new connection
        monkeypatch.setattr(postgres._PostgresSession, "_configure", broken)
        for _ in range(3):
            with pytest.raises(RuntimeError, match="the test"):
                session.connect(1.0)
        monkeypatch.undo()
        enqueue(store, "k")
        _send_all(session)
        assert store.rows()[0].status == "sent"


def test_rows_claimed_by_the_first_of_two_writes_are_returned_when_the_second_fails(
    postgres_url: str, tables: list[str]
) -> None:
    # A batch with one row twice is written in two statements. When the
    # second failed, the rows the first had claimed (its ``take``) were
    # lost with the exception: leased to the relay, never run, until their
    # lease expired.
    store = PostgresStore(postgres_url, table=new_table(tables))
    with _relay_session(store) as session:
        a1, a2 = enqueue(store, "a"), enqueue(store, "a")
        (claimed,) = session.claim("me", 10, 30.0, None)
        assert claimed.message.id == a1
        done = Outcome(a1, claimed.token, "a", "sent")
        run = session._run
        statements: list[str] = []

        def second_dies(name: str, params: Any) -> Any:
            statements.append(name)
            if statements.count("finish") == 2:
                conn = session.connect(10.0)
                with psycopg.connect(postgres_url, autocommit=True) as admin:
                    admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
            return run(name, params)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(session, "_run", second_dies)
            finished = session.finish("me", [done, done], take=10, lease=30.0)
        assert statements == ["finish", "finish"]
        assert [c.message.id for c in finished.claimed] == [a2]
        assert (finished.written, finished.later) == (1, (done,))
        assert {r.id: r.status for r in store.rows()} == {a1: "sent", a2: "processing"}


@pytest.mark.parametrize("max_pending", [None, 5])
def test_notify_off_enqueues_and_relays_poll(
    postgres_url: str, tables: list[str], max_pending: int | None
) -> None:
    store = PostgresStore(
        postgres_url, table=new_table(tables), notify=False, max_pending=max_pending
    )
    sent: list[int] = []
    bus = EventBus()
    bus.subscribe("t", lambda m: sent.append(m.payload))
    try:
        assert store.listener(lambda: None) is None
        enqueue(store, "a", 1)
        with Relay(store, bus, poll_interval=0.02):
            wait_for(lambda: sent == [1])
    finally:
        store.close()


def test_a_store_starting_while_a_transaction_uses_the_table_takes_no_lock(
    postgres_url: str, tables: list[str]
) -> None:
    table = new_table(tables)
    store = PostgresStore(postgres_url, table=table)
    app = store.connect()  # a transaction that enqueued and is still open
    try:
        store.enqueue(app, key="k", type="t", payload=None)
        started = threading.Event()

        def start() -> None:
            PostgresStore(postgres_url, table=table).close()
            started.set()

        thread = threading.Thread(target=start)
        thread.start()
        try:
            assert started.wait(10.0), "the store's start waited for the open transaction"
            enqueue(store, "k2")  # and nothing queued behind it blocks the others
        finally:
            app.rollback()  # lets a blocked start finish, should the test fail
            thread.join(10.0)
    finally:
        app.close()
        store.close()


def test_a_migration_gives_up_after_its_lock_timeout(
    postgres_url: str, tables: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    table = new_table(tables)
    tables.extend([f"{table}_counts", f"{table}_schema"])
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        v1_schema.create_postgres(admin, table)
    monkeypatch.setattr(postgres, "_DDL_LOCK_TIMEOUT", 0.2)
    with psycopg.connect(postgres_url) as app:
        app.execute(f"UPDATE {table} SET type = type WHERE id = 1")  # holds the table
        with pytest.raises(StoreError, match=r"was not free within 0\.2s"):
            PostgresStore(postgres_url, table=table)
        app.commit()
    store = PostgresStore(postgres_url, table=table)
    try:
        assert store.schema_version() == SCHEMA_VERSION
    finally:
        store.close()


def test_an_index_name_taken_by_another_table_is_a_store_error(
    postgres_url: str, tables: list[str]
) -> None:
    table = new_table(tables)
    tables.append(f"{table}_other")
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table}_other (key text)")
        admin.execute(f"CREATE UNIQUE INDEX {table}_head ON {table}_other (key)")
    with pytest.raises(StoreError, match=f"{table}_head"):
        PostgresStore(postgres_url, table=table)
    assert not exists(postgres_url, table)  # nothing half made
    assert not exists(postgres_url, f"{table}_schema")


@pytest.mark.parametrize("max_pending", [None, 5])
@pytest.mark.parametrize("mode", ["transaction", "autocommit-block", "implicit"])
def test_a_database_error_in_enqueue_leaves_the_callers_transaction_usable(
    postgres_url: str, tables: list[str], mode: str, max_pending: int | None
) -> None:
    # No table behind this store: every enqueue fails in the database.
    store = PostgresStore(
        postgres_url, table=new_table(tables), create=False, max_pending=max_pending
    )
    idle = psycopg.pq.TransactionStatus.IDLE
    intrans = psycopg.pq.TransactionStatus.INTRANS
    try:
        with psycopg.connect(postgres_url, autocommit=mode == "autocommit-block") as conn:
            conn.execute("CREATE TEMP TABLE app (x int)")
            if mode == "transaction":  # the caller's transaction holds a write already
                conn.execute("INSERT INTO app VALUES (1)")
                with pytest.raises(StoreError, match="does not exist"):
                    store.enqueue(conn, key="k", type="t", payload=None)
                assert conn.info.transaction_status == intrans
                conn.execute("INSERT INTO app VALUES (2)")
                assert conn.execute("SELECT count(*) FROM app").fetchone()[0] == 2
            elif mode == "autocommit-block":
                with conn.transaction():
                    conn.execute("INSERT INTO app VALUES (1)")
                    with pytest.raises(StoreError, match="does not exist"):
                        store.enqueue(conn, key="k", type="t", payload=None)
                    conn.execute("INSERT INTO app VALUES (2)")
                assert conn.execute("SELECT count(*) FROM app").fetchone()[0] == 2
            else:  # not autocommit, no transaction yet: enqueue would open it
                conn.commit()
                with pytest.raises(StoreError, match="does not exist"):
                    store.enqueue(conn, key="k", type="t", payload=None)
                assert conn.info.transaction_status == idle
                conn.execute("INSERT INTO app VALUES (1)")
                conn.commit()
                assert conn.execute("SELECT count(*) FROM app").fetchone()[0] == 1
    finally:
        store.close()


def test_relay_statements_fit_psycopgs_parse_cache() -> None:
    # psycopg parses a query text again at every execution when it is longer
    # than this (psycopg 3.1 to 3.3: psycopg._queries); the relay's
    # statements are sent compacted to stay under it with the longest name.
    from psycopg import _queries  # noqa: PLC0415

    limit = _queries.MAX_CACHED_STATEMENT_LENGTH
    assert limit >= 4096
    longest = "t" * 40
    sent = postgres._statements(longest, notify=True)  # NOTIFY makes some longer
    assert set(sent) == set(postgres._SESSION_STATEMENTS)
    for name, text in sent.items():
        assert len(text.encode()) <= limit, (name, len(text.encode()))
        assert "--" not in text, name
        # Compacting changed blanks only, and none in a literal.
        woke = "RETURNING pg_notify(%(channel)s, '')"
        full = postgres._sql(getattr(postgres._SQL, name), longest).replace("{woke}", woke)
        full = postgres._COMMENT.sub("", full)
        assert "".join(text.split()) == "".join(full.split()), name
        assert re.findall("'[^']*'", text) == re.findall("'[^']*'", full), name


def _log_plans(conn: Any, plans: list[str]) -> None:
    """Have the server send the plan of every statement on ``conn`` into ``plans``."""
    conn.add_notice_handler(lambda diag: plans.append(str(diag.message_primary)))
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_min_duration = 0")
    conn.execute("SET client_min_messages = log")


def _planned(session: Any) -> tuple[Any, list[str]]:
    """``session``'s connection, and the plans of the statements run on it from now on."""
    conn = session.connect(10.0)
    plans: list[str] = []
    _log_plans(conn, plans)
    return conn, plans


def _without_cte(plan: str, name: str) -> str:
    """An EXPLAIN text without the lines of CTE ``name`` (up to the next one)."""
    lines = plan.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"CTE {name}")
    depth = len(lines[start]) - len(lines[start].lstrip())
    end = next(
        (
            i
            for i in range(start + 1, len(lines))
            if len(lines[i]) - len(lines[i].lstrip()) <= depth
        ),
        len(lines),
    )
    return "\n".join(lines[:start] + lines[end:])


@pytest.mark.parametrize("max_concurrency", [None, 500])
def test_looks_on_a_table_without_statistics_lock_their_rows_by_primary_key(
    postgres_url: str, tables: list[str], max_concurrency: int | None
) -> None:
    # A table filled at once has no statistics until autovacuum analyzes it,
    # and the first executions of a statement get plans made for their own
    # parameters. A look must then reach the first rows of the keys it saw
    # by primary key, not read every pending row through the status index to
    # find them (the first look on 6,000 rows over 1,000 keys took twice as
    # long that way, and each look after it read all pending rows again).
    store = PostgresStore(postgres_url, table=new_table(tables))
    with store.connect() as conn:
        store.enqueue_many(
            conn, [{"key": f"k{i % 1000}", "type": "t", "payload": i} for i in range(6000)]
        )
    with _relay_session(store) as session:
        if max_concurrency is not None:
            session.ensure_slots(max_concurrency)
        conn, plans = _planned(session)
        claimed = session.claim("me", 100, 30.0, max_concurrency)
        assert len(claimed) == 100
        for _ in range(6):  # the next looks: narrow ones, still planned for their parameters
            session.claim("me", 10, 30.0, max_concurrency)
        looks = [plan for plan in plans if f"{store.table}_look" in plan]
        assert len(looks) == 7, plans
        for plan in looks:
            assert f"{store.table}_state" not in plan, plan
            assert f"Index Scan using {store.table}_pkey" in plan, plan
            # Only the front (rows past the last look, in id order) may be
            # read in full, on a table this small.
            assert f"Seq Scan on {store.table} " not in _without_cte(plan, "front"), plan
        # The first look made a head for every key.
        assert conn.execute(f"SELECT count(*) FROM {store.table} WHERE head").fetchone() == (1000,)


@pytest.mark.parametrize("max_concurrency", [None, 50])
def test_a_relay_started_on_an_empty_table_keeps_to_indexes_once_rows_come(
    postgres_url: str, tables: list[str], max_concurrency: int | None
) -> None:
    # A relay usually starts before the rows it will send. Its statements
    # are prepared, and the plans the server keeps for them were made while
    # the table was empty (nothing analyzes it meanwhile here). Once 6,000
    # rows come, no statement may read the whole table or every pending row:
    # a look that did found the rows it places and wrote its heads that
    # way, at every claim (a third of the rate, a sixth with capacity slots).
    store = PostgresStore(postgres_url, table=new_table(tables))
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"ALTER TABLE {store.table} SET (autovacuum_enabled = false)")
    plans: list[str] = []
    configure = postgres._PostgresSession._configure

    def explained(self: postgres._PostgresSession, conn: Any) -> None:
        configure(self, conn)
        _log_plans(conn, plans)

    sent: list[int] = []
    bus = EventBus()
    bus.subscribe("t", lambda m: sent.append(m.payload))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(postgres._PostgresSession, "_configure", explained)
        relay = Relay(store, bus, poll_interval=0.01, listen=False, max_concurrency=max_concurrency)
        try:
            relay.start()
            for i in range(1, 13):  # claims and outcome writes on a table of a row or none
                enqueue(store, "k", i)
                wait_for(lambda: len(sent) == i)
            made = len(plans)
            with store.connect() as conn:
                store.enqueue_many(
                    conn,
                    [{"key": f"k{i % 1000}", "type": "t", "payload": i} for i in range(6000)],
                )
            wait_for(lambda: len(sent) == 6012, timeout=60)
        finally:
            relay.stop(10.0)
            store.close()
    later = plans[made:]
    assert any(f"{store.table}_look" in plan for plan in later)  # looks ran, rows came
    for plan in later:
        assert f"Seq Scan on {store.table} " not in plan, plan
        assert f"{store.table}_state" not in plan, plan
        assert _unbounded_index_scans(plan, store.table) == [], plan


def test_a_renewal_reads_its_own_rows_by_primary_key_after_statistics_of_a_drained_table(
    postgres_url: str, tables: list[str]
) -> None:
    # Statistics taken while no row was in flight (a drained table), then
    # another relay holds 2,000 rows: renewing five leases must read those
    # five by id, not every row in flight through the lease index.
    store = PostgresStore(postgres_url, table=new_table(tables))
    mine = store.session()
    other = store.session()
    try:
        with store.connect() as conn:
            store.enqueue_many(
                conn, [{"key": f"a{i}", "type": "t", "payload": i} for i in range(200)]
            )
        _send_all(mine)
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"ANALYZE {store.table}")
        with store.connect() as conn:
            store.enqueue_many(
                conn, [{"key": f"k{i}", "type": "t", "payload": i} for i in range(2005)]
            )
        held = 0
        while held < 2000:
            held += len(other.claim("other", min(500, 2000 - held), 3600.0, None))
        mine_now = mine.claim("me", 5, 30.0, None)
        assert len(mine_now) == 5
        assert isinstance(mine, postgres._PostgresSession)
        conn, plans = _planned(mine)
        for _ in range(8):  # past psycopg's prepare and the server's custom plans
            assert mine.renew("me", 30.0, mine_now) == 5
        renewals = [plan for plan in plans if "renewed" in plan]
        assert len(renewals) == 8
        for plan in renewals:
            assert f"{store.table}_lease" not in plan, plan
    finally:
        mine.close()
        other.close()
        store.close()


def test_a_keys_next_row_is_found_by_key_after_statistics_of_a_few_keys(
    postgres_url: str, tables: list[str]
) -> None:
    # Statistics of a table with few keys and long lines (20 keys here):
    # the generic plan of "the first new row of key k, by id" read the
    # primary key from the oldest row, past every sent row and every other
    # key's row, at each finish and each look (12,000 rows went out at a
    # sixth of the rate). Each key's next row must come from an index on
    # its key.
    store = PostgresStore(postgres_url, table=new_table(tables))
    with store.connect() as conn:
        store.enqueue_many(
            conn, [{"key": f"k{i % 20}", "type": "t", "payload": i} for i in range(3000)]
        )
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"ANALYZE {store.table}")
    with _relay_session(store) as session:
        conn, plans = _planned(session)
        held = session.claim("me", 20, 30.0, None)
        sent = 0
        for _ in range(12):  # past psycopg's prepare and the server's custom plans
            assert len(held) == 20
            done = [Outcome(c.message.id, c.token, c.message.key, "sent") for c in held]
            finished = session.finish("me", done, take=20, lease=30.0)
            sent += len(done) - len(finished.later)
            held = list(finished.claimed)
            session.sequence(100)  # a look (every key has its head: it places none)
        assert sent == 240
        finishes = [plan for plan in plans if "CTE nexts" in plan]
        looks = [plan for plan in plans if f"{store.table}_look" in plan]
        assert len(finishes) == 12
        assert len(looks) >= 12
        for plan in finishes + looks:
            assert _unbounded_index_scans(plan, store.table) == [], plan
            assert f"{store.table}_new" in plan or plan in looks, plan


def test_a_key_whose_line_ended_reads_only_its_own_index_entries(
    postgres_url: str, tables: list[str]
) -> None:
    # An old snapshot (a report, a dump, any long transaction) keeps the
    # index entries of every row made head since the last vacuum. Looking
    # for the next row of a key whose line ended read on past the key,
    # through all the other keys' entries: about 20 times as slow while a
    # snapshot was held. The probe must stay within its key.
    store = PostgresStore(postgres_url, table=new_table(tables))
    with _relay_session(store) as session:
        with psycopg.connect(postgres_url) as old:
            old.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            old.execute("SELECT 1").fetchone()  # its snapshot is taken
            with store.connect() as conn:
                store.enqueue_many(
                    conn, [{"key": f"k{i % 20:02}", "type": "t", "payload": i} for i in range(2000)]
                )
            _send_all(session)
            enqueue(store, "a")  # sorts before every other key
            (claimed,) = session.claim("me", 10, 30.0, None)
            conn, plans = _planned(session)
            conn.execute("SET auto_explain.log_analyze = on")
            conn.execute("SET auto_explain.log_buffers = on")
            done = Outcome(claimed.message.id, claimed.token, "a", "sent")
            assert session.finish("me", [done], take=10, lease=30.0).written == 1
        (finish,) = [plan for plan in plans if "CTE nexts" in plan]
        reads = _index_reads(finish, f"{store.table}_new") + _index_reads(
            finish, f"{store.table}_waiting"
        )
        assert len(reads) == 2, finish
        assert max(reads) < 20, finish  # 2,000 and more read past the key


def test_an_outcome_write_promotes_only_the_rows_it_does_not_take(
    postgres_url: str, tables: list[str]
) -> None:
    # The rows moved up that the write does not claim itself are made head
    # by their ids. It read every row moved up and dropped those it took
    # (75 of 89 at batch 100, a seventh of the write's time); it must read
    # only the rows it makes head.
    store = PostgresStore(postgres_url, table=new_table(tables))
    enqueue_keys(store, *[f"k{i % 20:02}" for i in range(60)])
    with _relay_session(store) as session:
        held = session.claim("me", 20, 30.0, None)
        assert len(held) == 20
        conn, plans = _planned(session)
        conn.execute("SET auto_explain.log_analyze = on")
        done = [Outcome(c.message.id, c.token, c.message.key, "sent") for c in held]
        finished = session.finish("me", done, take=5, lease=30.0)
        assert (finished.written, len(finished.claimed)) == (20, 5)
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            heads = admin.execute(
                f"SELECT status, count(*) FROM {store.table} WHERE head "
                "AND status IN ('pending', 'processing') GROUP BY status ORDER BY status"
            ).fetchall()
        assert heads == [("pending", 15), ("processing", 5)]
    (finish,) = [plan for plan in plans if "CTE nexts" in plan]
    # The scan of the promoting update (alias w): the rows it found, and
    # none read and dropped.
    ((scan, details),) = _scans(finish, lambda line: re.search(r" on \S+ w ", line) is not None)
    assert re.search(r"\(actual time=\S+ rows=15 loops=1\)", scan), finish
    assert not any("Removed by Filter" in d for d in details), finish


def _scans(plan: str, matches: Callable[[str], bool]) -> list[tuple[str, list[str]]]:
    """The index scans in an EXPLAIN text whose line ``matches``, each with its detail lines."""
    lines = plan.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "Scan using " not in line or not matches(line):
            continue
        depth = len(line) - len(line.lstrip())
        details = []
        for below in lines[i + 1 :]:
            if len(below) - len(below.lstrip()) <= depth or below.lstrip().startswith("->"):
                break
            details.append(below)
        found.append((line, details))
    return found


def _index_reads(plan: str, index: str) -> list[int]:
    """The buffers each scan of ``index`` read, in an EXPLAIN (ANALYZE, BUFFERS) text."""
    reads = []
    for _, details in _scans(plan, lambda line: f"Scan using {index} " in line):
        hits = [m for d in details if (m := re.search(r"Buffers: shared hit=(\d+)", d))]
        reads.append(int(hits[0].group(1)) if hits else 0)
    return reads


def _unbounded_index_scans(plan: str, table: str) -> list[str]:
    """The index scans of ``table`` in an EXPLAIN text that have no index condition."""
    return [
        line.strip()
        for line, details in _scans(plan, lambda line: f" on {table} " in line + " ")
        if not any("Index Cond" in d for d in details)
    ]


def test_a_row_behind_a_head_is_not_written_until_its_turn(
    postgres_url: str, tables: list[str]
) -> None:
    store = PostgresStore(postgres_url, table=new_table(tables))

    def state(row_id: int) -> tuple[str, bool]:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            found = conn.execute(
                f"SELECT xmin::text, seq IS NULL FROM {store.table} WHERE id = %s", (row_id,)
            ).fetchone()
            return str(found[0]), bool(found[1])

    with _relay_session(store) as session:
        b1, a1 = enqueue(store, "b"), enqueue(store, "a")
        (claimed,) = session.claim("me", 1, 30.0, None)  # b1 is delivered
        assert claimed.message.id == b1
        rows = {r.id: r for r in store.rows()}
        assert rows[a1].head  # a head, not claimed
        assert rows[a1].status == "pending"
        a_before, b_before = state(a1), state(b1)
        a2, b2 = enqueue(store, "a"), enqueue(store, "b")
        before = {i: state(i) for i in (a2, b2)}
        # Both keys have a head: a look makes none, and writes nothing, not
        # to the new rows nor to their heads.
        assert session.sequence(100) == 0
        assert session.claim("other", 0, 30.0, None) == []
        assert (state(a1), state(b1)) == (a_before, b_before)
        assert {i: state(i) for i in (a2, b2)} == before
        assert all(new for _, new in before.values())
        rows = {r.id: r for r in store.rows()}
        assert not rows[a2].head
        assert not rows[b2].head
        # The write that finishes b1 takes b2 from where it is: one write.
        done = session.finish("me", [Outcome(b1, claimed.token, "b", "sent")], take=5, lease=30.0)
        assert [c.message.id for c in done.claimed] == [b2]
        assert not state(b2)[1]
        assert state(a2) == before[a2]


def test_a_finish_whose_snapshot_missed_a_row_revived_behind_its_head_writes_it_later(
    postgres_url: str, tables: list[str]
) -> None:
    # The seam: an operator revives a row behind a head after the write
    # that finishes the head took its snapshot, and before it locks the
    # head. The snapshot sees no row behind the head; the operator touched
    # the head, so the locked version is not the one the snapshot read:
    # the outcome waits for the next write, whose snapshot sees the revived
    # row and moves it up. Written then and there, the head would be sent
    # with no next head, and the revived row would wait forever.
    store = PostgresStore(postgres_url, table=new_table(tables))
    pause = 0x0B5E_55ED
    with _relay_session(store) as session:
        r0 = enqueue(store, "k")
        (first,) = session.claim("me", 10, 30.0, None)
        assert session.finish("me", [Outcome(r0, first.token, "k", "dead")]).written == 1
        r1 = enqueue(store, "k")
        (head,) = session.claim("me", 10, 30.0, None)
        assert head.message.id == r1
        plain = session._sql["finish"]
        start = "WITH snap AS MATERIALIZED ("
        assert plain.count(start) == 1
        # The write waits for an advisory lock after its snapshot is taken.
        session._sql["finish"] = plain.replace(
            start,
            f"WITH pause AS MATERIALIZED (SELECT true AS p FROM "
            f"(SELECT pg_advisory_xact_lock({pause})) AS w), snap AS MATERIALIZED (",
        ).replace(
            "AS l ON true",
            "AS l ON true WHERE (SELECT p FROM pause)",
            1,
        )
        outcome = Outcome(r1, head.token, "k", "sent")
        result: list[Any] = []
        with psycopg.connect(postgres_url, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (pause,))
            writer = threading.Thread(target=lambda: result.append(session.finish("me", [outcome])))
            writer.start()
            try:

                def waiting() -> bool:
                    found = holder.execute(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                        "AND NOT granted AND objid = %s",
                        (pause,),
                    ).fetchone()
                    return bool(found and found[0])

                wait_for(waiting)
                assert store.retry_dead([r0]) == 1  # touches the head r1
            finally:
                holder.execute("SELECT pg_advisory_unlock(%s)", (pause,))
                writer.join(30.0)
        assert not writer.is_alive()
        (finished,) = result
        assert finished.written == 0
        assert [o.id for o in finished.later] == [r1]
        session._sql["finish"] = plain
        assert session.finish("me", [outcome]).written == 1
        assert [c.message.id for c in session.claim("me", 10, 30.0, None)] == [r0]


@pytest.fixture
def late(postgres_url: str, tables: list[str]) -> Iterator[tuple[PostgresStore, Any, Any]]:
    """A store, a relay session on it, and an application connection whose
    transaction the test leaves open (its rows commit late)."""
    store = PostgresStore(postgres_url, table=new_table(tables))
    session = store.session()
    slow = store.connect()
    try:
        yield store, session, slow
    finally:
        slow.close()
        session.close()
        store.close()


def test_a_row_that_commits_after_the_front_passed_its_id_gets_its_head(
    late: tuple[PostgresStore, Any, Any],
) -> None:
    # Ids are taken at insert, rows become visible at commit: a look can
    # pass the id of a row still being written. Its key has no head; the
    # sweep of keys with new rows finds it at the next look.
    store, session, slow = late
    row = store.enqueue(slow, key="late", type="t", payload=None)  # not committed
    early = enqueue(store, "early")
    assert row < early
    assert [c.message.id for c in session.claim("me", 10, 30.0, None)] == [early]
    slow.commit()
    assert [c.message.id for c in session.claim("me", 10, 30.0, None)] == [row]


def test_the_sweep_goes_round_every_key_with_new_rows(
    late: tuple[PostgresStore, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # More keys with rows waiting behind a head than one look sweeps, and a
    # late row of a key without a head among the last of them: the looks
    # go on from where the last stopped and find it.
    monkeypatch.setattr(postgres, "_WIDE_EVERY", 0.0)  # every look wide: few looks
    store, session, slow = late
    keys = [f"k{i:05d}" for i in range(3 * postgres._SWEEP_KEYS_IDLE)]
    row = store.enqueue(slow, key="zzz", type="t", payload=None)  # not committed
    with store.connect() as conn:
        store.enqueue_many(
            conn, [{"key": k, "type": "t", "payload": n} for n in range(2) for k in keys]
        )
    heads = session.claim("me", 10_000, 30.0, None)
    assert sorted(c.message.key for c in heads) == keys  # the second rows wait
    slow.commit()
    found: list[int] = []
    for _ in range(4):  # every key is swept within this many looks
        found += [c.message.id for c in session.claim("me", 10_000, 30.0, None)]
    assert found == [row]


def test_every_relays_look_starts_where_the_last_look_of_any_relay_stopped(
    postgres_url: str, tables: list[str]
) -> None:
    # One relay looks at many rows while another does not look at all. The
    # other's next look starts past them: it finds a new key at once, though
    # more keys wait behind their heads than one sweep looks at.
    store = PostgresStore(postgres_url, table=new_table(tables))
    busy, idle = store.session(), store.session()
    try:
        assert idle.claim("idle", 1, 30.0, None) == []
        keys = [f"k{i:04d}" for i in range(3 * postgres._SEQUENCE_MIN)]
        with store.connect() as conn:
            store.enqueue_many(
                conn, [{"key": k, "type": "t", "payload": n} for n in range(2) for k in keys]
            )
        assert len(busy.claim("busy", 10_000, 30.0, None)) == len(keys)  # the heads
        last = enqueue(store, "zzz", 1)
        assert [c.message.id for c in idle.claim("idle", 1, 30.0, None)] == [last]
    finally:
        busy.close()
        idle.close()
        store.close()


def _keys_with_lines(store: PostgresStore, keys: int, waiting: int) -> None:
    """``keys`` keys whose head is due in an hour, each with ``waiting`` rows behind it."""
    with store.connect() as conn:
        store.enqueue_many(
            conn,
            [{"key": f"k{k:04d}", "type": "t", "payload": 0, "delay": 3600.0} for k in range(keys)],
        )
        session = store.session()
        try:
            while session.sequence(100_000):
                pass
        finally:
            session.close()
        for n in range(1, waiting + 1):
            store.enqueue_many(
                conn, [{"key": f"k{k:04d}", "type": "t", "payload": n} for k in range(keys)]
            )


def test_a_late_row_beside_many_waiting_lines_goes_at_the_next_wide_look(
    late: tuple[PostgresStore, Any, Any],
) -> None:
    # A row that commits behind the front, while hundreds of keys have rows
    # waiting behind their heads: a relay that is not busy sweeps them all
    # in one look (a busy one, a few dozen per look), at most every
    # _WIDE_EVERY seconds (a relay woken by every enqueue keeps its claims
    # cheap meanwhile).
    store, session, slow = late
    assert isinstance(session, postgres._PostgresSession)
    # Not committed; its key sorts among the last of the waiting keys.
    row = store.enqueue(slow, key="k0600-late", type="t", payload=None)
    _keys_with_lines(store, 640, 1)
    early = enqueue(store, "b-early")
    assert [c.message.id for c in session.claim("me", 10, 30.0, None)] == [early]
    slow.commit()
    assert session.claim("me", 10, 30.0, None) == []  # too soon for a wide look
    session._wide_at = 0.0  # as when _WIDE_EVERY has passed
    assert [c.message.id for c in session.claim("me", 10, 30.0, None)] == [row]


def test_a_new_key_behind_long_lines_goes_at_a_new_relays_first_look(
    postgres_url: str, tables: list[str]
) -> None:
    store = PostgresStore(postgres_url, table=new_table(tables))
    try:
        _keys_with_lines(store, 640, 20)  # 12,800 rows wait
        fresh = enqueue(store, "zz-fresh")  # after every other key
        session = store.session()
        try:
            assert [c.message.id for c in session.claim("me", 10, 30.0, None)] == [fresh]
        finally:
            session.close()
    finally:
        store.close()


def test_relay_commits_keep_the_servers_durability_unless_the_conninfo_opts_out(
    postgres_url: str, tables: list[str]
) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        server = conn.execute("SHOW synchronous_commit").fetchone()[0]
    table = new_table(tables)
    durable = PostgresStore(postgres_url, table=table)
    sep = "&" if "?" in postgres_url else "?"
    fast = PostgresStore(
        f"{postgres_url}{sep}options=-c%20synchronous_commit%3Doff", table=table, create=False
    )
    try:
        for store, expected in ((durable, server), (fast, "off")):
            session = store.session()
            try:
                assert isinstance(session, postgres._PostgresSession)
                row = session.connect(5.0).execute("SHOW synchronous_commit").fetchone()
                assert row is not None
                assert row[0] == expected
            finally:
                session.close()
    finally:
        durable.close()
        fast.close()


def _enqueue_quietly(store: PostgresStore, keys: int) -> None:
    """``keys`` rows, one per key, through a store of the table that sends no NOTIFY."""
    quiet = PostgresStore(store.conninfo, table=store.table, create=False, notify=False)
    try:
        with quiet.connect() as conn:
            quiet.enqueue_many(
                conn, [{"key": f"k{i}", "type": "t", "payload": i} for i in range(keys)]
            )
    finally:
        quiet.close()


@contextlib.contextmanager
def _session_and_listener(store: PostgresStore) -> Iterator[tuple[Any, Any]]:
    """A relay session of ``store`` and a connection listening on its channel;
    both closed afterwards, and the store."""
    with _relay_session(store) as session:
        with psycopg.connect(store.conninfo, autocommit=True) as listening:
            listening.execute(f"LISTEN {store.channel}")
            yield session, listening


def test_a_claim_that_makes_heads_it_does_not_take_notifies_the_other_relays(
    postgres_url: str, tables: list[str]
) -> None:
    store = PostgresStore(postgres_url, table=new_table(tables))
    with _session_and_listener(store) as (session, listening):
        _enqueue_quietly(store, 5)
        assert list(listening.notifies(timeout=0.2)) == []  # none from the enqueue
        # Five heads made, two taken: the other three are anyone's.
        assert len(session.claim("me", 2, 30.0, None)) == 2
        got = list(listening.notifies(timeout=10.0, stop_after=1))
        assert [n.channel for n in got] == [store.channel]
        # A claim that takes every head it makes (the three, then the
        # new key's) leaves none to anyone else: no notification.
        _enqueue_quietly(store, 6)
        assert len(session.claim("me", 10, 30.0, None)) == 4
        assert list(listening.notifies(timeout=0.2)) == []


def test_a_store_with_notify_off_makes_heads_without_notifying(
    postgres_url: str, tables: list[str]
) -> None:
    table = new_table(tables)
    PostgresStore(postgres_url, table=table).close()  # the schema
    quiet = PostgresStore(postgres_url, table=table, create=False, notify=False)
    with _session_and_listener(quiet) as (session, listening):
        _enqueue_quietly(quiet, 5)
        assert len(session.claim("me", 2, 30.0, None)) == 2
        assert session.sequence(100) == 0  # the others have heads already
        assert list(listening.notifies(timeout=0.2)) == []


def test_a_relay_that_found_nothing_while_another_looked_claims_its_heads_at_once(
    postgres_url: str, tables: list[str]
) -> None:
    # A relay whose claim ran while another statement held the look's lock
    # finds no head, and would sleep until its next poll (30 s here) while
    # the heads that look made wait. The look's notification wakes it.
    store = PostgresStore(postgres_url, table=new_table(tables))
    sent: list[int] = []
    bus = EventBus()
    bus.subscribe("t", lambda m: sent.append(m.payload))
    other = store.session()
    assert isinstance(other, postgres._PostgresSession)
    try:
        _enqueue_quietly(store, 5)
        with (
            psycopg.connect(postgres_url) as holder,
            psycopg.connect(postgres_url, autocommit=True) as watch,
        ):
            holder.execute("SELECT pg_advisory_xact_lock(%s)", (other._seq_lock,))
            with Relay(store, bus, poll_interval=30.0) as relay:
                session = relay._side  # it claims there, beside its writes
                assert isinstance(session, postgres._PostgresSession)
                assert session._conn is not None
                pid = session._conn.info.backend_pid

                def claimed_nothing() -> bool:
                    # (Outside the holder's transaction: pg_stat_activity is
                    # read once per transaction.)
                    row = watch.execute(
                        "SELECT state, query FROM pg_stat_activity WHERE pid = %s", (pid,)
                    ).fetchone()
                    return row is not None and row[0] == "idle" and "look" in row[1]

                wait_for(claimed_nothing)  # its first claim ran, without a look
                assert relay.stats().claimed == 0
                holder.rollback()  # the look's lock is free again
                assert len(other.claim("other", 1, 30.0, None)) == 1  # four heads left
                wait_for(lambda: sorted(sent) == [1, 2, 3, 4], timeout=10.0)
    finally:
        other.close()
        store.close()


def test_rows_put_back_are_found_by_id_in_a_plan_made_on_an_empty_table(
    postgres_url: str, tables: list[str]
) -> None:
    # The claim's look for rows the relay put back, planned once for all
    # (a generic plan) on an empty table: it read every pending row through
    # the status index, and filtered them by id, at each claim.
    store = PostgresStore(postgres_url, table=new_table(tables))
    store.close()
    text = (
        postgres._SQL.due_back.replace("{t}", store.table)
        .replace("%(first)s", "$1")
        .replace("%(ahead)s", "$2")
        .replace("%(skip)s", "$3")
    )
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off; SET enable_bitmapscan = off")
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE back (bigint[], float8, text[]) AS {text}")
        plan = "\n".join(str(r[0]) for r in conn.execute("EXPLAIN EXECUTE back('{}', 0, '{}')"))
    assert f"Index Scan using {store.table}_pkey" in plan, plan
