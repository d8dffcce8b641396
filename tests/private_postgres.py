"""A PostgreSQL server of a test module's own, for tests that stall or stop a whole server.

``initdb`` in a temporary directory, started on a free port, stopped and
removed afterwards. A test that holds a server-wide resource (the WAL
writer, or the WAL write lock of a process paused in its commit) runs on
one of these, so that tests running beside it on the shared server never
wait on what it holds.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path("/usr/lib/postgresql/15/bin")


@dataclass
class PrivatePostgres:
    url: str
    #: Stop the WAL writer until the next restart.
    hold_wal_writer: Callable[[], None]
    #: ``pg_ctl stop -m immediate``, then start again (a held WAL writer never runs).
    restart: Callable[[], None]
    #: Send a signal to the server and all its processes (SIGSTOP: a hung host).
    signal_all: Callable[[int], None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def private_server(settings: str = "") -> Iterator[PrivatePostgres]:
    """Start a server of its own with the extra ``-c`` ``settings``; skip the
    test without the server binaries or the rights to run them."""
    import psycopg  # noqa: PLC0415 - only where PostgreSQL is tested

    if not (BIN / "initdb").exists() or shutil.which("runuser") is None:
        pytest.skip(f"no PostgreSQL server binaries in {BIN} (or no runuser)")
    if os.geteuid() != 0:
        pytest.skip("starting a private PostgreSQL needs root (to run it as 'postgres')")
    home = Path(tempfile.mkdtemp(prefix="outbound-pg-"))
    shutil.chown(home, "postgres")
    data, port = home / "data", _free_port()
    options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1 {settings}"

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
            found = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'"
            ).fetchone()
        assert found is not None
        os.kill(found[0], signal.SIGSTOP)
        held.append(found[0])

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

    def signal_all(signum: int) -> None:
        postmaster = int((data / "postmaster.pid").read_text().split()[0])
        children = subprocess.run(
            ["pgrep", "-P", str(postmaster)], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in [postmaster, *map(int, children)]:
            os.kill(pid, signum)

    try:
        yield PrivatePostgres(url, hold_wal_writer, restart, signal_all)
    finally:
        for pid in held:
            os.kill(pid, signal.SIGKILL)
        with suppress(OSError, ValueError, IndexError):
            signal_all(signal.SIGCONT)  # a stopped server would not stop
        pg_ctl("-m", "immediate", "stop")
        shutil.rmtree(home, ignore_errors=True)
