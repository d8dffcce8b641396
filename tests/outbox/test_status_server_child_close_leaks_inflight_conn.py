"""A forked child's StatusServer.close() must close the child's copies of the sockets of
the connections being served; a connection in flight (its handler made a file over the
socket: socket._io_refs > 0) keeps its file descriptor open in the child."""

from __future__ import annotations

import os
import textwrap

import pytest
from outbound_process import run_script_ok

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    """
    import os, socket, sys, tempfile, time
    from outbound.outbox.sqlite import SQLiteStore
    from outbound.outbox.web import StatusServer

    store = SQLiteStore(os.path.join(tempfile.mkdtemp(), "o.db"))
    store.create_schema()
    srv = StatusServer(store, port=0).start()
    client = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    client.sendall(b"GET / HTTP/1.1\\r\\n")  # a request not whole yet: in flight
    deadline = time.monotonic() + 5
    while srv._httpd.open_connections() != 1:
        assert time.monotonic() < deadline, "connection never tracked"
        time.sleep(0.01)
    conn_fd = next(iter(srv._httpd._sockets)).fileno()
    listen_fd = srv._httpd.socket.fileno()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            srv.close()
            state = []
            for fd in (listen_fd, conn_fd):
                try:
                    os.fstat(fd)
                    state.append("open")
                except OSError:
                    state.append("closed")
            code = 0 if state == ["closed", "closed"] else 1
            if code:
                print("child fds after close() (listening, connection):", state, flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    # the parent's request goes on
    client.sendall(b"Host: 127.0.0.1:%d\\r\\n\\r\\n" % srv.port)
    assert client.recv(12) == b"HTTP/1.0 200"
    srv.close()
    assert os.waitstatus_to_exitcode(status) == 0
    print("ok")
    """
)


def test_child_close_closes_inflight_connection_copy() -> None:
    run_script_ok(SCRIPT)
