"""The status page without a browser: the stores' throughput and leases, the monitor, the
HTML, the HTTP server and ``outbox serve`` (see test_status_browser.py for the browser)."""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import re
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbound.__main__ import main
from outbound.errors import StoreError
from outbound.outbox import PostgresStore, SQLiteStore, Store
from outbound.outbox._base import Outcome
from outbound.outbox.web import (
    SECURITY_HEADERS,
    StatusMonitor,
    StatusServer,
    format_age,
    render_page,
    snapshot_json,
)

from .conftest import app_connection, wait_for

OWNER = "relay-a"


def enqueue(store: Store, *keys: str, **payload: Any) -> list[int]:
    conn = app_connection(store)
    try:
        ids = [store.enqueue(conn, key=k, type="greet", payload={"k": k, **payload}) for k in keys]
        conn.commit()
        return ids
    finally:
        conn.close()


def finish(store: Store, kind: str, count: int, *, error: str | None = None, **extra: Any) -> None:
    """Claim up to ``count`` rows as OWNER and write ``kind`` for each."""
    session = store.session()
    try:
        claimed = session.claim(OWNER, count, 30.0, None)
        outcomes = [
            Outcome(c.message.id, c.token, c.message.key, kind, error=error, **extra)  # type: ignore[arg-type]
            for c in claimed
        ]
        session.finish(OWNER, outcomes)
    finally:
        session.close()


def age_rows(store: Store, ids: list[int], seconds: float) -> None:
    """Move the rows' last update ``seconds`` into the past (the test's only raw write)."""
    conn = app_connection(store)
    try:
        if isinstance(store, SQLiteStore):
            conn.executemany(
                f"UPDATE {store.table} SET updated_at = updated_at - ? WHERE id = ?",
                [(seconds, i) for i in ids],
            )
        else:
            conn.execute(
                f"UPDATE {store.table} SET updated_at = updated_at - %s * interval '1 second' "
                "WHERE id = ANY(%s)",
                (seconds, ids),
            )
        conn.commit()
    finally:
        conn.close()


# ------------------------------------------------------------------ the stores


def test_throughput_counts_rows_marked_sent_per_bucket(store: Store) -> None:
    ids = enqueue(store, *(f"k{i}" for i in range(8)))
    finish(store, "sent", 6)
    finish(store, "dead", 1, error="no")  # neither dead nor pending rows count
    sent = [r.id for r in store.rows(status="sent")]
    age_rows(store, sent[:2], 30.5)  # in the bucket [-31, -30)
    age_rows(store, sent[2:3], 100.0)  # before the window
    before = time.time()
    throughput = store.throughput(window=60, bucket=1)
    assert len(throughput.sent) == 60
    assert throughput.bucket == 1.0
    assert abs(throughput.end - before) < 5  # the store's clock
    assert throughput.start == pytest.approx(throughput.end - 60)
    # Each sent row counts in the bucket of its last update (a loaded
    # machine may take a while between the writes and the count: the
    # buckets are read off the rows, not assumed).
    expected = [0] * 60
    bucket_of = {}
    for row in store.rows(status="sent"):
        assert row.updated_at is not None
        i = math.floor(row.updated_at - throughput.start)
        bucket_of[row.id] = i
        if 0 <= i < 60:
            expected[i] += 1
    assert list(throughput.sent) == expected
    assert sum(throughput.sent) == 5  # not the one past the window, nor the dead one
    assert {bucket_of[i] for i in sent[:2]} <= set(range(20, 30))  # 30.5 s old
    assert all(bucket_of[i] >= 50 for i in sent[3:])  # sent just now
    twice = bucket_of[sent[0]]
    assert throughput.per_second[twice] == float(expected[twice])
    coarse = store.throughput(window=60, bucket=7)  # 9 buckets, the first one partly older
    assert len(coarse.sent) == 9
    assert coarse.end - coarse.start == pytest.approx(63)
    assert sum(coarse.sent) == 5
    assert len(ids) == 8


def test_throughput_checks_its_arguments(store: Store) -> None:
    with pytest.raises(ValueError, match="window"):
        store.throughput(window=0)
    with pytest.raises(ValueError, match="bucket"):
        store.throughput(window=10, bucket=11)
    with pytest.raises(ValueError, match="1000 buckets"):
        store.throughput(window=3600, bucket=1)
    with pytest.raises(TypeError):
        store.throughput(window="60")  # type: ignore[arg-type]
    assert len(store.throughput(window=1000, bucket=1).sent) == 1000


def test_latest_expiry_moves_with_claims_and_renewals(store: Store) -> None:
    enqueue(store, "a", "b")
    session = store.session()
    try:
        first = session.claim(OWNER, 1, 30.0, None)
        (lease,) = store.leases()
        assert lease.owner == OWNER
        assert lease.rows == 1
        assert lease.latest_expiry == pytest.approx(lease.expires_at)
        assert lease.latest_expiry == pytest.approx(time.time() + 30, abs=5)
        second = session.claim(OWNER, 1, 60.0, None)
        (lease,) = store.leases()
        assert lease.rows == 2
        assert lease.expires_at is not None
        assert lease.latest_expiry is not None
        assert lease.expires_at < lease.latest_expiry - 20  # the first and the last lease
        session.renew(OWNER, 120.0, first)
        (lease,) = store.leases()
        assert lease.latest_expiry == pytest.approx(time.time() + 120, abs=5)
        session.finish(
            OWNER, [Outcome(c.message.id, c.token, c.message.key, "sent") for c in first + second]
        )
        assert store.leases() == []
    finally:
        session.close()


# ----------------------------------------------------------------- the monitor


def test_snapshot_has_every_part_of_the_page(store: Store) -> None:
    enqueue(store, "a", "a", "b", "c", "c", "d")
    finish(store, "sent", 1)  # a's first row
    # b's head fails and backs off: b is blocked (though no row waits
    # behind it); c's head is being delivered, a row behind it: working,
    # not blocked.
    session = store.session()
    try:
        claimed = {c.message.key: c for c in session.claim(OWNER, 10, 30.0, None)}
        b = claimed["b"]
        session.finish(
            OWNER, [Outcome(b.message.id, b.token, "b", "retry", delay=60.0, error="502 <b>x</b>")]
        )
        monitor = StatusMonitor(store, window=60, bucket=5, min_interval=0, max_load=None)
        snapshot = monitor.snapshot()
    finally:
        session.close()
    assert snapshot.counts == {
        "pending": 2,
        "processing": 3,
        "sent": 1,
        "dead": 0,
        "cancelled": 0,
    }
    assert snapshot.unfinished == 5
    assert {item.key for item in store.blocked()} == {"b", "c"}
    assert snapshot.oldest_pending_age is not None
    assert [item.key for item in snapshot.blocked] == ["b"]
    assert snapshot.blocked[0].head.last_error == "502 <b>x</b>"
    assert [relay.owner for relay in snapshot.relays] == [OWNER]
    assert snapshot.relays[0].rows == 3
    assert sum(snapshot.throughput.sent) == 1
    assert snapshot.table == store.table
    data = json.loads(json.dumps(snapshot_json(snapshot)))
    assert data["counts"]["processing"] == 3
    assert data["blocked"][0]["head"]["last_error"] == "502 <b>x</b>"
    assert data["relays"][0]["owner"] == OWNER
    assert data["sent_per_second"]["bucket"] == 5.0
    assert len(data["sent_per_second"]["rates"]) == 12
    assert data["slots"] == {"total": 0, "in_use": 0, "slots": []}
    assert data["now"] == snapshot.now


def test_a_head_held_by_a_relay_that_stopped_is_blocked(store: Store) -> None:
    enqueue(store, "a", "a")
    monitor = StatusMonitor(store, min_interval=0, max_load=None)
    session = store.session()
    try:
        session.claim(OWNER, 1, 0.001, None)  # a lease over at once
        wait_for(lambda: monitor.snapshot().blocked != ())
        snapshot = monitor.snapshot()
    finally:
        session.close()
    assert [(item.key, item.waiting) for item in snapshot.blocked] == [("a", 1)]
    page = render_page(snapshot)
    assert "its relay stopped" in page


def test_a_key_held_up_stays_listed_when_a_relay_claims_during_the_reading(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocked keys were asked for as many more as the processing rows counted
    before: a relay's claim between the two statements filled that answer with
    running heads, and the page said no key was held up."""
    conn = app_connection(store)
    try:
        # (Two rows a key: the second waits behind its head, running once claimed.)
        busy = [{"key": f"busy-{i}", "type": "greet", "payload": {}} for i in range(50)]
        store.enqueue_many(conn, busy + busy)
        store.enqueue(conn, key="held", type="greet", payload={}, delay=600)
        store.enqueue(conn, key="held", type="greet", payload={})
        conn.commit()
    finally:
        conn.close()
    counted = store.status

    def status_then_a_claim() -> Any:
        found = counted()
        session = store.session()
        try:
            session.claim(OWNER, 50, 30.0, None)  # a relay's batch, between the statements
        finally:
            session.close()
        return found

    monkeypatch.setattr(store, "status", status_then_a_claim)
    snapshot = StatusMonitor(store, min_interval=0, max_load=None, blocked_limit=5).snapshot()
    assert [item.key for item in snapshot.blocked] == ["held"]
    assert not snapshot.blocked_more


def test_monitor_remembers_relays_and_sees_renewals(store: Store) -> None:
    enqueue(store, "a", "b")
    monitor = StatusMonitor(store, min_interval=0, max_load=None, forget_after=3600)
    session = store.session()
    try:
        held = session.claim(OWNER, 2, 30.0, None)
        first = monitor.snapshot()
        (relay,) = first.relays
        assert (relay.owner, relay.rows, relay.holding) == (OWNER, 2, True)
        assert relay.renewed_at is None  # not seen moving yet
        assert relay.first_seen == first.now
        session.renew(OWNER, 60.0, held)
        second = monitor.snapshot()
        (relay,) = second.relays
        assert relay.renewed_at == second.now
        assert relay.latest_expiry == pytest.approx(second.now + 60, abs=5)
        session.finish(OWNER, [Outcome(c.message.id, c.token, c.message.key, "sent") for c in held])
        third = monitor.snapshot()
        (relay,) = third.relays
        assert (relay.rows, relay.slots, relay.holding) == (0, 0, False)
        assert relay.last_seen == second.now
        assert relay.renewed_at == second.now
        monitor.forget_after = 1e-6
        assert monitor.snapshot().relays == ()
    finally:
        session.close()


def test_one_reading_serves_every_viewer(store: Store) -> None:
    calls = 0
    original = store.status

    def counted() -> Any:
        nonlocal calls
        calls += 1
        time.sleep(0.2)  # a slow database
        return original()

    store.status = counted  # type: ignore[method-assign]
    monitor = StatusMonitor(store, min_interval=60)
    barrier = threading.Barrier(8)
    results: list[Any] = []

    def view() -> None:
        barrier.wait(timeout=10)
        results.append(monitor.snapshot())

    threads = [threading.Thread(target=view) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert calls == 1
    assert len(results) == 8
    assert all(result is results[0] for result in results)
    assert results[0].took >= 0.2
    # A reading that took T is served again for T / max_load (10 T), whatever
    # min_interval.
    monitor.min_interval = 0
    assert monitor.snapshot() is results[0]
    assert calls == 1


def test_monitor_checks_its_options(store: Store) -> None:
    with pytest.raises(ValueError, match="1000 buckets"):
        StatusMonitor(store, window=2000, bucket=1)
    with pytest.raises(ValueError, match="dead_limit"):
        StatusMonitor(store, dead_limit=0)
    with pytest.raises(ValueError, match="bucket"):
        StatusMonitor(store, window=10, bucket=20)
    with pytest.raises(ValueError, match="max_load"):
        StatusMonitor(store, max_load=0)


# -------------------------------------------------------------------- the page


def test_page_escapes_what_comes_from_the_database(store: Store) -> None:
    hostile = "<script>alert(1)</script>"
    enqueue(store, hostile, hostile)
    finish(store, "dead", 1, error=f"{hostile} & more")
    monitor = StatusMonitor(store, min_interval=0, max_load=None)
    page = render_page(monitor.snapshot(), json_url='x"><script>')
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in page
    assert 'href="x&quot;&gt;&lt;script&gt;"' in page
    assert page.count("<script>") == 1  # the page's own


def test_chart_has_one_bar_per_bucket_scaled_to_the_peak(store: Store) -> None:
    empty = render_page(
        StatusMonitor(store, window=5, bucket=1, min_interval=0, max_load=None).snapshot()
    )
    assert "nothing sent in the last 5.0 s" in empty
    enqueue(store, *(f"k{i}" for i in range(4)))
    finish(store, "sent", 4)
    sent = [r.id for r in store.rows(status="sent")]
    age_rows(store, sent[:1], 25.0)
    snapshot = StatusMonitor(store, window=60, bucket=10, min_interval=0, max_load=None).snapshot()
    page = render_page(snapshot)
    chart = re.search(r'<svg id="sent-chart".*?</svg>', page, re.S)
    assert chart is not None
    bars = re.findall(r'<rect class="bar"[^>]*height="([0-9.]+)" data-sent="(\d+)"', chart.group())
    assert len(bars) == 6
    heights = {int(n): float(h) for h, n in bars}
    assert sum(int(n) for _, n in bars) == 4
    assert heights[0] == 0.0
    assert heights[3] == pytest.approx(3 * heights[1])  # one bar of 3 sent, one of 1
    assert "nothing sent" not in chart.group()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (0.04, "0.0 s"),
        (9.96, "10.0 s"),
        (12.7, "12 s"),
        (60, "1 min"),
        (184, "3 min 4 s"),
        (7500, "2 h 5 min"),
        (3 * 86400 + 4 * 3600 + 5, "3 d 4 h"),
        (-3, "0.0 s"),
        (float("inf"), "-"),
    ],
)
def test_format_age(seconds: float | None, text: str) -> None:
    assert format_age(seconds) == text


# ------------------------------------------------------------------ the server


@pytest.fixture
def server(store: Store) -> Iterator[StatusServer]:
    with StatusServer(
        StatusMonitor(store, min_interval=0, max_load=None), port=0, refresh=0.5
    ) as running:
        yield running


def get(
    server: StatusServer, path: str, *, method: str = "GET", host: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        headers = {} if host is None else {"Host": host}
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_server_serves_the_page_and_its_json(store: Store, server: StatusServer) -> None:
    enqueue(store, "a")
    status, headers, body = get(server, "/")
    assert status == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["Cache-Control"] == "no-store"
    page = body.decode()
    assert 'data-count="pending">1<' in page
    assert 'data-refresh="0.5"' in page
    assert 'href="status.json"' in page  # relative: a prefix in front of it is kept
    status, headers, body = get(server, "/status.json")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    data = json.loads(body)
    assert data["counts"]["pending"] == 1
    assert data["outbox"]["table"] == store.table
    assert get(server, "/status.json?x=1")[0] == 200
    assert get(server, "/nothing")[0] == 404
    assert get(server, "/", method="POST")[0] == 405
    status, headers, body = get(server, "/", method="HEAD")
    assert (status, body) == (200, b"")
    assert int(headers["Content-Length"]) > 1000


def test_server_refuses_other_host_names_on_loopback(server: StatusServer) -> None:
    assert get(server, "/", host=f"localhost:{server.port}")[0] == 200
    assert get(server, "/", host=f"127.0.0.1:{server.port}")[0] == 200
    assert get(server, "/status.json", host=f"attacker.example:{server.port}")[0] == 421
    assert get(server, "/", host="127.0.0.1:1")[0] == 421
    assert server.url == f"http://127.0.0.1:{server.port}/"


def test_a_database_that_fails_is_shown_and_the_server_goes_on(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "x.db")
    enqueue(store, "a")
    with StatusServer(StatusMonitor(store, min_interval=0, max_load=None), port=0) as running:
        assert get(running, "/")[0] == 200
        os.rename(tmp_path / "x.db", tmp_path / "y.db")
        status, _, body = get(running, "/")
        assert status == 503
        assert b"The outbox cannot be read: cannot open the outbox database" in body
        status, _, body = get(running, "/status.json")
        assert status == 503
        assert "cannot open" in json.loads(body)["error"]
        os.rename(tmp_path / "y.db", tmp_path / "x.db")
        status, _, body = get(running, "/status.json")
        assert status == 200
        assert json.loads(body)["counts"]["pending"] == 1


def test_close_ends_connections_that_send_nothing(store: Store) -> None:
    server = StatusServer(store, port=0).start()
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        # Its thread waits for a request line.
        wait_for(lambda: any(t.name == "outbound-status-request" for t in threading.enumerate()))
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 5
        server.close()  # idempotent
    finally:
        idle.close()
    with pytest.raises(RuntimeError, match="closed"):
        server.start()


def test_a_client_that_goes_away_is_one_debug_line_not_a_traceback(
    server: StatusServer, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG, logger="outbound.outbox.web")
    for _ in range(3):
        # Half a request, then a reset: the server's read fails mid-request.
        client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        client.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()

    def went() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "went away" in r.getMessage()]

    wait_for(lambda: len(went()) == 3)
    assert {r.levelno for r in went()} == {logging.DEBUG}
    assert get(server, "/")[0] == 200  # and it goes on serving
    assert "Traceback" not in capfd.readouterr().err


def test_a_taken_port_is_an_os_error(store: Store) -> None:
    with StatusServer(store, port=0) as first, pytest.raises(OSError):
        StatusServer(store, port=first.port)
    with pytest.raises(ValueError, match="port"):
        StatusServer(store, port=70000)


# ------------------------------------------------------------------ outbox serve


def db_url(store: Store) -> str:
    if isinstance(store, SQLiteStore):
        return f"sqlite:///{store.path}"
    assert isinstance(store, PostgresStore)
    return store.conninfo


# Starts the command with SIGINT ignored, as a shell script's background job is.
_SIGINT_IGNORED = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def serve_cli(*argv: str, sigint_ignored: bool = False) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "outbound", "outbox", "serve", *argv]
    if sigint_ignored:
        command[1:1] = ["-c", _SIGINT_IGNORED]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["foreground", "sigint-ignored"])
def test_outbox_serve_until_interrupted(store: Store, sigint_ignored: bool) -> None:
    """Ctrl-C stops it, also when it was started with SIGINT ignored (a background job)."""
    enqueue(store, "a", "b")
    process = serve_cli(
        "--db", db_url(store), "--table", store.table, "--port", "0", sigint_ignored=sigint_ignored
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"status page at http://127\.0\.0\.1:(\d+)/", line)
        assert match, line
        conn = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=10)
        conn.request("GET", "/status.json")
        data = json.loads(conn.getresponse().read())
        conn.close()
        assert data["counts"]["pending"] == 2
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "status page stopped" in out
    assert err == ""


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--port", "70000"], 2, "--port must be a whole number from 0 to 65535, not '70000'"),
        (["--port", "http"], 2, "--port must be a whole number"),
        (["--refresh", "-1"], 2, "--refresh must be a number of seconds"),
        (["--host", " "], 2, "--host must name an address"),
        # (the bind's own error was a TypeError: a traceback)
        (["--host", "a..\u00e9"], 2, "--host must be a host name or an address"),
        (["--db", "mysql://x/y"], 2, "unsupported database URL scheme 'mysql'"),
        (["--db", "/nonexistent/outbox.db"], 1, "no SQLite database file"),
        (["--host", "host.invalid", "--port", "0"], 1, "cannot listen on host.invalid:0"),
    ],
)
def test_outbox_serve_errors_are_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    status: int,
    message: str,
) -> None:
    path = tmp_path / "ok.db"
    SQLiteStore(path).close()
    args = ["--db", str(path), *argv] if "--db" not in argv else argv
    assert main(["outbox", "serve", *args]) == status
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("outbox: ")
    assert message in err


def test_outbox_serve_on_a_taken_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = SQLiteStore(tmp_path / "x.db")
    with StatusServer(store, port=0) as taken:
        assert main(["outbox", "serve", "--db", store.path, "--port", str(taken.port)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"outbox: cannot listen on 127.0.0.1:{taken.port}: ")
    assert err.count("\n") == 1


def test_store_errors_reach_the_monitor_as_store_errors(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "x.db")
    os.remove(tmp_path / "x.db")
    with pytest.raises(StoreError):
        StatusMonitor(store).snapshot()


def test_text_that_is_not_utf8_in_a_sqlite_row_is_shown_replaced(tmp_path: Path) -> None:
    # Written by another program (SQLite keeps what it is given): one such
    # row among the newest dead made the whole page "cannot be read" (503).
    store = SQLiteStore(tmp_path / "outbox.db", table="outbox")
    try:
        conn = store.connect()
        with conn:
            for i in range(3):
                store.enqueue(conn, key=f"k{i}", type="t", payload={"i": i})
        conn.close()
        raw = sqlite3.connect(tmp_path / "outbox.db")
        with raw:
            raw.execute(
                "UPDATE outbox SET status = 'dead', head = 0, attempts = 1, "
                "last_error = CAST(X'626164FF6279746573' AS TEXT) WHERE id = 1"
            )
            raw.execute("UPDATE outbox_counts SET unfinished = unfinished - 1")
        raw.close()
        snapshot = StatusMonitor(store, min_interval=0, max_load=None).snapshot()
        assert snapshot.counts["dead"] == 1
        assert snapshot.counts["pending"] == 2
        assert "bad\ufffdbytes" in render_page(snapshot)
        (dead,) = [r for r in store.rows(limit=10) if r.status == "dead"]
        assert dead.last_error == "bad\ufffdbytes"
    finally:
        store.close()


def test_values_another_program_wrote_in_sqlite_rows_are_shown(tmp_path: Path) -> None:
    # SQLite keeps any type in any column: a BLOB key and error (what Python's
    # sqlite3 writes for bytes), text in attempts and lease_expires_at, an
    # infinite time. Each made the page or its JSON fail with no answer at all.
    store = SQLiteStore(tmp_path / "outbox.db", table="outbox")
    try:
        ids = enqueue(store, "a", "b", "c")
        raw = sqlite3.connect(tmp_path / "outbox.db")
        with raw:
            raw.execute(
                "UPDATE outbox SET status = 'dead', head = 0, key = X'6b6579', "
                "last_error = X'6f6f7073ff', attempts = 'many', updated_at = 9e999 WHERE id = ?",
                (ids[0],),
            )
            raw.execute(
                "UPDATE outbox SET status = 'processing', lease_owner = X'72656c6179', "
                "lease_expires_at = 'soon', attempts = 1 WHERE id = ?",
                (ids[1],),
            )
            raw.execute("UPDATE outbox_counts SET unfinished = unfinished - 1")
        raw.close()
        monitor = StatusMonitor(store, min_interval=0, max_load=None)
        with StatusServer(monitor, port=0, refresh=0) as running:
            status, _, body = get(running, "/")
            assert status == 200
            page = body.decode()
            assert "<code>key</code>" in page
            assert "oops\ufffd" in page
            status, _, body = get(running, "/status.json")
            assert status == 200
            data = json.loads(body)
        (dead,) = data["dead"]["rows"]
        assert (dead["key"], dead["last_error"], dead["attempts"]) == ("key", "oops\ufffd", 0)
        assert dead["updated_at"] is None  # (JSON has no infinity)
        assert [relay["owner"] for relay in data["relays"]] == ["relay"]
        (listed,) = store.rows(status="processing")
        assert (listed.lease_owner, listed.lease_expires_at) == ("relay", None)
    finally:
        store.close()


def test_an_unexpected_error_of_a_reading_is_a_failed_reading(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    # Only store errors were caught: any other exception dropped the connection
    # (no answer, the page said the server cannot be reached), was not kept
    # (every request read again) and logged a traceback per request.
    caplog.set_level(logging.DEBUG, logger="outbound.outbox.web")
    reads = []

    def leases() -> Any:
        reads.append(1)
        raise ValueError("could not convert string to float: 'soon'")

    store.leases = leases  # type: ignore[method-assign]
    monitor = StatusMonitor(store, min_interval=3600, max_load=None)
    with StatusServer(monitor, port=0, refresh=0) as running:
        status, _, body = get(running, "/")
        assert status == 503
        assert b"reading the outbox failed: ValueError: could not convert" in body
        for _ in range(5):
            status, _, body = get(running, "/status.json")
            assert status == 503
            assert json.loads(body)["error"].startswith("reading the outbox failed: ValueError")
    assert len(reads) == 1
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "cannot be read: reading the outbox failed: ValueError" in warnings[0].getMessage()
    with pytest.raises(StoreError) as raised:
        monitor.snapshot()
    assert isinstance(raised.value.__cause__, ValueError)


def test_an_answer_that_cannot_be_made_is_a_503_logged_once(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import outbound.outbox.web._page as page_module  # noqa: PLC0415

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("cannot render this")

    monkeypatch.setattr(page_module, "render_page", broken)
    monkeypatch.setattr(page_module, "snapshot_json", broken)
    caplog.set_level(logging.DEBUG, logger="outbound.outbox.web")
    with StatusServer(StatusMonitor(store), port=0, refresh=0) as running:
        for path in ("/", "/status.json", "/"):
            status, _, body = get(running, path)
            assert status == 503
            assert b"cannot show this reading: TypeError: cannot render this" in body
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"])
def test_other_methods_get_405_saying_what_is_allowed(server: StatusServer, method: str) -> None:
    for path in ("/", "/status.json"):
        status, headers, _ = get(server, path, method=method)
        assert status == 405
        assert headers["Allow"] == "GET, HEAD"
        for name, value in SECURITY_HEADERS.items():
            assert headers[name] == value
    status, headers, _ = get(server, "/")
    assert status == 200
    assert "Allow" not in headers


def test_the_standard_librarys_own_errors_carry_the_security_headers(
    server: StatusServer,
) -> None:
    status, headers, _ = get(server, "/", method="BREW")
    assert status == 501
    for name, value in SECURITY_HEADERS.items():
        assert headers[name] == value


@pytest.mark.skipif(sys.platform != "linux", reason="a file name of bytes that are not UTF-8")
def test_a_sqlite_file_name_that_is_not_utf8_is_shown_replaced(tmp_path: Path) -> None:
    # os.fsdecode keeps the byte as a lone surrogate, which UTF-8 cannot encode:
    # every answer of the page and of its JSON was dropped.
    path = os.path.join(tmp_path, os.fsdecode(b"caf\xe9.db"))
    store = SQLiteStore(path, table="outbox")
    try:
        enqueue(store, "a")
        monitor = StatusMonitor(store, min_interval=0, max_load=None)
        assert monitor.database == f"SQLite {tmp_path}/caf\ufffd.db"
        with StatusServer(monitor, port=0, refresh=0) as running:
            status, _, body = get(running, "/")
            assert status == 200
            assert f"SQLite {tmp_path}/caf\ufffd.db" in body.decode()
            status, _, body = get(running, "/status.json")
            assert status == 200
            assert json.loads(body)["outbox"]["database"] == f"SQLite {tmp_path}/caf\ufffd.db"
    finally:
        store.close()


@pytest.mark.skipif(sys.platform != "linux", reason="a file name of bytes that are not UTF-8")
def test_outbox_serve_answers_for_a_file_name_that_is_not_utf8(tmp_path: Path) -> None:
    path = os.path.join(tmp_path, os.fsdecode(b"caf\xe9.db"))
    store = SQLiteStore(path, table="outbox")
    enqueue(store, "a")
    store.close()
    proc = serve_cli("--db", path, "--port", "0")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert found, line
        port = int(found.group(1))
        for target in ("/", "/status.json"):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request("GET", target, headers={"Host": f"127.0.0.1:{port}"})
                response = conn.getresponse()
                assert response.status == 200
                assert "caf\ufffd.db" in response.read().decode()
            finally:
                conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "Traceback" not in err


def test_an_infinite_count_and_a_time_past_year_9999_are_shown(tmp_path: Path) -> None:
    # attempts = Infinity (int() of it is an OverflowError, not caught) failed
    # every reading: the page and the JSON were 503 for the whole outbox, and
    # `outbox list` a traceback. A dead row's updated_at of 1e300 made the
    # page (its UTC tooltip) a 503 while the JSON answered.
    store = SQLiteStore(tmp_path / "outbox.db", table="outbox")
    try:
        ids = enqueue(store, "a", "b")
        raw = sqlite3.connect(tmp_path / "outbox.db")
        with raw:
            raw.execute(
                "UPDATE outbox SET status = 'dead', head = 0, attempts = 9e999, "
                "updated_at = 1e300 WHERE id = ?",
                (ids[0],),
            )
            raw.execute("UPDATE outbox_counts SET unfinished = unfinished - 1")
        raw.close()
        monitor = StatusMonitor(store, min_interval=0, max_load=None)
        with StatusServer(monitor, port=0, refresh=0) as running:
            status, _, body = get(running, "/")
            assert status == 200, body
            status, _, body = get(running, "/status.json")
            assert status == 200, body
        (dead,) = json.loads(body)["dead"]["rows"]
        assert (dead["id"], dead["attempts"]) == (ids[0], 0)
        assert [row.id for row in store.rows(status="dead")] == [ids[0]]
    finally:
        store.close()
