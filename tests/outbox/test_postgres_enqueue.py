"""PostgreSQL enqueue: counter shards and concurrent application transactions."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outbound.errors import StoreError
from outbound.outbox import PostgresStore
from outbound.outbox._base import Outcome

from .conftest import wait_for

psycopg = pytest.importorskip("psycopg")


@pytest.fixture
def store(postgres_url: str) -> Iterator[PostgresStore]:
    made = PostgresStore(postgres_url, table=f"ofx_enq_{uuid.uuid4().hex[:8]}")
    yield made
    made.close()
    made.drop_schema()


def _scalar(store: PostgresStore, sql: str) -> Any:
    with store.connect() as conn:
        row = conn.execute(sql.replace("{t}", store.table)).fetchone()
        assert row is not None
        return row[0]


def test_an_enqueue_never_waits_for_an_unrelated_transactions_counter_shard(
    store: PostgresStore,
) -> None:
    # 15 open transactions that enqueued hold the 15 writers' shards; the
    # next ones take shards of their own instead of waiting (lock_timeout
    # turns a wait into an error, so a wait fails the test within 5 s).
    for round_ in range(3):
        conns = [store.connect() for _ in range(18)]
        try:
            for i, conn in enumerate(conns):
                conn.execute("SET lock_timeout = '5s'")
                if i == 17:
                    store.enqueue_many(
                        conn,
                        [{"key": f"m{round_}", "type": "t", "payload": n} for n in range(3)],
                    )
                else:
                    store.enqueue(conn, key=f"k{round_}-{i}", type="t", payload=i)
                    store.enqueue(conn, key=f"k{round_}-{i}", type="t", payload=i)
        finally:
            for i, conn in enumerate(conns):
                if round_ == 1 and i % 2:
                    conn.rollback()
                else:
                    conn.commit()
                conn.close()
        unfinished = _scalar(store, "SELECT count(*) FROM {t} WHERE status = 'pending'")
        assert store.status().unfinished == unfinished
    assert unfinished == 2 * (2 * 17 + 3) + 2 * 9  # round 1 rolled back the odd ones
    # A transaction's own shard folds the earlier ones in: they stay few.
    assert _scalar(store, "SELECT count(*) FROM {t}_counts WHERE shard < 0") <= 4


def test_a_writer_waiting_for_the_counter_sees_the_rows_finished_meanwhile(
    postgres_url: str,
) -> None:
    # max_pending=3; A and B are pending; an open transaction enqueued C and
    # holds the counter. D waits for it. Meanwhile A and B are sent: when C
    # commits, one row is unfinished, and D must be accepted (it was refused
    # when D's count used what it read before its wait).
    store = PostgresStore(postgres_url, table=f"ofx_mp_{uuid.uuid4().hex[:8]}", max_pending=3)
    try:
        with store.connect() as conn:
            a = store.enqueue(conn, key="a", type="t", payload=1)
            b = store.enqueue(conn, key="b", type="t", payload=2)
            conn.commit()
        holder = store.connect()
        store.enqueue(holder, key="c", type="t", payload=3)
        waiter = store.connect()
        waiter_pid = waiter.info.backend_pid
        outcome: list[Any] = []

        def enqueue_d() -> None:
            try:
                outcome.append(store.enqueue(waiter, key="d", type="t", payload=4))
                waiter.commit()
            except BaseException as exc:  # reported below
                outcome.append(exc)

        thread = threading.Thread(target=enqueue_d)
        thread.start()
        try:
            with store.connect() as watch:

                def waiting() -> bool:
                    row = watch.execute(
                        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                        (waiter_pid,),
                    ).fetchone()
                    return row is not None and row[0] == "Lock"

                wait_for(waiting, timeout=20)
            session = store.session()
            try:
                claimed = session.claim("relay", 10, 30.0, None)
                assert sorted(c.message.id for c in claimed) == [a, b]
                session.finish(
                    "relay",
                    [Outcome(c.message.id, c.token, c.message.key, "sent") for c in claimed],
                )
            finally:
                session.close()
            holder.commit()
        finally:
            thread.join(20.0)
            holder.close()
        waiter.close()
        assert len(outcome) == 1
        assert isinstance(outcome[0], int), outcome
        assert store.status().unfinished == 2
    finally:
        store.close()
        store.drop_schema()


@pytest.fixture
def limited(postgres_url: str) -> Iterator[PostgresStore]:
    made = PostgresStore(postgres_url, table=f"ofx_enc_{uuid.uuid4().hex[:8]}", max_pending=100)
    yield made
    made.close()
    made.drop_schema()


def _others_enqueue(store: PostgresStore) -> None:
    """An enqueue on a connection of its own, which a counter lock left held would
    hold up: a lock_timeout makes that wait an error."""
    with store.connect() as other:
        other.execute("SET lock_timeout = '5s'")
        store.enqueue(other, key="other", type="t", payload=1)
        other.commit()


@pytest.mark.parametrize("field", ["key", "type", "payload", "dedupe_key"])
@pytest.mark.parametrize(
    ("encoding", "text"),
    [
        ("LATIN1", "5 \u20ac"),  # (a bare UnicodeEncodeError, after the counter's lock)
        ("SJIS", "5 \u00a5n"),  # (a yen sign stored as a backslash: "\n" in a payload)
        ("EUC_KR", "\uac02"),  # (a Hangul syllable stored as its letters)
        ("LATIN1", "caf\u00e9"),  # (one LATIN1 carries: refused all the same)
    ],
)
def test_text_past_ascii_on_a_connection_not_in_utf8_is_refused_naming_it(
    limited: PostgresStore, postgres_url: str, field: str, encoding: str, text: str
) -> None:
    """On a connection whose client_encoding is not UTF8 the server converts the
    text, and may change it without a word or refuse it: a ValueError naming
    the field, before any statement (a refusal after the counter's lock had
    opened the caller's transaction left it open, every other writer waiting).
    ASCII goes in on any encoding."""
    message: dict[str, Any] = {"key": "k", "type": "t", "payload": {"n": 1}, "dedupe_key": "d"}
    message[field] = {"text": text} if field == "payload" else text
    first = next(char for char in text if not char.isascii())
    with psycopg.connect(postgres_url, options=f"-c client_encoding={encoding}") as app:
        app.execute("SELECT 1")
        app.commit()
        with pytest.raises(ValueError, match=rf"^{field} holds {first!r}, .*\({encoding}\)"):
            limited.enqueue(app, **message)
        batch = [{"key": "fine", "type": "t", "payload": "ascii"}, message]
        with pytest.raises(ValueError, match=rf"^messages\[1\]: {field} holds {first!r}"):
            limited.enqueue_many(app, batch)
        assert app.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        _others_enqueue(limited)
        limited.enqueue(app, key="cafe\\", type="t", payload={"text": "ascii \\n"})
        app.commit()
    with limited.connect() as conn:
        rows = conn.execute(f"SELECT key, payload FROM {limited.table} ORDER BY id").fetchall()
    assert rows == [("other", 1), ("cafe\\", {"text": "ascii \\n"})]


def test_a_client_encoding_python_has_no_codec_for_is_a_store_error(
    limited: PostgresStore, postgres_url: str
) -> None:
    """EUC_TW: psycopg has no codec for it, and sends no text on it; the check
    of the text raised psycopg's NotSupportedError out of enqueue, none of the
    errors it documents. A StoreError naming it, the connection left as it
    was."""
    with psycopg.connect(postgres_url, options="-c client_encoding=EUC_TW") as app:
        with pytest.raises(StoreError, match="EUC_TW"):
            limited.enqueue(app, key="k", type="t", payload={"n": 1})
        assert app.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert limited.rows() == []


def test_an_error_between_the_counters_lock_and_the_write_ends_the_transaction_it_opened(
    limited: PostgresStore, postgres_url: str
) -> None:
    """A BaseException (a Ctrl-C) after the counter's lock, before the write: the
    transaction the call opened is rolled back, its lock with it; it was left
    open unless the error was psycopg's."""
    calls = []

    class Interrupted(psycopg.Cursor):  # type: ignore[misc, name-defined]
        def execute(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(args[0])
            if len(calls) == 2:  # (the write, after the counter's lock)
                raise KeyboardInterrupt
            return super().execute(*args, **kwargs)

    with psycopg.connect(postgres_url, cursor_factory=Interrupted) as app:
        with pytest.raises(KeyboardInterrupt):
            limited.enqueue(app, key="k", type="t", payload=1)
        assert len(calls) == 2
        assert app.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        _others_enqueue(limited)
    assert [r.key for r in limited.rows()] == ["other"]
