"""Real OS processes sharing one outbox: max_pending, max_concurrency, per-key order, SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import POSTGRES_URL, unique_table, wait_for
from .worker import create_aux_tables, drop_aux_tables, fetch, open_store

WORKER = str(Path(__file__).with_name("worker.py"))


@pytest.fixture(params=["postgres", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        if not POSTGRES_URL:
            pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
        return POSTGRES_URL
    return str(tmp_path / "shared.db")


@pytest.fixture
def table(db: str) -> Iterator[str]:
    name = unique_table()
    store = open_store(db, name)
    create_aux_tables(db, name)
    yield name
    drop_aux_tables(db, name)
    if hasattr(store, "drop_schema"):
        store.drop_schema()
    store.close()


def spawn(*args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def finish(procs: list[subprocess.Popen[str]], timeout: float = 60.0) -> list[str]:
    outs = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        assert proc.returncode == 0, out
        outs.append(out)
    return outs


def enqueue_rows(db: str, table: str, keys: int, per_key: int) -> None:
    store = open_store(db, table, create=False)
    conn: Any = store.connect()  # type: ignore[attr-defined]
    try:
        for n in range(per_key):
            for k in range(keys):
                store.enqueue(conn, key=f"k{k}", type="t", payload={"n": n})
        conn.commit()
    finally:
        conn.close()
        store.close()


def deliveries(db: str, table: str) -> dict[str, list[tuple[int, int]]]:
    """key -> [(n, row_id)] in delivery order."""
    by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, n, row_id in fetch(db, f"SELECT key, n, row_id FROM {table}_log ORDER BY id"):
        by_key[key].append((int(n), int(row_id)))
    return by_key


def unfinished(db: str, table: str) -> int:
    counts = open_store(db, table, create=False).status().counts
    return counts["pending"] + counts["processing"]


@pytest.mark.parametrize("batch", [1, 3])
def test_concurrent_enqueue_never_exceeds_max_pending(db: str, table: str, batch: int) -> None:
    procs = [
        spawn("enqueue", db, table, "--count", 40, "--max-pending", 99, "--batch", batch)
        for _ in range(4)
    ]
    outs = finish(procs)
    accepted = sum(int(out.split()[0].split("=")[1]) for out in outs)
    assert accepted == 99 // batch
    ((pending,),) = fetch(db, f"SELECT count(*) FROM {table} WHERE status = 'pending'")
    assert pending == 99 // batch * batch
    # Every refused enqueue rolled the application's row back with it.
    ((app_rows,),) = fetch(db, f"SELECT count(*) FROM {table}_app")
    assert app_rows == 99 // batch


def test_relay_processes_hold_max_concurrency_and_per_key_order(db: str, table: str) -> None:
    nprocs, keys, per_key = (4, 20, 20) if db == POSTGRES_URL else (2, 8, 10)
    enqueue_rows(db, table, keys, per_key)
    procs = [
        spawn("relay", db, table, "--max-concurrency", 3, "--work", 0.004, "--wait-go")
        for _ in range(nprocs)
    ]
    for proc in procs:  # every process is connected and waiting: start them together
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    finish(procs)
    assert unfinished(db, table) == 0
    ((peak, running),) = fetch(db, f"SELECT peak, running FROM {table}_probe")
    assert 1 <= peak <= 3
    assert running == 0
    by_key = deliveries(db, table)
    assert len(by_key) == keys
    for key, seen in by_key.items():
        assert [n for n, _ in seen] == list(range(per_key)), key  # in order, each once


def test_sigkill_in_the_middle_of_batches_loses_nothing(db: str, table: str) -> None:
    keys, per_key, kills = (10, 30, 3) if db == POSTGRES_URL else (5, 20, 2)
    total = keys * per_key
    enqueue_rows(db, table, keys, per_key)
    in_flight_at_kill: set[int] = set()
    # A kill may land between a relay's write and its next claim (nothing
    # in flight): a few more rounds, until one has landed mid-batch.
    rounds = kills + 3
    for round_ in range(rounds):
        if round_ >= kills and in_flight_at_kill:
            break
        before = len(fetch(db, f"SELECT id FROM {table}_log"))
        proc = spawn("relay", db, table, "--max-concurrency", 4, "--work", 0.01, "--lease", 1.0)
        target = before + total // (rounds + 2)
        wait_for(lambda: len(fetch(db, f"SELECT id FROM {table}_log")) >= target, 30.0)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10.0)
        assert proc.returncode == -signal.SIGKILL, round_
        in_flight_at_kill |= {
            int(r) for (r,) in fetch(db, f"SELECT id FROM {table} WHERE status = 'processing'")
        }
    assert in_flight_at_kill  # the kills did land mid-batch
    finish([spawn("relay", db, table, "--max-concurrency", 4, "--lease", 1.0)])
    assert unfinished(db, table) == 0
    ((sent,),) = fetch(db, f"SELECT count(*) FROM {table} WHERE status = 'sent'")
    assert sent == total
    by_key = deliveries(db, table)
    handled: dict[int, int] = defaultdict(int)
    for key, seen in by_key.items():
        ns = [n for n, _ in seen]
        assert ns == sorted(ns), key  # per-key order holds (a redelivery repeats in place)
        assert set(ns) == set(range(per_key)), key  # none lost
        for _, row_id in seen:
            handled[row_id] += 1
    duplicated = {row_id for row_id, times in handled.items() if times > 1}
    assert duplicated <= in_flight_at_kill
    # The slots of the killed relays came back: a slot still naming a killed
    # relay has an expired lease (free to the next claim); none is live.
    now = (
        "CURRENT_TIMESTAMP" if db == POSTGRES_URL else "((julianday('now') - 2440587.5) * 86400.0)"
    )
    ((held,),) = fetch(
        db, f"SELECT count(*) FROM {table}_slots WHERE owner IS NOT NULL AND expires_at > {now}"
    )
    assert held == 0


def test_sigkill_of_a_relay_holding_rows_it_put_off_loses_nothing(db: str, table: str) -> None:
    # The relay holds a row put off for at most _PARK_AT_MOST itself: claimed,
    # nothing written, its lease renewed in the process. Killed while it
    # holds them (and while rows it put off again are written back, claimed
    # early, held until due), the rows wait out their lease and go out once
    # each, in key order, through the next relay.
    keys, per_key = 6, 3
    enqueue_rows(db, table, keys, per_key)
    proc = spawn("relay", db, table, "--defer", 2.0, "--lease", 1.0)
    deferred: list[int] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("deferred "):
                deferred.append(int(line.split()[1]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(set(deferred)) >= keys, 30.0)  # every key's head is held
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10.0)
        reader.join(10.0)
    assert proc.returncode == -signal.SIGKILL
    held = {int(r) for (r,) in fetch(db, f"SELECT id FROM {table} WHERE status = 'processing'")}
    assert held  # killed while it held rows ...
    assert held <= set(deferred)  # ... that it had put off, and delivered none
    assert fetch(db, f"SELECT id FROM {table}_log") == []
    finish([spawn("relay", db, table, "--lease", 1.0)])
    assert unfinished(db, table) == 0
    by_key = deliveries(db, table)
    assert len(by_key) == keys
    for key, seen in by_key.items():
        assert [n for n, _ in seen] == list(range(per_key)), key  # once each, in order


def test_relays_taking_next_rows_keep_per_key_order_through_a_sigkill(db: str, table: str) -> None:
    # No capacity slots: each write of outcomes also takes the next rows of
    # the keys it finishes. One of three relays is killed mid-batch.
    if db != POSTGRES_URL:
        pytest.skip("only the PostgreSQL store takes next rows with its outcomes")
    keys, per_key = 15, 20
    enqueue_rows(db, table, keys, per_key)
    procs = [spawn("relay", db, table, "--work", 0.002, "--lease", 1.0) for _ in range(3)]
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
    wait_for(lambda: len(fetch(db, f"SELECT id FROM {table}_log")) >= keys * per_key // 3, 30.0)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].communicate(timeout=10.0)
    in_flight_at_kill = {
        int(r) for (r,) in fetch(db, f"SELECT id FROM {table} WHERE status = 'processing'")
    }
    finish(procs[1:])
    assert unfinished(db, table) == 0
    by_key = deliveries(db, table)
    assert len(by_key) == keys
    for key, seen in by_key.items():
        ns = [n for n, _ in seen]
        assert ns == sorted(ns), key  # per-key order holds (a redelivery repeats in place)
        assert set(ns) == set(range(per_key)), key  # none lost
    handled: dict[int, int] = defaultdict(int)
    for seen in by_key.values():
        for _, row_id in seen:
            handled[row_id] += 1
    assert {row_id for row_id, times in handled.items() if times > 1} <= in_flight_at_kill
