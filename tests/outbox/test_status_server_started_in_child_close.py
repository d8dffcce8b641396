"""A StatusServer built before a fork and started (or served) in the child: close()
in that child does not stop its serving loop.

close() decides "a forked child's copy" by `self._pid != os.getpid()`, _pid being
the process that *built* the server, not the one that started it
(web/_server.py __init__ `self._pid = os.getpid()`; close()). So in the child
that started it, close() skips httpd.shutdown() and the join, closes the socket
under the running serve_forever(), which then spins on the closed descriptor
forever. Docstring: serve_forever "Serve[s] until close() is called";
close() "blocks until the serving threads ended".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import os, sys, threading, urllib.request, warnings
    from outbound.outbox import SQLiteStore
    from outbound.outbox.web import StatusServer
    warnings.simplefilter("ignore", DeprecationWarning)
    server = StatusServer(SQLiteStore(sys.argv[1]), port=0)  # built, not started
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if sys.argv[2] == "start":
                server.start()
                loop = server._thread
            else:
                loop = threading.Thread(target=server.serve_forever, daemon=True)
                loop.start()
            with urllib.request.urlopen(server.url + "status.json", timeout=10) as answer:
                assert answer.status == 200
            closer = threading.Thread(target=server.close, daemon=True)
            closer.start()
            closer.join(10)
            loop.join(10)
            code = 3 if loop.is_alive() else 0
        finally:
            os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """
)


@pytest.mark.parametrize("how", ["start", "serve_forever"])
def test_close_stops_a_loop_the_child_started(tmp_path: Path, how: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "o.db"), how],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    code = done.stdout.strip()
    assert code != "3", "the child's serving loop still runs 10 s after close() returned"
    assert code == "0", done.stdout + done.stderr
