"""The store contract: every outbox store passes these, on SQLite and on PostgreSQL."""

from __future__ import annotations

import enum
import json
import time
from typing import Any

import pytest

from outbound.errors import DuplicateMessage, OutboxFull, StoreError
from outbound.outbox import MAX_KEY_BYTES, PostgresStore, SQLiteStore, Store
from outbound.outbox._base import Outcome, OutcomeKind

from .conftest import StoreFactory, app_connection, wait_for

OWNER = "relay-a"


def nested(depth: int) -> Any:
    """A JSON value ``depth`` arrays deep."""
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def enqueue(store: Store, key: str, type: str = "t", payload: Any = None, **kw: Any) -> int:
    conn = app_connection(store)
    try:
        row_id = store.enqueue(conn, key=key, type=type, payload=payload, **kw)
        conn.commit()
        return row_id
    finally:
        conn.close()


def counts(store: Store) -> dict[str, int]:
    return dict(store.status().counts)


def claimed_into(into: list[Any], claimed: list[Any]) -> bool:
    """Add ``claimed`` to ``into``; whether ``into`` holds a row now (a wait_for predicate)."""
    into.extend(claimed)
    return bool(into)


def finish(session: Any, claimed: list[Any], kind: OutcomeKind = "sent", **kw: Any) -> int:
    """Write ``kind`` for every claimed row; return how many were written."""
    outcomes = [
        Outcome(c.message.id, c.token, c.message.key, kind, slot=c.slot, **kw) for c in claimed
    ]
    done = session.finish(OWNER, outcomes)
    assert not done.later
    return int(done.written)


# ------------------------------------------------------------------ enqueue


def test_enqueue_commits_and_rolls_back_with_the_callers_transaction(store: Store) -> None:
    conn = app_connection(store)
    try:
        store.enqueue(conn, key="k", type="t", payload={"n": 1})
        conn.rollback()
        assert counts(store)["pending"] == 0
        row_id = store.enqueue(conn, key="k", type="t", payload={"n": 2})
        assert counts(store)["pending"] == 0  # not committed yet: invisible to others
        conn.commit()
    finally:
        conn.close()
    assert counts(store)["pending"] == 1
    session = store.session()
    try:
        (claimed,) = session.claim(OWNER, 10, 30.0, None)
    finally:
        session.close()
    assert claimed.message.id == row_id
    assert claimed.message.payload == {"n": 2}
    assert claimed.message.attempt == 1


def test_the_payload_arrives_exactly_as_enqueued(make_store: StoreFactory) -> None:
    # Floats stay floats (also 1e16 and 1.5e300), -0.0 keeps its sign, big
    # ints keep every digit, keys keep their order: on both stores.
    payload = {
        "bbb": 1e16,
        "a": 1.5e300,
        "cc": -0.0,
        "ints": [2**70, -(2**63), 0],
        "floats": [0.1, 1.0, 2.5e-300, 123456789.123456789],
        "nested": {"z": 1, "y": {"x": [1.0, "é"]}},
    }
    store = make_store(table=f"ofx_pl_{time.monotonic_ns() % 10**9}")
    enqueue(store, "k", payload=payload)
    enqueue_many_conn = app_connection(store)
    try:
        store.enqueue_many(enqueue_many_conn, [{"key": "m", "type": "t", "payload": payload}])
        enqueue_many_conn.commit()
    finally:
        enqueue_many_conn.close()
    session = store.session()
    try:
        claimed = session.claim(OWNER, 10, 30.0, None)
    finally:
        session.close()
    assert len(claimed) == 2
    sent = json.dumps(payload, ensure_ascii=False)
    for item in claimed:
        got = item.message.payload
        assert json.dumps(got, ensure_ascii=False) == sent
        assert type(got["bbb"]) is float
        assert got["a"] == 1.5e300
        assert str(got["cc"]) == "-0.0"
        assert list(got) == list(payload)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"payload": object()}, TypeError),
        ({"payload": {"x": float("nan")}}, TypeError),
        ({"payload": "x" * 2000}, ValueError),
        ({"key": ""}, ValueError),
        ({"key": None}, TypeError),
        ({"type": ""}, ValueError),
        ({"type": 3}, TypeError),
        ({"dedupe_key": 5}, TypeError),
        ({"delay": -1}, ValueError),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    make_store: StoreFactory, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    store = make_store(max_payload_bytes=1000)
    args: dict[str, Any] = {"key": "k", "type": "t", "payload": {"ok": True}, **kwargs}
    conn = app_connection(store)
    try:
        with pytest.raises(error):
            store.enqueue(conn, **args)
        conn.commit()
    finally:
        conn.close()
    assert counts(store)["pending"] == 0


def test_a_closed_connection_is_a_store_error(store: Store) -> None:
    conn = app_connection(store)
    conn.close()
    with pytest.raises(StoreError) as info:
        store.enqueue(conn, key="k", type="t", payload=1)
    assert "closed" in str(info.value).lower()
    assert counts(store)["pending"] == 0


def test_a_connection_of_the_wrong_kind_is_refused(store: Store) -> None:
    with pytest.raises(TypeError, match="conn must be"):
        store.enqueue(object(), key="k", type="t", payload=1)


def test_max_pending_refuses_and_writes_nothing(make_store: StoreFactory) -> None:
    store = make_store(max_pending=3)
    for i in range(3):
        enqueue(store, f"k{i}")
    conn = app_connection(store)
    try:
        with pytest.raises(OutboxFull):
            store.enqueue(conn, key="k9", type="t", payload=None)
        conn.commit()
    finally:
        conn.close()
    assert counts(store)["pending"] == 3
    # A finished row frees its place.
    session = store.session()
    try:
        claimed = session.claim(OWNER, 1, 30.0, None)
        finish(session, claimed)
    finally:
        session.close()
    enqueue(store, "k9")
    assert counts(store) == {"pending": 3, "processing": 0, "sent": 1, "dead": 0, "cancelled": 0}


def test_duplicate_dedupe_key_is_refused_while_unfinished(store: Store) -> None:
    enqueue(store, "k", dedupe_key="order-1")
    conn = app_connection(store)
    try:
        with pytest.raises(DuplicateMessage, match="order-1"):
            store.enqueue(conn, key="k", type="t", payload=None, dedupe_key="order-1")
        # The caller's transaction is still usable.
        store.enqueue(conn, key="k", type="t", payload=None, dedupe_key="order-2")
        conn.commit()
    finally:
        conn.close()
    assert counts(store)["pending"] == 2
    session = store.session()
    try:
        finish(session, session.claim(OWNER, 10, 30.0, None))
    finally:
        session.close()
    enqueue(store, "k", dedupe_key="order-1")  # the first one finished: allowed again


def test_payload_round_trips_as_json(store: Store) -> None:
    payload = {"text": "héllo ✓", "n": [1, 2.5, None, True], "nested": {"a": {}}}
    enqueue(store, "k", payload=payload)
    session = store.session()
    try:
        (claimed,) = session.claim(OWNER, 1, 30.0, None)
    finally:
        session.close()
    assert claimed.message.payload == json.loads(json.dumps(payload))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"payload": {"s": "a\x00b"}}, "payload"),
        ({"payload": ["\\\x00"]}, "payload"),  # an escaped backslash, then NUL
        ({"payload": {"k\x00": 1}}, "payload"),
        ({"key": "k\x00"}, "key"),
        ({"type": "t\x00"}, "type"),
        ({"dedupe_key": "d\x00"}, "dedupe_key"),
    ],
)
def test_nul_is_refused_alike_on_every_store_and_the_transaction_stays_usable(
    store: Store, kwargs: dict[str, Any], named: str
) -> None:
    args: dict[str, Any] = {"key": "k", "type": "t", "payload": None, **kwargs}
    conn = app_connection(store)
    try:
        first = store.enqueue(conn, key="before", type="t", payload=1)
        with pytest.raises(ValueError, match=f"^{named} must not contain a NUL"):
            store.enqueue(conn, **args)
        second = store.enqueue(conn, key="after", type="t", payload=2)
        conn.commit()
    finally:
        conn.close()
    assert sorted(r.id for r in store.rows()) == [first, second]


def test_a_backslash_before_u0000_is_not_a_nul(store: Store) -> None:
    payload = {"one": "\\u0000", "two": "\\\\u0000", "\\u0000": "key"}
    enqueue(store, "k", payload=payload)
    session = store.session()
    try:
        (claimed,) = session.claim(OWNER, 1, 30.0, None)
    finally:
        session.close()
    assert claimed.message.payload == payload


def test_table_name_is_validated(make_store: StoreFactory) -> None:
    for bad in ("Outbox", "1x", "x;drop", "", "a" * 41):
        with pytest.raises(ValueError, match="table"):
            make_store(table=bad)


def test_schema_creation_is_idempotent(store: Store) -> None:
    store.create_schema()
    store.create_schema()
    enqueue(store, "k")
    assert counts(store)["pending"] == 1


# -------------------------------------------------------------------- claim


def test_claim_takes_only_the_head_of_each_key(store: Store) -> None:
    a1, a2, b1, a3 = (enqueue(store, k) for k in ("a", "a", "b", "a"))
    session = store.session()
    try:
        first = session.claim(OWNER, 10, 30.0, None)
        assert [c.message.id for c in first] == [a1, b1]
        assert session.claim(OWNER, 10, 30.0, None) == []  # a2 waits behind a1
        assert finish(session, first) == 2
        second = session.claim(OWNER, 10, 30.0, None)
        assert [c.message.id for c in second] == [a2]
        finish(session, second)
        third = session.claim(OWNER, 10, 30.0, None)
        assert [c.message.id for c in third] == [a3]
    finally:
        session.close()


def test_claim_respects_limit_and_age_order(store: Store) -> None:
    ids = [enqueue(store, f"k{i}") for i in range(5)]
    session = store.session()
    try:
        assert [c.message.id for c in session.claim(OWNER, 2, 30.0, None)] == ids[:2]
        assert [c.message.id for c in session.claim(OWNER, 10, 30.0, None)] == ids[2:]
    finally:
        session.close()


def test_an_expired_lease_is_claimed_again_and_fences_the_old_owner(store: Store) -> None:
    row_id = enqueue(store, "k")
    enqueue(store, "k")
    session = store.session()
    try:
        (old,) = session.claim(OWNER, 10, 0.05, None)
        wait_for(lambda: claimed_into(reclaimed, session.claim("relay-b", 10, 30.0, None)))
        assert [c.message.id for c in reclaimed] == [row_id]
        assert reclaimed[0].message.attempt == 2
        # The first owner lost the row: its outcome is refused.
        assert finish(session, [old]) == 0
        assert counts(store)["processing"] == 1
        done = session.finish("relay-b", [Outcome(row_id, reclaimed[0].token, "k", "sent")])
        assert done.written == 1
    finally:
        session.close()
    assert counts(store) == {"pending": 1, "processing": 0, "sent": 1, "dead": 0, "cancelled": 0}


def lease_lapsed(store: Store, row_id: int) -> bool:
    """True once the lease of the processing row ``row_id`` has run out."""
    row = store.get(row_id)
    assert row is not None
    assert row.lease_expires_at is not None
    return row.lease_expires_at < time.time()


@pytest.mark.parametrize("max_concurrency", [None, 5])
def test_a_claim_leaves_the_expired_leases_of_held_keys_alone(
    store: Store, max_concurrency: int | None
) -> None:
    # A relay's own rows whose leases ran out while their deliveries still
    # run: its claim must not take them back (nor their capacity slots).
    mine = enqueue(store, "mine")
    session = store.session()
    try:
        if max_concurrency is not None:
            session.ensure_slots(max_concurrency)
        (held,) = session.claim(OWNER, 10, 0.05, max_concurrency)
        assert held.message.id == mine
        other = enqueue(store, "other")

        wait_for(lambda: lease_lapsed(store, mine))
        found = session.claim(OWNER, 10, 30.0, max_concurrency, held_keys=["mine"])
        assert [c.message.id for c in found] == [other]  # the key's other rows: none
        assert [c.message.id for c in session.claim(OWNER, 10, 30.0, max_concurrency)] == [mine]
    finally:
        session.close()


def test_a_claim_leaves_the_expired_slots_of_held_rows_alone(store: Store) -> None:
    # A relay's own row whose lease, and slot, ran out while its outcome was
    # being written (renewals held up): the relay's next claim took the slot
    # for another row; the late outcome then freed it (by slot and owner)
    # under that row, and the next claim ran a third row beside it.
    mine = enqueue(store, "mine")
    session = store.session()
    try:
        session.ensure_slots(1)
        (held,) = session.claim(OWNER, 10, 0.05, 1)
        assert held.message.id == mine
        assert held.slot == 1
        other = enqueue(store, "other")

        wait_for(lambda: lease_lapsed(store, mine))
        assert session.claim(OWNER, 10, 30.0, 1, held_keys=["mine"], held_slots=[1]) == []
        assert finish(session, [held]) == 1  # the late outcome frees the slot
        (after,) = session.claim(OWNER, 10, 30.0, 1, held_slots=[])
        assert (after.message.id, after.slot) == (other, 1)
        enqueue(store, "third")
        assert session.claim(OWNER, 10, 30.0, 1, held_slots=[1]) == []  # one at a time
    finally:
        session.close()


reclaimed: list[Any] = []


@pytest.fixture(autouse=True)
def _clear_reclaimed() -> None:
    reclaimed.clear()


def test_renew_keeps_a_lease(store: Store) -> None:
    k = enqueue(store, "k")
    session = store.session()
    try:
        (claimed,) = session.claim(OWNER, 10, 0.3, None)
        # A renewal counts from now: it holds a row past the end of the lease it was claimed
        # with. (It renews a lapsed lease too, as long as nobody has taken the row since, so
        # how long this thread is kept off the CPU here decides nothing.)
        assert session.renew(OWNER, 30.0, [claimed]) == 1
        # A witness claimed after the renewal, on the claim's lease: once it is free again,
        # the claim's lease has run out too.
        w = enqueue(store, "w")
        (witness,) = session.claim(OWNER, 10, 0.3, None)
        assert witness.message.id == w
        got: list[Any] = []
        wait_for(lambda: claimed_into(got, session.claim("relay-b", 10, 30.0, None)))
        assert [c.message.id for c in got] == [w]
        assert session.claim("relay-b", 10, 30.0, None) == []
        assert finish(session, [claimed]) == 1
    finally:
        session.close()
    assert store.get(k).status == "sent"  # type: ignore[union-attr]


def test_max_concurrency_slots_gate_claims_and_come_back(store: Store) -> None:
    for i in range(5):
        enqueue(store, f"k{i}")
    session = store.session()
    try:
        session.ensure_slots(2)
        first = session.claim(OWNER, 10, 30.0, 2)
        assert len(first) == 2
        assert {c.slot for c in first} == {1, 2}
        assert session.claim("relay-b", 10, 30.0, 2) == []  # full: rows stay pending
        assert counts(store)["pending"] == 3
        finish(session, first[:1])
        more = session.claim("relay-b", 10, 30.0, 2)
        assert len(more) == 1
        # A crashed holder's slot comes back when its lease expires.
        expiring = session.claim(OWNER, 10, 0.05, 2)
        assert expiring == []  # no free slot yet
        session.renew(OWNER, 0.05, first[1:])
        got: list[Any] = []
        wait_for(lambda: claimed_into(got, session.claim("relay-b", 1, 30.0, 2)))
        # The holder's row expired with it: the slot and the row go together.
        assert [c.message.id for c in got] == [first[1].message.id]
        assert got[0].message.attempt == 2
    finally:
        session.close()
    assert counts(store)["processing"] == 2


def test_retry_backs_off_and_strict_order_blocks_the_key(store: Store) -> None:
    a1, a2 = enqueue(store, "a"), enqueue(store, "a")
    session = store.session()
    try:
        first = session.claim(OWNER, 10, 30.0, None)
        finish(session, first, "retry", delay=0.3, error="boom")
        assert session.claim(OWNER, 10, 30.0, None) == []  # a1 backs off; a2 still waits
        got: list[Any] = []
        wait_for(lambda: claimed_into(got, session.claim(OWNER, 10, 30.0, None)))
        assert [c.message.id for c in got] == [a1]
        assert got[0].message.attempt == 2
        finish(session, got)
        assert [c.message.id for c in session.claim(OWNER, 10, 30.0, None)] == [a2]
    finally:
        session.close()
    (row,) = [r for r in store.rows() if r.id == a1]
    assert row.status == "sent"


def test_mutex_ordering_sends_a_failed_row_to_the_back(make_store: StoreFactory) -> None:
    store = make_store(ordering="mutex")
    a1, a2 = enqueue(store, "a"), enqueue(store, "a")
    session = store.session()
    try:
        first = session.claim(OWNER, 10, 30.0, None)
        finish(session, first, "retry", delay=0.0, error="boom")
        second = session.claim(OWNER, 10, 30.0, None)
        assert [c.message.id for c in second] == [a2]  # a1 stepped aside
        assert session.claim(OWNER, 10, 30.0, None) == []  # still one per key
        finish(session, second)
        third = session.claim(OWNER, 10, 30.0, None)
        assert [c.message.id for c in third] == [a1]
    finally:
        session.close()


def test_requeue_does_not_count_an_attempt(store: Store) -> None:
    enqueue(store, "a")
    session = store.session()
    try:
        for _ in range(3):
            (claimed,) = session.claim(OWNER, 10, 30.0, None)
            assert claimed.message.attempt == 1
            finish(session, [claimed], "requeue", delay=0.0)
    finally:
        session.close()


def test_delay_postpones_a_row(store: Store) -> None:
    enqueue(store, "a", delay=0.3)
    enqueue(store, "b")
    session = store.session()
    try:
        assert [c.message.key for c in session.claim(OWNER, 10, 30.0, None)] == ["b"]
        got: list[Any] = []
        wait_for(lambda: claimed_into(got, session.claim(OWNER, 10, 30.0, None)))
        assert [c.message.key for c in got] == ["a"]
    finally:
        session.close()


# --------------------------------------------------------- command-line side


def test_status_rows_retry_dead_and_purge(store: Store) -> None:
    d1 = enqueue(store, "a")
    enqueue(store, "a")
    enqueue(store, "b")
    session = store.session()
    try:
        first = session.claim(OWNER, 10, 30.0, None)
        dead = [c for c in first if c.message.id == d1]
        sent = [c for c in first if c.message.id != d1]
        finish(session, dead, "dead", error="ValueError: bad")
        finish(session, sent)
        status = store.status()
        assert dict(status.counts) == {
            "pending": 1,
            "processing": 0,
            "sent": 1,
            "dead": 1,
            "cancelled": 0,
        }
        assert status.oldest_pending_age is not None
        assert status.oldest_pending_age >= 0
        (dead_row,) = store.rows(status="dead")
        assert (dead_row.id, dead_row.last_error) == (d1, "ValueError: bad")
        assert store.retry_dead() == 1
        # The revived row goes to the back of key "a": a2 first.
        nxt = session.claim(OWNER, 10, 30.0, None)
        assert [c.message.id for c in nxt] == [d1 + 1]
        finish(session, nxt)
        again = session.claim(OWNER, 10, 30.0, None)
        assert [c.message.id for c in again] == [d1]
        assert again[0].message.attempt == 1
        finish(session, again)
    finally:
        session.close()
    assert store.purge(statuses=["sent"], older_than=3600) == 0
    assert store.purge(statuses=["sent"]) == 3
    assert dict(store.status().counts) == {
        "pending": 0,
        "processing": 0,
        "sent": 0,
        "dead": 0,
        "cancelled": 0,
    }
    with pytest.raises(ValueError, match="purged"):
        store.purge(statuses=["pending"])


def test_store_type_specific_constructor_checks(backend: str, tmp_path: Any) -> None:
    if backend == "sqlite":
        with pytest.raises(ValueError, match="file"):
            SQLiteStore(":memory:")
    else:
        with pytest.raises(ValueError, match="conninfo"):
            PostgresStore("")


class _Chat(str, enum.Enum):
    A = "chat-a"


class _Number(enum.IntEnum):
    ONE = 1


def test_an_enum_member_is_stored_as_its_value(store: Store) -> None:
    # str() of a (str, Enum) member is "_Chat.A": a key given as the member
    # and the same key as text must be one line, in order.
    conn = app_connection(store)
    try:
        store.enqueue(conn, key=_Chat.A, type=_Chat.A, payload={}, dedupe_key=_Chat.A)
        store.enqueue(conn, key="chat-a", type="chat-a", payload={})
        store.enqueue_many(conn, [{"key": _Number.ONE, "type": "t", "payload": {}}])
        conn.commit()
        with pytest.raises(DuplicateMessage):
            store.enqueue(conn, key="x", type="t", payload={}, dedupe_key="chat-a")
    finally:
        conn.close()
    rows = sorted(store.rows(), key=lambda row: row.id)
    assert [(row.key, row.type) for row in rows] == [
        ("chat-a", "chat-a"),
        ("chat-a", "chat-a"),
        ("1", "t"),
    ]
    assert all(type(row.key) is str and type(row.type) is str for row in rows)


# ----------------------------------------------------- limits and bad input


def test_a_key_at_the_limit_is_delivered_and_one_past_it_is_refused(store: Store) -> None:
    # CJK text compresses badly: 341 characters are 1023 bytes of UTF-8.
    cjk = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(341))
    at_limit = cjk + "x"
    assert len(at_limit.encode()) == MAX_KEY_BYTES
    for name in ("key", "type", "dedupe_key"):
        args: dict[str, Any] = {"key": "k", "type": "t", "payload": None, name: at_limit + "y"}
        conn = app_connection(store)
        try:
            with pytest.raises(ValueError, match=f"^{name} is 1025 bytes in UTF-8"):
                store.enqueue(conn, **args)
        finally:
            conn.close()
    long_id = enqueue(store, at_limit, type=at_limit, dedupe_key=at_limit)
    other_id = enqueue(store, "other")
    session = store.session()
    try:
        claimed = session.claim(OWNER, 10, 30.0, None)
        assert sorted(c.message.id for c in claimed) == [long_id, other_id]
        assert finish(session, claimed) == 2
    finally:
        session.close()
    assert store.get(long_id) is not None
    assert store.get(long_id).key == at_limit  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"payload": nested(5000)}, ValueError, "^payload is nested too deeply"),
        ({"payload": nested(101)}, ValueError, "^payload is nested too deeply: 101 levels"),
        ({"payload": {"s": "\ud800"}}, ValueError, "^payload must be valid Unicode"),
        ({"key": "k\udfff"}, ValueError, "^key must be valid Unicode"),
        ({"type": "\ud800t"}, ValueError, "^type must be valid Unicode"),
        ({"dedupe_key": "d\ud800"}, ValueError, "^dedupe_key must be valid Unicode"),
        ({"delay": 1e300}, ValueError, "^delay must be at most"),
        ({"delay": 10**400}, ValueError, "^delay must be a finite number of seconds"),
        ({"key": 10**5000}, ValueError, "^key is an int of more than 1024 digits"),
        ({"key": 10**1024}, ValueError, "^key is an int of more than 1024 digits"),
        ({"payload": {1: "int", "1": "str"}}, TypeError, "^payload has a key of type int"),
        (
            {"payload": {"a": [{"b": {None: 1}}]}},
            TypeError,
            r"^payload\['a'\]\[0\]\['b'\] has a key of type NoneType",
        ),
    ],
)
def test_bad_input_gets_the_documented_error(
    store: Store, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    args: dict[str, Any] = {"key": "k", "type": "t", "payload": None, **kwargs}
    conn = app_connection(store)
    try:
        with pytest.raises(error, match=match):
            store.enqueue(conn, **args)
        with pytest.raises(error, match="^messages\\[1\\]: " + match.lstrip("^")):
            store.enqueue_many(conn, [{"key": "ok", "type": "t", "payload": 1}, args])
        conn.commit()
    finally:
        conn.close()
    assert store.status().unfinished == 0
    assert store.rows() == []


def test_a_payload_at_the_depth_limit_round_trips(store: Store) -> None:
    enqueue(store, "k", payload=nested(100))
    session = store.session()
    try:
        (claimed,) = session.claim(OWNER, 1, 30.0, None)
    finally:
        session.close()
    assert claimed.message.payload == nested(100)


@pytest.mark.parametrize("value", [2**63, 2**31, 0, -1])
def test_max_pending_out_of_range_is_refused_at_construction(
    make_store: StoreFactory, value: int
) -> None:
    with pytest.raises(ValueError, match="max_pending must be between 1 and 2147483647"):
        make_store(max_pending=value)
    make_store(max_pending=2**31 - 1)  # the largest is accepted, and enqueues work
    enqueue(make_store(max_pending=2**31 - 1), "k")


# ------------------------------------------------------------------ fencing


def test_a_stale_outcome_never_matches_a_new_row_after_a_purge(store: Store) -> None:
    old = enqueue(store, "k")
    session = store.session()
    try:
        (stale,) = session.claim(OWNER, 10, 0.05, None)  # this relay then stalls
        reclaimed: list[Any] = []
        wait_for(lambda: claimed_into(reclaimed, session.claim("relay-b", 10, 30.0, None)))
        session.finish("relay-b", [Outcome(old, reclaimed[0].token, "k", "sent")])
        assert store.purge(statuses=["sent"]) == 1
        new = enqueue(store, "k")
        assert new != old  # ids are never reused
        (fresh,) = session.claim(OWNER, 10, 30.0, None)  # the stalled relay, running again
        assert fresh.message.id == new
        assert fresh.token != stale.token
        # The late "sent" of the purged row's handler: refused.
        late = session.finish(OWNER, [Outcome(old, stale.token, "k", "sent")])
        assert (late.written, late.lost) == (0, 1)
        late = session.finish(OWNER, [Outcome(new, stale.token, "k", "sent")])
        assert (late.written, late.lost) == (0, 1)
    finally:
        session.close()
    assert store.get(new).status == "processing"  # type: ignore[union-attr]


def test_renew_extends_only_the_rows_given(store: Store) -> None:
    a, b = enqueue(store, "a"), enqueue(store, "b")
    session = store.session()
    try:
        claimed = {c.message.id: c for c in session.claim(OWNER, 10, 0.3, None)}
        assert session.renew(OWNER, 30.0, [claimed[a]]) == 1
        # "b" is processing under this owner but was not renewed: a ghost.
        got: list[Any] = []
        wait_for(lambda: claimed_into(got, session.claim("relay-b", 10, 30.0, None)))
        assert [c.message.id for c in got] == [b]
        assert session.reconcile(OWNER, [claimed[a]]) == 0
    finally:
        session.close()


def test_reconcile_releases_at_once_what_the_owner_does_not_hold(store: Store) -> None:
    a, b = enqueue(store, "a"), enqueue(store, "b")
    session = store.session()
    try:
        session.ensure_slots(2)
        claimed = {c.message.id: c for c in session.claim(OWNER, 10, 3600.0, 2)}
        assert session.claim("relay-b", 10, 30.0, None) == []
        assert session.reconcile(OWNER, [claimed[a]]) == 1
        (again,) = session.claim("relay-b", 10, 30.0, 2)  # the slot came back too
        assert again.message.id == b
        assert again.message.attempt == 2
    finally:
        session.close()


# ---------------------------------------------------------- taking next rows


def test_finish_may_take_the_next_row_of_each_finished_key(store: Store) -> None:
    a1, a2 = enqueue(store, "a"), enqueue(store, "a")
    b1, b2 = enqueue(store, "b"), enqueue(store, "b")
    c1, c2 = enqueue(store, "c"), enqueue(store, "c", delay=3600)
    d1, d2 = enqueue(store, "d"), enqueue(store, "d")
    e1, e2 = enqueue(store, "e"), enqueue(store, "e")
    session = store.session()
    try:
        heads = session.claim(OWNER, 10, 30.0, None)
        assert [c.message.id for c in heads] == [a1, b1, c1, d1, e1]
        outcomes = [
            Outcome(c.message.id, c.token, c.message.key, "sent")
            for c in heads
            if c.message.key != "e"
        ]
        (e_head,) = [c for c in heads if c.message.key == "e"]
        outcomes.append(Outcome(e1, e_head.token, "e", "retry", delay=3600.0, error="x"))
        done = session.finish(OWNER, outcomes, take=1, lease=30.0, skip_keys=["d"])
        assert done.written == 5
        assert done.lost == 0
        assert not done.later
        taken = {c.message.id: c for c in done.claimed}
        # At most ``take``; never a row not yet due (c2), of a skipped key (d2),
        # or behind a head that is to be retried (e2); oldest first.
        assert len(taken) <= 1
        if isinstance(store, PostgresStore):
            assert list(taken) == [a2]
        assert set(taken) <= {a2, b2}
        for claimed in taken.values():
            assert claimed.message.attempt == 1
            # Fenced by the token of this step: the old token is refused.
            stale = Outcome(claimed.message.id, heads[0].token, claimed.message.key, "sent")
            assert session.finish(OWNER, [stale]).lost == 1
        # What was not taken moved up and is claimed as usual, oldest first.
        rest = session.claim(OWNER, 10, 30.0, None)
        assert [c.message.id for c in rest] == [i for i in (a2, b2, d2) if i not in taken]
        assert finish(session, [*taken.values(), *rest]) == len(taken) + len(rest)
        assert session.claim(OWNER, 10, 30.0, None) == []  # c2 is not due; e1 backs off
    finally:
        session.close()
    rows = {r.id: r for r in store.rows(limit=20)}
    assert {i for i, r in rows.items() if r.status == "sent"} == {a1, a2, b1, b2, c1, d1, d2}
    assert (rows[c2].status, rows[c2].head) == ("pending", True)
    assert (rows[e1].status, rows[e1].head, rows[e2].head) == ("pending", True, False)
    assert counts(store)["pending"] == 3


def test_rows_taken_with_outcomes_keep_per_key_order_to_the_end(store: Store) -> None:
    keys, per_key = 5, 6
    ids: dict[str, list[int]] = {f"k{k}": [] for k in range(keys)}
    for _ in range(per_key):
        for key, key_ids in ids.items():
            key_ids.append(enqueue(store, key))
    delivered: dict[str, list[int]] = {key: [] for key in ids}
    session = store.session()
    try:
        held = session.claim(OWNER, 3, 30.0, None)
        while held:
            for c in held:
                delivered[c.message.key].append(c.message.id)
            outcomes = [Outcome(c.message.id, c.token, c.message.key, "sent") for c in held]
            done = session.finish(OWNER, outcomes, take=2, lease=30.0)
            assert done.written == len(held)
            held = [*done.claimed, *session.claim(OWNER, 3 - len(done.claimed), 30.0, None)]
            assert len({c.message.key for c in held}) == len(held)  # one row per key at a time
    finally:
        session.close()
    assert delivered == ids


#: Keys that an array literal must quote: quotes, backslashes, braces,
#: commas, blanks, the word NULL, letters outside ASCII.
_AWKWARD_KEYS = ['q"uote', "back\\slash", "\\", '"', "{a,b}", "a,b", "NULL", " sp ", "ünï 💬"]


def test_keys_skipped_by_a_claim_or_a_write_are_skipped_whatever_their_characters(
    store: Store,
) -> None:
    awkward = {enqueue(store, key): key for key in _AWKWARD_KEYS}
    plain, plain_next = enqueue(store, "plain"), enqueue(store, "plain")
    session = store.session()
    try:
        (head,) = session.claim(OWNER, 20, 30.0, None, _AWKWARD_KEYS)
        assert head.message.id == plain
        done = session.finish(
            OWNER,
            [Outcome(plain, head.token, "plain", "sent")],
            take=20,
            lease=30.0,
            skip_keys=_AWKWARD_KEYS,
        )
        assert done.written == 1
        # (A store may take none: SQLite's writes do not take.)
        assert [c.message.id for c in done.claimed] in ([plain_next], [])
        if isinstance(store, PostgresStore):
            assert done.claimed
        rest = session.claim(OWNER, 20, 30.0, None, ["plain"])
        assert {c.message.id: c.message.key for c in rest} == awkward
        rest += session.claim(OWNER, 20, 30.0, None, _AWKWARD_KEYS)
        assert finish(session, [*done.claimed, *rest]) == len(awkward) + 1
    finally:
        session.close()
