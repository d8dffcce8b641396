"""The limiter's invariant, property-based: no window of one period ever holds too many sends.

A simulation on a fake clock: chats (some of them groups) get messages at
random instants; each chat is a lane that asks :meth:`RateLimiter.acquire`
for its head message, and when told to wait comes back *late* by a random
hold-up (none, within the limiter's ``slack``, or seconds: a busy pool, a
CPU stall); bot-wide stalls postpone every lane; random 429s are recorded.
Whatever the draw, in every half-open window of one period (to within
1 µs of float rounding) there are at most ``limit + burst - 1`` sends
overall, per chat and per group, and every message is sent in the end.

The same simulation runs a :class:`RedisRateLimiter` whose store (a real
Redis behind a proxy) goes down and comes back at random instants: across
every switch to the local fallback and back, the bound holds all the same.

Settings: derandomized (the same examples on every run, no example
database), no deadline; 250 examples, about 2 s; with outages 25 examples
and two explicit ones, under a second.
"""

from __future__ import annotations

import heapq
import itertools
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ratelimit_stores import REDIS_URL, FakeClock, StoreProxy, drop_redis_keys, max_in_window

from outbound.ratelimit import (
    BaseRateLimiter,
    Rate,
    RateLimiter,
    RateLimits,
    RedisRateLimiter,
    is_group,
)

SETTINGS = settings(
    max_examples=250,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def rates(limits: tuple[int, int], periods: list[float], bursts: int) -> st.SearchStrategy[Rate]:
    return st.builds(
        Rate,
        st.integers(*limits),
        st.sampled_from(periods),
        st.integers(1, bursts),
    )


@st.composite
def limit_sets(draw: st.DrawFn) -> RateLimits:
    overall = draw(st.none() | rates((1, 12), [0.5, 1.0, 2.0], 4))
    per_chat = draw(st.none() | rates((1, 3), [0.5, 1.0, 2.0], 3))
    per_group = draw(st.none() | rates((2, 6), [2.0, 5.0], 3))
    if overall is None and per_chat is None and per_group is None:
        overall = Rate(5)
    return RateLimits(overall, per_chat, per_group)


@dataclass(frozen=True)
class Scenario:
    limits: RateLimits
    slack: float
    arrivals: list[tuple[float, int]]  # (instant, chat), any order
    lateness: list[float]  # cycled: how late each lane comes back
    stalls: list[tuple[float, float]]  # (start, length): no lane runs
    bans: list[tuple[float, int, float, str | None]]  # (instant, chat, retry_after, scope)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    chats = draw(st.lists(st.integers(-4, 6).filter(bool), min_size=1, max_size=6, unique=True))
    instants = st.floats(0.0, 6.0, allow_nan=False)
    arrivals = draw(st.lists(st.tuples(instants, st.sampled_from(chats)), min_size=1, max_size=40))
    slack = draw(st.sampled_from([0.0, 0.01, 0.05, 0.2]))
    late = st.one_of(
        st.just(0.0),
        st.floats(0.0, slack, allow_nan=False),
        st.floats(0.0, 3.0, allow_nan=False),
    )
    lateness = draw(st.lists(late, min_size=1, max_size=12))
    stalls = draw(st.lists(st.tuples(instants, st.floats(0.01, 2.0)), max_size=3))
    bans = draw(
        st.lists(
            st.tuples(
                instants,
                st.sampled_from(chats),
                st.floats(0.0, 2.0),
                st.sampled_from([None, "chat", "global"]),
            ),
            max_size=3,
        )
    )
    return Scenario(draw(limit_sets()), slack, arrivals, lateness, stalls, bans)


def simulate(
    sc: Scenario,
    limiter: BaseRateLimiter | None = None,
    clock: FakeClock | None = None,
    outages: list[tuple[float, float]] = (),  # type: ignore[assignment]
    proxy: StoreProxy | None = None,
) -> list[tuple[float, int]]:
    """Run the lanes of ``sc``; return the (instant, chat) of every send.

    ``outages`` (start, length): the ``proxy`` in front of ``limiter``'s store
    is down meanwhile.
    """
    if clock is None:
        clock = FakeClock(0.0)
    if limiter is None:
        limiter = RateLimiter(sc.limits, clock=clock, slack=sc.slack, infer_window=1.0)
    lateness = itertools.cycle(sc.lateness)
    queues: dict[int, deque[float]] = defaultdict(deque)
    for instant, chat in sorted(sc.arrivals):
        queues[chat].append(instant)
    seq = itertools.count()
    # (instant, order, kind, chat): kind 0 a ban, 1 a lane's try.
    events: list[tuple[float, int, int, int]] = []
    for chat, queue in queues.items():
        heapq.heappush(events, (queue[0], next(seq), 1, chat))
    bans = {}
    for instant, chat, seconds, scope in sc.bans:
        order = next(seq)
        bans[order] = (seconds, scope)
        heapq.heappush(events, (instant, order, 0, chat))
    for start, length in outages:  # kind 2: the store goes down; 3: it comes back
        heapq.heappush(events, (start, next(seq), 2, 0))
        heapq.heappush(events, (start + length, next(seq), 3, 0))

    def unstall(t: float) -> float:
        for start, length in sc.stalls:
            if start <= t < start + length:
                return start + length
        return t

    sent: list[tuple[float, int]] = []
    for _ in range(20_000):
        if not events:
            break
        instant, order, kind, chat = heapq.heappop(events)
        clock.now = max(clock.now, instant)
        if kind == 0:
            seconds, scope = bans[order]
            limiter.record_429(chat, seconds, scope)  # type: ignore[arg-type]
            continue
        if kind in (2, 3):
            assert proxy is not None
            proxy.down() if kind == 2 else proxy.up()
            continue
        later = unstall(clock.now)
        if later > clock.now:
            heapq.heappush(events, (later, next(seq), 1, chat))
            continue
        wait = limiter.acquire(chat)
        queue = queues[chat]
        if wait > 0.0:
            heapq.heappush(events, (clock.now + wait + next(lateness), next(seq), 1, chat))
            continue
        sent.append((clock.now, chat))
        queue.popleft()
        if queue:
            heapq.heappush(events, (max(queue[0], clock.now), next(seq), 1, chat))
    assert not [e for e in events if e[2] == 1], "the simulation did not end: a lane starved"
    return sent


def check(sc: Scenario, sent: list[tuple[float, int]]) -> None:
    limits = sc.limits
    assert len(sent) == len(sc.arrivals)
    if limits.overall is not None:
        times = [t for t, _ in sent]
        assert max_in_window(times, limits.overall.period) <= limits.overall.window_max
    by_chat: dict[int, list[float]] = defaultdict(list)
    for t, chat in sent:
        by_chat[chat].append(t)
    for chat, times in by_chat.items():
        if limits.per_chat is not None:
            assert max_in_window(times, limits.per_chat.period) <= limits.per_chat.window_max
        if limits.per_group is not None and is_group(chat):
            assert max_in_window(times, limits.per_group.period) <= limits.per_group.window_max


@SETTINGS
@given(scenarios())
@example(  # a lane always later than slack must not starve behind its own bookings
    Scenario(RateLimits(overall=Rate(1, 0.5)), 0.0, [(0.0, 1), (0.0, 1)], [0.5], [], [])
)
def test_no_window_ever_holds_more_than_limit_plus_burst_minus_one(sc: Scenario) -> None:
    check(sc, simulate(sc))


def test_the_defect_scenario_holds() -> None:
    # 20 chats booked at 10/s, a 0.55 s stall: before the fix, 15 sends in 1 s.
    sc = Scenario(
        RateLimits(overall=Rate(10)),
        0.02,
        [(0.0, chat) for chat in range(1, 21)],
        [0.0],
        [(0.05, 0.55)],
        [],
    )
    sent = simulate(sc)
    check(sc, sent)
    assert max_in_window([t for t, _ in sent], 1.0) == 10  # and the limit is used


@st.composite
def failovers(draw: st.DrawFn) -> tuple[Scenario, list[tuple[float, float]]]:
    sc = draw(scenarios())
    instants = st.floats(0.0, 6.0, allow_nan=False)
    outages = draw(st.lists(st.tuples(instants, st.floats(0.05, 3.0)), min_size=1, max_size=3))
    return sc, outages


@pytest.mark.skipif(not REDIS_URL, reason="OUTBOUND_TEST_REDIS is not set")
@settings(SETTINGS, max_examples=25)
@given(failovers())
@example(  # the store is lost right after a send, and comes back after a local one
    (
        Scenario(RateLimits(per_chat=Rate(1)), 0.0, [(0.0, 1), (0.1, 1), (1.6, 1)], [0.0], [], []),
        [(0.05, 1.2)],
    )
)
@example(  # a local send, then the store back: it must know of that send
    (
        Scenario(RateLimits(per_chat=Rate(1)), 0.0, [(0.0, 1), (1.0, 1), (2.6, 1)], [0.0], [], []),
        [(0.5, 2.0)],
    )
)
def test_no_window_holds_too_many_sends_across_store_outages(
    case: tuple[Scenario, list[tuple[float, float]]],
) -> None:
    """A shared limiter whose store (a real Redis behind a proxy) goes down and
    comes back at random instants: the fallback and the handovers keep the bound."""
    import redis  # noqa: PLC0415

    sc, outages = case
    clock = FakeClock(0.0)
    prefix = f"outbound-test:{uuid.uuid4().hex}"
    assert REDIS_URL is not None
    host, port = urlsplit(REDIS_URL).hostname, urlsplit(REDIS_URL).port
    with StoreProxy(host or "127.0.0.1", port or 6379) as proxy:
        client = redis.Redis(host="127.0.0.1", port=proxy.port)
        limiter = RedisRateLimiter(
            client,
            sc.limits,
            prefix=prefix,
            clock=clock,
            slack=sc.slack,
            infer_window=1.0,
            retry_interval=0.3,
        )
        try:
            check(sc, simulate(sc, limiter, clock, outages, proxy))
        finally:
            limiter.close()
            client.close()
            proxy.up()
            with redis.Redis.from_url(REDIS_URL) as direct:
                drop_redis_keys(direct, prefix)
