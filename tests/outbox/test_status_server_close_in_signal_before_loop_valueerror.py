"""StatusServer.close() run by a signal handler on the main thread right after
StatusServer.serve_forever() claimed the loop (``_loop``/``_pid`` set) but before
socketserver's serve_forever() registered the listening socket: close() takes the
"on the loop's own thread" branch (sets socketserver's private flag), then shuts
down and closes the listening socket; when the handler returns, socketserver's
serve_forever() registers a socket whose fileno() is now -1 and serve_forever()
raises ``ValueError: Invalid file descriptor: -1`` instead of returning.

The signal is raised for real (signal.raise_signal runs the Python handler before
it returns) just before socketserver's serve_forever is entered. Bounded: a fresh
interpreter with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "kill"), reason="needs signals")

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, tempfile, threading
    from outbound.outbox.sqlite import SQLiteStore
    from outbound.outbox.web import StatusServer

    store = SQLiteStore(os.path.join(tempfile.mkdtemp(dir=sys.argv[1]), "o.db"))
    store.create_schema()
    srv = StatusServer(store, port=0)
    handled = []

    def on_signal(signum, frame):
        srv.close()
        handled.append(True)

    signal.signal(signal.SIGUSR1, on_signal)

    def watchdog():
        if not done.wait(5):
            print("serve_forever() did not return 5 s after close()", flush=True)
            os._exit(3)

    done = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()
    httpd_serve_forever = srv._httpd.serve_forever

    def socketserver_loop(*args, **kwargs):
        signal.raise_signal(signal.SIGUSR1)  # lands as the loop begins
        return httpd_serve_forever(*args, **kwargs)

    srv._httpd.serve_forever = socketserver_loop
    try:
        srv.serve_forever()  # "Serve until close() is called"
    except BaseException as exc:
        print("serve_forever raised", type(exc).__name__, exc, flush=True)
        os._exit(4)
    done.set()
    assert handled == [True], handled
    print("ok", flush=True)
    os._exit(0)
    """
)


def test_close_from_a_signal_handler_as_serve_forever_begins_ends_it_cleanly() -> None:
    base = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tmp")
    os.makedirs(base, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, base],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok"), done.stdout + done.stderr
