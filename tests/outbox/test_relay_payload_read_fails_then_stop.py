"""stop() arriving while a write's payload read fails: the rows that write took
stay leased to the stopped relay (attempt counted) instead of being released.

postgres.py finish(): on a failed _read_payloads the token goes to
_lost.unseen and `self._replaced = True` "forces a reconcile" - but that flag
is only read by reconnected() at the top of the relay loop's *next* turn. If
the relay is stopping, the loop breaks in the same turn and _close() is called
with reconcile=(local reconcile or self._unanswered) == False (relay.py:801,
1023): the reconcile never runs and the rows stay 'processing' under the dead
owner until their lease expires.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from outbound.errors import StoreError
from outbound.outbox import EventBus, PostgresStore, Relay, postgres
from outbound.outbox.relay import RelayState

from .conftest import POSTGRES_URL
from .conftest import unique_table as adv_table

pytestmark = pytest.mark.skipif(not POSTGRES_URL, reason="OUTBOUND_TEST_POSTGRES is not set")


def test_rows_a_write_took_are_released_when_stop_follows_the_failed_payload_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert POSTGRES_URL
    store = PostgresStore(POSTGRES_URL, table=adv_table())
    real_run = postgres._PostgresSession._run
    holder: dict[str, Relay] = {}
    last: list[str] = []
    failed = threading.Event()

    def run(self: postgres._PostgresSession, name: str, params: object) -> object:
        if name == "payloads" and last and last[-1] == "finish" and not failed.is_set():
            failed.set()
            relay = holder["relay"]
            with relay._lock:  # what stop() does first (relay.py stop(): RUNNING -> STOPPING)
                relay._state = RelayState.STOPPING
            conn = self.connect(10.0)
            try:
                conn.execute("SELECT 1/0")
            except psycopg.Error as exc:
                raise StoreError(f"outbox database error: {exc}") from exc
        last.append(name)
        return real_run(self, name, params)

    monkeypatch.setattr(postgres._PostgresSession, "_run", run)
    relay = None
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
        bus = EventBus()
        bus.subscribe("t", lambda m: None)
        relay = holder["relay"] = Relay(store, bus, poll_interval=0.05, lease=120.0, listen=False)
        relay.start()
        assert failed.wait(30.0), "the write never took the key's next row"
        assert relay.stop(30.0)
        rows = {r.id: r for r in store.rows()}
        assert rows[ids[0]].status == "sent"
        second = rows[ids[1]]
        # Released (a reconcile's release: the lease ended now, the attempt
        # given back), not left leased to the stopped relay for 120 s.
        assert second.attempts == 0, second
        assert second.lease_expires_at is not None
        assert second.lease_expires_at <= time.time(), second
    finally:
        if relay is not None:
            relay.stop(10.0)
        store.close()
        store.drop_schema()
