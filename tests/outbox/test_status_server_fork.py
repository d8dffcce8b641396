"""A status server started before a fork: ``start()`` in the child says it serves
in the parent, ``close()`` there returns, and the parent serves on.

The child's copy has no serving loop (that thread is the parent's):
``close()`` waited for it to end, forever. It now closes the child's copy
of the socket only. Run in a fresh interpreter: it forks.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from outbound_process import run_script_ok

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    r"""
    import os, sys, threading, urllib.request, warnings
    from outbound.outbox import SQLiteStore
    from outbound.outbox.web import StatusServer

    store = SQLiteStore(sys.argv[1])
    server = StatusServer(store, port=0).start()

    def fetch():
        with urllib.request.urlopen(server.url + "status.json", timeout=10) as answer:
            return answer.status

    assert fetch() == 200
    warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded fork"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                server.start()  # the parent's: it would not serve here
                code = 3
                raise SystemExit
            except RuntimeError as exc:
                assert "start a StatusServer of this process's own" in str(exc), exc
            closer = threading.Thread(target=server.close, daemon=True)
            closer.start()
            closer.join(10)
            code = 0 if not closer.is_alive() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "close() in the child did not return"
    assert fetch() == 200  # the parent serves on
    server.close()
    print("ok")
    """
)


def test_close_in_a_forked_child_returns_and_the_parent_serves_on(tmp_path: Path) -> None:
    run_script_ok(SCRIPT, str(tmp_path / "o.db"))
