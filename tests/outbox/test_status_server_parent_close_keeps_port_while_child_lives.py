"""StatusServer.close() in the process that started it must "release the port". With a
forked child alive that never touched the server (a multiprocessing fork worker, a
gunicorn --preload worker: README says "post_fork needs nothing"), the child's copy of
the listening socket stays in LISTEN: after the parent's close() the port cannot be
bound again, and clients still connect (the kernel completes the handshake into the
backlog) and then hang, as nobody will ever accept.

_HTTPServer.server_close only closes the parent's descriptor (socketserver's
server_close -> socket.close()); the child cannot serve it (start() refuses there), so
shutting the listening socket down first would end LISTEN for every copy."""

from __future__ import annotations

import os
import textwrap

import pytest
from outbound_process import run_script_ok

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    """
    import os, socket, tempfile
    from outbound.outbox.sqlite import SQLiteStore
    from outbound.outbox.web import StatusServer

    store = SQLiteStore(os.path.join(tempfile.mkdtemp(), "o.db"))
    store.create_schema()
    srv = StatusServer(store, port=0).start()
    port = srv.port
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker that never uses the status server; lives until told
        os.close(w); os.read(r, 1); os._exit(0)
    os.close(r)
    problems = []
    try:
        srv.close()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            problems.append(f"bind after close(): {exc}")
        finally:
            s.close()
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=2)
        except ConnectionRefusedError:
            pass
        else:
            c.settimeout(2)
            c.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            try:
                c.recv(10)
            except socket.timeout:
                problems.append("a client still connects after close() and hangs")
            c.close()
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
    print("; ".join(problems) or "ok")
    """
)


def test_parent_close_releases_the_port_while_a_forked_child_lives() -> None:
    run_script_ok(SCRIPT, timeout=60)
