"""Client-side send limits: :class:`Rate`, :class:`RateLimits`, :class:`RateLimiter`.

A :class:`RateLimiter` paces sends so that the platform rarely has to say
"429": messages per second overall, per chat, and per group (a chat whose
id is a negative int, as on Telegram), each optional. It never sleeps: it
answers "go" or "wait this long", and the
:func:`~outbound.middleware.rate_limit` middleware turns a wait into a
:class:`~outbound.Defer`, so that the lane is parked and no thread or
permit is held while it waits.

Each limit is a GCRA (generic cell rate algorithm) bucket, the
token-bucket equivalent that keeps one number per key: the *theoretical
arrival time* ``tat``. A send at ``t`` conforms if ``t >= tat - tolerance``,
and then ``tat = max(tat, t) + interval``. A key whose ``tat`` has passed is
exactly as good as a key never seen, so idle chats are simply forgotten.

The overall limit is shared by every chat, and many parked lanes waking
at the same instant to fight for the next token would waste work. So when
a chat is ready but the overall limit is not, the limiter *books* the next
overall slot for that chat and returns the delay to it; when the chat
comes back at or after that instant (its lane's head is the same message,
since a lane runs one task at a time), the booked slot is its own.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Final

__all__ = ["SLACK", "TELEGRAM", "Rate", "RateLimiter", "RateLimiterStats", "RateLimits", "is_group"]

# A booked slot counts as due when the caller comes back this early (the
# dispatcher's timer wakes at or after the due instant; this absorbs float
# rounding).
_DUE_SLACK: Final = 1e-3

# A store sweeps out forgotten keys when it grows past this many entries,
# then past twice what survived the last sweep: amortized O(1) per call.
_MIN_SWEEP: Final = 256


@dataclass(frozen=True, slots=True)
class Rate:
    """``limit`` sends per ``period`` seconds, evenly spaced, with bursts of ``burst``.

    ``Rate(30)`` is 30 per second; ``Rate(20, 60.0)`` is 20 per minute.
    ``burst`` sends may go back to back after an idle spell; ``1`` (the
    default) spaces every send by ``period / limit``. Immutable.
    """

    limit: int
    period: float = 1.0
    burst: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise ValueError(f"Rate.limit must be an int >= 1, not {self.limit!r}")
        if isinstance(self.period, bool) or not isinstance(self.period, (int, float)):
            raise TypeError("Rate.period must be a number of seconds")
        if not (self.period > 0 and math.isfinite(self.period)):
            raise ValueError(f"Rate.period must be a finite number > 0, not {self.period!r}")
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ValueError(f"Rate.burst must be an int >= 1, not {self.burst!r}")

    @property
    def interval(self) -> float:
        """Seconds between two evenly spaced sends."""
        return self.period / self.limit


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Which limits apply; each is optional (``None``: no such limit). Immutable.

    - ``overall``: every send of the bot, whatever the chat.
    - ``per_chat``: sends to any one chat.
    - ``per_group``: sends to any one group (a negative int chat id), on
      top of ``per_chat``.
    """

    overall: Rate | None = None
    per_chat: Rate | None = None
    per_group: Rate | None = None

    def __post_init__(self) -> None:
        for name in ("overall", "per_chat", "per_group"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Rate):
                raise TypeError(f"RateLimits.{name} must be a Rate or None")


#: Telegram's published bot limits: about 30 messages per second overall,
#: 1 per second to one chat, 20 per minute to one group.
TELEGRAM: Final = RateLimits(overall=Rate(30), per_chat=Rate(1), per_group=Rate(20, 60.0))

#: Slack's ``chat.postMessage`` limit: about 1 message per second per channel.
SLACK: Final = RateLimits(per_chat=Rate(1))


def is_group(chat_id: Hashable) -> bool:
    """True for a group chat: a negative int id (Telegram's convention)."""
    return isinstance(chat_id, int) and not isinstance(chat_id, bool) and chat_id < 0


@dataclass(frozen=True, slots=True)
class RateLimiterStats:
    """A snapshot of what a :class:`RateLimiter` tracks (for monitoring and tests)."""

    chats: int
    groups: int
    booked: int


class _Store:
    """GCRA state of one :class:`Rate`, one ``tat`` per key.

    ``_lock`` guards ``_tat`` and ``_sweep_at``; every sending thread takes
    it for O(1) work (O(n) once per doubling, to sweep). Invariant: a key
    absent from ``_tat`` behaves exactly like a key whose ``tat`` passed.
    """

    __slots__ = ("_interval", "_lock", "_sweep_at", "_tat", "_tolerance")

    def __init__(self, rate: Rate) -> None:
        self._interval: Final = rate.interval
        self._tolerance: Final = (rate.burst - 1) * rate.interval
        self._lock: Final = threading.Lock()
        self._tat: dict[Hashable, float] = {}
        self._sweep_at = _MIN_SWEEP

    def wait(self, key: Hashable, now: float) -> float:
        """Seconds from ``now`` until ``key`` may send; 0.0 if it may now."""
        with self._lock:
            tat = self._tat.get(key)
        return 0.0 if tat is None else max(0.0, tat - self._tolerance - now)

    def book(self, key: Hashable, at: float, now: float) -> float:
        """Book the earliest slot of ``key`` at or after ``at``; return its instant."""
        with self._lock:
            tat = self._tat.get(key)
            slot = at if tat is None else max(at, tat - self._tolerance)
            self._tat[key] = (slot if tat is None else max(tat, slot)) + self._interval
            if len(self._tat) > self._sweep_at:
                self._sweep_locked(now)
        return slot

    def take(self, key: Hashable, now: float) -> float:
        """Take a slot of ``key`` at ``now`` and return 0.0, or return the wait and take nothing."""
        with self._lock:
            tat = self._tat.get(key)
            if tat is not None and tat - self._tolerance > now:
                return tat - self._tolerance - now
            self._tat[key] = (now if tat is None else max(tat, now)) + self._interval
            if len(self._tat) > self._sweep_at:
                self._sweep_locked(now)
        return 0.0

    def sent_late(self, key: Hashable, now: float) -> None:
        """A slot booked for ``key`` was used only at ``now``: count from ``now``."""
        with self._lock:
            tat = self._tat.get(key)
            self._tat[key] = now + self._interval if tat is None else max(tat, now + self._interval)

    def _sweep_locked(self, now: float) -> None:
        self._tat = {key: tat for key, tat in self._tat.items() if tat > now}
        self._sweep_at = max(_MIN_SWEEP, 2 * len(self._tat))

    def __len__(self) -> int:
        with self._lock:
            return len(self._tat)


class RateLimiter:
    """Paces sends per :class:`RateLimits`; answers at once, never sleeps.

    ``clock`` is a ``time.monotonic``-like function (inject a fake one in
    tests). ``stale_after``: a booked overall slot not claimed within this
    many seconds of its instant is dropped (its message failed or was
    cancelled meanwhile). Thread-safe: each store of buckets has its own
    lock, held only for O(1) bookkeeping, and no two are held at once.
    Memory: a chat is tracked only while its next slot lies in the future.
    """

    def __init__(
        self,
        limits: RateLimits,
        *,
        clock: Callable[[], float] = time.monotonic,
        stale_after: float = 1.0,
    ) -> None:
        if not isinstance(limits, RateLimits):
            raise TypeError(f"limits must be a RateLimits, not {type(limits).__name__}")
        if not (stale_after > 0 and math.isfinite(stale_after)):
            raise ValueError(f"stale_after must be a finite number > 0, not {stale_after!r}")
        self._limits: Final = limits
        self._clock: Final = clock
        self._stale_after: Final = float(stale_after)
        self._overall: Final = None if limits.overall is None else _Store(limits.overall)
        self._chats: Final = None if limits.per_chat is None else _Store(limits.per_chat)
        self._groups: Final = None if limits.per_group is None else _Store(limits.per_group)
        # Guards _booked and _booked_sweep_at: chat -> instant of the overall
        # slot booked for that chat's next send. Taken by sending threads.
        self._booked_lock: Final = threading.Lock()
        self._booked: dict[Hashable, float] = {}
        self._booked_sweep_at = _MIN_SWEEP

    @property
    def limits(self) -> RateLimits:
        return self._limits

    def acquire(self, chat_id: Hashable, *, book: bool = True) -> float:
        """Take a send slot for ``chat_id``: return 0.0 to send now, or seconds to wait.

        A wait takes nothing, except that with ``book=True``, when only the
        overall limit is short, the next overall slot is booked for this
        chat: call again for the same chat once the wait is over and the
        slot is yours. Calls for one chat should not overlap (a dispatcher
        lane guarantees it); with ``book=False`` (for a caller that may not
        come back) nothing is booked. Never blocks.
        """
        now = self._clock()
        group = self._groups is not None and is_group(chat_id)
        if book:
            slot = self._take_booking(chat_id, now)
            if slot is not None:
                if slot - now > _DUE_SLACK:
                    return slot - now
                if now > slot:
                    # Used late (the lane waited for a worker): the chat's
                    # next slot counts from now, not from the booked instant.
                    if self._chats is not None:
                        self._chats.sent_late(chat_id, now)
                    if group and self._groups is not None:
                        self._groups.sent_late(chat_id, now)
                return 0.0
        wait = 0.0
        if self._chats is not None:
            wait = self._chats.wait(chat_id, now)
        if group and self._groups is not None:
            wait = max(wait, self._groups.wait(chat_id, now))
        if wait > 0.0:
            return wait
        slot = now
        if self._overall is not None:
            if book:
                slot = self._overall.book(None, now, now)
            else:
                wait = self._overall.take(None, now)
                if wait > 0.0:
                    return wait
        if self._chats is not None:
            self._chats.book(chat_id, slot, now)
        if group and self._groups is not None:
            self._groups.book(chat_id, slot, now)
        if slot - now <= _DUE_SLACK:
            return 0.0
        with self._booked_lock:
            self._booked[chat_id] = slot
            if len(self._booked) > self._booked_sweep_at:
                horizon = now - self._stale_after
                self._booked = {k: v for k, v in self._booked.items() if v > horizon}
                self._booked_sweep_at = max(_MIN_SWEEP, 2 * len(self._booked))
        return slot - now

    def _take_booking(self, chat_id: Hashable, now: float) -> float | None:
        """The slot booked for ``chat_id``, removed if it is due; None if none (or stale)."""
        with self._booked_lock:
            slot = self._booked.get(chat_id)
            if slot is None:
                return None
            if slot + self._stale_after < now:
                del self._booked[chat_id]
                return None
            if slot - now <= _DUE_SLACK:
                del self._booked[chat_id]
            return slot

    def stats(self) -> RateLimiterStats:
        """How many chats, groups and booked slots are tracked now. O(1)."""
        with self._booked_lock:
            booked = len(self._booked)
        return RateLimiterStats(
            chats=0 if self._chats is None else len(self._chats),
            groups=0 if self._groups is None else len(self._groups),
            booked=booked,
        )

    def __repr__(self) -> str:
        s = self.stats()
        return f"<RateLimiter {self._limits!r} chats={s.chats} booked={s.booked}>"
