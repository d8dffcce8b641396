"""The durable outbox: messages that commit with the application's data, then get delivered.

::

    store = SQLiteStore("app.db")                # or PostgresStore("postgresql://...")
    with store.connect() as conn:                # the application's own transaction
        conn.execute("INSERT INTO orders ...")
        store.enqueue(conn, key="order-42", type="OrderPlaced", payload={"id": 42})
        # or many rows in one statement:
        store.enqueue_many(conn, [{"key": k, "type": "Hello", "payload": {}} for k in keys])

    bus = EventBus()
    bus.subscribe("OrderPlaced", handle_order_placed)
    with Relay(store, bus, max_concurrency=8):   # claims, delivers, marks sent
        ...

A row is delivered at least once, to every handler of its type, rows of one
key one at a time in enqueue order (``ordering="strict"``; ``"mutex"`` lets
a failing row step aside), by any number of relays in any number of
processes. See :class:`SQLiteStore`, :class:`PostgresStore` and
:class:`Relay`.
"""

from __future__ import annotations

from ._base import (
    MAX_KEY_BYTES,
    MAX_PAYLOAD_DEPTH,
    SCHEMA_VERSION,
    BlockedKey,
    LeaseInfo,
    OutboxMessage,
    OutboxStatus,
    RetryPolicy,
    RowInfo,
    SlotInfo,
    Store,
    Throughput,
)
from ._base import Ordering as Ordering
from .bus import EventBus, Handler
from .postgres import PostgresStore
from .relay import DEFAULT_RETRY, Relay, RelayState, RelayStats
from .sqlite import SQLiteStore, immediate

__all__ = [
    "DEFAULT_RETRY",
    "MAX_KEY_BYTES",
    "MAX_PAYLOAD_DEPTH",
    "SCHEMA_VERSION",
    "BlockedKey",
    "EventBus",
    "Handler",
    "LeaseInfo",
    "Ordering",
    "OutboxMessage",
    "OutboxStatus",
    "PostgresStore",
    "Relay",
    "RelayState",
    "RelayStats",
    "RetryPolicy",
    "RowInfo",
    "SQLiteStore",
    "SlotInfo",
    "Store",
    "Throughput",
    "immediate",
]
