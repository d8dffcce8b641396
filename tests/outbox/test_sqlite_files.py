"""SQLite outbox files: inspecting leaves a file as it is; any spelling of a path works."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from outbound.outbox import Relay, SQLiteStore
from outbound.outbox.cli import main

from .conftest import attempts_bus, enqueue_keys, wait_for


def _journal_mode(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])
    finally:
        conn.close()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_inspecting_a_rollback_journal_file_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An outbox file another tool left in rollback-journal mode: reading it,
    # by the store's methods or the command line, must not switch it to WAL.
    path = tmp_path / "outbox.db"
    store = SQLiteStore(path)
    enqueue_keys(store, "a", "b", "a")
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode = DELETE").fetchone()[0] == "delete"
    conn.close()
    before = _digest(path)

    inspector = SQLiteStore(path, create=False)
    assert inspector.schema_version() is not None
    inspector.check_schema()
    assert inspector.status().counts["pending"] == 3
    assert len(inspector.rows()) == 3
    assert inspector.get(1) is not None
    inspector.blocked()
    inspector.leases()
    inspector.throughput()
    inspector.slots()
    for command in ("status", "list", "blocked"):
        assert main(["outbox", "--db", str(path), command]) == 0, capsys.readouterr().err

    assert _journal_mode(path) == "delete"
    assert _digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outbox.db"]


def test_writing_puts_the_file_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    store = SQLiteStore(path)
    enqueue_keys(store, "a")
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()
    assert SQLiteStore(path, create=False).purge(statuses=["sent"]) == 0
    assert _journal_mode(path) == "wal"


def test_a_path_that_starts_with_two_slashes_is_relayed(tmp_path: Path) -> None:
    # POSIX reads "//x" as "/x"; a file: URI would read "x" as a host name.
    path = "/" + str(tmp_path / "outbox.db")
    assert path.startswith("//")
    store = SQLiteStore(path)
    enqueue_keys(store, "a", "b")
    assert store.status().counts["pending"] == 2
    bus, seen = attempts_bus()
    relay = Relay(store, bus, poll_interval=0.05)
    relay.start()
    try:
        wait_for(lambda: len(seen) == 2)
    finally:
        relay.stop(10.0)
    assert store.status().counts["sent"] == 2
    assert (tmp_path / "outbox.db").exists()
