"""The limiters of outbound.ratelimit, one contract for every store, on an injected clock.

Each test runs against :class:`RateLimiter` (this process), and against
:class:`RedisRateLimiter` and :class:`PostgresRateLimiter` when
``OUTBOUND_TEST_REDIS`` / ``OUTBOUND_TEST_POSTGRES`` name servers: the
three must give the same answers. No sleeping: the clock is a fake one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from ratelimit_stores import STORES, FakeClock, limiter_on, max_in_window

from outbound.ratelimit import (
    SLACK,
    TELEGRAM,
    BaseRateLimiter,
    Rate,
    RateLimiter,
    RateLimits,
    is_group,
)

# slack=0: a booked slot is good only at its instant, so waits are exact.
EXACT = {"slack": 0.0}


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make(store: str, clock: FakeClock) -> Iterator[Any]:
    """make(**limits) -> a limiter of the parametrized store on the fake clock."""
    made: list[Any] = []

    def build(options: dict[str, Any] | None = None, **limits: Rate) -> BaseRateLimiter:
        ctx = limiter_on(store, RateLimits(**limits), clock=clock, **{**EXACT, **(options or {})})
        made.append(ctx)
        return ctx.__enter__()

    yield build
    for ctx in reversed(made):
        ctx.__exit__(None, None, None)


# ------------------------------------------------------------------ config


def test_rate_validation() -> None:
    assert Rate(20, 60.0).interval == pytest.approx(3.0)
    assert Rate(16, 60.0, burst=5).window_max == 20
    for bad in (
        {"limit": 0},
        {"limit": 1.5},
        {"limit": True},
        {"limit": 1, "period": 0},
        {"limit": 1, "period": float("inf")},
        {"limit": 1, "burst": 0},
    ):
        with pytest.raises((TypeError, ValueError)):
            Rate(**bad)
    with pytest.raises(TypeError):
        RateLimits(per_chat=30)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Rate(10).scaled(0.0)
    assert Rate(10, 1.0, burst=4).scaled(0.25) == Rate(10, 4.0, burst=1)


@pytest.mark.parametrize(
    "args",
    [
        (2, 1e307, 100),  # (burst - 1) * interval overflows to inf
        (10**400, 1.0, 1),  # period / limit: no float
        (1, 1.0, 10**400),  # (burst - 1) * interval: no float
        (10**300, 1e-300, 1),  # period / limit rounds to 0
        # Below a step of a clock of Unix time (0.24 us): a bucket never moved
        # ahead, and every send at one instant was granted.
        (1, 1e-8, 1),
        (2**60, 1.0, 1),
        (1_000_001, 1.0, 1),
        # One a second, but neither a float: the limiters (and Rate.scaled)
        # raised OverflowError dividing floats by them.
        (10**400, 10**400, 1),
        (10**309, 10**309, 1),
    ],
)
def test_a_rate_no_clock_can_pace_is_refused(args: tuple[int, float, int]) -> None:
    """Accepted, an infinite tolerance or a zero interval was no limit at all
    (every decision granted at once); refused at construction, naming the rate."""
    with pytest.raises(ValueError, match="out of range"):
        Rate(*args)


def test_the_fastest_accepted_rate_still_limits_on_a_clock_of_unix_time() -> None:
    now = 1.7e9  # (the stores' clock; frozen: every send at one instant)
    limiter = RateLimiter(RateLimits(per_chat=Rate(1_000_000)), clock=lambda: now)
    assert sum(limiter.acquire(1, book=False) == 0.0 for _ in range(1000)) == 1


def test_the_largest_accepted_settings_still_limit() -> None:
    clock = FakeClock()
    limiter = RateLimiter(
        RateLimits(overall=Rate(10, 1.0, burst=100), per_chat=Rate(2, 3e7, burst=66)),
        clock=clock,
        slack=3600.0,
        stale_after=3600.0,
        infer_window=3600.0,
    )
    granted = sum(limiter.acquire(1, book=False) == 0.0 for _ in range(1000))
    assert granted == 66  # the burst, then the chat waits
    with pytest.raises(ValueError, match="slack"):
        RateLimiter(RateLimits(overall=Rate(10, 1.0, burst=100)), slack=1e308)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((1, 10**400), "period=an int of 1329 bits"),
        ((10**400, 1.0), "limit=an int of 1329 bits"),
        ((1, 1e14), "at most 1e+09 seconds"),  # a Redis key cannot live that long
        ((1, 1e8, 11), "at most 1e+09 seconds"),  # 11 intervals of 1e8 s ahead
    ],
)
def test_a_rate_past_what_a_store_keeps_is_refused_naming_it(
    args: tuple[int, float] | tuple[int, float, int], says: str
) -> None:
    """Huge ints raised OverflowError naming nothing; a period of 1e14 s was taken,
    and the Redis limiter then fell back to its local share for good."""
    with pytest.raises(ValueError, match=re.escape(says)):
        Rate(*args)
    assert Rate(1, 1e9).interval == 1e9
    assert Rate(1, 1e8, 10).window_max == 10


def test_every_share_of_a_rate_at_the_reach_bound_is_a_rate() -> None:
    """Exactly, a share's burst intervals reach no further than the rate's; rounded,
    a quarter of the shares came out an ulp past 1e9 s, and a shared limiter with
    such a fallback_share (0.99, not 0.3) was refused as "too small"."""
    rate = Rate(1, 1.0, burst=10**9)  # reach: exactly 1e9 s
    for percent in range(1, 101):
        share = percent / 100
        scaled = rate.scaled(share)
        assert scaled.period == 1.0 / share
        # the burst cut, by one interval at most, to stay within the bound
        assert math.floor(10**9 * share) - 1 <= scaled.burst <= math.floor(10**9 * share)
    with pytest.raises(ValueError, match="out of range"):
        Rate(1, 5e8).scaled(0.25)  # one interval alone is past the bound


def test_a_share_of_a_huge_rate_is_cut_at_once_or_refused_at_once() -> None:
    # The burst was counted down one by one to fit the bound: 39 s (in a shared
    # limiter's constructor, with its fallback_share) for a burst of 9e14,
    # then "period must be finite" when the stretched period overflowed.
    huge = Rate(10**308, 1.001e302, burst=9 * 10**14)
    with pytest.raises(ValueError, match="share 5e-07 is too small"):
        huge.scaled(5e-7)
    wide = Rate(1, 1.0, burst=10**9)
    scaled = wide.scaled(1e-6)  # its interval 1e6 s: a burst of 1,000 at most
    assert scaled.burst * scaled.interval <= 1e9
    assert scaled.burst == 1000


@pytest.mark.parametrize("option", ["slack", "stale_after", "infer_window"])
def test_an_option_too_large_for_a_float_is_refused_naming_it(option: str) -> None:
    options: dict[str, Any] = {option: 10**400}
    with pytest.raises(ValueError, match=f"{option} must be a finite number >=? 0, not an int"):
        RateLimiter(TELEGRAM, **options)


def test_a_429_whose_retry_after_is_past_a_float_bans_for_a_day() -> None:
    clock = FakeClock()
    limiter = RateLimiter(TELEGRAM, clock=clock)
    assert limiter.record_429(1, 10**400, "chat") == "chat"
    assert limiter.acquire(1) == pytest.approx(86400.0)
    assert limiter.record_429(2, math.inf, "chat") == "chat"
    assert limiter.acquire(2) == pytest.approx(86400.0)


def test_limiter_options_are_checked() -> None:
    for bad in (
        {"slack": -1.0},
        {"slack": 3600.5},
        {"slack": 1e308},
        {"stale_after": 0.0},
        {"stale_after": 3601},
        {"infer_chats": 0},
        {"infer_chats": 1_000_001},  # the stores keep it as a 32-bit int (2**31 failed there)
        {"infer_chats": 2**31},
        {"infer_chats": 10**400},
        {"infer_window": -1},
        {"infer_window": 1e308},
    ):
        with pytest.raises((TypeError, ValueError)):
            RateLimiter(TELEGRAM, **bad)
    with pytest.raises(TypeError):
        RateLimiter(Rate(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RateLimiter(TELEGRAM).record_429(1, -1.0)
    with pytest.raises(ValueError):
        RateLimiter(TELEGRAM).record_429(1, 1.0, "group")  # type: ignore[arg-type]


def test_presets_keep_the_documented_window_counts() -> None:
    # Telegram: 30/s overall, 1/s per chat, at most 20 in any minute per group.
    assert TELEGRAM.overall == Rate(30)
    assert TELEGRAM.per_chat == Rate(1)
    assert TELEGRAM.per_group is not None
    assert TELEGRAM.per_group.period == 60.0
    assert TELEGRAM.per_group.window_max == 20
    assert TELEGRAM.per_group.burst > 1  # a few quick replies after a quiet spell
    assert SLACK == RateLimits(per_chat=Rate(1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        TELEGRAM.overall = None  # type: ignore[misc]


def test_is_group() -> None:
    assert is_group(-100123)
    assert not is_group(42)
    assert not is_group("@channel")
    assert not is_group(True)


# ------------------------------------------------------------------ buckets


def test_per_chat_spacing(make: Any, clock: FakeClock) -> None:
    rl = make(per_chat=Rate(1))
    assert rl.acquire(1) == 0.0
    assert rl.acquire(1) == pytest.approx(1.0)
    assert rl.acquire(2) == 0.0  # another chat is independent
    clock.advance(0.4)
    assert rl.acquire(1) == pytest.approx(0.6)  # a wait takes nothing
    clock.advance(0.6)
    assert rl.acquire(1) == 0.0
    assert rl.acquire(1) == pytest.approx(1.0)
    assert rl.acquire("1") == 0.0  # the str "1" is another chat than the int 1


def test_burst_then_even_spacing(make: Any, clock: FakeClock) -> None:
    rl = make(per_chat=Rate(10, 1.0, burst=3))
    assert [rl.acquire("c") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rl.acquire("c") == pytest.approx(0.1)
    clock.advance(0.1)
    assert rl.acquire("c") == 0.0
    assert rl.acquire("c") == pytest.approx(0.1)
    clock.advance(10.0)  # idle: the burst is back, and no more
    assert [rl.acquire("c") for _ in range(4)][:3] == [0.0, 0.0, 0.0]


def test_groups_obey_both_the_chat_and_the_group_limit(make: Any, clock: FakeClock) -> None:
    rl = make(per_chat=Rate(1), per_group=Rate(20, 60.0))
    assert rl.acquire(-5) == 0.0
    assert rl.acquire(-5) == pytest.approx(3.0)  # the group limit is the longer
    assert rl.acquire(5) == 0.0
    assert rl.acquire(5) == pytest.approx(1.0)  # a private chat: no group limit
    clock.advance(3.0)
    assert rl.acquire(-5) == 0.0


def test_overall_limit_books_distinct_slots(make: Any, clock: FakeClock) -> None:
    rl = make(overall=Rate(10))
    waits = [rl.acquire(chat) for chat in range(5)]
    assert waits == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4], abs=1e-4)
    assert booked(rl) in (4, None)
    # Coming back early: the same slot, nothing new booked.
    assert rl.acquire(3) == pytest.approx(0.3, abs=1e-4)
    clock.advance(waits[3])
    assert rl.acquire(3) == 0.0  # its slot, though chats 1 and 2 did not come back yet
    assert booked(rl) in (3, None)
    # A new chat queues behind every booked slot.
    assert rl.acquire(99) == pytest.approx(0.5 - 0.3, abs=1e-4)


def test_chat_limit_waits_without_booking_the_overall_slot(make: Any) -> None:
    rl = make(overall=Rate(10), per_chat=Rate(1))
    assert rl.acquire("a") == 0.0
    assert rl.acquire("a") == pytest.approx(1.0)
    assert booked(rl) in (0, None)
    assert rl.acquire("b") == pytest.approx(0.1, abs=1e-4)  # the overall slot "a" did not take


def test_a_booked_send_spaces_the_chat_from_when_it_went(make: Any, clock: FakeClock) -> None:
    rl = make(overall=Rate(10), per_chat=Rate(2))
    assert rl.acquire("x") == 0.0
    wait = rl.acquire("a")
    assert wait == pytest.approx(0.1, abs=1e-4)
    clock.advance(wait)
    assert rl.acquire("a") == 0.0
    assert rl.acquire("a") == pytest.approx(0.5)


def test_no_booking_mode_takes_nothing_when_refused(make: Any) -> None:
    rl = make(overall=Rate(10))
    assert rl.acquire("a", book=False) == 0.0
    assert rl.acquire("b", book=False) == pytest.approx(0.1, abs=1e-4)
    assert rl.acquire("c", book=False) == pytest.approx(0.1, abs=1e-4)
    assert booked(rl) in (0, None)


def test_a_booking_used_late_is_void_and_no_burst_follows(make: Any, clock: FakeClock) -> None:
    # The defect: 20 chats booked at 10/s, then a 0.55 s hold-up; the late
    # slots went out at once, 15 sends in one second.
    rl = make(overall=Rate(10))
    waits = {chat: rl.acquire(chat) for chat in range(20)}
    granted = [clock.now]  # chat 0 went at once
    start = clock.now
    clock.advance(0.55)
    pending = {chat: start + w for chat, w in waits.items() if chat}
    for _ in range(200):
        if not pending:
            break
        chat, due = min(pending.items(), key=lambda kv: kv[1])
        clock.now = max(clock.now, due)
        wait = rl.acquire(chat)
        if wait == 0.0:
            granted.append(clock.now)
            del pending[chat]
        else:
            pending[chat] = clock.now + wait
    assert not pending
    assert max_in_window(granted, 1.0) <= 10


def test_a_booking_used_within_slack_keeps_its_slot(store: str, clock: FakeClock) -> None:
    with limiter_on(store, RateLimits(overall=Rate(10)), clock=clock, slack=0.05) as rl:
        assert rl.acquire("a") == 0.0
        wait = rl.acquire("b")
        assert wait == pytest.approx(0.1 + 0.05 / 10, abs=1e-4)  # interval widened by slack/N
        assert rl.acquire("c") == pytest.approx(2 * wait, abs=1e-4)
        clock.advance(wait + 0.049)  # late, within slack
        assert rl.acquire("b") == 0.0
        clock.advance(0.2)  # "c" comes back 0.2 - 0.049 - wait s late: too late
        assert rl.acquire("c") == 0.0  # decided afresh: nothing is ahead of it now
        assert rl.acquire("d") > 0.0


# -------------------------------------------------------------------- bans


def test_a_chat_ban_holds_that_chat_only(make: Any, clock: FakeClock) -> None:
    rl = make(per_chat=Rate(100))
    assert rl.record_429(1, 5.0, "chat") == "chat"
    assert rl.acquire(1) == pytest.approx(5.0)
    assert rl.acquire(1, book=False) == pytest.approx(5.0)
    assert rl.acquire(2) == 0.0
    rl.record_429(1, 1.0, "chat")  # a shorter ban never shortens the longer one
    clock.advance(4.0)
    assert rl.acquire(1) == pytest.approx(1.0)
    clock.advance(1.0)
    assert rl.acquire(1) == 0.0


def test_a_global_ban_holds_every_chat_then_no_burst(make: Any, clock: FakeClock) -> None:
    rl = make(overall=Rate(10))
    assert rl.record_429(7, 0.5, "global") == "global"
    waits = [rl.acquire(chat) for chat in range(5)]
    assert waits == pytest.approx([0.5] * 5)
    clock.advance(0.5)
    after = [rl.acquire(chat) for chat in range(5)]
    assert after == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4], abs=1e-4)


def test_a_ban_survives_a_booking(make: Any, clock: FakeClock) -> None:
    rl = make(overall=Rate(10))
    assert rl.acquire("a") == 0.0
    wait = rl.acquire("b")
    rl.record_429("b", 2.0, "chat")
    clock.advance(wait)
    assert rl.acquire("b") == pytest.approx(2.0 - wait)


def test_the_scope_of_an_unstated_429_is_inferred(store: str, clock: FakeClock) -> None:
    limits = RateLimits(per_chat=Rate(100))
    with limiter_on(store, limits, clock=clock, infer_chats=2, infer_window=5.0) as rl:
        assert rl.record_429(1, 3.0) == "chat"  # one chat alone: its own limit
        assert rl.acquire(1) == pytest.approx(3.0)
        assert rl.acquire(2) == 0.0
        assert rl.record_429(2, 3.0) == "global"  # a second chat soon after: the bot's
        assert rl.acquire(3) == pytest.approx(3.0)
    with limiter_on(store, limits, clock=clock, infer_chats=3) as rl:
        assert rl.record_429(1, 1.0) == "chat"
        assert rl.record_429(1, 1.0) == "chat"  # the same chat twice is still one chat
        assert rl.record_429(2, 1.0) == "chat"
        assert rl.record_429(3, 1.0) == "global"


def test_stats_and_repr(make: Any, clock: FakeClock) -> None:
    rl = make(overall=Rate(10), per_chat=Rate(1), per_group=Rate(20, 60.0))
    rl.acquire(1)
    rl.acquire(-2)
    rl.acquire(3)
    rl.record_429(4, 2.0, "chat")
    stats = rl.stats()
    if isinstance(rl, RateLimiter):
        assert stats.booked == 2
        assert (stats.chats, stats.groups, stats.banned) == (1, 0, 1)
        assert stats.store == "local"
    else:
        assert stats.store == "shared"
    assert type(rl).__name__ in repr(rl)
    assert rl.limits.per_chat == Rate(1)


# ---------------------------------------------------------------- memory


def test_idle_chats_are_forgotten() -> None:
    clock = FakeClock()
    rl = RateLimiter(RateLimits(per_chat=Rate(1), per_group=Rate(20, 60.0)), clock=clock)
    for i in range(20_000):
        assert rl.acquire(-i - 1) == 0.0
        clock.advance(0.01)
    # At most 1 s (per chat) or 3 s (per group) of chats are live; sweeps
    # keep the rest within twice that.
    assert len(rl._chat_tat.values) <= 2 * 100 + 256
    assert len(rl._group_tat.values) <= 2 * 300 + 256


def test_idle_bookings_are_forgotten() -> None:
    clock = FakeClock()
    rl = RateLimiter(RateLimits(overall=Rate(1000)), clock=clock, stale_after=0.1)
    for i in range(20_000):
        rl.acquire(i)
        clock.advance(0.01)
    assert rl.stats().booked <= 600


# ------------------------------------------------------------ concurrency


def test_concurrent_takers_never_exceed_the_overall_burst(store: str, clock: FakeClock) -> None:
    limits = RateLimits(overall=Rate(100, 1.0, burst=100))
    with limiter_on(store, limits, clock=clock, **EXACT) as rl:
        granted = []
        lock = threading.Lock()
        barrier = threading.Barrier(8)

        def worker(n: int) -> None:
            barrier.wait(timeout=10)
            mine = sum(1 for i in range(40) if rl.acquire(f"{n}:{i}", book=False) == 0.0)
            with lock:
                granted.append(mine)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        # The whole burst, but for its last send when a step's sum was rounded
        # down and moved up by a unit of the last place (the interval, widened
        # by a margin, is not a double exactly): that one waits a few of them.
        assert 99 <= sum(granted) <= 100
        if sum(granted) == 99:
            assert rl.acquire("later", book=False) < 1e-6


def test_concurrent_bookings_get_distinct_slots(store: str, clock: FakeClock) -> None:
    with limiter_on(store, RateLimits(overall=Rate(100)), clock=clock, **EXACT) as rl:
        waits: list[float] = []
        lock = threading.Lock()
        barrier = threading.Barrier(4)

        def worker(n: int) -> None:
            barrier.wait(timeout=10)
            mine = [rl.acquire(f"{n}:{i}") for i in range(50)]
            with lock:
                waits.extend(mine)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        slots = sorted(round(w * 100) for w in waits)
        assert slots == list(range(200))


# ------------------------------------------------------------------ helper


def booked(limiter: BaseRateLimiter) -> int | None:
    """Bookings a local limiter holds; None for a shared one (they are in its store)."""
    return limiter.stats().booked if isinstance(limiter, RateLimiter) else None


def test_max_in_window() -> None:
    assert max_in_window([0.0, 0.5, 1.0, 1.5], 1.0) == 2
    assert max_in_window([0.0, 0.0, 0.0], 1.0) == 3
    assert max_in_window([], 1.0) == 0
    logging.getLogger(__name__).debug("ok")


def _platform_refuses(arrivals: list[float], rate: Rate) -> int:
    """How many of ``arrivals`` a platform pacing ``rate`` exactly (GCRA on each
    arrival, no tolerance past the burst's) refuses."""
    tat = -math.inf
    refused = 0
    for t in arrivals:
        if t < tat - (rate.burst - 1) * rate.interval - 1e-9:
            refused += 1
            continue
        tat = max(tat, t) + rate.interval
    return refused


@pytest.mark.parametrize(
    ("chat", "rate"),
    [(7, Rate(1)), (-100123, Rate(16, 60.0, burst=5))],
    ids=["chat", "group"],
)
def test_sends_held_up_on_their_way_by_up_to_slack_still_arrive_within_the_limit(
    chat: int, rate: Rate
) -> None:
    """The platform counts arrivals: a send granted on time and then held up on its
    way (a thread waiting for the GIL behind busy ones) arrived closer to the
    one before than the rate, and a chat paced at exactly 1 s got 429s from a
    platform forgiving 20 ms. Every limit runs slack under its rate."""
    limits = RateLimits(per_chat=rate) if chat > 0 else RateLimits(per_group=rate)
    clock = FakeClock()
    limiter = RateLimiter(limits, clock=clock)  # (slack: 20 ms)
    for late in ([True, False], [True, False, False, False, False], [False]):
        arrivals: list[float] = []
        for i in range(60):
            while (wait := limiter.acquire(chat)) > 0.0:
                clock.advance(wait)
            arrivals.append(clock() + (limiter.slack if late[i % len(late)] else 0.0))
            # (One send of a chat after another: the next is granted once this
            # one arrived, and its answer came back.)
            clock.advance(max(0.0, arrivals[-1] - clock()) + 0.001)
        assert _platform_refuses(arrivals, rate) == 0, late
        clock.advance(3600.0)
