"""StatusServer.close() in a forked child cuts the parent's in-flight request.

README: "A status server serves in the process that started it: `close()` in a
child closes only the child's copy of its socket". close() in the child still
calls self._httpd.server_close() -> ConnectionThreadsServer.close_connections(),
which does sock.shutdown(SHUT_RDWR) on every connection socket the parent was
serving at the fork (_http.py close_connections; web/_server.py close()). A
shutdown acts on the shared socket, not on the child's copy: the parent's client
gets no answer.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    r"""
    import os, sys, threading, urllib.request, warnings
    from outbound.outbox import SQLiteStore
    from outbound.outbox.web import StatusServer
    warnings.simplefilter("ignore", DeprecationWarning)
    server = StatusServer(SQLiteStore(sys.argv[1]), port=0).start()
    entered, release = threading.Event(), threading.Event()
    real_json = server.json
    def slow_json():          # the parent is answering a request at the fork
        entered.set()
        release.wait(30)
        return real_json()
    server.json = slow_json
    result = []
    def client():
        try:
            with urllib.request.urlopen(server.url + "status.json", timeout=30) as answer:
                result.append(answer.status)
        except Exception as exc:
            result.append(repr(exc))
    t = threading.Thread(target=client)
    t.start()
    assert entered.wait(30)
    pid = os.fork()
    if pid == 0:
        try:
            server.close()
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    release.set()
    t.join(30)
    server.close()
    print(result[0] if result else "no result")
    """
)


def test_close_in_a_child_leaves_the_parents_request_alone(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "o.db")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "200", "parent's in-flight request: " + done.stdout + done.stderr
