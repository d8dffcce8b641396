"""A forked child's StatusServer.close() must close the child's copies of the sockets
(README: "in a child, close() closes only the child's copies of its sockets"). A
connection of the parent that is accepted but not yet tracked (the loop thread between
socketserver's accept and ConnectionThreadsServer.process_request's _sockets.add), or
already untracked but not yet closed (_serve_connection's finally: discard, then
shutdown_request), is not in _sockets at the fork: the child's close() leaves that
descriptor open in the child for good.

The windows are held open deterministically by blocking, in the parent, inside the
very call that follows them; the fork happens on the main thread meanwhile."""

from __future__ import annotations

import os
import textwrap

import pytest
from outbound_process import run_script_ok

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    """
    import os, socket, sys, tempfile, threading
    from outbound.outbox.sqlite import SQLiteStore
    from outbound.outbox.web import StatusServer

    window = sys.argv[1]
    store = SQLiteStore(os.path.join(tempfile.mkdtemp(), "o.db"))
    store.create_schema()
    srv = StatusServer(store, port=0)
    h = srv._httpd
    held, go, seen = threading.Event(), threading.Event(), {}
    if window == "accepted-not-tracked":
        orig_pr = type(h).process_request
        def process_request(request, address):   # accept() has returned this request
            seen["fd"] = request.fileno(); held.set(); go.wait(10)
            return orig_pr(h, request, address)
        h.process_request = process_request
    else:  # "untracked-not-closed"
        orig_sr = type(h).shutdown_request
        def shutdown_request(request):           # _sockets.discard(request) has run
            if threading.current_thread().name == h.thread_name and not seen:
                seen["fd"] = request.fileno(); held.set(); go.wait(10)
            return orig_sr(h, request)
        h.shutdown_request = shutdown_request
    srv.start()
    client = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    client.sendall(b"GET /status.json HTTP/1.0\\r\\nHost: 127.0.0.1:%d\\r\\n\\r\\n" % srv.port)
    assert held.wait(10), "window never reached"
    conn_fd = seen["fd"]
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            srv.close()
            try:
                os.fstat(conn_fd); state = "open"
            except OSError:
                state = "closed"
            code = 0 if state == "closed" else 1
            if code:
                print(f"{window}: child's copy of the connection (fd {conn_fd}) still open "
                      "after the child's close()", flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    go.set()
    data = b""
    while True:
        chunk = client.recv(65536)
        if not chunk:
            break
        data += chunk
    assert data.startswith(b"HTTP/1.0 200"), data[:40]  # the parent's request went on
    srv.close()
    assert os.waitstatus_to_exitcode(status) == 0
    print("ok")
    """
)


@pytest.mark.parametrize("window", ["accepted-not-tracked", "untracked-not-closed"])
def test_child_close_closes_connection_in_a_tracking_window(window: str) -> None:
    run_script_ok(SCRIPT, window, timeout=60)
