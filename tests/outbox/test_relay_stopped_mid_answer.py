"""A PostgreSQL relay stopped while its claim's answer is on its way holds nothing.

The server commits a statement once it has sent the whole answer. A claim
that returned every payload, large ones in a large batch, could not all fit
in the sockets' buffers: with the relay stopped (SIGSTOP, a paused VM) the
server waited to send it with the statement uncommitted, and the claimed
rows (never leased, so never expired) and the look's lock stayed held until
the relay ran again: no other relay took them, and every operator write
timed out. A claim now leaves out payloads over 512 bytes, read next.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay

from .conftest import POSTGRES_URL, unique_table, wait_for

pytestmark = [
    pytest.mark.skipif(not POSTGRES_URL, reason="OUTBOUND_TEST_POSTGRES is not set"),
    pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc"),
]

CHILD = textwrap.dedent(
    r"""
    import os, signal, sys, threading
    import psycopg
    from outbound.outbox import EventBus, PostgresStore, Relay
    from outbound.outbox import postgres as pg

    real_run = pg._PostgresSession._run

    def run(self, name, params):
        if name == "claim":
            # Sent, then stopped before a byte of the answer is read (what a
            # SIGSTOP landing in that read does).
            conn = self.connect(30.0)
            sql = psycopg.ClientCursor(conn).mogrify(self._sql[name], params)
            conn.pgconn.send_query(sql.encode())
            conn.pgconn.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_run(self, name, params)

    pg._PostgresSession._run = run
    store = PostgresStore(sys.argv[1], table=sys.argv[2], create=False)
    bus = EventBus()
    bus.subscribe("t", lambda message: None)
    Relay(store, bus, lease=2.0, poll_interval=0.05, batch_size=60, listen=False).start()
    threading.Event().wait(120)
    """
)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_relay_stopped_mid_answer_leaves_its_rows_to_the_others() -> None:
    assert POSTGRES_URL
    table = unique_table()
    store = PostgresStore(POSTGRES_URL, table=table)
    child: subprocess.Popen[bytes] | None = None
    relay: Relay | None = None
    try:
        conn = store.connect()
        big = "x" * 200_000  # 60 of them: 12 MB, far past any socket buffer
        ids = store.enqueue_many(
            conn, [{"key": f"k{i}", "type": "t", "payload": {"p": big}} for i in range(60)]
        )
        conn.commit()
        conn.close()
        child = subprocess.Popen([sys.executable, "-c", CHILD, POSTGRES_URL, table])
        wait_for(lambda: _stopped(child.pid), timeout=30.0)
        # Its claim committed (before, the server waited to send the answer,
        # the statement uncommitted, for as long as the relay was stopped).
        wait_for(lambda: store.status().counts["processing"] == len(ids), timeout=30.0)
        seen: set[int] = set()
        bus = EventBus()

        def handler(message: OutboxMessage) -> None:
            assert message.payload == {"p": big}
            seen.add(message.id)

        bus.subscribe("t", handler)
        # The stopped relay's lease is 2 s: after it, the rows are the others'.
        relay = Relay(store, bus, lease=2.0, poll_interval=0.05, listen=False).start()
        wait_for(lambda: seen == set(ids), timeout=30.0)
        # And an operator's write is not held up by the stopped relay.
        (extra,) = store.enqueue_many(
            conn := store.connect(), [{"key": "late", "type": "other", "payload": 1}]
        )
        conn.commit()
        conn.close()
        assert store.cancel([extra]) == 1
    finally:
        if relay is not None:
            assert relay.stop(10.0)
        if child is not None:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        store.drop_schema()  # waits for the killed child's server process to end
        store.close()


@pytest.mark.parametrize("max_concurrency", [None, 4], ids=["claim", "claim_slots"])
def test_payloads_around_the_answers_cap_arrive_whole(max_concurrency: int | None) -> None:
    # Payloads past 512 bytes of JSON text are read after the claiming
    # statement (a claim, or the write that takes a key's next row).
    assert POSTGRES_URL
    store = PostgresStore(POSTGRES_URL, table=unique_table())
    try:
        sizes = [0, 400, 500, 501, 502, 503, 600, 5_000, 100_000]  # around the cap
        messages = [
            {"key": f"k{i % 3}", "type": "t", "payload": {"p": "é" * n, "n": i}}
            for i, n in enumerate(sizes * 3)
        ]
        conn = store.connect()
        ids = store.enqueue_many(conn, messages)
        conn.commit()
        conn.close()
        got: dict[int, object] = {}
        bus = EventBus()
        bus.subscribe("t", lambda message: got.__setitem__(message.id, message.payload))
        with Relay(store, bus, poll_interval=0.02, max_concurrency=max_concurrency) as relay:
            wait_for(lambda: relay.stats().sent == len(ids), timeout=30.0)
        assert got == {i: m["payload"] for i, m in zip(ids, messages, strict=True)}
    finally:
        store.close()
        store.drop_schema()
