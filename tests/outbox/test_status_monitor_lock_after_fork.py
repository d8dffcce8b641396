"""A StatusMonitor forked while the parent was serving a request: every read of it
in the child waits forever.

StatusMonitor._reading (web/_monitor.py:191) is a plain threading.Lock, held for
the whole store read of a snapshot, and not registered with
outbound._fork.renewed_after_fork (unlike StatusServer._lock, _Monitors._lock,
the Django view's lock). Forked while a parent request thread holds it, the
child's copy stays held for good: a status server the child starts over that
monitor (StatusServer accepts one: "``store`` may also be a StatusMonitor"), or
the inherited server's page()/json(), never answers.
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
    from outbound.outbox.web import StatusMonitor, StatusServer
    warnings.simplefilter("ignore", DeprecationWarning)
    monitor = StatusMonitor(SQLiteStore(sys.argv[1]), min_interval=0)
    server = StatusServer(monitor, port=0).start()
    entered, release = threading.Event(), threading.Event()
    real_read = monitor._read
    def slow_read():           # the parent is reading a snapshot at the fork
        entered.set()
        release.wait(30)
        return real_read()
    monitor._read = slow_read
    url = server.url + "status.json"
    t = threading.Thread(target=lambda: urllib.request.urlopen(url, timeout=30).read())
    t.start()
    assert entered.wait(30)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            monitor._read = real_read
            mine = StatusServer(monitor, port=0).start()   # "start one in each process"
            try:
                with urllib.request.urlopen(mine.url + "status.json", timeout=10) as answer:
                    code = 0 if answer.status == 200 else 2
            except Exception as exc:
                print("child:", repr(exc), flush=True)
                code = 3
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    release.set()
    t.join(30)
    server.close()
    print(code)
    """
)


def test_a_monitor_forked_mid_read_answers_in_the_child(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "o.db")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("0"), "child's status request: " + done.stdout + done.stderr
