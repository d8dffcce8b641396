"""Outbox fixtures: one store factory per backend, each test on its own table or file."""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from outbound.outbox import EventBus, OutboxMessage, PostgresStore, SQLiteStore, Store

POSTGRES_URL = os.environ.get("OUTBOUND_TEST_POSTGRES")
_names = itertools.count()

StoreFactory = Callable[..., Store]


def unique_table() -> str:
    return f"t_{os.getpid()}_{next(_names)}_{uuid.uuid4().hex[:6]}"


def app_connection(store: Store) -> Any:
    """A connection of the application's own, in its default transaction mode."""
    if isinstance(store, SQLiteStore):
        return store.connect()
    assert isinstance(store, PostgresStore)
    return store.connect()


def run_committed(store: Store, sql: str) -> None:
    """Run ``sql`` on an application's connection to the store's database, and commit."""
    conn = app_connection(store)
    try:
        conn.execute(sql)
        conn.commit()
    finally:
        conn.close()


def rename_table(store: Store, old: str, new: str) -> None:
    """The outbox table goes away (or comes back) under its store: a real failure."""
    run_committed(store, f"ALTER TABLE {old} RENAME TO {new}")


def enqueue_keys(store: Store, *keys: str, type: str = "t") -> list[int]:
    """One row of ``type`` per key (payload ``{"k": key}``), committed together; their ids."""
    conn = app_connection(store)
    try:
        ids = [store.enqueue(conn, key=k, type=type, payload={"k": k}) for k in keys]
        conn.commit()
        return ids
    finally:
        conn.close()


def attempts_bus() -> tuple[EventBus, list[tuple[int, int]]]:
    """A bus whose handler of type "t" records (row id, attempt) per delivery."""
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            seen.append((message.id, message.attempt))

    bus = EventBus()
    bus.subscribe("t", handler)
    return bus, seen


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, every: float = 0.02) -> None:
    """Poll ``predicate`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(every)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "postgres" and not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    return str(request.param)


@pytest.fixture
def make_store(backend: str, tmp_path: Path) -> Iterator[StoreFactory]:
    """Build stores of ``backend``, each on a fresh table; dropped and closed afterwards."""
    made: list[Store] = []

    def factory(**options: Any) -> Store:
        options.setdefault("table", unique_table())
        store: Store
        if backend == "sqlite":
            store = SQLiteStore(tmp_path / "outbox.db", **options)
        else:
            assert POSTGRES_URL
            store = PostgresStore(POSTGRES_URL, **options)
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()
        if isinstance(store, PostgresStore):
            store.drop_schema()


@pytest.fixture
def store(make_store: StoreFactory) -> Store:
    return make_store()
