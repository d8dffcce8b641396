"""A relay built before a fork and started after it takes an owner id of its own.

Slots and leases are freed by owner (``release_slots`` at stop, reconcile,
``free_slot``): a relay object made in a parent (a preloaded app) and started
in each worker would otherwise run under one owner in every process, and one
worker's graceful stop would free the capacity slot another still holds, past
``max_concurrency``. Run in a fresh interpreter: it forks, and the test
process has threads of its own.
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
    import os, select, sys, warnings
    from outbound.outbox import EventBus, Relay, SQLiteStore

    store = SQLiteStore(sys.argv[1])
    with store.connect() as conn:
        store.enqueue(conn, key="a", type="t", payload=1)

    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()

    def handler(message):
        os.write(to_parent_w, b"started\n")
        ready, _, _ = select.select([to_child_r], [], [], 30.0)  # bounded
        if ready:
            os.read(to_child_r, 10)

    bus = EventBus()
    bus.subscribe("t", handler)
    # Built in the parent (a preloaded app), started in a worker process.
    relay = Relay(store, bus, max_concurrency=1, poll_interval=0.02, lease=10.0)
    built_by = relay.owner
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            relay.start()
            os.write(to_parent_w, relay.owner.encode() + b"\n")
            code = 0 if relay.stop(30.0) else 2
        finally:
            os._exit(code)

    buffered = b""

    def read(timeout):
        global buffered
        while b"\n" not in buffered:
            ready, _, _ = select.select([to_parent_r], [], [], timeout)
            assert ready, "the child did not answer in time"
            buffered += os.read(to_parent_r, 200)
        line, buffered = buffered.split(b"\n", 1)
        return line

    try:
        lines = {read(30.0), read(30.0)}
        assert b"started" in lines, lines
        (child_owner,) = [line.decode() for line in lines if line != b"started"]
        assert child_owner != built_by, "the child runs under the parent's owner id"
        assert f":{pid}:" in child_owner, child_owner
        held = [s for s in store.slots() if s.owner is not None]
        assert [s.owner for s in held] == [child_owner], held
        # Another worker of the same app (here: the parent) starts and stops.
        relay.start()
        assert relay.owner == built_by  # started where it was built: its own id
        assert relay.stop(10.0)
        still = [s for s in store.slots() if s.owner is not None]
        assert still == held, f"the child's slot was freed by another process's stop: {still}"
    finally:
        os.write(to_child_w, b"go")
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    print("ok")
    """
)


def test_a_stop_in_one_process_does_not_free_the_slot_another_holds(tmp_path: Path) -> None:
    run_script_ok(SCRIPT, str(tmp_path / "o.db"))
