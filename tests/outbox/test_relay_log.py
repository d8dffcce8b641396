"""A relay whose log is broken, and stop() timeouts no wait can take.

A logging handler that raises must change nothing the relay does after a
log line: a failed delivery's outcome is written all the same, a row given
up past its timeout is recorded, and the relay goes on.
"""

from __future__ import annotations

import logging
import math
import threading

import pytest

from outbound._log import _kind_of
from outbound.errors import PermanentSendError
from outbound.outbox import (
    EventBus,
    OutboxMessage,
    PostgresStore,
    Relay,
    RelayState,
    RetryPolicy,
    Store,
)

from .conftest import (
    POSTGRES_URL,
    attempts_bus,
    enqueue_keys,
    rename_table,
    unique_table,
    wait_for,
)

FAST = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.02, max_total=3600, jitter=0)


class Broken(BaseException):
    """Raised by a handler: not an Exception."""


def _statuses(store: Store, ids: list[int]) -> list[str]:
    rows = [store.get(i) for i in ids]
    return [r.status if r is not None else "gone" for r in rows]


@pytest.mark.parametrize(
    ("failure", "retry", "first"),
    [
        # retried (logged at INFO), then sent
        ("error", FAST, "sent"),
        ("base", FAST, "sent"),
        # dead at its last attempt (logged at WARNING)
        ("error", RetryPolicy(max_attempts=1, base_delay=0.01, max_total=3600), "dead"),
        # dead: a retry would be past max_total (logged at WARNING)
        ("error", RetryPolicy(max_attempts=5, base_delay=5.0, max_total=1.0), "dead"),
        # rejected (logged at WARNING)
        ("permanent", FAST, "dead"),
    ],
)
@pytest.mark.usefixtures("broken_log")
def test_a_failed_delivery_is_recorded_though_its_log_line_raises(
    store: Store, failure: str, retry: RetryPolicy, first: str
) -> None:
    calls: list[tuple[int, int]] = []

    def handler(message: OutboxMessage) -> None:
        calls.append((message.id, message.attempt))
        if len(calls) == 1:
            if failure == "error":
                raise RuntimeError("flaky")
            if failure == "base":
                raise Broken("x")
            raise PermanentSendError("no")

    bus = EventBus()
    bus.subscribe("t", handler)
    ids = enqueue_keys(store, "a", "a")
    relay = Relay(store, bus, poll_interval=0.02, retry=retry).start()
    try:
        # The key's next row goes out: the first one's outcome was written.
        wait_for(lambda: _statuses(store, ids) == [first, "sent"], timeout=10.0)
    finally:
        stopped = relay.stop(10.0)
        store.close()
        store.drop_schema()
    assert stopped is True
    stats = relay.stats()
    assert (stats.state, stats.inflight) == (RelayState.STOPPED, 0)
    attempts = [a for i, a in calls if i == ids[0]]
    assert attempts == ([1, 2] if first == "sent" else [1])


@pytest.mark.usefixtures("broken_log")
def test_a_delivery_given_up_past_its_timeout_is_recorded_though_the_log_raises(
    store: Store,
) -> None:
    # The loop gives the delivery up (timeout 0.2 s, then a grace of 1 s)
    # and logs it: the relay goes on, and the row is tried again once the
    # handler returns.
    release = threading.Event()
    bus, seen = attempts_bus()
    blocked: list[int] = []

    def slow(message: OutboxMessage) -> None:
        if message.attempt == 1:
            blocked.append(message.id)
            assert release.wait(20.0)

    bus.subscribe("t", slow)
    (row,) = enqueue_keys(store, "a")
    relay = Relay(store, bus, poll_interval=0.02, retry=FAST, timeout=0.2).start()
    try:
        wait_for(lambda: relay.stats().timed_out == 1, timeout=10.0)
        assert relay.state is RelayState.RUNNING
        release.set()
        wait_for(lambda: _statuses(store, [row]) == ["sent"], timeout=10.0)
    finally:
        release.set()
        stopped = relay.stop(10.0)
    assert stopped is True
    assert blocked == [row]
    assert seen == [(row, 1), (row, 2)]


@pytest.mark.parametrize("how", ["stop", "force_stop"])
@pytest.mark.parametrize("timeout", [math.inf, threading.TIMEOUT_MAX, threading.TIMEOUT_MAX * 2])
def test_stop_takes_any_timeout_up_to_infinity(store: Store, how: str, timeout: float) -> None:
    # Past threading.TIMEOUT_MAX no wait can take it: as long as it takes.
    bus, seen = attempts_bus()
    (row,) = enqueue_keys(store, "a")
    relay = Relay(store, bus, poll_interval=0.02).start()
    try:
        wait_for(lambda: seen == [(row, 1)])
    finally:
        stopped = getattr(relay, how)(timeout)
    assert stopped is True
    assert relay.state is RelayState.STOPPED


@pytest.mark.parametrize("timeout", [-1.0, math.nan, -math.inf])
def test_stop_refuses_a_timeout_that_is_not_one(store: Store, timeout: float) -> None:
    relay = Relay(store, EventBus(), poll_interval=0.02).start()
    try:
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            relay.stop(timeout)
        assert relay.state is RelayState.RUNNING  # refused before it began stopping
    finally:
        assert relay.stop(10.0) is True


@pytest.mark.usefixtures("broken_log")
def test_a_listener_whose_connection_drops_listens_again_though_the_log_raises() -> None:
    # The listener logs the dropped connection before it listens again: a
    # log that raises must not end its thread, or a relay that polls seldom
    # would hear of no new row.
    if not POSTGRES_URL:
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's: set OUTBOUND_TEST_POSTGRES")
    import psycopg  # noqa: PLC0415

    store = PostgresStore(POSTGRES_URL, table=unique_table())
    bus, seen = attempts_bus()
    relay = Relay(store, bus, poll_interval=3600.0).start()
    try:
        (first,) = enqueue_keys(store, "a")
        wait_for(lambda: seen == [(first, 1)], timeout=10.0)
        with psycopg.connect(store.conninfo, autocommit=True) as admin:
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query = %s AND pid <> pg_backend_pid()",
                (f"LISTEN {store.channel}",),
            ).fetchall()
            assert ended == [(True,)]

            def listening_again() -> bool:
                row = admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE query = %s",
                    (f"LISTEN {store.channel}",),
                ).fetchone()
                return row is not None and row[0] == 1

            wait_for(listening_again, timeout=10.0)
        (second,) = enqueue_keys(store, "b")
        wait_for(lambda: seen == [(first, 1), (second, 1)], timeout=10.0)
    finally:
        stopped = relay.stop(10.0)
        store.close()
        store.drop_schema()
    assert stopped is True


def test_a_failure_that_repeats_is_logged_in_full_once_then_counted(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The outbox table is renamed under a polling relay: its claims fail (the
    database answers, with an error), and on SQLite the reconciles that follow
    them, dozens a second. The first failure of each kind is a warning with its
    traceback, the others debug lines; once the table is back the relay delivers,
    and one info line per kind ends its streak, counting its failures."""
    caplog.set_level(logging.DEBUG, logger="outbound")
    bus, seen = attempts_bus()
    table = store.table
    away = f"{table}_away"
    kinds = ("outbound: outbox claim failed", "outbound: cannot reconcile outbox leases")

    def failures(level: int, kind: str | None = None) -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.levelno == level
            and r.getMessage().startswith(kinds if kind is None else kind)
            and "works again" not in r.getMessage()
        ]

    relay = Relay(store, bus, poll_interval=0.02, listen=False).start()
    try:
        rename_table(store, table, away)
        wait_for(lambda: len(failures(logging.DEBUG)) >= 10, timeout=20.0)
        rename_table(store, away, table)
        (row,) = enqueue_keys(store, "a")
        wait_for(lambda: [i for i, _ in seen] == [row], timeout=20.0)
        wait_for(lambda: any("works again" in r.getMessage() for r in caplog.records))
    finally:
        stopped = relay.stop(10.0)
    assert stopped is True
    ended = {
        r.getMessage().split(": works again")[0]: r
        for r in caplog.records
        if "works again" in r.getMessage()
    }
    for kind in kinds:
        warnings, debug = failures(logging.WARNING, kind), failures(logging.DEBUG, kind)
        if not warnings:
            continue
        (warning,) = warnings  # the first, in full
        assert warning.exc_info
        if debug:
            line = ended[warning.getMessage()]
            assert line.levelno == logging.INFO
            assert f"after {1 + len(debug)} failures" in line.getMessage()
    assert failures(logging.WARNING, kinds[0])


def test_a_failure_that_flaps_is_a_warning_once(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The outbox table goes away and comes back five times under a polling relay
    (fails, works, fails, as a flapping connection does): its claims (and on SQLite
    the reconciles that follow them) fail and work again in turn. Each kind of
    failure is a warning once in the minute, not once a flap; the relay delivers a
    row after each return."""
    caplog.set_level(logging.DEBUG, logger="outbound")
    bus, seen = attempts_bus()
    table = store.table
    away = f"{table}_away"
    kinds = ("outbound: outbox claim failed", "outbound: cannot reconcile outbox leases")

    def failing(level: int | None = None) -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if (level is None or r.levelno == level)
            and r.getMessage().startswith(kinds)
            and r.exc_info
        ]

    relay = Relay(store, bus, poll_interval=0.02, listen=False).start()
    rows: list[int] = []
    try:
        for _ in range(5):
            before = len(failing())
            rename_table(store, table, away)
            wait_for(lambda n=before: len(failing()) >= n + 3, timeout=20.0)  # type: ignore[misc]
            rename_table(store, away, table)
            rows += enqueue_keys(store, "a")
            wait_for(lambda: [i for i, _ in seen] == rows, timeout=20.0)
    finally:
        stopped = relay.stop(10.0)
    assert stopped is True
    warnings = failing(logging.WARNING)
    assert warnings
    # once a kind of step and error (a statement prepared, or not, words it apart)
    seen_kinds = {(r.getMessage(), _kind_of(r.exc_info[1])) for r in warnings if r.exc_info}
    assert len(seen_kinds) == len(warnings)
    assert len(failing(logging.DEBUG)) >= 5 * 3 - len(warnings)
    for kind in kinds:
        ends = [
            r
            for r in caplog.records
            if r.getMessage().startswith(f"{kind}") and ("works again" in r.getMessage())
        ]
        # The first end after two or more failures is told; the flaps after it are not.
        assert sum(r.levelno == logging.INFO for r in ends) <= 1
    assert sum(
        r.levelno == logging.INFO and "works again" in r.getMessage() for r in caplog.records
    ) <= len(kinds)
