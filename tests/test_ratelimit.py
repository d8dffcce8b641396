"""Token buckets of outbound.ratelimit, on an injected clock (no sleeping)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from outbound.ratelimit import SLACK, TELEGRAM, Rate, RateLimiter, RateLimits, is_group


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def limiter(clock: FakeClock, **limits: Rate) -> RateLimiter:
    return RateLimiter(RateLimits(**limits), clock=clock)


# ------------------------------------------------------------------ config


def test_rate_validation() -> None:
    assert Rate(20, 60.0).interval == pytest.approx(3.0)
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


def test_presets_are_immutable_and_match_the_platforms() -> None:
    assert TELEGRAM.overall == Rate(30)
    assert TELEGRAM.per_chat == Rate(1)
    assert TELEGRAM.per_group == Rate(20, 60.0)
    assert SLACK.overall is None
    assert SLACK.per_chat == Rate(1)
    assert SLACK.per_group is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        TELEGRAM.overall = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TELEGRAM.per_chat.limit = 100  # type: ignore[misc]


def test_is_group() -> None:
    assert is_group(-100123)
    assert not is_group(42)
    assert not is_group("@channel")
    assert not is_group(True)


# ------------------------------------------------------------------ buckets


def test_per_chat_spacing() -> None:
    clock = FakeClock()
    rl = limiter(clock, per_chat=Rate(1))
    assert rl.acquire(1) == 0.0
    assert rl.acquire(1) == pytest.approx(1.0)
    assert rl.acquire(2) == 0.0  # another chat is independent
    clock.advance(0.4)
    assert rl.acquire(1) == pytest.approx(0.6)  # a wait takes nothing
    clock.advance(0.6)
    assert rl.acquire(1) == 0.0
    assert rl.acquire(1) == pytest.approx(1.0)


def test_burst_then_even_spacing() -> None:
    clock = FakeClock()
    rl = limiter(clock, per_chat=Rate(10, 1.0, burst=3))
    assert [rl.acquire("c") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rl.acquire("c") == pytest.approx(0.1)
    clock.advance(0.1)
    assert rl.acquire("c") == 0.0
    assert rl.acquire("c") == pytest.approx(0.1)
    clock.advance(10.0)  # idle: the burst is back, and no more
    assert [rl.acquire("c") for _ in range(4)][:3] == [0.0, 0.0, 0.0]


def test_groups_obey_both_the_chat_and_the_group_limit() -> None:
    clock = FakeClock()
    rl = limiter(clock, per_chat=Rate(1), per_group=Rate(20, 60.0))
    assert rl.acquire(-5) == 0.0
    assert rl.acquire(-5) == pytest.approx(3.0)  # the group limit is the longer
    assert rl.acquire(5) == 0.0
    assert rl.acquire(5) == pytest.approx(1.0)  # a private chat: no group limit
    clock.advance(3.0)
    assert rl.acquire(-5) == 0.0


def test_overall_limit_books_distinct_slots() -> None:
    clock = FakeClock()
    rl = limiter(clock, overall=Rate(10))
    waits = [rl.acquire(chat) for chat in range(5)]
    assert waits == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert rl.stats().booked == 4
    # Coming back early: the same slot, nothing new booked.
    assert rl.acquire(3) == pytest.approx(0.3)
    clock.advance(0.3)
    assert rl.acquire(3) == 0.0  # its slot, even though chats 1 and 2 did not come back yet
    assert rl.acquire(1) == 0.0
    assert rl.stats().booked == 2
    # A new chat queues behind every booked slot.
    assert rl.acquire(99) == pytest.approx(0.2)


def test_chat_limit_waits_without_booking_the_overall_slot() -> None:
    clock = FakeClock()
    rl = limiter(clock, overall=Rate(10), per_chat=Rate(1))
    assert rl.acquire("a") == 0.0
    assert rl.acquire("a") == pytest.approx(1.0)
    assert rl.stats().booked == 0
    assert rl.acquire("b") == pytest.approx(0.1)  # the overall slot "a" did not take


def test_booked_slot_also_spaces_the_chat() -> None:
    clock = FakeClock()
    rl = limiter(clock, overall=Rate(10), per_chat=Rate(2))
    assert rl.acquire("x") == 0.0
    assert rl.acquire("a") == pytest.approx(0.1)
    clock.advance(0.1)
    assert rl.acquire("a") == 0.0
    # "a" sent at +0.1, so its next slot is 0.5 s after that, not after the booking.
    assert rl.acquire("a") == pytest.approx(0.5)


def test_no_booking_mode_takes_nothing_when_refused() -> None:
    clock = FakeClock()
    rl = limiter(clock, overall=Rate(10))
    assert rl.acquire("a", book=False) == 0.0
    assert rl.acquire("b", book=False) == pytest.approx(0.1)
    assert rl.acquire("c", book=False) == pytest.approx(0.1)
    assert rl.stats().booked == 0


def test_stale_bookings_are_dropped() -> None:
    clock = FakeClock()
    rl = RateLimiter(RateLimits(overall=Rate(10)), clock=clock, stale_after=0.5)
    assert rl.acquire("a") == 0.0
    assert rl.acquire("b") == pytest.approx(0.1)  # booked, but "b" never comes back
    clock.advance(5.0)
    assert rl.acquire("b") == 0.0  # a fresh slot, not the stale one
    assert rl.stats().booked == 0


def test_idle_chats_are_forgotten() -> None:
    clock = FakeClock()
    rl = limiter(clock, per_chat=Rate(1), per_group=Rate(20, 60.0))
    for i in range(20_000):
        assert rl.acquire(-i - 1) == 0.0
        clock.advance(0.01)
    stats = rl.stats()
    # At most 1 s (per chat) or 3 s (per group) of chats are live; sweeps
    # keep the rest within twice that.
    assert stats.chats <= 2 * 100 + 256
    assert stats.groups <= 2 * 300 + 256


def test_idle_bookings_are_forgotten() -> None:
    clock = FakeClock()
    rl = RateLimiter(RateLimits(overall=Rate(1000)), clock=clock, stale_after=0.1)
    for i in range(20_000):
        rl.acquire(i)
        clock.advance(0.01)
    assert rl.stats().booked <= 600


def test_concurrent_takers_never_exceed_the_overall_burst() -> None:
    clock = FakeClock()
    rl = limiter(clock, overall=Rate(100, 1.0, burst=100))
    granted = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(n: int) -> None:
        barrier.wait(timeout=10)
        mine = sum(1 for i in range(200) if rl.acquire((n, i), book=False) == 0.0)
        with lock:
            granted.append(mine)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sum(granted) == 100


def test_concurrent_bookings_get_distinct_slots() -> None:
    clock = FakeClock()
    rl = limiter(clock, overall=Rate(100))
    waits: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(n: int) -> None:
        barrier.wait(timeout=10)
        mine = [rl.acquire((n, i)) for i in range(100)]
        with lock:
            waits.extend(mine)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    slots = sorted(round(w * 100) for w in waits)
    assert slots == list(range(800))


def test_repr_and_limits() -> None:
    rl = RateLimiter(TELEGRAM)
    assert rl.limits is TELEGRAM
    assert "RateLimiter" in repr(rl)
    with pytest.raises(TypeError):
        RateLimiter(Rate(1))  # type: ignore[arg-type]


def test_a_slot_used_late_spaces_the_chat_from_the_actual_send() -> None:
    clock = FakeClock()
    rl = limiter(clock, overall=Rate(10), per_chat=Rate(2), per_group=Rate(1, 2.0))
    assert rl.acquire("x") == 0.0
    assert rl.acquire(-1) == pytest.approx(0.1)
    clock.advance(0.3)  # the lane came back 0.2 s after its slot
    assert rl.acquire(-1) == 0.0
    assert rl.acquire(-1) == pytest.approx(2.0)  # the group limit, counted from now
    clock.advance(2.0)
    rl2 = limiter(clock, overall=Rate(10), per_chat=Rate(2))
    assert rl2.acquire("x") == 0.0
    assert rl2.acquire("a") == pytest.approx(0.1)
    clock.advance(0.3)
    assert rl2.acquire("a") == 0.0
    assert rl2.acquire("a") == pytest.approx(0.5)
