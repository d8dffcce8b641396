"""A private PostgreSQL server restarted with ``-m immediate`` under a running relay.

The server is this module's own (``initdb`` in a temporary directory, on a
free port), never the shared one. So that the test decides what a crash
loses, it runs without background writer or autovacuum, and its WAL writer
can be held (SIGSTOP) for a while: what a relay commits asynchronously
meanwhile is then flushed by nothing but a synchronous commit, and an
immediate restart loses it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay

from .conftest import unique_table, wait_for

psycopg = pytest.importorskip("psycopg")

BIN = Path("/usr/lib/postgresql/15/bin")


@dataclass
class PrivatePostgres:
    url: str
    #: Stop the WAL writer until the next restart.
    hold_wal_writer: Callable[[], None]
    #: ``pg_ctl stop -m immediate``, then start again (a held WAL writer never runs).
    restart: Callable[[], None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of this module's own; skipped without the binaries."""
    if not (BIN / "initdb").exists() or shutil.which("runuser") is None:
        pytest.skip(f"no PostgreSQL server binaries in {BIN} (or no runuser)")
    if os.geteuid() != 0:
        pytest.skip("starting a private PostgreSQL needs root (to run it as 'postgres')")
    home = Path(tempfile.mkdtemp(prefix="outbound-pg-"))
    shutil.chown(home, "postgres")
    data, port = home / "data", _free_port()
    options = (
        f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c wal_writer_delay=10000 -c bgwriter_lru_maxpages=0 -c autovacuum=off"
    )

    def run(*argv: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *argv],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def pg_ctl(*argv: str) -> None:
        run(str(BIN / "pg_ctl"), "-D", str(data), "-l", str(home / "log"), "-w", *argv)

    try:
        run(str(BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync")
        pg_ctl("-o", options, "start")
    except (subprocess.SubprocessError, OSError) as exc:
        shutil.rmtree(home, ignore_errors=True)
        pytest.skip(f"cannot start a private PostgreSQL server: {exc}")
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    held: list[int] = []

    def hold_wal_writer() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            (pid,) = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'"
            ).fetchone()
        os.kill(pid, signal.SIGSTOP)
        held.append(pid)

    def restart() -> None:
        postmaster = int((data / "postmaster.pid").read_text().split()[0])
        pg_ctl("-m", "immediate", "-W", "stop")
        for pid in held:  # it would flush on waking: it dies without running again
            os.kill(pid, signal.SIGKILL)
        held.clear()
        deadline = time.monotonic() + 30.0
        while _alive(postmaster):
            assert time.monotonic() < deadline, "the private server did not stop"
            time.sleep(0.01)
        pg_ctl("-o", options, "start")

    try:
        yield PrivatePostgres(url, hold_wal_writer, restart)
    finally:
        for pid in held:
            os.kill(pid, signal.SIGKILL)
        pg_ctl("-m", "immediate", "stop")
        shutil.rmtree(home, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_lost_outcome_is_delivered_again_without_waiting_out_its_lease(
    private_postgres: PrivatePostgres,
) -> None:
    url = private_postgres.url
    # The relay opts in to asynchronous commit: what it commits while the
    # WAL writer is held is lost by the crash.
    store = PostgresStore(f"{url}?options=-c%20synchronous_commit%3Doff", table=unique_table())
    first_may_finish = threading.Event()
    busy_may_finish = threading.Event()
    seen: list[int] = []
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            seen.append(message.payload)
        if message.payload == 1 and len(seen) <= 2:
            assert first_may_finish.wait(10.0)
        if message.payload == 0:  # keeps the relay busy, renewing its leases, throughout
            assert busy_may_finish.wait(30.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    with store.connect() as conn:
        first, second, busy = store.enqueue_many(
            conn,
            [
                {"key": "k", "type": "t", "payload": 1},
                {"key": "k", "type": "t", "payload": 2},
                {"key": "busy", "type": "t", "payload": 0},
            ],
        )
    relay = Relay(store, bus, poll_interval=0.05, lease=6.0, listen=False).start()
    try:
        wait_for(lambda: sorted(seen) == [0, 1])
        # The claim is made durable (a synchronous commit flushes the WAL
        # before it) ...
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("CREATE TABLE IF NOT EXISTS flush (x int)")
        # ... but not the outcomes written after it.
        private_postgres.hold_wal_writer()
        first_may_finish.set()
        wait_for(lambda: seen.count(2) == 1)
        wait_for(lambda: store.get(second).status == "sent")  # type: ignore[union-attr]
        private_postgres.restart()
        # The server lost the outcomes: the row went back to processing
        # under this relay, which is busy and renewing, for seconds more.
        # The relay reconnects, releases the row it no longer tracks, and
        # delivers it again, then the row behind it.
        wait_for(lambda: seen.count(2) == 2, timeout=3.0)
        wait_for(lambda: store.get(second).status == "sent", timeout=3.0)  # type: ignore[union-attr]
        assert relay.stats().released == 1
        assert seen[:2] == [0, 1] or seen[:2] == [1, 0]
        assert seen[2:] == [2, 1, 2]
        assert store.get(first).attempts == 2  # type: ignore[union-attr]  # claimed again
        busy_may_finish.set()
        wait_for(lambda: store.get(busy).status == "sent")  # type: ignore[union-attr]
    finally:
        first_may_finish.set()
        busy_may_finish.set()
        assert relay.stop(10.0)
        store.close()
