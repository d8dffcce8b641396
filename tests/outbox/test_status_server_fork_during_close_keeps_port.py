"""A child forked while a parent thread is inside StatusServer.close() (after _closed is
set, before the listening socket is closed: close() is waiting for the serving loop
to notice its shutdown, up to poll_interval 0.1 s) inherits _closed=True: its close()
returns at once and never closes its copy of the listening socket. The port stays
bound and listening in the child after both processes closed the server: the
parent cannot bind it again, and clients connect into a backlog nobody accepts."""

from __future__ import annotations

import os
import textwrap

import pytest
from outbound_process import run_script_ok

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    """
    import os, socket, sys, tempfile, threading, time
    from outbound.outbox.sqlite import SQLiteStore
    from outbound.outbox.web import StatusServer

    store = SQLiteStore(os.path.join(tempfile.mkdtemp(), "o.db"))
    store.create_schema()
    srv = StatusServer(store, port=0)
    armed, in_loop, gate = threading.Event(), threading.Event(), threading.Event()

    def service_actions():  # socketserver's per-iteration hook: holds the loop's turn
        if armed.is_set():
            in_loop.set()
            gate.wait(10)

    srv._httpd.service_actions = service_actions
    srv.start()
    armed.set()
    assert in_loop.wait(5)
    closer = threading.Thread(target=srv.close)
    closer.start()
    deadline = time.monotonic() + 5
    while not srv._closed:  # close() is now waiting in shutdown() for the loop
        assert time.monotonic() < deadline
        time.sleep(0.005)
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            srv.close()  # the child's own close(): should close its copies
            os.write(w, b"c")
            os.read(r2, 1)
        finally:
            os._exit(0)
    os.read(r, 1)
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("127.0.0.1", srv.port))
        ok = True
    except OSError as exc:
        print("port still held after both closed:", exc, flush=True)
        ok = False
    finally:
        probe.close()
        os.write(w2, b"x")
        os.waitpid(pid, 0)
    assert ok
    print("ok")
    """
)


def test_fork_during_parent_close_child_close_releases_port() -> None:
    run_script_ok(SCRIPT)
