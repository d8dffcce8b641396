"""A private PostgreSQL server restarted with ``-m immediate`` under a running relay.

The server is this module's own (``initdb`` in a temporary directory, on a
free port), never the shared one. So that the test decides what a crash
loses, it runs without background writer or autovacuum, and its WAL writer
can be held (SIGSTOP) for a while: what a relay commits asynchronously
meanwhile is then flushed by nothing but a synchronous commit, and an
immediate restart loses it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from private_postgres import PrivatePostgres, private_server

from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay

from .conftest import unique_table, wait_for

psycopg = pytest.importorskip("psycopg")


@pytest.fixture(scope="module")
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of this module's own; skipped without the binaries."""
    with private_server(
        "-c fsync=off -c wal_writer_delay=10000 -c bgwriter_lru_maxpages=0 -c autovacuum=off"
    ) as server:
        yield server


def test_a_lost_outcome_is_delivered_again_without_waiting_out_its_lease(
    private_postgres: PrivatePostgres,
) -> None:
    url = private_postgres.url
    # The relay opts in to asynchronous commit: what it commits while the
    # WAL writer is held is lost by the crash.
    store = PostgresStore(f"{url}?options=-c%20synchronous_commit%3Doff", table=unique_table())
    first_may_finish = threading.Event()
    busy_may_finish = threading.Event()
    seen: list[int] = []
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            seen.append(message.payload)
        if message.payload == 1 and len(seen) <= 2:
            assert first_may_finish.wait(10.0)
        if message.payload == 0:  # keeps the relay busy, renewing its leases, throughout
            assert busy_may_finish.wait(60.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    with store.connect() as conn:
        first, second, busy = store.enqueue_many(
            conn,
            [
                {"key": "k", "type": "t", "payload": 1},
                {"key": "k", "type": "t", "payload": 2},
                {"key": "busy", "type": "t", "payload": 0},
            ],
        )
    relay = Relay(store, bus, poll_interval=0.05, lease=30.0, listen=False).start()
    try:
        wait_for(lambda: sorted(seen) == [0, 1])
        # The claim is made durable (a synchronous commit flushes the WAL
        # before it) ...
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("CREATE TABLE IF NOT EXISTS flush (x int)")
        # ... but not the outcomes written after it.
        private_postgres.hold_wal_writer()
        first_may_finish.set()
        wait_for(lambda: seen.count(2) == 1)
        wait_for(lambda: store.get(second).status == "sent")  # type: ignore[union-attr]
        private_postgres.restart()
        # The server lost the outcomes: the row went back to processing
        # under this relay, which is busy and renewing (its lease of 30 s,
        # renewed every 10 s, runs out 20 s from now at the soonest). The
        # relay reconnects, releases the row it no longer tracks, and
        # delivers it again, then the row behind it, well before that.
        wait_for(lambda: seen.count(2) == 2, timeout=15.0)
        wait_for(lambda: store.get(second).status == "sent", timeout=15.0)  # type: ignore[union-attr]
        assert relay.stats().released == 1
        assert seen[:2] == [0, 1] or seen[:2] == [1, 0]
        assert seen[2:] == [2, 1, 2]
        assert store.get(first).attempts == 2  # type: ignore[union-attr]  # claimed again
        busy_may_finish.set()
        wait_for(lambda: store.get(busy).status == "sent")  # type: ignore[union-attr]
    finally:
        first_may_finish.set()
        busy_may_finish.set()
        assert relay.stop(10.0)
        store.close()
