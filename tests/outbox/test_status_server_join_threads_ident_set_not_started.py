"""ConnectionThreadsServer.join_threads takes ``thread.ident is not None`` to mean
"started", but a new thread sets its ident (threading.Thread._bootstrap_inner:
_set_ident, _set_tstate_lock, _set_native_id) *before* it sets ``_started``;
Thread.join() in between raises ``RuntimeError: cannot join thread before it is
started``. StatusServer.close() reaches join_threads while a request thread is in
that window when a signal handler calls it on the loop's thread while the loop waits
in Thread.start() (lock waits are interrupted by signals): close() raises.

Deterministic: the request thread, inside _set_native_id (ident set, not yet
started), sends SIGUSR1 to its process; the main thread, waiting in Thread.start()'s
_started.wait(), runs the handler, which calls close(). Bounded: a fresh
interpreter, a watchdog, a timeout."""

from __future__ import annotations

import os
import textwrap

import pytest
from outbound_process import run_script_ok

pytestmark = pytest.mark.skipif(
    not hasattr(os, "kill") or not hasattr(__import__("threading").Thread, "_set_native_id"),
    reason="needs signals and CPython's Thread._set_native_id",
)

SCRIPT = textwrap.dedent(
    """
    import os, signal, socket, sys, tempfile, threading
    from outbound.outbox.sqlite import SQLiteStore
    from outbound.outbox.web import StatusServer

    store = SQLiteStore(os.path.join(tempfile.mkdtemp(dir=sys.argv[1]), "o.db"))
    store.create_schema()
    srv = StatusServer(store, port=0)
    result = []
    handled = threading.Event()

    def on_signal(signum, frame):
        try:
            srv.close()
            result.append("ok")
        except BaseException as exc:
            result.append(f"close() raised {exc!r}")
        finally:
            handled.set()

    signal.signal(signal.SIGUSR1, on_signal)
    orig = threading.Thread._set_native_id

    def set_native_id(self):
        if self.name == "outbound-status-request":
            threading.Thread._set_native_id = orig
            os.kill(os.getpid(), signal.SIGUSR1)  # the main thread is in _started.wait()
            handled.wait(5)
        return orig(self)

    threading.Thread._set_native_id = set_native_id

    def watchdog():
        if not finished.wait(10):
            print("hung", result, flush=True)
            os._exit(3)

    finished = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()
    client = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    try:
        srv.serve_forever()
    except BaseException as exc:
        result.append(f"serve_forever() raised {exc!r}")
    finished.set()
    print(*result, flush=True)
    os._exit(0)
    """
)


def test_close_from_a_signal_handler_while_a_request_thread_starts() -> None:
    base = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tmp")
    os.makedirs(base, exist_ok=True)
    run_script_ok(SCRIPT, base, timeout=60)
