"""A request thread that was tracked but never started (Thread.start() raised: "can't
start new thread" under thread/memory pressure, or a Ctrl-C landing between the
tracking and the start while serve_forever() runs on the main thread, as in
``outbox serve``) makes StatusServer.close() raise
``RuntimeError: cannot join thread before it is started`` from join_threads, and leaves
a phantom connection counted against _MAX_CONNECTIONS for good.

ConnectionThreadsServer.process_request appends the thread to _threads and the
socket to _sockets *before* thread.start(), and nothing untracks them when start fails.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from outbound.outbox.sqlite import SQLiteStore
from outbound.outbox.web import StatusServer


def _fail_next_request_thread_start(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    orig = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "outbound-status-request":
            monkeypatch.setattr(threading.Thread, "start", orig)
            raise exc
        orig(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def test_thread_start_failure_then_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SQLiteStore(tmp_path / "o.db")
    store.create_schema()
    srv = StatusServer(store, port=0).start()
    try:
        _fail_next_request_thread_start(monkeypatch, RuntimeError("can't start new thread"))
        c = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        assert c.recv(10) == b""  # the server dropped it (handle_error + shutdown_request)
        c.close()
        # (Untracked once closed: just after the client saw the end.)
        deadline = time.monotonic() + 10.0
        while (phantom := srv._httpd.open_connections()) and time.monotonic() < deadline:
            threading.Event().wait(0.01)
    finally:
        srv.close()  # raised RuntimeError: cannot join thread before it is started
    assert phantom == 0, f"{phantom} connection(s) counted that nobody serves"


def test_ctrl_c_between_tracking_and_start_then_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what ``outbox serve`` does: serve_forever() on this thread, close() in finally
    store = SQLiteStore(tmp_path / "o.db")
    store.create_schema()
    srv = StatusServer(store, port=0)
    _fail_next_request_thread_start(monkeypatch, KeyboardInterrupt())
    c = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    try:
        with pytest.raises(KeyboardInterrupt):
            srv.serve_forever()
    finally:
        c.close()
        srv.close()  # raises RuntimeError: cannot join thread before it is started
