"""Adversarial tests: the operators' line lock, (id, token) holds, the timer restart.

Operators (cancel, dead_letter, retry_dead) race each other on a few keys
while two relays deliver; an operator's transaction is held open while
relays run; the dispatcher's timer thread fails to start again and again.
"""

from __future__ import annotations

import collections
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbound import Defer, Dispatcher, current_context
from outbound.errors import StoreError
from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, RetryPolicy, postgres
from outbound.outbox._base import Ordering

from .conftest import unique_table, wait_for
from .test_adversarial_lines import Pause, enqueue, in_thread
from .test_adversarial_stress import HEADLESS_MOST, HeadlessWatch, heads_per_key, unfinished_rows

FAST_RETRY = RetryPolicy(base_delay=0.01, max_delay=0.05, max_attempts=1000, max_total=3600.0)

psycopg = pytest.importorskip("psycopg")


@pytest.fixture
def store(postgres_url: str) -> Iterator[PostgresStore]:
    made = PostgresStore(postgres_url, table=unique_table(), pool_size=10)
    yield made
    made.close()
    made.drop_schema()


def counted(url: str, table: str) -> tuple[int, int]:
    """(the counter's unfinished total, the unfinished rows)."""
    with psycopg.connect(url, autocommit=True) as conn:
        total = conn.execute(f"SELECT coalesce(sum(n), 0) FROM {table}_counts").fetchone()
        rows = conn.execute(
            f"SELECT count(*) FROM {table} WHERE status IN ('pending', 'processing')"
        ).fetchone()
    assert total is not None
    assert rows is not None
    return int(total[0]), int(rows[0])


@pytest.mark.parametrize("ordering", ["strict", "mutex"])
def test_operators_racing_on_the_same_keys_while_two_relays_run(
    postgres_url: str, ordering: Ordering
) -> None:
    # Six operator threads cancel, dead-letter and revive rows of four keys
    # (the same rows, often at once) while a writer adds rows to those keys
    # and two relays deliver them. No operator call fails (no deadlock, no
    # lock timeout, no "kept moving"); no key has two heads or waits long
    # without one; no row claimed after its cancel committed; nothing is
    # left pending; the counter agrees with the rows. The load runs for at
    # least 5 s and until each kind of call changed rows 25 times: how long
    # that takes depends on the machine's load, not on what is tested.
    keys = [f"k{i}" for i in range(4)]
    lock = threading.Lock()
    errors: list[str] = []
    claimed_at: dict[int, list[float]] = collections.defaultdict(list)
    cancelled_at: dict[int, float] = {}
    running: collections.Counter[str] = collections.Counter()
    ops: collections.Counter[str] = collections.Counter()
    slowest = [0.0]  # the longest operator call, in seconds
    stop = threading.Event()
    original_claim = postgres._PostgresSession.claim
    original_finish = postgres._PostgresSession.finish

    def claim(self: postgres._PostgresSession, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        found = original_claim(self, *args, **kwargs)
        with lock:
            for item in found:
                claimed_at[item.message.id].append(started)
        return found

    def finish(self: postgres._PostgresSession, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        done = original_finish(self, *args, **kwargs)
        with lock:
            for item in done.claimed:
                claimed_at[item.message.id].append(started)
        return done

    flaky = random.Random(3)

    def handler(message: OutboxMessage) -> None:
        with lock:
            running[message.key] += 1
            fail = flaky.random() < 0.2
        try:
            if fail:
                raise RuntimeError("flaky")
        finally:
            with lock:
                running[message.key] -= 1

    def writer() -> None:
        rnd = random.Random(1)
        while not stop.wait(0.005):
            enqueue(made, rnd.choice(keys), 0)

    def operator(o: int) -> None:
        rnd = random.Random(200 + o)
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            while not stop.is_set():
                key = rnd.choice(keys)
                ids = [
                    int(r[0])
                    for r in conn.execute(
                        f"SELECT id FROM {made.table} WHERE key = %s "
                        "AND status IN ('pending', 'processing', 'dead') "
                        "ORDER BY (status = 'dead') DESC, random() LIMIT 3",
                        (key,),
                    ).fetchall()
                ]
                for row_id in ids:
                    what = rnd.random()
                    started = time.monotonic()
                    try:
                        if what < 0.2:
                            if made.cancel([row_id]):
                                with lock:
                                    cancelled_at[row_id] = time.monotonic()
                                    ops["cancel"] += 1
                        elif what < 0.5:
                            n = made.dead_letter([row_id])
                            with lock:
                                ops["dead_letter"] += n
                        else:
                            n = made.retry_dead([row_id])
                            with lock:
                                ops["retry_dead"] += n
                    except StoreError as exc:
                        with lock:
                            errors.append(str(exc))
                    with lock:
                        slowest[0] = max(slowest[0], time.monotonic() - started)

    made = PostgresStore(postgres_url, table=unique_table(), pool_size=10, ordering=ordering)
    bus = EventBus()
    bus.subscribe("t", handler)
    mp = pytest.MonkeyPatch()
    mp.setattr(postgres._PostgresSession, "claim", claim)
    mp.setattr(postgres._PostgresSession, "finish", finish)
    relays = [
        Relay(
            made,
            bus,
            poll_interval=0.1,
            batch_size=10,
            max_inflight=4,
            lease=3.0,
            retry=FAST_RETRY,
        )
        for _ in range(2)
    ]
    threads = [threading.Thread(target=operator, args=(o,)) for o in range(6)]
    threads.append(threading.Thread(target=writer))
    try:
        for relay in relays:
            relay.start()
        with HeadlessWatch(postgres_url, made.table) as watch:
            for thread in threads:
                thread.start()
            started = time.monotonic()
            two_heads = 0
            while time.monotonic() < started + 60.0:  # the load's duration
                two_heads = max(two_heads, heads_per_key(postgres_url, made.table))
                with lock:
                    done = min(ops["cancel"], ops["dead_letter"], ops["retry_dead"])
                if done >= 25 and time.monotonic() >= started + 5.0:
                    break
                time.sleep(0.05)
            stop.set()
            for thread in threads:
                thread.join(30.0)
            wait_for(lambda: unfinished_rows(postgres_url, made.table) == 0, timeout=20)
    finally:
        stop.set()
        for relay in relays:
            if not relay.stop(5.0):
                relay.force_stop(10.0)
        mp.undo()
        made.close()
        total, rows = counted(postgres_url, made.table)
        made.drop_schema()
    assert errors == []
    assert min(ops["cancel"], ops["dead_letter"], ops["retry_dead"]) >= 25, (ops, slowest)
    assert two_heads <= 1
    assert watch.worst < HEADLESS_MOST, watch.worst_key
    late = [i for i, at in cancelled_at.items() if any(c > at for c in claimed_at.get(i, []))]
    assert late == []
    assert (total, rows) == (0, 0)


def test_a_stalled_operator_holds_back_only_new_heads(store: PostgresStore) -> None:
    # An operator's transaction is held open right after it took the looks'
    # lock. A relay still delivers every row of a key that has a head (the
    # finishers move its line up without the lock); a key with no head gets
    # one only once the operator is done.
    pause = Pause(monkeypatch_for(store), "lock_lines")
    delivered: list[tuple[str, int]] = []
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        with lock:
            delivered.append((message.key, message.payload))

    bus = EventBus()
    bus.subscribe("t", handler)
    other = enqueue(store, "other", -1, delay=60.0)
    busy = [enqueue(store, "busy", n) for n in range(5)]
    session = store.session()
    try:
        assert session.sequence(100) == 2  # both keys have heads
    finally:
        session.close()

    def operator() -> int:
        pause.arm()
        return store.cancel([other])

    op, out = in_thread(operator)
    relay = Relay(store, bus, poll_interval=0.05).start()
    try:
        assert pause.reached.wait(10)
        wait_for(lambda: [n for k, n in delivered if k == "busy"] == list(range(5)), timeout=10)
        fresh = enqueue(store, "fresh", 0)
        assert ("fresh", 0) not in delivered
        pause.go.set()
        op.join(20)
        assert out == {"result": 1}
        wait_for(lambda: ("fresh", 0) in delivered, timeout=10)
        assert ("other", -1) not in delivered
        info = store.get(fresh)
        assert info is not None
        assert busy
    finally:
        pause.go.set()
        relay.stop(10.0)


_patches: list[pytest.MonkeyPatch] = []


def monkeypatch_for(store: PostgresStore) -> pytest.MonkeyPatch:
    mp = pytest.MonkeyPatch()
    _patches.append(mp)
    return mp


@pytest.fixture(autouse=True)
def _undo_patches() -> Iterator[None]:
    yield
    while _patches:
        _patches.pop().undo()


@pytest.mark.xfail(
    strict=True,
    reason="known limit: every operator takes one table-wide lock (the relays' looks' "
    "lock): an operator on one key waits out (up to 5 s, then fails) an operator stalled "
    "on another key",
)
@pytest.mark.parametrize("op", ["cancel", "retry_dead"])
def test_an_operator_on_one_key_waits_out_a_stalled_operator_on_another(
    store: PostgresStore, op: str
) -> None:
    # A stalled operator transaction on key "a" (a slow network, a debugger,
    # a GC pause between two statements) holds the looks' lock that every
    # operator now waits for: an operator on an unrelated key "b" fails
    # after the admin lock timeout (5 s) although no row of "b" is locked.
    pause = Pause(monkeypatch_for(store), "lock_lines")
    a = enqueue(store, "a", 0)
    b = enqueue(store, "b", 0)
    if op == "retry_dead":
        store.dead_letter([b])

    def stalled() -> int:
        pause.arm()
        return store.cancel([a])

    first, _ = in_thread(stalled)
    try:
        assert pause.reached.wait(10)
        started = time.monotonic()
        method: Callable[[list[int]], int] = getattr(store, op)
        try:
            done = method([b])
        except StoreError as exc:
            pytest.fail(
                f"{op} on an unrelated key failed after {time.monotonic() - started:.1f}s: {exc}"
            )
        assert done == 1
    finally:
        pause.go.set()
        first.join(20)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_row_revived_while_its_first_delivery_runs_with_capacity_slots(
    store: PostgresStore, slots: int
) -> None:
    # As test_adversarial_lines' revived-row test, with max_concurrency: the
    # first delivery holds a slot; the row, dead-lettered and revived, is
    # claimed again once a slot is free; then it is sent, no slot is left
    # held, and another key's row goes at once.
    release = threading.Event()
    attempts: list[tuple[str, int]] = []

    def handler(message: OutboxMessage) -> None:
        attempts.append((message.key, message.attempt))
        if len(attempts) == 1:
            assert release.wait(20.0)

    bus = EventBus()
    bus.subscribe("t", handler)
    row = enqueue(store, "k")
    relay = Relay(store, bus, poll_interval=0.05, max_concurrency=slots).start()
    try:
        wait_for(lambda: attempts == [("k", 1)], timeout=10)
        assert store.dead_letter([row]) == 1
        assert store.retry_dead([row]) == 1
        if slots > 1:
            wait_for(lambda: relay.stats().claimed == 2, timeout=10)
        release.set()

        def sent(row_id: int) -> bool:
            info = store.get(row_id)
            return info is not None and info.status == "sent"

        wait_for(lambda: sent(row), timeout=5)  # well within the 30 s lease
        other = enqueue(store, "other")
        wait_for(lambda: sent(other), timeout=5)
        wait_for(lambda: all(s.owner is None for s in store.slots()), timeout=5)
        assert relay.stop(5.0)
    finally:
        release.set()
        relay.force_stop(10.0)


_FROZEN_OPERATOR = """
import os, signal, sys
from outbound.outbox import PostgresStore, postgres

original = postgres._PostgresDb.all

def all_(db, name, **params):
    found = original(db, name, **params)
    if name == "lock_lines":
        print("locked", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # a frozen VM, a debugger, SIGSTOP
    return found

postgres._PostgresDb.all = all_
store = PostgresStore(sys.argv[1], table=sys.argv[2])
store.cancel([int(sys.argv[3])])
"""


def test_a_frozen_operator_process_does_not_hold_back_new_keys_for_good(
    store: PostgresStore, postgres_url: str, tmp_path: Any
) -> None:
    delivered: list[str] = []
    bus = EventBus()
    bus.subscribe("t", lambda message: delivered.append(message.key))
    target = enqueue(store, "held", 0, delay=60.0)
    script = tmp_path / "frozen_operator.py"
    script.write_text(_FROZEN_OPERATOR)
    proc = subprocess.Popen(
        [sys.executable, str(script), postgres_url, store.table, str(target)],
        stdout=subprocess.PIPE,
        text=True,
    )
    relay = Relay(store, bus, poll_interval=0.05).start()
    try:
        stdout = proc.stdout
        assert stdout is not None
        reader, line = in_thread(stdout.readline)
        reader.join(20.0)
        assert line.get("result", "").strip() == "locked"  # it holds the lock, frozen
        enqueue(store, "fresh", 0)
        # Within the operators' 10 s idle-in-transaction limit, and a margin.
        wait_for(lambda: "fresh" in delivered, timeout=30)
    finally:
        relay.stop(10.0)
        proc.kill()  # its connection closes: the server ends its transaction
        proc.wait(10)


# ------------------------------------------------------------------ the timer


def test_a_worker_start_failing_after_the_timer_failed_strands_no_deferred_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_start = threading.Thread.start
    failing = {"timer": True, "worker": False}
    failures: collections.Counter[str] = collections.Counter()

    def start(self: threading.Thread) -> None:
        kind = "timer" if self.name.endswith("-timer") else "worker"
        if failing[kind]:
            failures[kind] += 1
            raise RuntimeError(f"can't start new thread ({kind})")
        real_start(self)

    go = threading.Event()

    def block() -> str:
        assert go.wait(20.0)
        return "blocked"

    def deferring() -> str:
        if current_context().attempt == 1:
            raise Defer(0.0)  # parks the lane: a timer add, whose thread cannot start
        return "deferred"

    d = Dispatcher(max_inflight=5, idle_timeout=60.0)
    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        d.submit("a", block)
        deferred = d.submit("k", deferring)
        wait_for(lambda: failures["timer"] > 0 and d._timer.stranded, timeout=10)
        d.submit("c", block)  # tries the timer again: it still fails
        failing["worker"] = True
        d.submit("d", lambda: "d")  # a new worker cannot start; others live
        assert failures["worker"] > 0
        failing["worker"] = failing["timer"] = False  # threads start again
        go.set()
        assert d.submit("e", lambda: "e").result(timeout=10) == "e"
        assert d.drain(3.0)  # retries what is stranded while it waits
        assert deferred.result(timeout=0) == "deferred"
    finally:
        failing["worker"] = failing["timer"] = False
        go.set()
        monkeypatch.undo()
        d.pause(0.0)  # a timer add: starts the timer, which fires what waits
        assert d.shutdown(10.0)


@pytest.mark.xfail(
    strict=True,
    reason="known limit: an operator holds the lock of the relays' looks for its whole "
    "transaction, so while it stalls (up to the 10 s idle-in-transaction limit) no key "
    "gets a new head; keys that have one go on",
)
def test_an_operator_stalled_on_a_head_in_flight_holds_back_only_its_key(
    store: PostgresStore,
) -> None:
    # The operator stalls holding the head of "x" (being delivered, its
    # handler returns meanwhile): the relay's outcome for "x" waits for that
    # row; rows of "y" still go out, in order.
    pause = Pause(monkeypatch_for(store), "lock_row")
    x_running = threading.Event()
    x_release = threading.Event()
    delivered: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def handler(message: OutboxMessage) -> None:
        if message.key == "x" and message.payload == 0:
            x_running.set()
            assert x_release.wait(20.0)
        with lock:
            delivered.append((message.key, message.payload))

    bus = EventBus()
    bus.subscribe("t", handler)
    x0, x1 = enqueue(store, "x", 0), enqueue(store, "x", 1)
    y0 = enqueue(store, "y", 0)
    relay = Relay(store, bus, poll_interval=0.05).start()
    try:
        assert x_running.wait(10)
        wait_for(lambda: ("y", 0) in delivered, timeout=10)

        def operator() -> int:
            pause.arm()
            return store.dead_letter([x1])  # a row behind x's head: locks the head first

        op, out = in_thread(operator)
        assert pause.reached.wait(10)
        x_release.set()  # x's outcome now waits for the operator
        for n in range(1, 6):
            enqueue(store, "y", n)
        wait_for(lambda: [p for k, p in delivered if k == "y"] == list(range(6)), timeout=8)
        pause.go.set()
        op.join(20)
        assert out == {"result": 1}
        wait_for(lambda: getattr(store.get(x0), "status", None) == "sent", timeout=10)
        assert ("x", 1) not in delivered
        assert y0
    finally:
        pause.go.set()
        x_release.set()
        relay.stop(10.0)


def test_an_operator_stalled_on_one_head_lets_no_other_lease_run_out(
    store: PostgresStore,
) -> None:
    # Relay A delivers "x" (returns at once after the operator locked its
    # head) and "y" (a handler that runs 4 s, within its timeout). Lease 1.5 s:
    # A renews every 0.5 s. The operator stalls holding x's head. Relay B
    # must not get "y" while A's handler for it runs.
    pause = Pause(monkeypatch_for(store), "lock_row")
    lock = threading.Lock()
    running: collections.Counter[str] = collections.Counter()
    overlaps: list[str] = []
    x_running = threading.Event()
    x_release = threading.Event()
    y_running = threading.Event()
    y_release = threading.Event()

    def handler(message: OutboxMessage) -> None:
        with lock:
            running[message.key] += 1
            if running[message.key] > 1:
                overlaps.append(message.key)
        try:
            if message.key == "x":
                x_running.set()
                assert x_release.wait(20.0)
            elif message.attempt == 1:
                y_running.set()
                y_release.wait(4.0)  # the handler's own work: 4 s at most
        finally:
            with lock:
                running[message.key] -= 1

    bus = EventBus()
    bus.subscribe("t", handler)
    x0, x1 = enqueue(store, "x", 0), enqueue(store, "x", 1)
    enqueue(store, "y", 0)
    first = Relay(store, bus, poll_interval=0.05, lease=1.5, timeout=10.0).start()
    second: Relay | None = None
    try:
        assert x_running.wait(10)
        assert y_running.wait(10)

        def operator() -> int:
            pause.arm()
            return store.dead_letter([x1])

        op, out = in_thread(operator)
        assert pause.reached.wait(10)
        x_release.set()
        second = Relay(store, bus, poll_interval=0.05, lease=1.5, timeout=10.0).start()
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline and not overlaps:  # y's handler runs 4 s
            time.sleep(0.05)
        assert overlaps == []
        y_release.set()
        pause.go.set()
        op.join(20)
        assert out == {"result": 1}
        assert x0
    finally:
        pause.go.set()
        x_release.set()
        y_release.set()
        first.stop(10.0)
        if second is not None:
            second.stop(10.0)


@pytest.mark.parametrize("ordering", ["strict", "mutex"])
def test_a_row_revived_twice_while_its_first_delivery_runs_is_sent_and_the_relay_stops(
    postgres_url: str, ordering: Ordering
) -> None:
    # Dead-lettered and revived twice while its first handler runs: the row
    # is then held three times (three claim tokens). Each delivery's outcome
    # but the last is refused; the row ends sent; the relay drains.
    made = PostgresStore(postgres_url, table=unique_table(), ordering=ordering)
    release = threading.Event()
    attempts: list[int] = []

    def handler(message: OutboxMessage) -> None:
        attempts.append(message.attempt)
        if len(attempts) == 1:
            assert release.wait(20.0)
        elif len(attempts) == 2:
            raise RuntimeError("the second delivery fails")

    bus = EventBus()
    bus.subscribe("t", handler)
    row = enqueue(made, "k")
    relay = Relay(made, bus, poll_interval=0.05, retry=FAST_RETRY).start()
    try:
        wait_for(lambda: attempts == [1], timeout=10)
        for n in (2, 3):
            assert made.dead_letter([row]) == 1
            assert made.retry_dead([row]) == 1
            wait_for(lambda n=n: relay.stats().claimed == n, timeout=10)  # type: ignore[misc]
        release.set()
        wait_for(lambda: getattr(made.get(row), "status", None) == "sent", timeout=10)
        assert relay.stop(5.0)
        assert made.status().unfinished == 0
    finally:
        release.set()
        relay.force_stop(10.0)
        made.close()
        made.drop_schema()
