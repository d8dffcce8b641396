"""StatusServer.close() called from a signal handler while serve_forever() runs on the
main thread returns, but serve_forever() never returns: the loop spins at full CPU
on the closed listening socket (poll() says POLLNVAL = readable, accept() raises EBADF,
which socketserver swallows, forever).

close() skips ``self._httpd.shutdown()`` when the loop is the current thread (it would
deadlock) but then nothing else tells socketserver's loop to stop."""

from __future__ import annotations

import os
import textwrap

import pytest
from outbound_process import run_script_ok

pytestmark = pytest.mark.skipif(not hasattr(os, "kill"), reason="needs signals")

SCRIPT = textwrap.dedent(
    """
    import os, signal, socket, sys, tempfile, threading, time
    from outbound.outbox.sqlite import SQLiteStore
    from outbound.outbox.web import StatusServer

    store = SQLiteStore(os.path.join(tempfile.mkdtemp(), "o.db"))
    store.create_schema()
    srv = StatusServer(store, port=0)
    closed = threading.Event()
    returned = threading.Event()

    def on_signal(signum, frame):
        srv.close()          # "Stop serving ..."; returns at once here
        closed.set()

    signal.signal(signal.SIGUSR1, on_signal)

    def client():
        # once a request was answered the loop is serving; then signal the main thread
        c = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        c.sendall(b"GET /status.json HTTP/1.0\\r\\nHost: 127.0.0.1:%d\\r\\n\\r\\n" % srv.port)
        while c.recv(65536):
            pass
        c.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        if not closed.wait(10):
            print("close() never returned", flush=True); os._exit(1)
        cpu0 = time.process_time()
        if not returned.wait(5):   # bounded: poll_interval is 0.1 s
            cpu = time.process_time() - cpu0
            print(f"serve_forever() still running 5 s after close() returned "
                  f"(burned {cpu:.1f} s CPU)", flush=True)
            os._exit(1)

    t = threading.Thread(target=client, daemon=True)
    t.start()
    srv.serve_forever()
    returned.set()
    t.join(10)
    print("ok")
    """
)


def test_close_from_a_signal_handler_ends_serve_forever() -> None:
    run_script_ok(SCRIPT, timeout=60)
