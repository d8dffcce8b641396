"""A relay stopped (SIGSTOP) inside a handler, before its send, and continued once
another relay took its row over and sent it and the next row of its key: the
send it then makes would put the key out of order on the platform. The
handler's deadline is also the relay's lease, so the built-in sender refuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbound.errors import SendTimeout
from outbound.messages import SendRequest, TextMessage
from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, SQLiteStore
from outbound.simulator import Fault, PlatformSimulator
from outbound.telegram import TelegramSender

from .conftest import POSTGRES_URL, unique_table

CHAT = 4242

_RELAY = """
import sys, threading
from outbound.errors import SendTimeout
from outbound.messages import SendRequest, TextMessage
from outbound.outbox import EventBus, PostgresStore, Relay
from outbound.telegram import TelegramSender

db, table, url, token, chat = sys.argv[1:6]
sender = TelegramSender(token, base_url=url)

done = threading.Event()

def handle(message):
    print("holding", flush=True)  # the test stops this process now
    sys.stdin.readline()  # ... and continues it, once another relay sent this row and the next
    try:
        sender.send(SendRequest(int(chat), TextMessage(f"{message.payload['n']}|A")))
    except SendTimeout:
        print("refused", flush=True)
        raise
    else:
        print("sent", flush=True)
    finally:
        done.set()

bus = EventBus()
bus.subscribe("t", handle)
store = PostgresStore(db, table=table, create=False)
with Relay(store, bus, lease=1.0, timeout=30.0, max_inflight=1, poll_interval=0.05, name="A"):
    done.wait(60)
"""


def _enqueue_two(store: PostgresStore | SQLiteStore) -> None:
    """Rows 0 and 1 of key K."""
    conn = store.connect()
    for n in (0, 1):
        store.enqueue(conn, key="K", type="t", payload={"n": n})
    conn.commit()
    conn.close()


def _sending_bus(sender: TelegramSender, suffix: str = "") -> EventBus:
    """A bus whose handler sends each row's number (and ``suffix``) to CHAT."""

    def handle(message: OutboxMessage) -> None:
        sender.send(SendRequest(CHAT, TextMessage(f"{message.payload['n']}{suffix}")))

    bus = EventBus()
    bus.subscribe("t", handle)
    return bus


@pytest.fixture
def table() -> Iterator[str]:
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    name = unique_table()
    store = PostgresStore(POSTGRES_URL, table=name)
    yield name
    store.drop_schema()
    store.close()


def test_a_relay_continued_past_its_lease_sends_nothing_of_a_row_taken_over(table: str) -> None:
    assert POSTGRES_URL
    store = PostgresStore(POSTGRES_URL, table=table)
    with PlatformSimulator() as sim, TelegramSender(sim.token, base_url=sim.url) as sender:
        _enqueue_two(store)
        a = subprocess.Popen(
            [sys.executable, "-c", _RELAY, POSTGRES_URL, table, sim.url, sim.token, str(CHAT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert a.stdin is not None
        assert a.stdout is not None
        try:
            assert a.stdout.readline() == "holding\n"
            os.kill(a.pid, signal.SIGSTOP)  # no renewal from here on: its lease runs out

            with Relay(store, _sending_bus(sender, "|B"), lease=1.0, poll_interval=0.05):
                assert sim.wait_received(2, chat_id=CHAT, timeout=30)
            os.kill(a.pid, signal.SIGCONT)
            a.stdin.write("\n")  # the handler goes on to its send
            a.stdin.flush()
            assert a.stdout.readline() == "refused\n"
            assert a.wait(30) == 0
        finally:
            if a.poll() is None:
                a.kill()
                a.wait(10)
            store.close()
        assert [m["text"] for m in sim.received(CHAT)] == ["0|B", "1|B"]


def test_a_healthy_relays_send_has_its_whole_deadline(tmp_path: Path) -> None:
    """The lease bounds when a send may begin, not how long it may take: a send
    begun in time had its socket timeout cut to the lease as then known (two
    thirds of it), failed on an answer slower than that, and went out again."""
    store = SQLiteStore(tmp_path / "o.db")
    with PlatformSimulator() as sim, TelegramSender(sim.token, base_url=sim.url) as sender:
        _enqueue_two(store)
        # Answers after 2.2 s: past two thirds of the 3 s lease, within the timeout.
        sim.inject(*[Fault("slow", delay=2.2, chat_id=CHAT)] * 2)

        bus = _sending_bus(sender)
        with Relay(store, bus, lease=3.0, timeout=10.0, poll_interval=0.05) as relay:
            deadline = time.monotonic() + 30
            while relay.stats().sent < 2:
                assert time.monotonic() < deadline, relay.stats()
                time.sleep(0.05)
            stats = relay.stats()
    store.close()
    assert [m["text"] for m in sim.received(CHAT)] == ["0", "1"]
    assert (stats.retried, stats.requeued) == (0, 0), stats


def test_a_row_closed_by_an_operator_leaves_the_other_rows_sends_alone(tmp_path: Path) -> None:
    """A renewal that renewed one row fewer than held (an operator cancelled one) was
    counted for none: the other rows' leases, renewed in the database, seemed to
    pass, and their handlers' sends failed with SendTimeout (and went out again)."""
    store = SQLiteStore(tmp_path / "o.db")
    conn = store.connect()
    store.enqueue(conn, key="a", type="t", payload={"role": "sends"})
    cancelled_id = store.enqueue(conn, key="b", type="t", payload={"role": "waits"})
    conn.commit()
    conn.close()
    running, cancelled, sent = threading.Event(), threading.Event(), threading.Event()
    failures: list[SendTimeout] = []
    with PlatformSimulator() as sim, TelegramSender(sim.token, base_url=sim.url) as sender:

        def handle(message: OutboxMessage) -> None:
            if message.payload["role"] == "waits":  # (running on, cancelled)
                running.set()
                assert sent.wait(30)
                return
            assert cancelled.wait(10)
            try:
                for n in range(10):  # over a second: three leases of 0.3 s
                    try:
                        sender.send(SendRequest(CHAT, TextMessage(str(n))))
                    except SendTimeout as exc:
                        failures.append(exc)
                        raise
                    threading.Event().wait(0.1)
            finally:
                sent.set()

        bus = EventBus()
        bus.subscribe("t", handle)
        with Relay(store, bus, lease=0.3, timeout=10.0, poll_interval=0.05) as relay:
            assert running.wait(10)
            assert store.cancel([cancelled_id]) == 1
            cancelled.set()
            deadline = time.monotonic() + 30
            while not sent.is_set():
                assert time.monotonic() < deadline, relay.stats()
                time.sleep(0.05)
    store.close()
    assert failures == []
    assert [m["text"] for m in sim.received(CHAT)] == [str(n) for n in range(10)]
