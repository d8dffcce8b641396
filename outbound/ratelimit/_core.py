"""The limiter's decision, shared by every store: :class:`BaseRateLimiter`, :class:`RateLimiter`.

Every limit is a GCRA (generic cell rate algorithm) bucket: one number per
key, the *theoretical arrival time* ``tat``. A send at ``t`` conforms if
``t >= tat - tolerance`` (``tolerance = (burst - 1) * interval``), and then
``tat = max(tat, t) + interval``. Any sequence of conforming sends holds at
most ``limit + burst - 1`` sends in any window of one period. A key whose
``tat`` has passed is exactly as good as a key never seen, so idle chats
are forgotten.

Per chat and per group a send is decided at the instant it is granted.
The platform counts arrivals, and a send granted on time may be held up
on its way (a thread waiting for the GIL, a pause): their intervals are
lengthened by ``slack`` (see :meth:`Gcra.paced`), so a send up to
``slack`` late on its way still keeps to them (2% of a chat's one per
second, 0.5% of a group's 16 a minute). The overall limit is shared by every chat,
and many parked lanes waking at the same instant to fight for the next
slot would waste work; so it keeps two buckets. The *plan* hands out
slots: when a chat is ready but the overall limit is not (or slots are
already booked ahead of it), the next slot ``s`` is *booked* for that
chat, in the store, and the wait returned; the chat comes back at ``s``
and no one else is given ``s``. The *sends* bucket decides: every send,
booked or not, must conform to it at the instant it is granted, with a
tolerance of ``slack`` seconds on top of the burst's, so a booked chat
that comes back a little late (a timer, a busy pool, a poll) still goes.
One that comes back later than the sends allow, or finds a ban, is booked
again behind the others; nothing ever goes out because of a stale slot.
To keep the bound exact with that tolerance, the overall interval is
lengthened by ``slack / limit``, which costs ``slack / period`` of the
overall throughput (2% of a per-second limit with the default 20 ms).
Bookings live where the rest of the state does (for a shared limiter, in
its store), so a chat may come back through another process: an outbox
row re-claimed by another relay keeps its slot.

A 429 is a fact about the chat or the bot, not about the message that got
it: :meth:`BaseRateLimiter.record_429` bans the chat (or every chat) until
the platform's ``retry_after`` has passed, and every later decision waits
for it, whatever became of that message. When the platform does not say
whose limit it was (real Telegram and Slack do not), the scope is
inferred: 429s for ``infer_chats`` different chats within
``infer_window`` seconds mean the bot's limit, anything less one chat's.
A ``retry_after`` longer than
:attr:`RateLimited.MAX_RETRY_AFTER <outbound.errors.RateLimited.MAX_RETRY_AFTER>`
(one day) is cut to it.
"""

from __future__ import annotations

import abc
import collections
import math
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Final, Literal

from outbound._fork import renewed_after_fork
from outbound.errors import RateLimited
from outbound.retry import check_number, shown_number

from ._limits import Rate, RateLimits, is_group

__all__ = ["BaseRateLimiter", "RateLimiter", "RateLimiterStats"]

Scope = Literal["chat", "global"]

#: A booked slot counts as due when the caller comes back this early (the
#: dispatcher's timer wakes at or after the due instant; this absorbs float
#: rounding). Included in the widening of the overall interval.
EARLY: Final = 1e-6

# A table sweeps out forgotten keys when it grows past this many entries,
# then past twice what survived the last sweep: amortized O(1) per call.
_MIN_SWEEP: Final = 256


@dataclass(frozen=True, slots=True)
class Gcra:
    """A :class:`Rate` as GCRA parameters: ``interval`` and ``tolerance``, seconds."""

    interval: float
    tolerance: float

    @classmethod
    def paced(cls, rate: Rate, slack: float) -> Gcra:
        """Decided at the instant of the send, which may then be up to ``slack`` late
        on its way: the interval widened by ``slack``, so that the arrivals of
        one key's sends, one after another, keep to ``rate`` (any ``n`` of
        them spaced at least ``(n - burst) * interval``, the earlier one late
        by ``slack``, the later one not). The rate as it is with no slack."""
        interval = rate.interval + slack
        return cls(interval, (rate.burst - 1) * interval)

    @classmethod
    def booked(cls, rate: Rate, slack: float) -> Gcra:
        """Booked ahead and used up to ``slack`` late: the interval widened to keep the bound.

        With ``interval = T + slack / limit`` and ``tolerance = (burst - 1) *
        interval``, sends each up to ``slack`` after a conforming slot still
        hold at most ``limit + burst - 1`` in any window of one period.
        """
        interval = rate.interval + (slack + EARLY) / rate.limit
        return cls(interval, (rate.burst - 1) * interval)


@dataclass(frozen=True, slots=True)
class RateLimiterStats:
    """A snapshot of what a limiter tracks (for monitoring and tests).

    ``chats``, ``groups``: keys with a future slot; ``booked``: overall
    slots booked and not yet used; ``banned``: chats under
    a 429 ban; ``global_ban``: seconds left of a bot-wide ban (0.0: none);
    ``store``: ``"local"``, or for a shared limiter ``"shared"`` or
    ``"fallback"`` (the store is unreachable: a local share is in force).
    """

    chats: int
    groups: int
    booked: int
    banned: int = 0
    global_ban: float = 0.0
    store: str = "local"


def check_seconds(name: str, value: object, *, positive: bool = False) -> float:
    return check_number(name, value, positive=positive)


#: The most chats ``infer_chats`` may name (a store keeps it as a 32-bit
#: integer; past a few, no 429 is ever taken for the bot's).
MAX_INFER_CHATS: Final = 1_000_000

#: The most seconds a limiter's ``slack``, ``stale_after``, ``retry_interval`` and
#: ``infer_window`` may be (each is a matter of milliseconds to seconds).
MAX_SETTING: Final = 3600.0


def _check_setting(name: str, value: object, *, positive: bool = False) -> float:
    seconds = check_seconds(name, value, positive=positive)
    if seconds > MAX_SETTING:
        raise ValueError(f"{name} must be at most {MAX_SETTING:g} seconds, not {value!r}")
    return seconds


class BaseRateLimiter(abc.ABC):
    """What every limiter does: pace sends, honour 429s. Subclasses keep the state.

    :class:`RateLimiter` keeps it in this process;
    :class:`~outbound.ratelimit.RedisRateLimiter` and
    :class:`~outbound.ratelimit.PostgresRateLimiter` in a store shared by
    every process of the bot. All answer alike. Thread-safe; never sleeps.
    """

    def __init__(
        self,
        limits: RateLimits,
        *,
        slack: float = 0.02,
        stale_after: float = 1.0,
        infer_chats: int = 2,
        infer_window: float = 1.0,
        tick: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(limits, RateLimits):
            raise TypeError(f"limits must be a RateLimits, not {type(limits).__name__}")
        self._limits: Final = limits
        self._slack: Final = _check_setting("slack", slack)
        self._stale_after: Final = _check_setting("stale_after", stale_after, positive=True)
        if (
            isinstance(infer_chats, bool)
            or not isinstance(infer_chats, int)
            or not 1 <= infer_chats <= MAX_INFER_CHATS
        ):
            raise ValueError(
                f"infer_chats must be an int in [1, {MAX_INFER_CHATS:,}], "
                f"not {shown_number(infer_chats)}"
            )
        self._infer_chats: Final = infer_chats
        self._infer_window: Final = _check_setting("infer_window", infer_window)
        # This process's clock, for what it keeps itself (bookings, recent 429s).
        self._tick: Final = tick
        # Per chat and per group, the interval widened by slack: a send granted
        # on time and then held up on its way by up to slack (a thread waiting
        # for the GIL, a pause) still arrives within the limit, as the platform
        # counts arrivals. (The overall's is widened by slack / limit, for its
        # bookings: see the module's notes.)
        self._chat: Final = None if limits.per_chat is None else Gcra.paced(limits.per_chat, slack)
        self._group: Final = (
            None if limits.per_group is None else Gcra.paced(limits.per_group, slack)
        )
        self._overall: Final = (
            None if limits.overall is None else Gcra.booked(limits.overall, slack)
        )
        for name, rate, gcra in (
            ("overall", limits.overall, self._overall),
            ("per-chat", limits.per_chat, self._chat),
            ("per-group", limits.per_group, self._group),
        ):
            if gcra is not None and not math.isfinite(gcra.tolerance):
                raise ValueError(
                    f"slack={slack!r} widens the {name} {rate!r} past any finite "
                    "tolerance; use a smaller slack or burst"
                )
        #: Seconds a booking is kept past its slot for a chat that comes back late.
        self._hold: Final = self._slack + self._stale_after
        # Guards _recent_429s; held for O(1) bookkeeping only, never while a
        # store is asked. Taken by threads that record 429s.
        self._lock: Final = renewed_after_fork(threading.Lock())
        # (tick, chat) of 429s whose scope the platform did not say.
        self._recent_429s: collections.deque[tuple[float, Hashable]] = collections.deque()

    @property
    def limits(self) -> RateLimits:
        return self._limits

    @property
    def slack(self) -> float:
        """How late (seconds) a booked send may come back and still go at once."""
        return self._slack

    # ---------------------------------------------------------------- deciding

    def acquire(self, chat_id: Hashable, *, book: bool = True) -> float:
        """Take a send slot for ``chat_id``: return 0.0 to send now, or seconds to wait.

        A wait takes nothing, except that with ``book=True``, when the
        overall limit is short, the next overall slot is booked for this
        chat: call again for the same chat once the wait is over and the
        slot is yours. Calls for one chat should not overlap (a dispatcher
        lane, or the outbox's per-key order, guarantees it); with
        ``book=False`` (for a caller that may not come back) nothing is
        booked. Never sleeps; a shared limiter makes one round trip to its
        store.
        """
        group = self._group is not None and is_group(chat_id)
        return self._decide(chat_id, group, book)

    def record_429(
        self, chat_id: Hashable, retry_after: float, scope: Scope | None = None
    ) -> Scope:
        """The platform answered 429 to a send for ``chat_id``: hold back what it named.

        ``scope`` ``"chat"`` bans that chat, ``"global"`` every chat, for
        ``retry_after`` seconds: every :meth:`acquire` meanwhile waits for the
        ban to end. ``None`` (the platform did not say) is inferred: see the
        module docstring. A ``retry_after`` past a day (an infinite one, or an
        int too large for a float, too) is cut to
        :attr:`~outbound.errors.RateLimited.MAX_RETRY_AFTER`. Returns the scope
        applied. Never sleeps.
        """
        seconds = min(
            check_number("retry_after", retry_after, allow_inf=True), RateLimited.MAX_RETRY_AFTER
        )
        if scope not in (None, "chat", "global"):
            raise ValueError(f"scope must be 'chat', 'global' or None, not {scope!r}")
        return self._record(chat_id, seconds, scope)

    def _record(self, chat_id: Hashable, seconds: float, scope: Scope | None) -> Scope:
        """Ban what the 429 names (inferring an unknown scope); return the scope applied."""
        if scope is None:
            scope = self._infer(chat_id)
        self._ban(None if scope == "global" else chat_id, seconds)
        return scope

    def _infer(self, chat_id: Hashable) -> Scope:
        """The scope of a 429 for ``chat_id`` the platform did not state, from the
        429s this process recorded in the last ``infer_window`` seconds."""
        now = self._tick()
        with self._lock:
            recent = self._recent_429s
            recent.append((now, chat_id))
            while recent and recent[0][0] < now - self._infer_window:
                recent.popleft()
            chats = len({chat for _, chat in recent})
        return "global" if chats >= self._infer_chats else "chat"

    def _global_ban_left(self) -> float:
        """Seconds left of a bot-wide ban this limiter knows of (0.0: none): what
        :func:`~outbound.middleware.rate_limit` reports as a ``"global"`` wait.
        Thread-safe; never blocks but for O(1) bookkeeping."""
        return 0.0

    @abc.abstractmethod
    def _decide(self, chat_id: Hashable, group: bool, book: bool) -> float:
        """One decision: the wait; ``0.0`` means granted and committed."""

    @abc.abstractmethod
    def _ban(self, chat_id: Hashable | None, seconds: float) -> None:
        """Ban ``chat_id`` (``None``: every chat) for ``seconds``; never shorten a ban."""


class _Table:
    """Values per key that matter only while in the future (tats, ban ends).

    Not locked itself: guarded by its owner's lock. Invariant: a key absent
    behaves exactly like a key whose value has passed.
    """

    __slots__ = ("sweep_at", "values")

    def __init__(self) -> None:
        self.values: dict[Hashable, float] = {}
        self.sweep_at = _MIN_SWEEP

    def get(self, key: Hashable) -> float | None:
        return self.values.get(key)

    def put(self, key: Hashable, value: float, now: float) -> None:
        self.values[key] = value
        if len(self.values) > self.sweep_at:
            self.values = {k: v for k, v in self.values.items() if v > now}
            self.sweep_at = max(_MIN_SWEEP, 2 * len(self.values))

    def live(self, now: float) -> int:
        return sum(1 for v in self.values.values() if v > now)


class RateLimiter(BaseRateLimiter):
    """Paces sends per :class:`RateLimits` within this process; answers at once, never sleeps.

    ``clock`` is a ``time.monotonic``-like function (inject a fake one in
    tests). ``slack``: how late a booked send may come back and still go at
    once (see the module docstring). ``stale_after``: how long past that a
    booking is kept for a chat that has not come back. ``infer_chats`` and
    ``infer_window``: how a 429 of unknown scope is judged bot-wide.

    Thread-safe: one lock guards the buckets, held for O(1) bookkeeping
    (O(n) once per doubling, to sweep). Memory: a chat is tracked only
    while its next slot or its ban lies in the future.
    """

    def __init__(
        self,
        limits: RateLimits,
        *,
        clock: Callable[[], float] = time.monotonic,
        slack: float = 0.02,
        stale_after: float = 1.0,
        infer_chats: int = 2,
        infer_window: float = 1.0,
    ) -> None:
        if not callable(clock):
            raise TypeError("clock must be callable")
        super().__init__(
            limits,
            slack=slack,
            stale_after=stale_after,
            infer_chats=infer_chats,
            infer_window=infer_window,
            tick=clock,
        )
        self._clock: Final = clock
        # Guards every table below and _overall_tat, _overall_plan, _global_ban. Taken by
        # sending threads for O(1) work; nothing else is done under it.
        self._state_lock: Final = renewed_after_fork(threading.Lock())
        self._chat_tat = _Table()
        self._group_tat = _Table()
        self._chat_ban = _Table()
        # chat -> the overall slot booked for its next send.
        self._bookings = _Table()
        self._overall_tat: float | None = None
        self._overall_plan: float | None = None
        self._global_ban: float | None = None
        # No send of a chat, a group, or of the bot conforms before these
        # instants (None: no floor). Set only when a shared limiter falls back
        # to this one (hold_back): then the store's state is unknown, and the
        # floors stand for the most it can hold.
        self._chat_floor: float | None = None
        self._group_floor: float | None = None
        self._overall_floor: float | None = None

    def _decide(self, chat_id: Hashable, group: bool, book: bool) -> float:
        with self._state_lock:
            return self._decide_locked(self._clock(), chat_id, group, book)

    def _decide_locked(self, now: float, chat_id: Hashable, group: bool, book: bool) -> float:
        # Mirrors the Lua script of RedisRateLimiter and the SQL function of
        # PostgresRateLimiter step by step; the contract tests hold all three
        # to the same answers.
        bans = (self._global_ban, self._chat_ban.get(chat_id))
        ban = max((b for b in bans if b is not None), default=now)
        if ban > now:
            return ban - now
        wait = 0.0
        chat_tat = group_tat = None
        if self._chat is not None:
            chat_tat = _floored(self._chat_tat.get(chat_id), self._chat_floor)
            if chat_tat is not None:
                wait = max(wait, chat_tat - self._chat.tolerance - now)
        if group and self._group is not None:
            group_tat = _floored(self._group_tat.get(chat_id), self._group_floor)
            if group_tat is not None:
                wait = max(wait, group_tat - self._group.tolerance - now)
        if wait > 0.0:
            return wait
        overall = self._overall
        if overall is not None:
            booked = self._bookings.get(chat_id) if book else None
            if booked is not None and booked + self._hold < now:
                booked = None  # forgotten: the chat did not come back in time
            if booked is not None and now < booked - EARLY:
                return booked - now  # early: the booking stands
            if booked is not None:
                del self._bookings.values[chat_id]
            sent = _floored(self._overall_tat, self._overall_floor)  # the sends made
            # the slots handed out (sends and bookings)
            plan = _floored(self._overall_plan, self._overall_floor)
            # The window bound rests on this test alone: every send, booked
            # or not, conforms to the sends bucket (its tolerance widened by
            # slack, its interval by slack / limit). The plan only orders.
            guard = sent is None or sent - overall.tolerance - self._slack <= now
            if booked is None and not (plan is None or plan - overall.tolerance <= now):
                guard = False  # slots are booked ahead: do not jump the queue
            if not guard:
                avail = max(
                    now,
                    -math.inf if plan is None else plan - overall.tolerance,
                    -math.inf if sent is None else sent - overall.tolerance - self._slack,
                )
                if not book:
                    return avail - now
                self._overall_plan = _after(
                    max(avail if plan is None else plan, avail), overall.interval
                )
                self._bookings.put(chat_id, avail, now - self._hold)
                return avail - now
            self._overall_tat = _after(max(now if sent is None else sent, now), overall.interval)
            if booked is None:
                self._overall_plan = _after(
                    max(now if plan is None else plan, now), overall.interval
                )
        if self._chat is not None:
            tat = _after(max(now if chat_tat is None else chat_tat, now), self._chat.interval)
            self._chat_tat.put(chat_id, tat, now)
        if group and self._group is not None:
            tat = _after(max(now if group_tat is None else group_tat, now), self._group.interval)
            self._group_tat.put(chat_id, tat, now)
        return 0.0

    def _ban(self, chat_id: Hashable | None, seconds: float) -> None:
        with self._state_lock:
            now = self._clock()
            until = now + seconds
            if chat_id is None:
                if self._global_ban is None or self._global_ban < until:
                    self._global_ban = until
            else:
                current = self._chat_ban.get(chat_id)
                if current is None or current < until:
                    self._chat_ban.put(chat_id, until, now)

    # ------------------------------------------- for a shared limiter's fallback

    def _banned(self, chat_id: Hashable) -> float:
        """Seconds left of a ban on ``chat_id`` or on every chat; 0.0 if none."""
        with self._state_lock:
            now = self._clock()
            bans = (self._global_ban, self._chat_ban.get(chat_id))
            return max(0.0, max((b for b in bans if b is not None), default=now) - now)

    def _global_ban_left(self) -> float:
        with self._state_lock:
            ban = self._global_ban
            return 0.0 if ban is None else max(0.0, ban - self._clock())

    def _hold_back(self, chat: float | None, group: float | None, overall: float | None) -> None:
        """Act as if every chat, every group and the bot had just used their budget.

        Each argument is how far from now (seconds) the floor of that kind of
        bucket is set (None: no floor); floors only ever move later.
        """
        with self._state_lock:
            now = self._clock()
            self._chat_floor = _later(self._chat_floor, chat, now)
            self._group_floor = _later(self._group_floor, group, now)
            self._overall_floor = _later(self._overall_floor, overall, now)

    def _forget_bookings(self) -> None:
        """Drop the bookings and the plan of slots they make: another decides from now
        on (the store a shared limiter goes back to), where the chats that hold
        them book again. Kept, they would hold every new chat back at the next
        outage, behind slots nobody holds."""
        with self._state_lock:
            self._bookings, self._overall_plan = _Table(), None  # (one line: both or neither)

    def _export(self) -> list[tuple[str, Hashable, float]]:
        """What this limiter holds that is still in the future, as ``(kind, chat,
        seconds from now)``: kind ``"ban"``, ``"chat"`` or ``"group"`` for one
        chat; ``"global_ban"`` or ``"overall"`` (chat ``None``) for the bot.
        Floors are left out, and so are the bookings and the plan of slots
        they make: a plan without its bookings would hold every process behind
        slots that nobody holds (the chats booked come back at their slots and
        book again). O(tracked keys)."""
        out: list[tuple[str, Hashable, float]] = []
        with self._state_lock:
            now = self._clock()
            if self._global_ban is not None and self._global_ban > now:
                out.append(("global_ban", None, self._global_ban - now))
            for kind, table in (("ban", self._chat_ban), ("chat", self._chat_tat)):
                out.extend((kind, k, v - now) for k, v in table.values.items() if v > now)
            out.extend(("group", k, v - now) for k, v in self._group_tat.values.items() if v > now)
            if self._overall_tat is not None and self._overall_tat > now:
                out.append(("overall", None, self._overall_tat - now))
        return out

    def stats(self) -> RateLimiterStats:
        """How many chats, groups, bookings and bans are tracked now. O(tracked keys)."""
        with self._state_lock:
            now = self._clock()
            chats = self._chat_tat.live(now)
            groups = self._group_tat.live(now)
            banned = self._chat_ban.live(now)
            booked = self._bookings.live(now - self._hold)
            global_ban = 0.0 if self._global_ban is None else max(0.0, self._global_ban - now)
        return RateLimiterStats(chats, groups, booked, banned, global_ban)

    def __repr__(self) -> str:
        s = self.stats()
        return f"<RateLimiter {self._limits!r} chats={s.chats} booked={s.booked}>"


def _after(base: float, step: float) -> float:
    """``base + step``, never less than ``step`` later. At Unix-time magnitudes a
    double's rounding can take up to half its resolution (0.12 µs) off each sum,
    and a period's steps add up: 10,000 a second let 10,011 sends through."""
    t = base + step
    # Whether the sum was rounded down, exactly (Knuth's two-sum: base + step
    # is t + err); t - base alone is rounded too when base < t / 2.
    b = t - base
    err = (base - (t - b)) + (step - b)
    return math.nextafter(t, math.inf) if err > 0 else t


def _floored(value: float | None, floor: float | None) -> float | None:
    if floor is None or (value is not None and value >= floor):
        return value
    return floor


def _later(floor: float | None, ahead: float | None, now: float) -> float | None:
    if ahead is None:
        return floor
    return now + ahead if floor is None else max(floor, now + ahead)


def make_fallback(
    limits: RateLimits, share: float, clock: Callable[[], float] | None, **options: Any
) -> RateLimiter:
    """The local limiter a shared one falls back to: ``share`` of every limit."""
    return RateLimiter(limits.scaled(share), clock=clock or time.monotonic, **options)
