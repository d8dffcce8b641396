"""StatusServer.close() called on a request's thread (here: from the monitor the
request reads) raises RuntimeError('cannot join current thread') out of
_HTTPServer.server_close -> join_threads, instead of closing."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

from outbound.outbox.sqlite import SQLiteStore
from outbound.outbox.web import StatusMonitor, StatusServer
from outbound.outbox.web._monitor import StatusSnapshot


def test_close_from_request_thread(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "o.db")
    outcome: dict[str, object] = {}
    done = threading.Event()

    class ClosingMonitor(StatusMonitor):
        def snapshot(self) -> StatusSnapshot:
            try:
                server.close()
                outcome["ok"] = True
            except BaseException as exc:
                outcome["error"] = repr(exc)
            finally:
                done.set()
            return super().snapshot()

    server = StatusServer(ClosingMonitor(store), port=0).start()
    try:
        urllib.request.urlopen(server.url + "status.json", timeout=15).read()
    except OSError:
        pass  # the server closed under the request: no answer
    assert done.wait(15)
    assert outcome == {"ok": True}, outcome
