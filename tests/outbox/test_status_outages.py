"""The status page while its database fails: a failed reading is shared by the requests
waiting for it and served again like a snapshot, so a failing database is read no more
often than a working one, and the page recovers at the next reading after it is back."""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbound.errors import StoreError
from outbound.outbox import PostgresStore, SQLiteStore, Store
from outbound.outbox.web import StatusMonitor, StatusServer

from .conftest import POSTGRES_URL, enqueue_keys, rename_table, unique_table, wait_for

TIMEOUT = 30.0


def count_readings(store: Store) -> Callable[[], int]:
    """Count the monitor's readings: each starts with ``store.throughput``."""
    calls = 0
    lock = threading.Lock()
    original = store.throughput

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        with lock:
            calls += 1
        return original(*args, **kwargs)

    store.throughput = counted  # type: ignore[method-assign]

    def readings() -> int:
        with lock:
            return calls

    return readings


def outcome(monitor: StatusMonitor) -> str:
    """ "ok", or the error the snapshot raised."""
    try:
        monitor.snapshot()
    except StoreError as exc:
        return str(exc)
    return "ok"


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The monitor's warnings: "failing" or "back", in order."""
    return [
        "failing" if "cannot be read:" in r.getMessage() else "back"
        for r in caplog.records
        if r.name == "outbound.outbox.web" and r.levelno == logging.WARNING
    ]


def test_a_failed_reading_is_shared_and_served_again(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="outbound.outbox.web")
    enqueue_keys(store, "a")
    readings = count_readings(store)
    monitor = StatusMonitor(store, min_interval=60, max_load=None)
    away = f"{store.table}_away"
    rename_table(store, store.table, away)
    try:
        barrier = threading.Barrier(8)
        seen: list[str] = []

        def view() -> None:
            barrier.wait(timeout=TIMEOUT)
            seen.append(outcome(monitor))

        threads = [threading.Thread(target=view) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert not any(thread.is_alive() for thread in threads)
        assert len(seen) == 8
        assert seen[0] != "ok"
        assert set(seen) == {seen[0]}  # one error for every viewer
        assert readings() == 1  # one reading for all of them
        # Back, but the failure is served until it is stale, as a snapshot is.
        rename_table(store, away, store.table)
        away = store.table
        assert outcome(monitor) == seen[0]
        assert readings() == 1
    finally:
        if away != store.table:
            rename_table(store, away, store.table)
    assert warnings(caplog) == ["failing"]


def test_a_failing_database_is_read_at_most_once_an_interval_and_recovers(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="outbound.outbox.web")
    enqueue_keys(store, "a")
    interval = 0.2
    monitor = StatusMonitor(store, min_interval=interval, max_load=None)
    readings = count_readings(store)
    assert monitor.snapshot().counts["pending"] == 1
    away = f"{store.table}_away"
    rename_table(store, store.table, away)
    try:
        wait_for(lambda: outcome(monitor) != "ok", timeout=TIMEOUT)
        before, started = readings(), time.monotonic()
        for _ in range(50):
            with pytest.raises(StoreError):
                monitor.snapshot()
        elapsed = time.monotonic() - started
        # Readings in [started, now] are at least `interval` apart.
        assert readings() - before <= 1 + elapsed / interval
    finally:
        rename_table(store, away, store.table)
    wait_for(lambda: outcome(monitor) == "ok", timeout=TIMEOUT)
    assert monitor.snapshot().counts["pending"] == 1
    assert warnings(caplog) == ["failing", "back"]


# ------------------------------------------------- a database that stops answering


@pytest.fixture
def slow_store() -> Iterator[PostgresStore]:
    """A PostgreSQL store whose admin reads give up after 3 x connect_timeout = 3 s."""
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    store = PostgresStore(POSTGRES_URL, table=unique_table(), connect_timeout=1)
    try:
        yield store
    finally:
        store.close()
        store.drop_schema()


def test_concurrent_pages_share_one_slow_failure(slow_store: PostgresStore) -> None:
    """A table locked away: the requests waiting for that reading get its 503 together,
    not one deadline after another."""
    enqueue_keys(slow_store, "a")
    readings = count_readings(slow_store)
    locker = slow_store.connect()
    results: list[tuple[int, str, float]] = []
    lock = threading.Lock()
    with StatusServer(StatusMonitor(slow_store, min_interval=60), port=0) as server:
        try:
            locker.execute(f"LOCK TABLE {slow_store.table} IN ACCESS EXCLUSIVE MODE")
            barrier = threading.Barrier(5)

            def view() -> None:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
                try:
                    barrier.wait(timeout=TIMEOUT)
                    conn.request("GET", "/status.json")
                    response = conn.getresponse()
                    body = json.loads(response.read())
                    with lock:
                        results.append((response.status, body.get("error"), time.monotonic()))
                finally:
                    conn.close()

            threads = [threading.Thread(target=view) for _ in range(5)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(2 * TIMEOUT)
            assert not any(thread.is_alive() for thread in threads)
        finally:
            locker.rollback()
            locker.close()
    assert len(results) == 5
    assert {status for status, _, _ in results} == {503}
    assert len({error for _, error, _ in results}) == 1
    # One reading, which gives up after 3 s; before the fix, each waiter read
    # again after the one before it gave up.
    assert readings() == 1


def test_a_slow_failure_is_not_held_for_ten_times_its_wait(slow_store: PostgresStore) -> None:
    """A failure that waited 3 s for a lock is held like the last snapshot (its cost is
    what readings cost), not 3 s / max_load = 30 s: the page is back soon after the
    database is."""
    enqueue_keys(slow_store, "a")
    monitor = StatusMonitor(slow_store, min_interval=0.5, max_load=0.1)
    cost = monitor.snapshot().took
    locker = slow_store.connect()
    try:
        locker.execute(f"LOCK TABLE {slow_store.table} IN ACCESS EXCLUSIVE MODE")
        wait_for(lambda: outcome(monitor) != "ok", timeout=TIMEOUT)  # waits 3 s for the lock
    finally:
        locker.rollback()
        locker.close()
    # Held for max(min_interval, cost / max_load), then read again.
    wait_for(lambda: outcome(monitor) == "ok", timeout=max(0.5, cost / 0.1) + 15)


def test_a_failure_raised_again_is_a_new_store_error_chained_to_the_drivers(
    tmp_path: Any,
) -> None:
    store = SQLiteStore(tmp_path / "x.db")
    (tmp_path / "x.db").unlink()
    monitor = StatusMonitor(store, min_interval=60, max_load=None)
    with pytest.raises(StoreError) as first:
        monitor.snapshot()
    with pytest.raises(StoreError) as again:
        monitor.snapshot()
    assert again.value is not first.value
    assert str(again.value) == str(first.value)
    assert again.value.__cause__ is first.value.__cause__
