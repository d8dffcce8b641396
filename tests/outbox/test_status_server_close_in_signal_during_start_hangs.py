"""StatusServer.close() run by a signal handler that interrupted start() -- after
start() set ``_loop`` to its new thread, before that thread is started -- never
returns: close() sees a loop on another thread and calls socketserver's
``shutdown()``, which waits for a serve_forever() that has not run yet and cannot
run until the handler returns (the RLock that start() holds lets close() in).

The signal is raised for real (signal.raise_signal runs the Python handler before
it returns) from inside threading.Thread.start of the "outbound-status-server"
thread, before the original start runs. Bounded: the script runs in a fresh
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
        srv.close()  # "Idempotent; blocks until the serving threads ended"
        handled.append(True)

    signal.signal(signal.SIGUSR1, on_signal)

    def watchdog():
        if not done.wait(5):
            print("close() in a signal handler inside start() never returned", flush=True)
            os._exit(3)

    done = threading.Event()
    orig_start = threading.Thread.start

    def start(self):
        if self.name == "outbound-status-server":
            threading.Thread.start = orig_start
            orig_start(threading.Thread(target=watchdog, daemon=True))
            signal.raise_signal(signal.SIGUSR1)  # the signal lands inside start()
        return orig_start(self)

    threading.Thread.start = start
    try:
        srv.start()
    except RuntimeError as exc:  # refusing to start a closed server would be fine
        print("start raised", exc, flush=True)
    done.set()
    assert handled == [True], handled
    srv.close()
    print("ok", flush=True)
    os._exit(0)
    """
)


def test_close_from_a_signal_handler_inside_start_returns() -> None:
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
