"""The shared limiters when their store fails: bounded waits, no limit exceeded, no ban lost.

Outages are real: a TCP proxy in front of the real Redis and PostgreSQL
drops or stalls every connection (``StoreProxy``), and private servers are
SIGSTOPped, killed and restarted. Two limiters on one budget stand for two
processes: ``behind`` reaches the store through the proxy, ``direct`` does
not. Most tests run on a fake clock shared by both, so every instant is
exact.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import pytest
from interrupts import held_at, line_of
from private_postgres import PrivatePostgres, private_server
from ratelimit_stores import (
    POSTGRES_URL,
    REDIS_URL,
    FakeClock,
    StoreProxy,
    drop_postgres_table,
    drop_redis_keys,
    private_redis_fixture,  # noqa: F401  (the private_redis fixture)
    redis_client,
    wait_until,
)

from outbound.errors import RateLimited
from outbound.ratelimit import (
    PostgresRateLimiter,
    Rate,
    RateLimiter,
    RateLimits,
    RedisRateLimiter,
)
from outbound.ratelimit._shared import _DOWN, _HANDOVER, SharedRateLimiter

LIMITS = RateLimits(overall=Rate(10), per_chat=Rate(1))
STORES = ["redis", "postgres"]


@dataclass
class Pair:
    behind: Any  # the limiter whose store the test takes down
    direct: Any  # another process, on the same budget, whose store stays up
    proxy: StoreProxy
    clock: FakeClock
    make: Callable[..., Any]  # another limiter behind the proxy, on the same budget


def _address(url: str, default_port: int) -> tuple[str, int]:
    from urllib.parse import urlsplit  # noqa: PLC0415

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


@contextmanager
def two_processes(store: str, limits: RateLimits = LIMITS, **options: Any) -> Iterator[Pair]:
    clock = FakeClock()
    options = {"clock": clock, "slack": 0.0, "retry_interval": 1.0, **options}
    made: list[Any] = []
    if store == "redis":
        if not REDIS_URL:
            pytest.skip("OUTBOUND_TEST_REDIS is not set: no Redis server to test against")
        redis = pytest.importorskip("redis")
        prefix = f"outbound-test:{uuid.uuid4().hex}"
        with StoreProxy(*_address(REDIS_URL, 6379)) as proxy:
            clients = [redis_client(), redis.Redis(host="127.0.0.1", port=proxy.port)]

            def make(**more: Any) -> Any:
                limiter = RedisRateLimiter(clients[1], limits, prefix=prefix, **{**options, **more})
                made.append(limiter)
                return limiter

            direct: Any = RedisRateLimiter(clients[0], limits, prefix=prefix, **options)
            try:
                yield Pair(make(), direct, proxy, clock, make)
            finally:
                for limiter in [direct, *made]:
                    limiter.close()
                drop_redis_keys(clients[0], prefix)
                for client in clients:
                    client.close()
    elif store == "postgres":
        if not POSTGRES_URL:
            pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
        psycopg = pytest.importorskip("psycopg")
        table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
        with StoreProxy(*_address(POSTGRES_URL, 5432)) as proxy:
            via = psycopg.conninfo.make_conninfo(POSTGRES_URL, host="127.0.0.1", port=proxy.port)

            def make(**more: Any) -> Any:
                limiter = PostgresRateLimiter(via, limits, table=table, **{**options, **more})
                made.append(limiter)
                return limiter

            direct = PostgresRateLimiter(POSTGRES_URL, limits, table=table, **options)
            try:
                yield Pair(make(), direct, proxy, clock, make)
            finally:
                for limiter in [direct, *made]:
                    limiter.close()
                drop_postgres_table(POSTGRES_URL, table)
    else:  # pragma: no cover
        raise ValueError(store)


# ------------------------------------------------- no limit exceeded at a switch


@pytest.mark.parametrize("store", STORES)
def test_the_fallback_starts_as_if_every_chat_had_just_sent(store: str) -> None:
    with two_processes(store) as p:
        assert p.direct.acquire(1) == 0.0  # another process sends to chat 1 ...
        p.proxy.down()  # ... and this one loses the store at once
        assert p.behind.acquire(1) == pytest.approx(1.0)  # not inside chat 1's second
        assert p.behind.degraded
        assert p.behind.acquire(2) == pytest.approx(1.0)  # nor any chat's: unknown here
        p.clock.advance(1.0)
        assert p.behind.acquire(1) == 0.0
        assert p.behind.acquire(1) == pytest.approx(4.0)  # then a quarter of the rate


@pytest.mark.parametrize("store", STORES)
def test_the_store_picks_up_where_the_fallback_left_off(store: str) -> None:
    with two_processes(store) as p:
        p.proxy.down()
        p.behind.acquire(1)
        p.clock.advance(1.0)
        assert p.behind.acquire(1) == 0.0  # sent while the store was down
        p.proxy.up()
        p.clock.advance(1.0)  # retry_interval: the next decision tries the store
        assert p.behind.acquire(2) == 0.0  # hands the fallback's state over, then decides
        assert not p.behind.degraded
        # The store knows chat 1's send: the fallback's pace (4 s) holds, from both.
        assert p.direct.acquire(1) == pytest.approx(3.0)
        assert p.behind.acquire(1) == pytest.approx(3.0)


@pytest.mark.parametrize("store", STORES)
def test_the_fallbacks_bookings_leave_no_plan_behind_in_the_store(store: str) -> None:
    """The fallback's plan (how far ahead it had booked slots) was handed over without
    the bookings it stood for: the store held a plan 24 s ahead that no booking
    filled, and every process was held behind it, the budget idle."""
    with two_processes(store, RateLimits(overall=Rate(10))) as p:
        p.proxy.down()
        p.behind.acquire(0)
        # Sixty parked chats booked a quarter of the rate apart: 0.4 s, 24 s ahead.
        booked = [p.behind.acquire(chat) for chat in range(1, 61)]
        assert max(booked) > 20.0
        p.proxy.up()
        p.clock.advance(1.0)  # retry_interval: the next decision hands the state over
        p.behind.acquire(1000)
        assert not p.behind.degraded
        # A chat of a process that never lost the store goes at the pace of the
        # sends made, not behind bookings the store never saw.
        assert p.direct.acquire(2000) < 1.0
        # The chats booked locally come back, in turn, at the whole rate.
        p.clock.advance(1.0)
        waits = [p.behind.acquire(chat) for chat in range(1, 61)]
        assert max(waits) < 8.0, waits
        # And the fallback forgot them: at the next outage, once its floors have
        # passed, a new chat is not held behind slots booked in the last one.
        p.clock.advance(10.0)
        p.proxy.down()
        p.behind.acquire(5000)
        assert p.behind.degraded
        p.clock.advance(1.0)
        assert p.behind.acquire(5001) < 1.0


def _most_in_a_window(times: list[float], period: float) -> int:
    times = sorted(times)
    return max(
        (sum(1 for t in times[i:] if t < start + period - 1e-9) for i, start in enumerate(times)),
        default=0,
    )


@pytest.mark.parametrize("store", STORES)
def test_a_grant_the_store_made_after_the_switch_to_the_fallback_is_not_used(
    store: str,
) -> None:
    """One decision's answer (a grant) is on its way back while another thread finds
    the store down, and the fallback (the only process: a share of 1) takes over,
    floored for what the store had granted until then. The late grant used on top of
    the fallback's sends put 11 in a second of an overall limit of 10."""
    limits = RateLimits(overall=Rate(10))
    with two_processes(store, limits, fallback_share=1.0) as p:
        answered, release = threading.Event(), threading.Event()
        real = p.behind._store_decide

        def late(now: float | None, chat: Any, group: bool, book: bool) -> Any:
            answer = real(now, chat, group, book)
            if chat == "late":
                answered.set()
                assert release.wait(10.0)
            return answer

        p.behind._store_decide = late
        granted: list[float] = []
        late_wait: list[float] = []
        thread = threading.Thread(target=lambda: late_wait.append(p.behind.acquire("late")))
        thread.start()
        try:
            assert answered.wait(10.0)  # granted in the store; not returned yet
            start = p.clock.now
            granted.append(start)
            p.proxy.down()
            chat = 0
            for _ in range(40):  # 2 s, a decision every 50 ms
                p.clock.advance(0.05)
                if p.clock.now - start >= 0.95 and thread.is_alive():
                    release.set()
                    thread.join(10.0)
                    if late_wait == [0.0]:
                        granted.append(p.clock.now)
                if p.behind.acquire(f"c{chat}", book=False) == 0.0:
                    granted.append(p.clock.now)
                    chat += 1
        finally:
            release.set()
            thread.join(10.0)
        assert p.behind.degraded
        assert len(late_wait) == 1
        assert late_wait[0] > 0.0  # decided locally: the fallback is spent
        assert _most_in_a_window(granted, 1.0) <= 10, granted


def _fallback_then_store(
    p: Pair,
    sent: threading.Event,
    answered: threading.Event,
    release: threading.Event,
    thread: threading.Thread,
    late_wait: list[float],
) -> list[float]:
    """With the store found down and a decision for chat "late" held in transit:
    the fallback grants "late" (then the held request reaches the store, which
    grants it too), the store is tried again and takes the fallback's state over,
    then the held answer comes back. The times "late" was sent, a decision every
    50 ms of the fake clock."""
    sends: list[float] = []
    for step in range(80):
        p.clock.advance(0.05)
        if not sent.is_set():
            if p.behind.acquire("late", book=False) == 0.0:  # the fallback's
                sends.append(p.clock.now)
                sent.set()  # the request reaches the store now
                assert answered.wait(10.0)
            continue
        p.behind.acquire(f"other{step}", book=False)  # tries the store in time
        if not p.behind.degraded:  # handed over: back up
            release.set()
            thread.join(10.0)
            if late_wait == [0.0]:
                sends.append(p.clock.now)
            break
    return sends


@pytest.mark.parametrize("store", STORES)
def test_a_grant_the_store_made_during_an_outage_it_came_back_from_is_not_used(
    store: str,
) -> None:
    """One decision's request reaches the store after another thread found the store
    down and the fallback granted the same chat (the store does not know of it), and
    its answer comes back after the store answered again and took the fallback's
    state over: used, it was a second send to the chat in one period (limit 1)."""
    limits = RateLimits(per_chat=Rate(1))
    with two_processes(store, limits, fallback_share=1.0, retry_interval=1.5) as p:
        asked, sent = threading.Event(), threading.Event()
        answered, release = threading.Event(), threading.Event()
        real = p.behind._store_decide
        reset = p.behind._store_errors[0]

        def in_transit(now: float | None, chat: Any, group: bool, book: bool) -> Any:
            if chat == "down":  # (the store found down by this decision)
                raise reset("the connection was reset")
            if chat != "late" or asked.is_set():
                return real(now, chat, group, book)
            asked.set()
            assert sent.wait(10.0)  # the request on its way
            answer = real(now, chat, group, book)
            answered.set()
            assert release.wait(10.0)  # the answer on its way
            return answer

        p.behind._store_decide = in_transit
        late_wait: list[float] = []
        thread = threading.Thread(
            target=lambda: late_wait.append(p.behind.acquire("late", book=False))
        )
        thread.start()
        try:
            assert asked.wait(10.0)
            p.behind.acquire("down")
            assert p.behind.degraded
            sends = _fallback_then_store(p, sent, answered, release, thread, late_wait)
        finally:
            sent.set()
            release.set()
            thread.join(10.0)
        assert not p.behind.degraded
        assert len(sends) >= 1
        assert _most_in_a_window(sends, 1.0) <= 1, sends


@pytest.mark.parametrize("store", STORES)
def test_an_outage_that_begins_as_a_decision_looks_at_the_state_is_seen(store: str) -> None:
    """The decision counted the outages after it found the store up: an outage that
    began in between (its request sent all the same, while the fallback granted the
    chat) was not seen when the answer came back after the store did."""
    limits = RateLimits(per_chat=Rate(1))
    with two_processes(store, limits, fallback_share=1.0, retry_interval=1.5) as p:
        at_count, counted = threading.Event(), threading.Event()
        sent, answered, release = threading.Event(), threading.Event(), threading.Event()
        real = p.behind._store_decide
        reset = p.behind._store_errors[0]
        late_thread: list[threading.Thread] = []

        def in_transit(now: float | None, chat: Any, group: bool, book: bool) -> Any:
            if chat == "down":
                raise reset("the connection was reset")
            if chat != "late" or threading.current_thread() is not late_thread[0]:
                return real(now, chat, group, book)
            assert sent.wait(10.0)  # the request on its way
            answer = real(now, chat, group, book)
            answered.set()
            assert release.wait(10.0)  # the answer on its way
            return answer

        decide = SharedRateLimiter._decide
        count_line = line_of(decide, "outages = self._outages")
        trace = held_at(decide.__code__, count_line, at_count, counted)
        late_wait: list[float] = []

        def late() -> None:
            sys.settrace(trace)
            try:
                late_wait.append(p.behind.acquire("late", book=False))
            finally:
                sys.settrace(None)
                answered.set()  # (also when it did not ask the store)

        p.behind._store_decide = in_transit
        thread = threading.Thread(target=late)
        late_thread.append(thread)
        thread.start()
        try:
            assert at_count.wait(10.0)
            p.behind.acquire("down")  # the outage begins here
            assert p.behind.degraded
            counted.set()
            sends = _fallback_then_store(p, sent, answered, release, thread, late_wait)
        finally:
            counted.set()
            sent.set()
            release.set()
            thread.join(10.0)
        assert len(sends) >= 1
        assert _most_in_a_window(sends, 1.0) <= 1, sends


@pytest.mark.parametrize("store", STORES)
def test_a_decision_whose_store_call_failed_does_not_grant_once_the_store_is_back(
    store: str,
) -> None:
    """Its call failed (the store switched to the fallback), and before it decided
    locally another decision handed the fallback's state over: its local grant, made
    after that snapshot, never reached the store, which granted the chat again."""
    limits = RateLimits(per_chat=Rate(1))
    with two_processes(store, limits, fallback_share=1.0) as p:
        reached, go_on = threading.Event(), threading.Event()
        real = p.behind._store_decide
        reset = p.behind._store_errors[0]
        held: list[threading.Thread] = []

        def failing(now: float | None, chat: Any, group: bool, book: bool) -> Any:
            if threading.current_thread() is held[0] and not reached.is_set():
                raise reset("the connection was reset")  # this decision's own call
            return real(now, chat, group, book)

        p.behind._store_decide = failing
        deciding = SharedRateLimiter._decide
        after_failed = line_of(deciding, "self._store_failed(exc)") + 1
        trace = held_at(deciding.__code__, after_failed, reached, go_on)
        waits: list[float] = []

        def decide() -> None:
            sys.settrace(trace)
            try:
                waits.append(p.behind.acquire("x", book=False))
            finally:
                sys.settrace(None)

        thread = threading.Thread(target=decide)
        held.append(thread)
        thread.start()
        try:
            assert reached.wait(10.0)
            assert p.behind.degraded
            p.clock.advance(1.0)  # retry_interval: the next decision tries the store
            p.behind.acquire("other", book=False)
            assert not p.behind.degraded  # handed over: back up
        finally:
            go_on.set()
            thread.join(10.0)
        sends = [p.clock.now] if waits == [0.0] else []
        if p.behind.acquire("x", book=False) == 0.0:
            sends.append(p.clock.now)
        assert len(sends) <= 1, sends


@contextmanager
def _handing_over(p: Pair) -> Iterator[None]:
    """The store found down (a decision's call fails), then tried again: it answers,
    and the body runs while the try is held in its first write of the fallback's
    state (a ban of chat "w"), which goes on once the body is done."""
    real_decide = p.behind._store_decide
    real_handover = p.behind._store_handover
    reset = p.behind._store_errors[0]
    handing, go_on = threading.Event(), threading.Event()

    def decide(now: float | None, chat: Any, group: bool, book: bool) -> Any:
        if chat == "down":
            raise reset("the connection was reset")
        return real_decide(now, chat, group, book)

    def handover(now: float | None, entries: Any) -> Any:
        if p.behind._state == _HANDOVER and not handing.is_set():
            handing.set()
            assert go_on.wait(10.0)
        return real_handover(now, entries)

    p.behind._store_decide = decide
    p.behind._store_handover = handover
    p.behind.acquire("down", book=False)
    assert p.behind.degraded
    p.behind._fallback._ban("w", 60.0)  # something to hand over
    p.clock.advance(1.0)
    trying = threading.Thread(target=lambda: p.behind.acquire("other", book=False))
    trying.start()
    try:
        assert handing.wait(10.0)
        yield
    finally:
        go_on.set()
        trying.join(10.0)


@pytest.mark.parametrize("store", STORES)
def test_a_ban_whose_write_failed_during_a_handover_reaches_the_store(store: str) -> None:
    """A 429 recorded while the fallback's state was handed over, whose own write
    to the store failed: the handover's snapshot was taken before the ban, and the
    ban never reached the store (the other processes sent to the banned chat)."""
    with two_processes(store, RateLimits(per_chat=Rate(1)), fallback_share=1.0) as p:
        real_record = p.behind._store_record
        reset = p.behind._store_errors[0]
        fail_record = threading.Event()

        def record(now: float | None, chat: Any, seconds: float, scope: Any) -> Any:
            if fail_record.is_set():
                fail_record.clear()
                raise reset("the connection was reset")
            return real_record(now, chat, seconds, scope)

        p.behind._store_record = record
        with _handing_over(p):
            fail_record.set()
            p.behind.record_429("y", 30.0, "chat")  # its write to the store fails
        for step in range(5):  # (the next try hands it over)
            if not p.behind.degraded:
                break
            p.clock.advance(1.0)
            p.behind.acquire(f"next{step}", book=False)
        assert not p.behind.degraded
        assert p.direct.acquire("y", book=False) > 0.0  # the other process is held


@pytest.mark.parametrize("store", STORES)
def test_a_late_failure_beside_a_handover_leaves_it_be(store: str) -> None:
    """A decision's call made before the outage fails late, while the store, tried
    again, takes the fallback's state: it carries nothing the handover lacks (only
    a ban that did not reach the store does), and the handover went on."""
    with two_processes(store, RateLimits(per_chat=Rate(1)), fallback_share=1.0) as p:
        reset = p.behind._store_errors[0]
        with _handing_over(p):
            p.behind._store_failed(reset("a decision's call, made before, timed out"))
        assert not p.behind.degraded


@pytest.mark.parametrize("where", ["write", "snapshot"])
@pytest.mark.parametrize("store", STORES)
def test_a_ctrl_c_during_the_handover_back_to_the_store_leaves_it_to_the_next_decision(
    store: str, where: str
) -> None:
    """A KeyboardInterrupt while the fallback's state is written back to the store (or
    while it is read, under the health lock) left the limiter handing over for good:
    every decision answered "a moment" after it."""
    with two_processes(store) as p:
        p.proxy.down()
        p.behind.record_429(7, 30.0, "chat")  # a ban to hand over
        assert p.behind.degraded
        p.proxy.up()
        p.clock.advance(1.0)  # retry_interval: the next decision tries the store
        real = p.behind._store_handover
        export = p.behind._fallback._export

        def interrupted(now: float | None, entries: Any) -> None:
            if entries:
                raise KeyboardInterrupt
            real(now, entries)

        def interrupted_export() -> Any:
            raise KeyboardInterrupt

        if where == "write":
            p.behind._store_handover = interrupted
        else:
            p.behind._fallback._export = interrupted_export
        with pytest.raises(KeyboardInterrupt):
            p.behind.acquire(1)
        p.behind._store_handover = real
        p.behind._fallback._export = export
        assert p.behind._state == _DOWN  # down, not handing over for good
        assert p.behind.acquire(2) == 0.0  # the next decision tries the store again
        assert not p.behind.degraded
        assert p.direct.acquire(7) == pytest.approx(30.0, abs=1.5)  # the ban reached it


def _lines(function: Any, *, before: str | None = None) -> list[int]:
    """The lines of ``function`` where a statement begins (up to the first line
    holding ``before``): where a signal handler's exception may land."""
    import dis  # noqa: PLC0415

    source, first = inspect.getsourcelines(function)
    end = math.inf
    if before is not None:
        end = first + next(i for i, text in enumerate(source) if before in text)
    lines = {line for _, line in dis.findlinestarts(function.__code__) if line}
    return sorted(line for line in lines if first < line < end)


def _interrupted(function: Any, line: int, call: Callable[[], object]) -> bool:
    """Run ``call`` with a KeyboardInterrupt raised as ``line`` of ``function`` begins
    (its first run there); whether it was."""
    code = function.__code__
    fired: list[int] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(line)
            raise KeyboardInterrupt
        return trace

    sys.settrace(trace)
    try:
        call()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return bool(fired)


# Where a decision tries a store marked down and hands its state back to it.
_TRY_POINTS = [
    (SharedRateLimiter._decide, line)
    for line in _lines(SharedRateLimiter._decide, before="fallback._banned(")
] + [
    (function, line)
    for function in (SharedRateLimiter._try_store, SharedRateLimiter._settling_locked)
    for line in _lines(function)
]


@pytest.mark.parametrize("store", STORES)
def test_a_ctrl_c_at_any_line_of_a_try_of_the_store_leaves_it_to_be_tried_again(
    store: str,
) -> None:
    """A KeyboardInterrupt (any exception of a signal handler) landing in a try of a
    store marked down, or in the handover back to it: landing after the claim of
    the try, before its ``try``, left the claim for good (the store never tried
    again: the process kept to its local share for the rest of its life); landing
    between the handover's end and the switch back, every decision answered
    "settling" for good. One run per line, the interrupt raised as the line
    begins (where a signal handler runs)."""
    with two_processes(store) as p:
        hit = 0
        for function, line in _TRY_POINTS:
            p.proxy.down()
            limiter = p.make()
            limiter.acquire(1)
            limiter.record_429(9, 30.0, "chat")  # a ban to hand over
            p.clock.advance(1.0)
            limiter.acquire(7)
            assert limiter.acquire(8) > 0.0  # booked a slot ahead, in the fallback's plan
            assert limiter.degraded
            p.proxy.up()
            p.clock.advance(1.0)  # retry_interval: the next decision tries the store
            hit += _interrupted(function, line, functools.partial(limiter.acquire, 2))
            # Past what a try and a handover may take (and the next retry_interval).
            p.clock.advance(3 * limiter.timeout + 3.0)
            for chat in range(3, 6):
                limiter.acquire(chat)
            where = f"{function.__name__} line {line}"
            assert not limiter.degraded, f"never tried again after a Ctrl-C at {where}"
            p.clock.advance(1.0)  # (the overall limit's next slot)
            assert limiter.acquire(100) == 0.0, f"granted nothing after a Ctrl-C at {where}"
            # (Kept, the plan of chat 1's booking would hold the next outage's chats back.)
            assert limiter._fallback._overall_plan is None, f"plan kept after a Ctrl-C at {where}"
            limiter.close()
        assert hit >= len(_TRY_POINTS) // 2  # (the sweep reached the code it sweeps)


@pytest.mark.parametrize("store", STORES)
def test_a_ctrl_c_at_any_line_of_a_failure_of_the_store_keeps_the_fallback_floored(
    store: str,
) -> None:
    """A KeyboardInterrupt landing as the store is found down, after the switch to the
    local share and before the fallback was held back for what the store had
    granted: the fallback granted a chat's send again, at once (two sends within
    a second at one a second, in one process)."""
    with two_processes(store, RateLimits(per_chat=Rate(1))) as p:
        hit = 0
        for line in _lines(SharedRateLimiter._store_failed):
            limiter = p.make()
            chat = 1000 + line
            assert limiter.acquire(chat) == 0.0  # granted by the store
            p.proxy.down()
            hit += _interrupted(
                SharedRateLimiter._store_failed, line, functools.partial(limiter.acquire, chat)
            )
            again = limiter.acquire(chat)  # at the same instant (the clock stood still)
            assert again > 0.0, f"granted twice after a Ctrl-C at _store_failed line {line}"
            p.proxy.up()
            limiter.close()
        assert hit >= 3


def test_a_handover_taken_as_abandoned_never_switches_to_the_store_under_the_next() -> None:
    """A handover whose write outlasted its claim (its thread stalled: a SIGSTOP, a
    frozen VM) is taken as abandoned; decisions go on locally, and the next try
    hands those over too. The stalled write then ended inside that next
    handover, and its thread switched to the store (and cleared the next one's
    claim): the store, missing the local grants made meanwhile, granted a
    chat's send again. Played step by step on a fake clock, the store's calls
    held by events."""
    if not REDIS_URL:
        pytest.skip("OUTBOUND_TEST_REDIS is not set: no Redis server to test against")
    clock = FakeClock()
    prefix = f"outbound-test:{uuid.uuid4().hex}"
    client = redis_client()
    limiter = RedisRateLimiter(
        client,
        RateLimits(per_chat=Rate(1)),
        prefix=prefix,
        clock=clock,
        slack=0.0,
        retry_interval=1.0,
        timeout=0.5,
    )
    down = [True]
    real_decide, real_handover = limiter._store_decide, limiter._store_handover
    held: dict[str, tuple[threading.Event, threading.Event]] = {}

    def decide(*args: Any) -> Any:
        if down[0]:
            raise ConnectionError("the store is down")
        return real_decide(*args)

    def handover(now: float | None, entries: Any) -> None:
        if down[0]:
            raise ConnectionError("the store is down")
        gate = held.get(threading.current_thread().name)
        if entries and gate is not None:
            gate[0].set()
            assert gate[1].wait(20)
        real_handover(now, entries)

    limiter._store_decide, limiter._store_handover = decide, handover  # type: ignore[method-assign,assignment]
    granted: list[tuple[float, str]] = []

    def acquire(chat: str) -> float:
        wait = limiter.acquire(chat)
        if wait == 0.0:
            granted.append((clock.now, chat))
        return wait

    threads: list[threading.Thread] = []
    try:
        acquire("warm")  # the store fails: the local share
        clock.now = 1002.0
        acquire("a")  # a local grant: the handover has something to write
        clock.now = 1003.0
        down[0] = False
        for name, chat in (("first", "b"), ("next", "d")):
            held[name] = (threading.Event(), threading.Event())
            threads.append(threading.Thread(target=acquire, args=(chat,), name=name))
            threads[-1].start()
            assert held[name][0].wait(10), f"the {name} try never handed over"
            if name == "first":
                clock.now = limiter._trying_until + 0.5  # its claim ended; it still writes
                assert acquire("c") == 0.0  # taken as abandoned: decided locally
        held["first"][1].set()  # its write ends inside the next handover
        threads[0].join(10)
        assert not threads[0].is_alive()
        clock.now += 0.1
        acquire("c")  # 0.1 s after c's send, at one a second
        held["next"][1].set()
        threads[1].join(10)
        assert not threads[1].is_alive()
        times = [t for t, chat in granted if chat == "c"]
        assert len(times) == 1, f"chat c granted at {times}, at one a second"
        clock.now += 2.0
        assert acquire("e") == 0.0
        assert not limiter.degraded  # back on the store
    finally:
        for gate in held.values():
            gate[1].set()
        for thread in threads:
            thread.join(10)
        limiter.close()
        drop_redis_keys(client, prefix)
        client.close()


# ------------------------------------------------------------- no ban lost


@pytest.mark.parametrize("store", STORES)
def test_bans_recorded_while_the_store_is_down_reach_it_when_it_answers(store: str) -> None:
    with two_processes(store) as p:
        p.proxy.down()
        assert p.behind.record_429(7, 30.0, "chat") == "chat"
        assert p.behind.record_429(8, 10.0, "global") == "global"
        assert p.behind.degraded
        assert p.behind.acquire(7) == pytest.approx(30.0)  # honoured locally meanwhile
        p.proxy.up()
        p.clock.advance(1.0)
        # Every chat is banned, yet the store is tried: the bans must reach it.
        assert p.behind.acquire(9) == pytest.approx(9.0)
        assert not p.behind.degraded
        assert p.direct.acquire(3) == pytest.approx(9.0)
        p.clock.advance(10.0)
        assert p.direct.acquire(7) == pytest.approx(19.0)


@pytest.mark.parametrize("store", STORES)
def test_a_ban_the_store_reported_outlives_the_store(store: str) -> None:
    with two_processes(store) as p:
        p.direct.record_429(1, 30.0, "global")  # another process got a bot-wide 429
        assert p.behind.acquire(2) == pytest.approx(30.0)
        p.proxy.down()
        p.clock.advance(10.0)
        assert p.behind.acquire(3) == pytest.approx(20.0)  # kept, though the store is gone
        assert p.behind.stats().global_ban == pytest.approx(20.0)


@pytest.mark.parametrize("store", STORES)
def test_a_huge_retry_after_is_cut_to_a_day_and_shared(store: str) -> None:
    with two_processes(store) as p:
        assert p.behind.record_429(1, 1e15, "global") == "global"
        assert p.behind.record_429(2, 1e300, "chat") == "chat"
        assert not p.behind.degraded  # the store took it
        assert p.direct.acquire(3) == pytest.approx(RateLimited.MAX_RETRY_AFTER)
    local = RateLimiter(LIMITS, clock=FakeClock())
    local.record_429(1, 1e308, "chat")
    assert local.acquire(1) == RateLimited.MAX_RETRY_AFTER


@pytest.mark.parametrize("store", STORES)
def test_scope_inference_is_shared_by_every_process(store: str) -> None:
    with two_processes(store, infer_chats=2, infer_window=1.0) as p:
        assert p.behind.record_429(1, 5.0) == "chat"  # one chat alone: its own limit
        p.clock.advance(0.5)
        assert p.direct.record_429(2, 5.0) == "global"  # a second chat, by another process
        assert p.behind.acquire(3) == pytest.approx(5.0)  # the bot waits, in both
        assert p.direct.acquire(4) == pytest.approx(5.0)


# ------------------------------------------------------------- bounded waits


@pytest.mark.parametrize("store", STORES)
def test_a_stalled_store_costs_one_timeout_not_one_per_thread(store: str) -> None:
    with two_processes(store, timeout=0.3) as p:
        limiter = p.behind
        assert limiter.acquire(0) == 0.0
        assert not limiter.degraded
        p.proxy.stall()  # connections stay open; nothing is answered
        barrier = threading.Barrier(8)
        took: list[float] = []
        lock = threading.Lock()

        def decide(chat: int) -> None:
            barrier.wait(timeout=10)
            start = time.monotonic()
            limiter.acquire(chat)
            with lock:
                took.append(time.monotonic() - start)

        threads = [threading.Thread(target=decide, args=(n,)) for n in range(1, 9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(took) == 8
        assert limiter.degraded
        assert max(took) < 0.3 * 3  # each waited one timeout at most, side by side
        start = time.monotonic()
        limiter.acquire(9)  # decided locally without asking the store
        assert time.monotonic() - start < 0.3  # asking it would take the timeout
        p.proxy.up()


@pytest.mark.parametrize("store", STORES)
def test_while_a_stalled_store_is_tried_the_others_decide_locally(store: str) -> None:
    with two_processes(store, RateLimits(per_chat=Rate(1)), timeout=0.5) as p:
        limiter = p.behind
        assert limiter.acquire(0) == 0.0
        p.proxy.stall()
        limiter.acquire(1)  # no answer within the timeout: local from now on
        assert limiter.degraded
        p.clock.advance(1.0)  # retry_interval: the next decision tries the store
        held = p.proxy.held
        prober = threading.Thread(target=limiter.acquire, args=(2,))
        prober.start()
        try:
            assert wait_until(lambda: p.proxy.held > held)  # its try reached the server
            start = time.monotonic()
            waits = [limiter.acquire(chat) for chat in range(10, 20)]
            # No decision waited for the try (one would wait out the 0.5 s timeout).
            assert time.monotonic() - start < 0.5
            assert waits == [0.0] * 10  # and each was decided, not put off
        finally:
            prober.join(10)
        assert limiter.degraded
        p.proxy.up()


@pytest.mark.parametrize(
    ("store", "timeout", "late", "chats"),
    # PostgreSQL's connect, schema check and first call shared one deadline
    # already: its decision makes more calls when the handover has many chunks.
    [("redis", 0.5, 0.3, 1), ("postgres", 1.0, 0.2, 2000)],
)
def test_a_decision_waits_for_a_slow_store_no_longer_than_the_timeout(
    store: str, timeout: float, late: float, chats: int
) -> None:
    """Each answer comes late, within the timeout of one call, but a decision that
    makes several (a try of the store after an outage, the handover in chunks, the
    decision; a new connection, its handshake and the script loaded) waited for
    all of them: 1.2 s to 2.4 s. The timeout bounds the whole decision."""
    # A minute per chat: each chat's local pace still matters at the handover.
    with two_processes(store, RateLimits(per_chat=Rate(1, 60.0)), timeout=timeout) as p:
        p.proxy.down()
        p.behind.acquire(0)
        assert p.behind.degraded
        p.clock.advance(60.0)  # past the floor of the switch: local grants from now
        for chat in range(chats):  # the pace of each, to hand over
            assert p.behind.acquire(chat) == 0.0
        p.proxy.up()
        p.proxy.slow(late)
        p.clock.advance(1.0)  # retry_interval: the next decision tries the store
        start = time.monotonic()
        assert p.behind.acquire(-1) >= 0.0
        tried = time.monotonic() - start
        start = time.monotonic()
        fresh = p.make()  # a new process: connect, handshake, first call
        assert fresh.acquire(-2) >= 0.0
        first = time.monotonic() - start
        p.proxy.slow(0)
    # Scheduling margin on a loaded machine; without the bound one took >= 1.2 s.
    assert tried < timeout + 0.25, tried
    assert first < timeout + 0.25, first


def test_a_redis_answer_that_trickles_in_holds_no_decision_past_the_timeout() -> None:
    """A socket timeout bounds each read, not a whole answer: an answer coming a
    byte every 0.1 s held a decision for 6 s, and was taken as a grant."""
    with two_processes("redis", RateLimits(per_chat=Rate(1)), timeout=0.5) as p:
        assert p.behind.acquire(1) == 0.0  # connected, the script loaded
        p.proxy.trickle(0.1)
        start = time.monotonic()
        p.behind.acquire(2)
        took = time.monotonic() - start
        p.proxy.trickle(0)
        assert p.behind.degraded  # the answer did not come in time: local from now on
    assert took < 0.75, took


def test_a_redis_health_check_is_part_of_the_decision() -> None:
    """redis-py sends a PING before a command on a connection idle past
    health_check_interval: its wait came on top of the decision's timeout."""
    with two_processes("redis", RateLimits(per_chat=Rate(1)), timeout=0.5) as p:
        redis = pytest.importorskip("redis")
        client = redis.Redis(host="127.0.0.1", port=p.proxy.port, health_check_interval=0.1)
        try:
            prefix = f"outbound-test:{uuid.uuid4().hex}"
            limits = RateLimits(per_chat=Rate(1))
            limiter = RedisRateLimiter(client, limits, clock=p.clock, timeout=0.5, prefix=prefix)
            assert limiter.acquire(1) == 0.0
            threading.Event().wait(0.2)  # idle past the interval (time passing, not a sync)
            p.proxy.slow(0.4)  # the PING's answer, then the script's: 0.8 s
            start = time.monotonic()
            limiter.acquire(2)
            took = time.monotonic() - start
            p.proxy.slow(0)
            limiter.close()
            drop_redis_keys(client, prefix)
        finally:
            client.close()
    assert took < 0.75, took


def _fork() -> int:
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded fork"
        return os.fork()


def _child_goes_back_to_the_store(p: Pair, ready: int) -> bool:
    """In the child: once the parent says the store answers (a byte on ``ready``), a
    decision a retry_interval later is made by the store again."""
    if os.read(ready, 1) != b"u":
        return False
    for _ in range(3):  # a try that hits the proxy mid-change gets another chance
        p.clock.advance(1.0)  # retry_interval
        p.behind.acquire(100)
        if not p.behind.degraded:
            return True
    return False


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("store", STORES)
def test_a_child_forked_while_a_thread_tries_the_store_goes_back_to_it(store: str) -> None:
    """gunicorn --preload forks a parent whose thread may be trying a store marked down:
    the child inherited 'a thread is trying' for good and stayed on the local share."""
    with two_processes(store, RateLimits(per_chat=Rate(1)), timeout=0.5) as p:
        p.proxy.stall()
        p.behind.acquire(1)  # no answer within the timeout: local from now on
        assert p.behind.degraded
        p.clock.advance(1.0)  # retry_interval: the next decision tries the store
        held = p.proxy.held
        prober = threading.Thread(target=p.behind.acquire, args=(2,))
        prober.start()
        ready, told = os.pipe()
        try:
            assert wait_until(lambda: p.proxy.held > held)  # its try is under way
            pid = _fork()
            if pid == 0:  # the child
                ok = False
                try:
                    ok = _child_goes_back_to_the_store(p, ready)
                finally:
                    os._exit(0 if ok else 1)
            prober.join(10)
            p.proxy.up()
            os.write(told, b"u")
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        finally:
            prober.join(10)
            os.close(ready)
            os.close(told)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("store", STORES)
def test_a_child_forked_while_a_thread_hands_the_state_over_grants_again(store: str) -> None:
    """Forked while the parent's thread wrote the fallback's state to a store that
    answered again: the child answered 'settling' to every decision, for good."""
    with two_processes(store, RateLimits(per_chat=Rate(1))) as p:
        p.proxy.down()
        p.behind.acquire(1)
        assert p.behind.degraded
        p.proxy.up()
        ready, told = os.pipe()
        try:
            # The state the handing thread leaves at the fork, between its snapshot
            # and its switch back (it does not exist in the child).
            with p.behind._health_lock:
                p.behind._state = _HANDOVER
                p.behind._trying_until = math.inf
                pid = _fork()
                if pid == 0:  # the child
                    ok = False
                    try:
                        os.write(told, b"u")  # the store answers: go on at once
                        ok = _child_goes_back_to_the_store(p, ready)
                        ok = ok and p.behind.acquire(200) == 0.0  # granted, not settling
                    finally:
                        os._exit(0 if ok else 1)
                p.behind._state = _DOWN
                p.behind._trying_until = -math.inf
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        finally:
            os.close(ready)
            os.close(told)


def test_timeouts_are_checked() -> None:
    pytest.importorskip("psycopg")
    for bad in (0.0004, 0.0, -1.0, float("nan"), 3600.0):
        with pytest.raises(ValueError, match="timeout"):
            PostgresRateLimiter("postgresql://x/y", LIMITS, timeout=bad)
    with pytest.raises(TypeError, match="timeout"):
        PostgresRateLimiter("postgresql://x/y", LIMITS, timeout=True)
    redis = pytest.importorskip("redis")
    client = redis.Redis(host="127.0.0.1", port=1)
    with pytest.raises(ValueError, match="timeout"):
        RedisRateLimiter(client, LIMITS, timeout=0.0)
    with pytest.raises(ValueError, match="prefix"):
        RedisRateLimiter(client, LIMITS, prefix="a{}b")  # the hash tag must be {name}
    with pytest.raises(ValueError, match="fallback_share"):
        RedisRateLimiter(client, LIMITS, fallback_share=1e-310)
    client.close()


def test_a_closed_postgres_limiter_decides_locally_and_says_it_is_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Documented: later decisions use the local share. The log says so
    # once, as a closed limiter at WARNING, not as an unreachable server
    # at ERROR, and no reminder follows.
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
    clock = FakeClock()
    limiter = PostgresRateLimiter(POSTGRES_URL, LIMITS, table=table, clock=clock, timeout=30.0)
    try:
        assert limiter.acquire(1) == 0.0
        assert limiter.stats().store == "shared"
        limiter.close()
        with caplog.at_level("INFO", logger="outbound"):
            assert limiter.acquire(2) == pytest.approx(1.02)  # locally, as after an outage
            for _ in range(5):  # past the retry interval and the reminders' period
                clock.advance(3600.0)
                limiter.acquire(3)
        assert limiter.degraded
        assert limiter.stats().store == "fallback"
        said = [(r.levelname, r.getMessage()) for r in caplog.records]
        assert len(said) == 1, said
        level, message = said[0]
        assert level == "WARNING"
        assert "closed" in message
        assert "unreachable" not in message
        limiter.close()  # idempotent
    finally:
        limiter.close()
        drop_postgres_table(POSTGRES_URL, table)


def test_a_postgres_limiter_closed_while_its_connection_is_busy_closes_it_after() -> None:
    # close() waits for the call in progress at most its timeout; past it,
    # the connection is closed by the call that holds it, or the next one.
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
    limiter = PostgresRateLimiter(POSTGRES_URL, LIMITS, table=table, timeout=0.2)
    try:
        assert limiter.acquire(1) == 0.0
        session = limiter._session

        def connected() -> bool:
            return bool(session.connected)

        assert connected()
        assert limiter._conn_lock.acquire(10.0)  # a call in progress, as close() sees it
        try:
            limiter.close()  # gives up waiting after 0.2 s
            assert connected()
        finally:
            limiter._conn_lock.release()
        limiter.acquire(2)  # decided locally; the connection is closed on the way
        assert not connected()
        assert limiter.stats().store == "fallback"
    finally:
        limiter.close()
        drop_postgres_table(POSTGRES_URL, table)


def test_a_closed_redis_limiter_decides_locally_and_opens_no_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # As PostgresRateLimiter: once closed, decisions use the local share and
    # never reach Redis (a decision used to connect again on the limiter's
    # own pool, a connection nothing closed, and spend the shared budget).
    if not REDIS_URL:
        pytest.skip("OUTBOUND_TEST_REDIS is not set: no Redis server to test against")
    tag = f"rl-closed-{uuid.uuid4().hex[:12]}"  # names the limiter's connections
    admin = redis_client()
    client = redis_client(client_name=tag)
    clock = FakeClock()
    limiter = RedisRateLimiter(client, LIMITS, name=tag, clock=clock, timeout=5.0)

    def connections() -> int:
        return sum(1 for c in admin.client_list() if c.get("name") == tag)

    try:
        assert limiter.acquire(1) == 0.0
        assert connections() == 1
        limiter.close()
        assert wait_until(lambda: connections() == 0)
        with caplog.at_level("INFO", logger="outbound"):
            assert limiter.acquire(2) == pytest.approx(1.02)  # locally, as after an outage
            assert limiter.record_429(3, 5.0, "chat") == "chat"
            for _ in range(5):  # past the retry interval and the reminders' period
                clock.advance(3600.0)
                limiter.acquire(4)
        assert connections() == 0
        assert limiter.degraded
        assert limiter.stats().store == "fallback"
        said = [(r.levelname, r.getMessage()) for r in caplog.records]
        assert len(said) == 1, said
        assert said[0][0] == "WARNING"
        assert "closed" in said[0][1]
        limiter.close()  # idempotent
    finally:
        limiter.close()
        drop_redis_keys(admin, limiter.key_prefix)
        client.close()
        admin.close()


def test_a_redis_limiter_closed_during_a_call_closes_the_connection_it_made() -> None:
    # A call that began before close() and connects after it (the pool made
    # anew) closes that connection itself when it returns.
    if not REDIS_URL:
        pytest.skip("OUTBOUND_TEST_REDIS is not set: no Redis server to test against")
    tag = f"rl-closing-{uuid.uuid4().hex[:12]}"
    admin = redis_client()
    client = redis_client(client_name=tag)
    limiter = RedisRateLimiter(client, LIMITS, name=tag, clock=FakeClock(), timeout=5.0)
    script = limiter._acquire_script

    def closed_first(**kwargs: Any) -> Any:
        limiter.close()  # as if from another thread, just before the call connects
        return script(**kwargs)

    try:
        limiter._acquire_script = closed_first  # type: ignore[misc]
        assert limiter.acquire(1) == 0.0  # the store's answer: it was asked
        assert wait_until(lambda: all(c.get("name") != tag for c in admin.client_list()))
    finally:
        limiter.close()
        drop_redis_keys(admin, limiter.key_prefix)
        client.close()
        admin.close()


def test_a_redis_limiter_closed_between_a_calls_send_and_its_read_decides_locally() -> None:
    # close() from another thread cut the connection a call was about to
    # read its answer from: redis-py raised AttributeError (its parser gone),
    # not a store's error, and it escaped acquire().
    if not REDIS_URL:
        pytest.skip("OUTBOUND_TEST_REDIS is not set: no Redis server to test against")
    tag = f"rl-cut-{uuid.uuid4().hex[:12]}"
    admin = redis_client()
    client = redis_client(client_name=tag)
    limiter = RedisRateLimiter(client, LIMITS, name=tag, clock=FakeClock(), timeout=5.0)
    fired: list[bool] = []

    def close_before_the_read(frame: FrameType, event: str, arg: Any) -> None:
        if fired or event != "call" or frame.f_code.co_name != "read_response":
            return
        if frame.f_code.co_filename.endswith(os.path.join("redis", "connection.py")):
            fired.append(True)
            limiter.close()  # as another thread's close() at this instant

    try:
        assert limiter.acquire(1) == 0.0
        sys.settrace(close_before_the_read)
        try:
            wait = limiter.acquire(2)
        finally:
            sys.settrace(None)
        assert fired, "the call never read an answer"
        assert wait == pytest.approx(1.02) or wait == 0.0  # decided, locally or not
        assert limiter.stats().store == "fallback"
    finally:
        limiter.close()
        drop_redis_keys(admin, limiter.key_prefix)
        client.close()
        admin.close()


# ---------------------------------------------------- private servers, for real


def test_a_stopped_redis_fails_over_within_the_timeout_whatever_the_clients_retries(
    private_redis: tuple[int, Callable[[], subprocess.Popen[bytes]]],
) -> None:
    redis = pytest.importorskip("redis")
    port, start = private_redis
    server = start()
    # The client's own policy: redis-py's default retries with backoff (seconds).
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
    limiter = RedisRateLimiter(client, RateLimits(per_chat=Rate(4)), timeout=0.2)
    try:
        assert limiter.acquire(1) == 0.0
        server.send_signal(signal.SIGSTOP)
        start_at = time.monotonic()
        wait = limiter.acquire(1)
        # One timeout, no retries (a retry would add the client's 0.5 s socket timeout).
        assert time.monotonic() - start_at < 0.95
        assert limiter.degraded
        assert wait > 0.2  # chat 1 sent a moment ago: not again inside its interval
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(10)
        nothing = RedisRateLimiter(client, RateLimits(per_chat=Rate(4)), timeout=0.2)
        start_at = time.monotonic()
        nothing.acquire(1)  # nothing listens: refused at once, no retries
        assert time.monotonic() - start_at < 0.2
        assert nothing.degraded
    finally:
        limiter.close()
        client.close()


@contextmanager
def _limiter_on(
    private_redis: tuple[int, Callable[[], subprocess.Popen[bytes]]],
) -> Iterator[
    tuple[
        subprocess.Popen[bytes],
        Callable[[], subprocess.Popen[bytes]],
        str,
        FakeClock,
        RedisRateLimiter,
    ]
]:
    """A limiter (on a fake clock, retrying every second) on a private Redis just
    started: (that server, a start of another, the URL, the clock, the limiter)."""
    pytest.importorskip("redis")
    port, start = private_redis
    server = start()
    clock = FakeClock()
    url = f"redis://127.0.0.1:{port}/0"
    client = redis_client(url)
    limiter = RedisRateLimiter(client, LIMITS, clock=clock, retry_interval=1.0)
    try:
        yield server, start, url, clock, limiter
    finally:
        limiter.close()
        client.close()


def test_bans_survive_a_redis_restart_and_are_written_back(
    private_redis: tuple[int, Callable[[], subprocess.Popen[bytes]]],
) -> None:
    with _limiter_on(private_redis) as (server, start, url, clock, limiter):
        limiter.record_429(7, 60.0, "chat")
        assert limiter.acquire(1) == 0.0
        server.kill()
        server.wait(10)
        start()  # empty: the ban is gone from the store
        assert limiter.acquire(7) == pytest.approx(60.0)  # honoured all the same
        limiter.acquire(2)  # finds the store new (or its connection broken) ...
        clock.advance(1.0)
        limiter.acquire(3)  # ... and has handed the ban back to it by now
        assert not limiter.degraded
        other = RedisRateLimiter(redis_client(url), LIMITS, clock=clock)  # another process
        assert other.acquire(7) == pytest.approx(59.0)
        other.close()


@pytest.mark.parametrize("store", STORES)
def test_bans_answered_locally_are_written_back_once_a_retry_interval(store: str) -> None:
    """Threads racing on decisions a local ban answers (switch interval 10 us)
    make one rewrite of the bans per retry_interval, not one each; a rewrite
    that fails takes the store as down, and the ban is answered all the same."""
    with two_processes(store) as pair:
        limiter = pair.behind
        limiter.record_429(1, 30.0, "global")
        rewrites: list[int] = []
        handover = limiter._store_handover

        def counted(now: float | None, entries: Any) -> None:
            rewrites.append(len(entries))
            handover(now, entries)

        limiter._store_handover = counted
        answers: list[float] = []
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        try:
            for expected in (1, 2):
                threads = [
                    threading.Thread(
                        target=lambda i=i: answers.extend(
                            limiter.acquire(i * 100 + k) for k in range(50)
                        )
                    )
                    for i in range(8)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30.0)
                assert not any(t.is_alive() for t in threads)
                assert rewrites == [1] * expected  # the one ban, once per interval
                pair.clock.advance(1.0)
        finally:
            sys.setswitchinterval(old)
        assert len(answers) == 800
        assert set(answers) == {30.0, 29.0}
        assert pair.direct.acquire(5) == pytest.approx(28.0)  # the store holds it
        pair.proxy.down()
        assert limiter.acquire(7) == pytest.approx(28.0)  # the rewrite fails ...
        assert limiter.degraded  # ... and the store is taken as down
        assert rewrites == [1, 1, 1]
        assert limiter.acquire(8) == pytest.approx(28.0)  # no rewrite while down
        assert rewrites == [1, 1, 1]


@pytest.mark.parametrize("scope", ["global", "chat"])
def test_a_ban_answered_locally_is_written_back_to_a_redis_that_lost_it(
    private_redis: tuple[int, Callable[[], subprocess.Popen[bytes]]], scope: str
) -> None:
    """The process that knows of a ban answers its decisions from it with no
    round trip: it writes it to the store again (once a retry_interval), so a
    Redis restarted empty holds the other processes back too, also a process
    started since (without, they were granted every send during the ban)."""
    banned = 7  # with a global ban, every chat
    with _limiter_on(private_redis) as (server, start, url, clock, limiter):
        limiter.record_429(banned, 60.0, scope)  # type: ignore[arg-type]
        server.kill()
        server.wait(10)
        start()  # empty: the ban is gone from the store
        for _ in range(2):  # a rewrite, or a broken connection then a handover
            clock.advance(1.0)
            assert limiter.acquire(banned) > 0.0
        assert not limiter.degraded
        other = RedisRateLimiter(redis_client(url), LIMITS, clock=clock)  # started since
        try:
            assert other.acquire(banned) == pytest.approx(58.0)
            if scope == "global":
                assert other.acquire(8) == pytest.approx(58.0)
        finally:
            other.close()


@pytest.fixture(scope="module")
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of this module's own, which the test may stop (SIGSTOP)."""
    with private_server("-c fsync=off") as server:
        yield server


def test_a_stopped_postgres_fails_over_within_the_timeout(
    private_postgres: PrivatePostgres,
) -> None:
    from outbound import Outbound  # noqa: PLC0415
    from outbound.middleware import chain, rate_limit, timeout  # noqa: PLC0415
    from outbound.simulator import PlatformSimulator  # noqa: PLC0415
    from outbound.telegram import TelegramSender  # noqa: PLC0415

    url, signal_all = private_postgres.url, private_postgres.signal_all
    limits = RateLimits(per_chat=Rate(20))
    limiter: Any = PostgresRateLimiter(url, limits, timeout=0.3, retry_interval=0.2, name="stop")
    assert limiter.acquire(1) == 0.0
    assert not limiter.degraded
    signal_all(signal.SIGSTOP)
    try:
        took: list[float] = []

        def decide(chat: int) -> None:
            start = time.monotonic()
            limiter.acquire(chat)
            took.append(time.monotonic() - start)

        threads = [threading.Thread(target=decide, args=(n,)) for n in range(2, 6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(took) == 4
        assert max(took) < 1.0
        assert limiter.degraded
        # End to end: replies to 8 chats on 4 workers all go out while the server
        # is stopped (the local share decides), none holds a worker.
        with (
            PlatformSimulator() as sim,
            TelegramSender(sim.token, base_url=sim.url) as telegram,
            Outbound(None, chain(rate_limit(limiter), timeout())(telegram), max_inflight=4) as out,
        ):
            futures = [out.reply_text(chat, "hi") for chat in range(10, 18)]
            assert [f.exception(timeout=10) for f in futures] == [None] * 8
        start = time.monotonic()
        limiter.close()
        assert time.monotonic() - start < 1.0
    finally:
        signal_all(signal.SIGCONT)


# ------------------------------------------------------------------ stress


@pytest.mark.parametrize("store", STORES)
def test_stress_threads_and_a_flapping_store_never_exceed_a_chats_limit(store: str) -> None:
    """Eight threads take slots for four chats as fast as they can, with a GIL
    switch interval of 10 µs, while the store goes down and comes back every
    ~0.15 s: on the real clocks (the store's and this process's), no chat's
    window ever holds more than its limit (give or take 10 ms of skew)."""
    from ratelimit_stores import max_in_window  # noqa: PLC0415

    rate = Rate(20)
    with two_processes(
        store, RateLimits(per_chat=rate), clock=None, retry_interval=0.05, timeout=0.3
    ) as p:
        limiter = p.behind
        grants: dict[int, list[float]] = {chat: [] for chat in range(4)}
        lock = threading.Lock()
        stop = threading.Event()
        errors: list[BaseException] = []

        def take(seed: int) -> None:
            chat = seed
            try:
                while not stop.is_set():
                    chat = (chat + 1) % 4
                    if limiter.acquire(chat) == 0.0:
                        at = time.monotonic()
                        with lock:
                            grants[chat].append(at)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        previous = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        threads = [threading.Thread(target=take, args=(n,)) for n in range(8)]
        try:
            for t in threads:
                t.start()
            flips = threading.Event()
            for _ in range(3):
                flips.wait(0.15)  # the store's up time: a stretch of the test, not a sync
                p.proxy.down()
                flips.wait(0.15)
                p.proxy.up()
            flips.wait(0.2)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
            sys.setswitchinterval(previous)
        assert not errors
        assert sum(len(v) for v in grants.values()) > 20  # it did run
        for times in grants.values():
            assert max_in_window(times, rate.period - 0.01) <= rate.window_max
