"""A relay process stopped (SIGSTOP) at the worst moment must not stop the others.

A relay that stalls (a GC pause, a frozen VM, a lost host) keeps the rows it
leased until their leases end; every other row keeps flowing through the
other relays. The stop is aimed at a moment when the stalled relay's
database session is inside a transaction or holds an advisory lock, if it
ever is (a relay of this version never is between statements).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import POSTGRES_URL, unique_table
from .worker import create_aux_tables, drop_aux_tables, fetch, open_store

WORKER = str(Path(__file__).with_name("worker.py"))

#: Does a session of this application hold an advisory lock right now (the
#: worst moment to stop a relay that takes one), or sit idle in a
#: transaction (the worst moment for any other)?
HOLDING = """
    SELECT coalesce(max(CASE WHEN EXISTS (SELECT 1 FROM pg_locks AS l
                                          WHERE l.pid = a.pid AND l.locktype = 'advisory'
                                            AND l.granted) THEN 2
                             WHEN a.state = 'idle in transaction' THEN 1
                             ELSE 0 END), 0)
    FROM pg_stat_activity AS a WHERE a.application_name = %s
"""


WHERE = ("stopped anywhere", "stopped in a transaction", "stopped holding a lock")


@pytest.fixture
def table() -> Iterator[str]:
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    name = unique_table()
    store = open_store(POSTGRES_URL, name)
    create_aux_tables(POSTGRES_URL, name)
    yield name
    drop_aux_tables(POSTGRES_URL, name)
    store.drop_schema()
    store.close()


def holding(admin: Any, name: str) -> int:
    return int(admin.execute(HOLDING, (name,)).fetchone()[0])


def still(admin: Any, name: str, level: int) -> bool:
    """Whether a stopped process's session stays at ``level`` (a COMMIT it had already
    sent when the signal landed ends its transaction just after)."""
    deadline = time.monotonic() + 0.1
    while time.monotonic() < deadline:
        if holding(admin, name) < level:
            return False
    return True


def aim(admin: Any, proc: subprocess.Popen[str], name: str) -> int:
    """SIGSTOP ``proc`` while its session holds a lock (2) or a transaction (1), if it
    does within a second; else anywhere (0). Returns where it was caught."""
    for level, within in ((2, 1.0), (1, 0.5)):
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if holding(admin, name) >= level:
                proc.send_signal(signal.SIGSTOP)
                if still(admin, name, level):
                    return level
                proc.send_signal(signal.SIGCONT)
    proc.send_signal(signal.SIGSTOP)
    return 0


def delivered_by(table: str) -> dict[int, int]:
    assert POSTGRES_URL
    return {
        int(pid): int(n)
        for pid, n in fetch(POSTGRES_URL, f"SELECT pid, count(*) FROM {table}_log GROUP BY pid")
    }


def free_rows(table: str, pid: int) -> int:
    """Rows not yet delivered whose keys the relay process ``pid`` holds no row of."""
    assert POSTGRES_URL
    ((n,),) = fetch(
        POSTGRES_URL,
        f"""
        SELECT count(*) FROM {table} AS o
        WHERE o.id NOT IN (SELECT row_id FROM {table}_log)
          AND o.key NOT IN (SELECT h.key FROM {table} AS h
                            WHERE h.status = 'processing' AND h.lease_owner LIKE %s)
        """,
        f"%:{pid}:%",
    )
    return int(n)


def test_one_stopped_relay_does_not_stop_the_others(table: str) -> None:
    import psycopg  # noqa: PLC0415

    assert POSTGRES_URL
    # Enough rows that the stop, aimed for up to 1.5 s, lands well before the end.
    keys, per_key = 150, 24
    store = open_store(POSTGRES_URL, table, create=False)
    with store.connect() as conn:  # type: ignore[attr-defined]
        store.enqueue_many(
            conn,
            [
                {"key": f"k{k}", "type": "t", "payload": {"n": n}}
                for n in range(per_key)
                for k in range(keys)
            ],
        )
    store.close()
    names = [f"stall_{table}_{i}" for i in range(3)]
    sep = "&" if "?" in POSTGRES_URL else "?"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                "relay",
                f"{POSTGRES_URL}{sep}application_name={name}",
                table,
                "--lease",
                "30",
                "--work",
                "0.002",
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        for name in names
    ]
    stopped = procs[0]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "started"
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            caught = aim(admin, stopped, names[0])
        others = [p.pid for p in procs[1:]]
        before = sum(delivered_by(table).get(pid, 0) for pid in others)
        total = keys * per_key
        # The others go on while the first relay stays stopped (it stays
        # stopped until the end of this test, so a generous deadline costs
        # nothing when they do and catches them waiting when they do not):
        # at least a tenth of the rows, or all that are left of the keys
        # it does not hold (those wait out its 30 s leases).
        free = free_rows(table, stopped.pid)
        wanted = before + min(total // 10, free)
        deadline = time.monotonic() + 15.0
        while sum(delivered_by(table).get(pid, 0) for pid in others) < wanted:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the other relays delivered "
                    f"{sum(delivered_by(table).get(pid, 0) for pid in others) - before} rows in "
                    f"15s while one relay was stopped ({WHERE[caught]}; {free} rows of "
                    "keys it did not hold were left)"
                )
            time.sleep(0.02)
    finally:
        stopped.send_signal(signal.SIGCONT)
        outs = []
        for proc in procs:
            try:
                outs.append(proc.communicate(timeout=60.0)[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    assert all(proc.returncode == 0 for proc in procs), outs
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, n in fetch(POSTGRES_URL, f"SELECT key, n FROM {table}_log ORDER BY id"):
        by_key[key].append(int(n))
    assert len(by_key) == keys
    for key, ns in by_key.items():
        assert ns == list(range(per_key)), key  # each once, in order
