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

from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, postgres

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


def _terminate_backend(session: object) -> None:
    import psycopg  # noqa: PLC0415

    assert POSTGRES_URL
    pid = session._conn.info.backend_pid  # type: ignore[attr-defined]
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_outcomes_written_stay_counted_when_the_next_rows_payload_read_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The write of a row's outcome takes its key's next row, whose payload is
    # read next; the connection dies in between. The outcome was written: it
    # counts as sent (not lost, written again and refused), and the row taken
    # is released, its attempt given back, and delivered once.
    assert POSTGRES_URL
    store = PostgresStore(POSTGRES_URL, table=unique_table())
    real_run = postgres._PostgresSession._run
    after: list[str] = []
    last: dict[int, str] = {}  # each session's last statement (see below)

    def run(self: postgres._PostgresSession, name: str, params: object) -> object:
        if name == "payloads" and not after:
            after.append(last.get(id(self), ""))
            _terminate_backend(self)
        last[id(self)] = name
        return real_run(self, name, params)

    monkeypatch.setattr(postgres._PostgresSession, "_run", run)
    try:
        conn = store.connect()
        ids = store.enqueue_many(
            conn,
            [
                {"key": "k", "type": "t", "payload": {"i": 0}},
                {"key": "k", "type": "t", "payload": {"p": "x" * 2000}},
            ],
        )
        conn.commit()
        conn.close()
        seen: list[int] = []
        bus = EventBus()
        bus.subscribe("t", lambda message: seen.append(message.id))
        with Relay(store, bus, poll_interval=0.05, lease=5.0, listen=False) as relay:
            wait_for(lambda: relay.stats().sent + relay.stats().lost == 2, timeout=30.0)
            stats = relay.stats()
        assert after == ["finish"], after  # the read that failed followed a write
        assert seen == ids
        assert {r.id: (r.status, r.attempts) for r in store.rows()} == {
            ids[0]: ("sent", 1),
            ids[1]: ("sent", 1),
        }
        assert (stats.sent, stats.lost) == (2, 0), stats
    finally:
        store.close()
        store.drop_schema()


def test_a_row_purged_before_its_payload_was_read_frees_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An operator cancels and purges a claimed row between the claim and the
    # read of its payload: the slot the claim gave it comes back at once (not
    # when its 30 s lease ends), and the next row goes out.
    assert POSTGRES_URL
    store = PostgresStore(POSTGRES_URL, table=unique_table())
    real_run = postgres._PostgresSession._run
    purged: list[int] = []
    try:
        conn = store.connect()
        first, second = store.enqueue_many(
            conn,
            [
                {"key": "a", "type": "t", "payload": "x" * 2000},
                {"key": "b", "type": "t", "payload": 1},
            ],
        )
        conn.commit()
        conn.close()

        def run(self: postgres._PostgresSession, name: str, params: object) -> object:
            if name == "payloads" and not purged:
                assert store.cancel([first]) == 1
                purged.append(store.purge(statuses=("cancelled",)))
            return real_run(self, name, params)

        monkeypatch.setattr(postgres._PostgresSession, "_run", run)
        seen: list[int] = []
        bus = EventBus()
        bus.subscribe("t", lambda message: seen.append(message.id))
        with Relay(store, bus, poll_interval=0.05, lease=30.0, max_concurrency=1):
            wait_for(lambda: seen == [second], timeout=10.0)
        assert purged == [1]
        assert [s.owner for s in store.slots()] == [None]
    finally:
        store.close()
        store.drop_schema()


@pytest.mark.parametrize("side", ["claim", "finish"])
def test_rows_whose_payload_read_is_refused_are_released_at_once(
    monkeypatch: pytest.MonkeyPatch, side: str
) -> None:
    # The payload read after a claiming statement fails with a server error
    # (not a lost connection): the rows the statement took are released by a
    # reconcile at once, their attempts given back, not left to their leases.
    assert POSTGRES_URL
    store = PostgresStore(POSTGRES_URL, table=unique_table())
    real_run = postgres._PostgresSession._run
    # The last statement of each session: the claim thread's session may
    # run a claim between the write's statement and its payload read.
    last: dict[int, str] = {}
    refused: list[str] = []

    def run(self: postgres._PostgresSession, name: str, params: object) -> object:
        if name == "payloads" and not refused and last.get(id(self)) == side:
            refused.append(name)
            return real_run(self, name, {"ids": "not an array"})  # the server refuses it
        last[id(self)] = name
        return real_run(self, name, params)

    monkeypatch.setattr(postgres._PostgresSession, "_run", run)
    try:
        payloads: list[object] = [{"p": "x" * 2000}, {"p": "y" * 2000}]
        if side == "finish":  # a small head, whose write takes the big row behind it
            payloads = [{"i": 0}, *payloads[:1]]
        conn = store.connect()
        ids = store.enqueue_many(conn, [{"key": "k", "type": "t", "payload": p} for p in payloads])
        conn.commit()
        conn.close()
        seen: list[int] = []
        bus = EventBus()
        bus.subscribe("t", lambda message: seen.append(message.id))
        with Relay(store, bus, poll_interval=0.05, lease=60.0, listen=False) as relay:
            wait_for(lambda: relay.stats().sent == 2, timeout=20.0)  # well within the lease
            stats = relay.stats()
        assert refused == ["payloads"]
        assert seen == ids
        assert {r.id: (r.status, r.attempts) for r in store.rows()} == {
            ids[0]: ("sent", 1),
            ids[1]: ("sent", 1),
        }
        assert stats.lost == 0, stats
    finally:
        store.close()
        store.drop_schema()
