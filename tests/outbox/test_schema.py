"""The schema version table and the migration from version 1, on both stores."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbound.errors import StoreError
from outbound.outbox import (
    SCHEMA_VERSION,
    EventBus,
    OutboxMessage,
    PostgresStore,
    Relay,
    SQLiteStore,
    Store,
)
from outbound.outbox._base import _KEYWORDS

from . import v1_schema
from .conftest import POSTGRES_URL, app_connection, unique_table, wait_for


@pytest.fixture
def old_store(backend: str, tmp_path: Path) -> Iterator[Store]:
    """A store (not created) over a version 1 table holding :data:`v1_schema.ROWS`."""
    table = unique_table()
    store: Store
    if backend == "sqlite":
        path = str(tmp_path / "old.db")
        v1_schema.create_sqlite(path, table)
        store = SQLiteStore(path, table=table, create=False)
    else:
        import psycopg  # noqa: PLC0415

        assert POSTGRES_URL
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            v1_schema.create_postgres(admin, table)
        store = PostgresStore(POSTGRES_URL, table=table, create=False)
    yield store
    store.close()
    store.drop_schema()


def test_a_new_outbox_is_created_at_the_current_version(old_store: Store) -> None:
    old_store.drop_schema()
    assert old_store.schema_version() is None
    with pytest.raises(StoreError, match="does not exist"):
        old_store.check_schema()
    old_store.create_schema()
    old_store.create_schema()  # idempotent
    assert old_store.schema_version() == SCHEMA_VERSION
    old_store.check_schema()
    assert _leaves_room(old_store)


def test_version_1_is_migrated_with_its_rows_places_and_counts(old_store: Store) -> None:
    assert old_store.schema_version() == 1
    with pytest.raises(StoreError, match="schema version 1"):
        Relay(old_store, EventBus()).start()  # an old schema is refused, not half used
    assert _fillfactor(old_store) is None
    old_store.create_schema()
    assert old_store.schema_version() == SCHEMA_VERSION
    assert _leaves_room(old_store)
    rows = sorted(old_store.rows(limit=100), key=lambda r: r.id)
    assert [(r.key, r.status, r.attempts) for r in rows] == [
        (key, status, attempts) for key, status, _, attempts, _ in v1_schema.ROWS
    ]
    status = old_store.status()
    assert status.unfinished == 5  # pending and processing rows, counted once
    # Key "d": its head backs off after a failure, a row waits behind it.
    (blocked,) = [b for b in old_store.blocked() if b.key == "d"]
    assert (blocked.head.id, blocked.waiting, blocked.head.last_error) == (
        6,
        1,
        "RuntimeError: flaky",
    )

    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            seen.append((message.key, message.payload["n"]))

    bus = EventBus()
    bus.subscribe("t", handler)
    with Relay(old_store, bus, poll_interval=0.02):
        wait_for(lambda: len(seen) == 2)  # "a": its head, then the row behind it
        assert old_store.dead_letter([6]) == 1  # "d": the row behind its head moves up
        assert old_store.cancel([4]) == 1  # "b": held by a relay of version 1
        wait_for(lambda: len(seen) == 3)
        wait_for(lambda: old_store.status().unfinished == 0)
    assert seen == [("a", 2), ("a", 3), ("d", 7)]
    counts = old_store.status().counts
    assert (counts["sent"], counts["dead"], counts["cancelled"]) == (4, 2, 1)
    # New rows get new ids, above every old one.
    conn: Any = old_store.connect()  # type: ignore[attr-defined]
    try:
        assert old_store.enqueue(conn, key="e", type="t", payload={"n": 8}) == 8
        conn.commit()
    finally:
        conn.close()


def test_stores_opening_an_older_file_together_all_open_it(tmp_path: Path) -> None:
    # A file in SQLite's rollback-journal mode (an application's own
    # database, or an older outbox) is switched to WAL by the first store
    # that opens it; one opening it meanwhile got "database is locked" at
    # once, without SQLite's busy handler (about 1 round in 60 here).
    for round_ in range(100):
        path = str(tmp_path / f"old{round_}.db")
        v1_schema.create_sqlite(path, "old")
        errors: list[BaseException] = []
        stores = [SQLiteStore(path, table="old", create=False) for _ in range(3)]

        def migrate(store: Store) -> None:
            try:
                store.create_schema()
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=migrate, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30.0)
        for store in stores:
            store.close()
        assert not errors, f"round {round_}: {errors[0]!r}"
        check = sqlite3.connect(path)
        try:
            assert check.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        finally:
            check.close()


def test_two_processes_migrating_at_once_migrate_once(old_store: Store) -> None:
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            old_store.create_schema()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30.0)
    assert not errors
    assert old_store.schema_version() == SCHEMA_VERSION
    assert old_store.status().unfinished == 5


def test_a_newer_schema_is_refused(old_store: Store) -> None:
    old_store.create_schema()
    table = old_store.table
    if isinstance(old_store, SQLiteStore):
        import sqlite3  # noqa: PLC0415

        conn = sqlite3.connect(old_store.path, isolation_level=None)
        conn.execute(f"INSERT INTO {table}_schema VALUES (99, 0)")
        conn.close()
    else:
        import psycopg  # noqa: PLC0415

        assert POSTGRES_URL
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"INSERT INTO {table}_schema (version) VALUES (99)")
    with pytest.raises(StoreError, match="newer than this code"):
        old_store.check_schema()
    with pytest.raises(StoreError, match="newer than this code"):
        old_store.create_schema()


def test_an_sqlite_store_that_inspects_never_creates_the_file(tmp_path: Path) -> None:
    path = tmp_path / "typo.db"
    store = SQLiteStore(path, create=False)
    assert store.schema_version() is None
    with pytest.raises(StoreError):
        store.status()
    with pytest.raises(StoreError):
        store.session()
    assert not path.exists()


def _fillfactor(store: Store) -> int | None:
    """The fillfactor of a PostgreSQL store's table (None: the default, 100;
    always None for SQLite)."""
    if isinstance(store, SQLiteStore):
        return None
    import psycopg  # noqa: PLC0415

    assert POSTGRES_URL
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        row = admin.execute(
            "SELECT option_value FROM pg_class c, pg_options_to_table(c.reloptions) "
            "WHERE c.oid = to_regclass(%s) AND option_name = 'fillfactor'",
            (store.table,),
        ).fetchone()
    return None if row is None else int(row[0])


def _leaves_room(store: Store) -> bool:
    """Does ``store``'s table leave room in its pages for the versions its
    rows' writes make (PostgreSQL; always true for SQLite)?"""
    return isinstance(store, SQLiteStore) or _fillfactor(store) == 60


def _step_back(store: Store, version: int, postgres_changes: list[str]) -> None:
    """Turn ``store``'s tables from ``version + 1`` back into ``version``: the
    PostgreSQL statements given (``{t}``: the table); SQLite's tables did not
    change, only the recorded version."""
    table = store.table
    record = f"UPDATE {table}_schema SET version = {version} WHERE version = {version + 1}"
    if isinstance(store, SQLiteStore):
        import sqlite3  # noqa: PLC0415

        conn = sqlite3.connect(store.path, isolation_level=None)
        conn.execute(record)
        conn.close()
        return
    import psycopg  # noqa: PLC0415

    assert POSTGRES_URL
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        for statement in [*postgres_changes, record]:
            admin.execute(statement.replace("{t}", table))


def _make_version_3(store: Store) -> None:
    """Turn ``store``'s current tables back into version 3 (on PostgreSQL new
    rows were found by id, and each relay kept where it looked)."""
    assert SCHEMA_VERSION == 4
    _step_back(
        store,
        3,
        [
            "DROP INDEX {t}_new",
            "DROP TABLE {t}_look",
            "CREATE INDEX {t}_new ON {t} (id) WHERE seq IS NULL",
            "ALTER TABLE {t} RESET (fillfactor)",  # pages were filled
        ],
    )


def _make_version_2(store: Store) -> None:
    """Turn ``store``'s current tables back into version 2 (on PostgreSQL the
    counter shards were smallint, the payload jsonb)."""
    _make_version_3(store)
    _step_back(
        store,
        2,
        [
            "ALTER TABLE {t}_counts ALTER COLUMN shard TYPE smallint",
            "ALTER TABLE {t} ALTER COLUMN payload TYPE jsonb USING payload::jsonb",
        ],
    )


def test_version_3_is_migrated_and_its_lines_are_kept(postgres_url: str) -> None:
    # Version 3 placed every new row behind its key's head (seq set, not
    # head); version 4 leaves new rows unplaced. Both kinds of row, and the
    # heads, go out in order after the migration.
    store = PostgresStore(postgres_url, table=unique_table())
    try:
        conn = app_connection(store)
        try:
            ids = {
                k: [store.enqueue(conn, key=k, type="t", payload={"n": n}) for n in range(4)]
                for k in ("a", "b", "c")
            }
            conn.commit()
        finally:
            conn.close()
        import psycopg  # noqa: PLC0415

        with psycopg.connect(postgres_url, autocommit=True) as admin:
            # As version 3 left them: a and b have a head; a's line is placed,
            # b's half placed; c's rows are all new.
            t = store.table
            admin.execute(
                f"UPDATE {t} SET seq = id, head = true WHERE id = ANY(%s)",
                ([ids["a"][0], ids["b"][0]],),
            )
            admin.execute(
                f"UPDATE {t} SET seq = id WHERE id = ANY(%s)", (ids["a"][1:] + ids["b"][1:2],)
            )
        _make_version_3(store)
        assert store.schema_version() == 3
        assert _fillfactor(store) is None
        with pytest.raises(StoreError, match="schema version 3"):
            store.check_schema()
        store.create_schema()
        assert store.schema_version() == SCHEMA_VERSION
        store.check_schema()
        assert _leaves_room(store)
        seen: dict[str, list[int]] = {}
        bus = EventBus()
        bus.subscribe("t", lambda m: seen.setdefault(m.key, []).append(m.id))
        with Relay(store, bus, poll_interval=0.01, batch_size=2):
            wait_for(lambda: sum(map(len, seen.values())) == 12, timeout=20)
        assert seen == ids
    finally:
        store.close()
        store.drop_schema()


def test_version_2_is_migrated_with_its_rows_and_counts(old_store: Store) -> None:
    old_store.create_schema()
    before = old_store.status().unfinished
    conn = app_connection(old_store)
    try:
        first = old_store.enqueue(conn, key="a", type="t", payload={"n": 1})
        conn.commit()
    finally:
        conn.close()
    _make_version_2(old_store)
    assert old_store.schema_version() == 2
    assert _fillfactor(old_store) is None
    with pytest.raises(StoreError, match="schema version 2"):
        old_store.check_schema()
    old_store.create_schema()
    assert old_store.schema_version() == SCHEMA_VERSION
    old_store.check_schema()
    assert _leaves_room(old_store)
    row = old_store.get(first)
    assert row is not None
    assert row.status == "pending"
    conn = app_connection(old_store)
    try:
        assert old_store.enqueue(conn, key="a", type="t", payload={"n": 2}) > first
        conn.commit()
    finally:
        conn.close()
    assert old_store.status().unfinished == before + 2


def test_enqueuers_running_through_the_migration_from_version_2_only_wait(
    postgres_url: str,
) -> None:
    # The migration alters the outbox table and its counters; enqueues
    # take the table, then the counters. In the other order the two
    # deadlocked, and PostgreSQL aborted the application's transactions.
    store = PostgresStore(postgres_url, table=unique_table())
    try:
        _make_version_2(store)
        stop = threading.Event()
        errors: list[BaseException] = []
        done = [0] * 8

        def writer(n: int) -> None:
            conn = app_connection(store)
            try:
                while not stop.is_set():
                    store.enqueue(conn, key=f"w{n}", type="t", payload={"n": n})
                    # Other statements of the transaction, after the enqueue.
                    conn.execute("SELECT pg_sleep(0.005)")
                    conn.commit()
                    done[n] += 1
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:
                conn.close()

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: all(done), timeout=20)
            store.create_schema()
            assert store.schema_version() == SCHEMA_VERSION
            before = sum(done)
            wait_for(lambda: sum(done) >= before + 8, timeout=20)  # and they go on
        finally:
            stop.set()
            for thread in threads:
                thread.join(20.0)
        assert not errors, errors[0]
        assert store.status().unfinished == sum(done)
    finally:
        store.close()
        store.drop_schema()


@pytest.mark.parametrize("name", ["order", "group", "select", "user", "current", "system_user"])
def test_an_sql_keyword_for_a_table_is_refused_before_anything_is_made(
    name: str, tmp_path: Path
) -> None:
    # It passed every check (manage.py check, Flask's init_app), then the
    # schema's statements failed on a syntax error.
    with pytest.raises(ValueError, match=f"table '{name}' is an SQL keyword.*{name}_outbox"):
        SQLiteStore(tmp_path / "o.db", table=name)
    assert not (tmp_path / "o.db").exists()
    with pytest.raises(ValueError, match="SQL keyword"):
        PostgresStore("postgresql://127.0.0.1:1/unused", table=name)
    assert SQLiteStore(tmp_path / "p.db", table=f"{name}_outbox").table == f"{name}_outbox"


def test_every_reserved_word_of_the_server_is_refused_for_a_table(postgres_url: str) -> None:
    # The list is the library's own: a server that reserves more words (a
    # later PostgreSQL) shows here.
    import psycopg  # noqa: PLC0415

    with psycopg.connect(postgres_url) as conn:
        reserved = {
            word
            for (word,) in conn.execute(
                "SELECT word FROM pg_get_keywords() WHERE catcode IN ('R', 'T')"
            )
        }
    assert reserved
    assert sorted(reserved - _KEYWORDS) == []


def test_a_keyword_sqlite_takes_for_a_table_is_left_alone(tmp_path: Path) -> None:
    # Not refused for nothing: a keyword SQLite takes as a name works.
    store = SQLiteStore(tmp_path / "o.db", table="key")
    try:
        conn = store.connect()
        with conn:
            store.enqueue(conn, key="k", type="t", payload={})
        conn.close()
        assert len(store.rows(limit=5)) == 1
    finally:
        store.close()


@pytest.mark.parametrize(
    "name",
    [
        *("orders_look", "orders_counts", "orders_schema", "a_slots", "x_v1"),
        *("orders_state", "orders_head", "orders_new", "orders_pkey", "orders_id_seq"),
    ],
)
def test_a_table_named_as_another_outboxs_own_tables_is_refused(name: str, tmp_path: Path) -> None:
    # Creating outbox "orders" dropped an outbox named "orders_look" (or
    # "orders_counts", "orders_schema"), its pending rows with it.
    with pytest.raises(ValueError, match="ends as the tables and indexes an outbox makes"):
        SQLiteStore(tmp_path / "o.db", table=name)
    with pytest.raises(ValueError, match="ends as the tables and indexes an outbox makes"):
        PostgresStore("postgresql://127.0.0.1:1/unused", table=name)


@pytest.mark.parametrize("name", ["pg_tables", "pg_class", "sqlite_master"])
def test_a_table_named_as_the_databases_own_is_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="begins as a database's own"):
        SQLiteStore(tmp_path / "o.db", table=name)


@pytest.mark.parametrize("suffix", ["_counts", "_schema", "_look", "_slots"])
def test_an_applications_table_of_a_name_the_outbox_needs_is_left_alone(
    postgres_url: str, suffix: str
) -> None:
    # It was dropped (_counts, _schema, _look) or taken over (_slots).
    import psycopg  # noqa: PLC0415

    table = unique_table()
    theirs = table + suffix
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {theirs} (note text)")
        conn.execute(f"INSERT INTO {theirs} VALUES ('keep me')")
    try:
        with pytest.raises(StoreError, match=f"{theirs}.*not outbox '{table}'"):
            PostgresStore(postgres_url, table=table)
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute(f"SELECT note FROM {theirs}").fetchall() == [("keep me",)]
            assert conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() == (None,)
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {theirs}")


def test_an_applications_slots_table_in_sqlite_is_left_alone(tmp_path: Path) -> None:
    raw = sqlite3.connect(tmp_path / "o.db")
    with raw:
        raw.execute("CREATE TABLE outbox_slots (note TEXT)")
        raw.execute("INSERT INTO outbox_slots VALUES ('keep me')")
    raw.close()
    with pytest.raises(StoreError, match="outbox_slots already exists"):
        SQLiteStore(tmp_path / "o.db", table="outbox")
    raw = sqlite3.connect(tmp_path / "o.db")
    try:
        assert raw.execute("SELECT note FROM outbox_slots").fetchall() == [("keep me",)]
    finally:
        raw.close()


def test_an_index_of_the_outboxs_name_is_not_taken_for_an_old_outbox(postgres_url: str) -> None:
    # It was taken for a table of version 1 (to_regclass finds any relation),
    # and migrated: the first ALTER failed.
    import psycopg  # noqa: PLC0415

    name, other = unique_table(), unique_table()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {other} (x integer)")
        conn.execute(f"CREATE INDEX {name} ON {other} (x)")
    try:
        with pytest.raises(StoreError, match="has an index, sequence or view of that name"):
            PostgresStore(postgres_url, table=name)
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {other}")


def test_an_applications_table_of_the_outboxs_name_is_not_migrated(
    backend: str, tmp_path: Path
) -> None:
    # It was taken for an outbox of version 1 (no version table): altered
    # under an exclusive lock (SQLite: renamed), then the migration failed on
    # a column it lacked, saying nothing of why.
    table = unique_table()
    if backend == "postgres":
        if not POSTGRES_URL:
            pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
        import psycopg  # noqa: PLC0415

        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {table} (id integer, note text)")
        try:
            with pytest.raises(StoreError, match="is there and is not an outbox"):
                PostgresStore(POSTGRES_URL, table=table)
            with psycopg.connect(POSTGRES_URL) as conn:
                columns = conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) "
                    "AND attnum > 0 AND NOT attisdropped",
                    (table,),
                ).fetchall()
            assert sorted(c for (c,) in columns) == ["id", "note"]
        finally:
            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                conn.execute(f"DROP TABLE IF EXISTS {table}")
    else:
        raw = sqlite3.connect(tmp_path / "o.db")
        with raw:
            raw.execute(f"CREATE TABLE {table} (id INTEGER, note TEXT)")
        raw.close()
        with pytest.raises(StoreError, match="is there and is not an outbox"):
            SQLiteStore(tmp_path / "o.db", table=table)
        raw = sqlite3.connect(tmp_path / "o.db")
        try:
            names = {r[0] for r in raw.execute("SELECT name FROM sqlite_master")}
            assert table in names
            assert f"{table}_v1" not in names
        finally:
            raw.close()


@pytest.mark.parametrize("outbox_columns", [False, True])
def test_an_applications_tables_of_the_outboxs_names_are_never_read_nor_written(
    backend: str, tmp_path: Path, outbox_columns: bool
) -> None:
    # An application's table of the outbox's name beside its own table named
    # {t}_schema (a registry of JSON schemas): the version was read from the
    # latter without a look at the former, so PostgreSQL took it for a
    # current outbox (the first enqueue failed on a missing column) and
    # SQLite "migrated" it, writing a row into the application's table.
    # With an outbox's columns but a foreign {t}_schema: refused too.
    table = unique_table()
    columns = (
        "id bigint, key text, type text, payload text, status text, head boolean, "
        "seq bigint, attempts integer"
        if outbox_columns
        else "id integer, name text"
    )
    rows = [(2, "{}"), (4, "{}")]
    message = "is not an outbox's version table" if outbox_columns else "is there and is not an"
    if backend == "postgres":
        if not POSTGRES_URL:
            pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
        import psycopg  # noqa: PLC0415

        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {table} ({columns})")
            conn.execute(f"CREATE TABLE {table}_schema (version integer PRIMARY KEY, body json)")
            conn.cursor().executemany(f"INSERT INTO {table}_schema VALUES (%s, %s)", rows)
        try:
            for _ in range(2):
                with pytest.raises(StoreError, match=message):
                    PostgresStore(POSTGRES_URL, table=table)
            with pytest.raises(StoreError, match=message):
                PostgresStore(POSTGRES_URL, table=table, create=False).schema_version()
            with psycopg.connect(POSTGRES_URL) as conn:
                got = conn.execute(f"SELECT version, body::text FROM {table}_schema ORDER BY 1")
                assert got.fetchall() == rows
        finally:
            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_schema")
    else:
        path = tmp_path / "o.db"
        raw = sqlite3.connect(path)
        with raw:
            raw.execute(f"CREATE TABLE {table} ({columns})")
            raw.execute(f"CREATE TABLE {table}_schema (version INTEGER PRIMARY KEY, body TEXT)")
            raw.executemany(f"INSERT INTO {table}_schema VALUES (?, ?)", rows)
        raw.close()
        for _ in range(2):
            with pytest.raises(StoreError, match=message):
                SQLiteStore(path, table=table)
        with pytest.raises(StoreError, match=message):
            SQLiteStore(path, table=table, create=False).schema_version()
        raw = sqlite3.connect(path)
        try:
            kept = raw.execute(f"SELECT version, body FROM {table}_schema ORDER BY 1").fetchall()
            assert kept == rows
            names = {r[0] for r in raw.execute("SELECT name FROM sqlite_master")}
            assert names == {table, f"{table}_schema"}  # nothing made, nothing renamed
        finally:
            raw.close()


def test_sqlite_migration_keeps_the_applications_views_triggers_and_indexes(
    tmp_path: Path,
) -> None:
    # The table was renamed away and rebuilt: SQLite rewrote every view and
    # trigger that named it to name the old table, which was then dropped
    # (the view failed on every read, the trigger and the index were gone).
    path = str(tmp_path / "old.db")
    table = unique_table()
    v1_schema.create_sqlite(path, table)
    app = sqlite3.connect(path, isolation_level=None)
    app.execute(f"CREATE VIEW app_pending AS SELECT id, key FROM {table} WHERE status = 'pending'")
    app.execute("CREATE TABLE app_audit (id INTEGER)")
    app.execute(
        f"CREATE TRIGGER app_audit_insert AFTER INSERT ON {table} "
        "BEGIN INSERT INTO app_audit VALUES (NEW.id); END"
    )
    # Named in another case (SQLite keeps it as written): the same table.
    app.execute(f"CREATE INDEX app_by_type ON {table.upper()} (type, id)")
    app.execute(
        f"CREATE TRIGGER app_audit_update AFTER UPDATE ON {table.capitalize()} "
        "BEGIN INSERT INTO app_audit VALUES (-NEW.id); END"
    )
    pending = app.execute("SELECT id, key FROM app_pending ORDER BY id").fetchall()
    assert pending
    app.close()

    store = SQLiteStore(path, table=table)  # migrated
    try:
        assert store.schema_version() == SCHEMA_VERSION
        app = sqlite3.connect(path, isolation_level=None)
        try:
            assert app.execute("SELECT id, key FROM app_pending ORDER BY id").fetchall() == pending
            (view,) = app.execute("SELECT sql FROM sqlite_master WHERE name = 'app_pending'")
            assert "_v1" not in view[0]
            made = dict(
                app.execute("SELECT name, tbl_name FROM sqlite_master WHERE name LIKE 'app_%'")
            )
            assert {name: tbl.lower() for name, tbl in made.items()} == {
                "app_pending": "app_pending",
                "app_audit": "app_audit",
                "app_audit_insert": table,
                "app_audit_update": table,
                "app_by_type": table,
            }
            with app:
                app.execute("BEGIN")
                new_id = store.enqueue(app, key="k", type="t", payload={})
            assert app.execute("SELECT id FROM app_audit").fetchall() == [(new_id,)]
        finally:
            app.close()
    finally:
        store.close()


def test_sqlite_migration_names_an_index_it_cannot_make_again_and_changes_nothing(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "old.db")
    table = unique_table()
    v1_schema.create_sqlite(path, table)
    app = sqlite3.connect(path, isolation_level=None)
    app.execute(f"CREATE INDEX app_claims ON {table} (claims)")  # a column version 1 had
    app.execute(f"CREATE VIEW app_pending AS SELECT id FROM {table}")
    schema = sorted(app.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))
    app.close()
    with pytest.raises(StoreError, match="the index 'app_claims' on it cannot be made again"):
        SQLiteStore(path, table=table)
    app = sqlite3.connect(path, isolation_level=None)
    try:
        assert sorted(app.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")) == schema
        assert app.execute("SELECT count(*) FROM app_pending").fetchone()[0] > 0
    finally:
        app.close()
