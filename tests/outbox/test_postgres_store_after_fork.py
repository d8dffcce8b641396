"""A PostgresStore used before a fork works in the children and the parent after it.

Its connection pool, opened in the parent (a preloaded app that checked its
outbox), went to every forked child with the parent's sockets: two
processes on one connection read each other's answers (a wrong result, a
"did not answer" drop) and broke it for all. A child now opens a pool of
its own and leaves the parent's alone (``close()`` in the child too).
Run in a fresh interpreter: it forks, and the test process has threads.
"""

from __future__ import annotations

import os
import textwrap

import pytest
from outbound_process import run_script_ok

from .conftest import POSTGRES_URL, unique_table

pytestmark = [
    pytest.mark.skipif(not POSTGRES_URL, reason="OUTBOUND_TEST_POSTGRES is not set"),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
]

SCRIPT = textwrap.dedent(
    r"""
    import os, sys, warnings
    from outbound.outbox import PostgresStore

    store = PostgresStore(sys.argv[1], table=sys.argv[2])
    with store.connect() as conn:
        store.enqueue(conn, key="k", type="t", payload=1)
    assert store.status().counts["pending"] == 1  # the parent's pool is open
    warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded fork"
    children = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for _ in range(100):
                    assert store.status().counts["pending"] == 1
                    assert [r.key for r in store.rows()] == ["k"]
                store.close()
            except BaseException as exc:
                print("child failed:", repr(exc), flush=True)
                code = 1
            os._exit(code)
        children.append(pid)
    for _ in range(100):  # the parent meanwhile, on its own pool
        assert store.status().counts["pending"] == 1
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    assert codes == [0, 0, 0], codes
    assert store.status().counts["pending"] == 1  # after the children closed theirs
    store.close()
    store.drop_schema()
    print("ok")
    """
)


def test_a_store_used_before_a_fork_works_in_every_process() -> None:
    assert POSTGRES_URL
    run_script_ok(SCRIPT, POSTGRES_URL, unique_table())
