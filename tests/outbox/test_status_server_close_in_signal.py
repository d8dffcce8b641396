"""StatusServer.close() run by a signal handler on the main thread, at the two
points of a start where the loop is claimed but not yet running.

The signal is raised for real (signal.raise_signal runs the Python handler
before it returns). Bounded: each script runs in a fresh interpreter with a
timeout, and a watchdog of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "kill"), reason="needs signals")

# A status server, close() as SIGUSR1's handler, and a watchdog that ends the
# script (exit 3, saying ``stuck``) unless ``done`` is set within 5 s.
PREAMBLE = """
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
done = threading.Event()

def watchdog():
    if not done.wait(5):
        print(stuck, flush=True)
        os._exit(3)
"""

# StatusServer.close() run by a signal handler on the main thread right after
# StatusServer.serve_forever() claimed the loop (``_loop``/``_pid`` set) but before
# socketserver's serve_forever() registered the listening socket: close() takes the
# "on the loop's own thread" branch (sets socketserver's private flag), then shuts
# down and closes the listening socket; when the handler returns, socketserver's
# serve_forever() registers a socket whose fileno() is now -1 and serve_forever()
# raises ``ValueError: Invalid file descriptor: -1`` instead of returning.
BEFORE_THE_LOOP = """
stuck = "serve_forever() did not return 5 s after close()"
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

# StatusServer.close() run by a signal handler that interrupted start() -- after
# start() set ``_loop`` to its new thread, before that thread is started -- never
# returns: close() sees a loop on another thread and calls socketserver's
# ``shutdown()``, which waits for a serve_forever() that has not run yet and cannot
# run until the handler returns (the RLock that start() holds lets close() in).
INSIDE_START = """
stuck = "close() in a signal handler inside start() never returned"
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


def _run(scenario: str) -> None:
    base = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tmp")
    os.makedirs(base, exist_ok=True)
    script = textwrap.dedent(PREAMBLE) + textwrap.dedent(scenario)
    done = subprocess.run(
        [sys.executable, "-c", script, base],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_close_from_a_signal_handler_as_serve_forever_begins_ends_it_cleanly() -> None:
    _run(BEFORE_THE_LOOP)


def test_close_from_a_signal_handler_inside_start_returns() -> None:
    _run(INSIDE_START)
