"""A Ctrl-C that lands in ``Thread.start()`` of a request thread almost always lands
in its ``self._started.wait()``: the thread *was* started and runs.
ConnectionThreadsServer.process_request then assumes "No thread", untracks it and
closes its connection (shutdown_request): the running handler is in neither
``_threads`` nor ``_sockets``, so StatusServer.close() neither shuts its connection
down nor joins it. close() returns while that request thread still serves (here:
blocked reading the request, for up to _REQUEST_TIMEOUT = 10 s), contrary to
"blocks until the serving threads ended".

Deterministic: threading.Thread.start is wrapped for the request thread: the
original start, then (once the handler is reading, bounded wait) the
KeyboardInterrupt a SIGINT would raise there."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbound.outbox.sqlite import SQLiteStore
from outbound.outbox.web import StatusServer
from outbound.outbox.web import _server as web_server

TIMEOUT = 5.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    made = SQLiteStore(tmp_path / "outbox.db")
    made.create_schema()
    try:
        yield made
    finally:
        made.close()


def request_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name == "outbound-status-request" and t.is_alive()
    ]


def test_close_after_ctrl_c_in_request_thread_start_leaves_no_thread(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    reading = threading.Event()
    orig_setup = web_server._Handler.setup

    def setup(self: web_server._Handler) -> None:
        orig_setup(self)
        reading.set()  # from here the handler blocks reading the request

    monkeypatch.setattr(web_server._Handler, "setup", setup)
    orig_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        orig_start(self)
        if self.name == "outbound-status-request":
            monkeypatch.setattr(threading.Thread, "start", orig_start)
            # (bounded; not an assert: socketserver would swallow it)
            reading.wait(TIMEOUT)
            raise KeyboardInterrupt  # Ctrl-C, as it lands at the end of _started.wait()

    server = StatusServer(store, port=0)
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        client.settimeout(TIMEOUT)
        client.connect(("127.0.0.1", server.port))  # queued: accepted by the loop below
        monkeypatch.setattr(threading.Thread, "start", start)
        with pytest.raises(KeyboardInterrupt):
            server.serve_forever()  # as `outbox serve` runs it, on the main thread
        monkeypatch.setattr(threading.Thread, "start", orig_start)
        started = time.monotonic()
        server.close()
        took = time.monotonic() - started
        left = request_threads()
        assert not left, (
            f"close() returned after {took:.2f}s with request thread(s) still serving: {left} "
            f"(open_connections()={server._httpd.open_connections()})"
        )
    finally:
        client.close()  # lets the orphaned handler end
        for thread in request_threads():
            thread.join(TIMEOUT)
