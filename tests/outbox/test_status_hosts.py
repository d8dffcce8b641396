"""The status server's Host check: decided by the address bound, however ``host`` spells
it, and a Host without a port meaning port 80."""

from __future__ import annotations

import errno
import http.client
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbound.outbox import SQLiteStore
from outbound.outbox.web import StatusMonitor, StatusServer

TIMEOUT = 10.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    made = SQLiteStore(tmp_path / "outbox.db")
    try:
        yield made
    finally:
        made.close()


def status(address: str, port: int, host: str) -> int:
    """The HTTP status of ``GET /status.json`` at address:port, sent with ``Host: host``."""
    conn = http.client.HTTPConnection(address, port, timeout=TIMEOUT)
    try:
        conn.putrequest("GET", "/status.json", skip_host=True)
        conn.putheader("Host", host)
        conn.endheaders()
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@pytest.mark.parametrize(
    "spelling", ["127.1", "LOCALHOST", "0x7f000001", "2130706433", "::ffff:127.0.0.1"]
)
def test_a_loopback_address_spelled_otherwise_keeps_the_host_check(
    store: SQLiteStore, spelling: str
) -> None:
    try:
        server = StatusServer(store, host=spelling, port=0)
    except OSError as exc:  # no IPv6 here
        pytest.skip(f"cannot listen on {spelling}: {exc.strerror}")
    address = "::ffff:127.0.0.1" if ":" in spelling else "127.0.0.1"
    with server:
        port = server.port
        assert status(address, port, f"attacker.example:{port}") == 421
        assert status(address, port, f"127.0.0.1:{port}") == 200
        assert status(address, port, f"localhost:{port}") == 200
        assert server.loopback  # so `outbox serve` gives no warning


def test_an_address_others_can_reach_has_no_host_check(store: SQLiteStore) -> None:
    with StatusServer(store, host="0.0.0.0", port=0) as server:
        assert not server.loopback
        assert status("127.0.0.1", server.port, "attacker.example") == 200


def bind_port_80(store: SQLiteStore) -> StatusServer:
    """A server on port 80 of some loopback address; skips where none can be had."""
    monitor = StatusMonitor(store, min_interval=0, max_load=None)
    for address in ("127.0.0.1", "127.80.0.1", "127.80.0.2"):
        try:
            return StatusServer(monitor, host=address, port=80)
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                raise
            reason = f"cannot listen on port 80: {exc.strerror}"
    pytest.skip(reason)


def test_on_port_80_a_host_without_port_is_this_host(store: SQLiteStore) -> None:
    with bind_port_80(store) as server:
        address = server.host
        for host in ("127.0.0.1", "localhost", "LOCALHOST", address, f"{address}:80"):
            assert status(address, 80, host) == 200, host
        for host in ("attacker.example", "attacker.example:80", "127.0.0.1:81", ""):
            assert status(address, 80, host) == 421, host


def test_elsewhere_a_host_without_port_is_refused(store: SQLiteStore) -> None:
    with StatusServer(store, port=0) as server:
        assert status("127.0.0.1", server.port, "127.0.0.1") == 421
        assert status("127.0.0.1", server.port, "localhost") == 421
        assert status("127.0.0.1", server.port, f"127.0.0.1:{server.port}") == 200
