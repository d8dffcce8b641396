"""The Flask status blueprint given a function returning a store: called once per app, its
store and one monitor shared by every request (no store, nor connection, per request)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

flask = pytest.importorskip("flask", reason="Flask is not installed: pip install '.[flask]'")
psycopg = pytest.importorskip("psycopg")

from outbound.contrib.flask_status import status_blueprint  # noqa: E402
from outbound.outbox import PostgresStore, SQLiteStore, Store  # noqa: E402

from .conftest import POSTGRES_URL, enqueue_keys, unique_table  # noqa: E402

TIMEOUT = 30.0


def test_a_store_function_is_called_once_and_holds_one_connection() -> None:
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    table = unique_table()
    name = f"outbound-test-{uuid.uuid4().hex[:8]}"  # tells this test's connections apart
    url = f"{POSTGRES_URL}{'&' if '?' in POSTGRES_URL else '?'}application_name={name}"
    owner = PostgresStore(POSTGRES_URL, table=table)
    made: list[PostgresStore] = []

    def factory() -> Store:
        store = PostgresStore(url, table=table, create=False)
        made.append(store)
        return store

    def connections() -> int:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
            ).fetchone()
            assert row is not None
            return int(row[0])

    try:
        enqueue_keys(owner, "a", "b")
        app = flask.Flask("ops")
        app.register_blueprint(status_blueprint(factory, authorize=None), url_prefix="/ops")
        client = app.test_client()
        first = client.get("/ops/status.json")
        assert first.status_code == 200
        assert json.loads(first.data)["counts"]["pending"] == 2
        held = connections()
        for _ in range(20):
            assert client.get("/ops/status.json").status_code == 200
            assert client.get("/ops/").status_code == 200
        assert connections() == held  # not one more per request
        assert len(made) == 1
    finally:
        for store in made:
            store.close()
        owner.drop_schema()
        owner.close()


@pytest.fixture
def two_outboxes(tmp_path: Path) -> Iterator[tuple[SQLiteStore, SQLiteStore]]:
    one, two = SQLiteStore(tmp_path / "one.db"), SQLiteStore(tmp_path / "two.db")
    try:
        yield one, two
    finally:
        one.close()
        two.close()


def test_a_store_function_is_called_once_per_app(
    two_outboxes: tuple[SQLiteStore, SQLiteStore],
) -> None:
    """One blueprint on two apps: each app's outbox, its function called once however many
    requests come at first."""
    one, two = two_outboxes
    enqueue_keys(one, "a")
    enqueue_keys(two, "a", "b")
    calls: list[str] = []
    lock = threading.Lock()

    def factory() -> Store:
        store: SQLiteStore = flask.current_app.config["OUTBOX"]
        with lock:
            calls.append(flask.current_app.name)
        return store

    blueprint = status_blueprint(factory, authorize=None)
    apps = []
    for app_name, store in (("one", one), ("two", two)):
        app = flask.Flask(app_name)
        app.config["OUTBOX"] = store
        app.register_blueprint(blueprint, url_prefix="/ops")
        apps.append(app)
    barrier = threading.Barrier(8)
    pending: list[tuple[str, int]] = []

    def view(app: Any) -> None:
        client = app.test_client()
        barrier.wait(timeout=TIMEOUT)
        data = json.loads(client.get("/ops/status.json").data)
        with lock:
            pending.append((app.name, data["counts"]["pending"]))

    threads = [threading.Thread(target=view, args=(apps[i % 2],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(calls) == ["one", "two"]
    assert sorted(set(pending)) == [("one", 1), ("two", 2)]
    assert len(pending) == 8


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_fork_while_the_store_function_runs_leaves_the_child_working(tmp_path: Path) -> None:
    """The lock held while the function built the store (in another thread) was copied
    held into a child forked meanwhile: every status request of the child waited."""
    import os  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    store = SQLiteStore(tmp_path / "o.db")
    enqueue_keys(store, "a")
    inside, release = threading.Event(), threading.Event()
    first: list[threading.Thread] = []

    def factory() -> Store:
        if not first:
            first.append(threading.current_thread())
            inside.set()
            assert release.wait(TIMEOUT)  # the parent's first request, held
        return store

    app = flask.Flask("ops")
    app.register_blueprint(status_blueprint(factory, authorize=None), url_prefix="/ops")
    worker = threading.Thread(target=lambda: app.test_client().get("/ops/status.json"))
    worker.start()
    try:
        assert inside.wait(TIMEOUT)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded fork"
            pid = os.fork()
        if pid == 0:  # the child: its own request, within a bound
            code = 1
            try:
                done = threading.Event()
                answer: list[int] = []

                def ask() -> None:
                    answer.append(app.test_client().get("/ops/status.json").status_code)
                    done.set()

                threading.Thread(target=ask, daemon=True).start()
                code = 0 if done.wait(10.0) and answer == [200] else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        worker.join(TIMEOUT)
        store.close()
