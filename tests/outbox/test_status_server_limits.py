"""The status server and monitor at their limits: a request that trickles in, more
connections than it serves, clients that arrive together, a reading that waited for
a lock, more blocked keys than listed, a prefix in front of it, a server that froze."""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbound.errors import StoreError
from outbound.outbox import SQLiteStore
from outbound.outbox._base import Outcome
from outbound.outbox.web import StatusMonitor, StatusServer, render_page
from outbound.outbox.web import _monitor as web_monitor
from outbound.outbox.web import _server as web_server

TIMEOUT = 10.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    made = SQLiteStore(tmp_path / "outbox.db")
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def monitor_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The status monitor's clock, ahead of time.monotonic() by the list's one item,
    which a test moves on (a reading's wait, the time between pages' asks)."""
    offset = [0.0]

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + offset[0]

    monkeypatch.setattr(web_monitor, "time", Clock)
    return offset


def wait_for(predicate: Any, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.01)
    return True


def get(port: int, path: str = "/status.json") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_request_that_trickles_in_is_dropped(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit is on the whole request, not on each read: a client sending a byte
    every 50 ms (each read well within the socket timeout) is dropped."""
    monkeypatch.setattr(web_server, "_REQUEST_TIMEOUT", 0.5)
    with StatusServer(store, port=0) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
        with sock:
            request = b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
            started = time.monotonic()
            dropped = False
            for byte in request:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    dropped = True
                    break
                readable, _, _ = select.select([sock], [], [], 0.05)  # the client's pace
                if readable:
                    try:
                        dropped = sock.recv(1024) == b""  # closed, no answer
                    except OSError:
                        dropped = True
                    break
                if time.monotonic() - started > 5.0:
                    break
            assert dropped, "a client trickling its request was still served 5 s on"
        assert get(server.port)[0] == 200  # others are served meanwhile and after


def test_connections_past_the_cap_are_closed_at_once(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(web_server, "_MAX_CONNECTIONS", 3)
    with StatusServer(store, port=0) as server:
        idle = [
            socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) for _ in range(3)
        ]
        try:
            assert wait_for(lambda: server._httpd.open_connections() == 3)
            extra = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
            with extra:
                assert extra.recv(1024) == b""  # closed at once, not held
        finally:
            for sock in idle:
                sock.close()
        assert wait_for(lambda: server._httpd.open_connections() == 0)
        assert get(server.port)[0] == 200


def test_clients_that_arrive_together_are_all_taken(store: SQLiteStore) -> None:
    """Forty connects before the server accepts one: each is queued by the kernel,
    none dropped to be retried a second later (the listen backlog)."""
    server = StatusServer(store, port=0)  # bound and listening, not serving yet
    sockets: list[socket.socket] = []
    try:
        for _ in range(40):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.settimeout(0.5)  # a dropped connect is retried by the kernel after 1 s
            sock.connect(("127.0.0.1", server.port))
    finally:
        for sock in sockets:
            sock.close()
        server.close()


def test_a_reading_that_waited_does_not_freeze_the_page(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch, monitor_clock: list[float]
) -> None:
    """A reading that took longer than the last one mostly waited (for a lock, for
    the connection a restart dropped) and did not keep the database busy: it is not
    served again for ten times its length (max_load), so new rows show soon. The
    monitor's clock is moved on by 2.5 s during the second reading, as a wait would."""
    offset = monitor_clock
    monitor = StatusMonitor(store, min_interval=1.0, max_load=0.1)
    first = monitor.snapshot()  # a quick reading first
    assert first.counts["pending"] == 0
    # Past min_interval, and past the first reading's own time / max_load (a
    # loaded machine makes even a quick reading take a few tenths of a second).
    past = max(1.1, first.took / 0.1 + 0.1)
    assert past < 25.0, f"the first reading took {first.took:.2f} s: too slow to tell"
    offset[0] += past
    read = monitor._read

    def waited() -> Any:
        offset[0] += 2.5  # the wait
        return read()

    monkeypatch.setattr(monitor, "_read", waited)
    assert monitor.snapshot().took >= 2.5
    monkeypatch.setattr(monitor, "_read", read)
    conn = store.connect()
    for i in range(3):
        store.enqueue(conn, key=f"k{i}", type="t", payload={})
    conn.commit()
    conn.close()
    offset[0] += past  # not past the second reading's took / max_load (25 s)
    assert monitor.snapshot().counts["pending"] == 3


def test_a_database_down_at_the_start_is_read_again_soon(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch, monitor_clock: list[float]
) -> None:
    """A first reading that failed after waiting (a pool timeout) is not kept for ten
    times its wait: with no success yet, it counts no time, and the page reads
    again once min_interval passed."""
    offset = monitor_clock
    monitor = StatusMonitor(store, min_interval=1.0, max_load=0.1)
    read = monitor._read

    def down() -> Any:
        offset[0] += 10.0  # waited for a connection, then failed
        raise StoreError("cannot connect")

    monkeypatch.setattr(monitor, "_read", down)
    with pytest.raises(StoreError):
        monitor.snapshot()
    monkeypatch.setattr(monitor, "_read", read)
    offset[0] += 1.1  # past min_interval: not past 10 s / max_load
    assert monitor.snapshot().counts["pending"] == 0


@pytest.mark.parametrize(("keys", "more"), [(20, False), (30, True)])
def test_more_blocked_keys_than_listed_are_said_to_be_more(
    store: SQLiteStore, keys: int, more: bool
) -> None:
    conn = store.connect()
    for i in range(keys):
        store.enqueue(conn, key=f"chat-{i}", type="t", payload={})
    conn.commit()
    conn.close()
    session = store.session()
    claimed = session.claim("relay-a", keys, 30.0, None)
    # Every head failed and backs off for ten minutes: every key is held up.
    outcomes = [
        Outcome(c.message.id, c.token, c.message.key, "retry", error="429", delay=600)
        for c in claimed
    ]
    session.finish("relay-a", outcomes)
    session.close()
    snapshot = StatusMonitor(store, blocked_limit=20).snapshot()
    assert len(snapshot.blocked) == 20
    assert snapshot.blocked_more is more
    page = render_page(snapshot)
    heading = 'Blocked keys <span class="count">' + ("20+" if more else "20") + "</span>"
    assert heading in page
    assert ("more keys are blocked" in page) is more
    with StatusServer(StatusMonitor(store, blocked_limit=20), port=0) as server:
        status, body = get(server.port)
        assert status == 200
        answer = json.loads(body)
        assert len(answer["blocked"]) == 20
        assert answer["blocked_more"] is more


def test_the_json_link_is_relative_so_a_prefix_is_kept(store: SQLiteStore) -> None:
    with StatusServer(store, port=0) as server:
        status, body = get(server.port, "/")
        assert status == 200
        assert b'href="status.json"' in body
        assert b'href="/status.json"' not in body


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_the_page_says_so_when_its_server_stops_answering(tmp_path: Path) -> None:
    """A stopped server (Ctrl-Z, a paused VM) still has its connections taken by the
    kernel: the page's refresh gives up after max(10 s, three refreshes) and shows
    the banner, instead of waiting for good with the last data shown as live."""
    from browser_helpers import TIMEOUT_MS  # noqa: PLC0415
    from browser_helpers import browser as _browser  # noqa: PLC0415

    db = tmp_path / "outbox.db"
    store = SQLiteStore(db)
    conn = store.connect()
    store.enqueue(conn, key="chat-1", type="t", payload={})
    conn.commit()
    conn.close()
    store.close()
    server = subprocess.Popen(
        [sys.executable, "-m", "outbound", "outbox", "--db", str(db), "serve", "--port", "0",
         "--refresh", "0.5"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    stopped = False
    try:
        assert server.stdout is not None
        url = server.stdout.readline().split("status page at ")[1].split(" ")[0]
        for browser in _browser():
            page = browser.new_page()
            page.goto(url)
            page.wait_for_selector("#counts", timeout=TIMEOUT_MS)
            assert page.locator("#stale").is_hidden()
            os.kill(server.pid, signal.SIGSTOP)
            stopped = True
            page.wait_for_selector("#stale:not([hidden])", timeout=10_000 + TIMEOUT_MS)
            assert "no answer within 10 s" in page.locator("#stale").inner_text()
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        server.terminate()
        server.wait(30)
