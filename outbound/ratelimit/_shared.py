"""A limiter whose state lives in a store shared by processes, with a fail-safe fallback.

:class:`SharedRateLimiter` is the part Redis and PostgreSQL have in
common: it asks the store for each decision and, when the store cannot
be reached, decides locally at a conservative share of every limit
(``fallback_share``, say 1/4 for four processes), logging loudly, and
asks the store again every ``retry_interval`` seconds. It never sends
unlimited.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Final

from ._core import BaseRateLimiter, RateLimiterStats, check_seconds, make_fallback
from ._limits import RateLimits

__all__ = ["SharedRateLimiter"]

logger = logging.getLogger("outbound.ratelimit")

#: While the store is down, a reminder is logged this often (seconds).
_REMIND_EVERY: Final = 30.0


class SharedRateLimiter(BaseRateLimiter):
    """Base of the limiters that keep their state in a shared store.

    ``clock``: ``None`` (the store's clock, the same for every process and
    host) or a function returning seconds (tests). ``fallback_share``: the
    fraction of every limit this process may spend while the store is
    unreachable (``1 / processes`` is exact for processes that share the
    load evenly). ``retry_interval``: seconds between two tries of a store
    that failed; meanwhile no decision waits for it.
    """

    #: What the store's client raises when the store cannot answer.
    _store_errors: tuple[type[BaseException], ...] = (OSError,)
    #: How the store is named in log messages.
    _store_name = "store"

    def __init__(
        self,
        limits: RateLimits,
        *,
        clock: Callable[[], float] | None = None,
        fallback_share: float = 0.25,
        retry_interval: float = 1.0,
        slack: float = 0.02,
        stale_after: float = 1.0,
        infer_chats: int = 2,
        infer_window: float = 1.0,
    ) -> None:
        super().__init__(
            limits,
            slack=slack,
            stale_after=stale_after,
            infer_chats=infer_chats,
            infer_window=infer_window,
            tick=clock or time.monotonic,
        )
        if clock is not None and not callable(clock):
            raise TypeError("clock must be callable or None")
        if isinstance(fallback_share, bool) or not isinstance(fallback_share, (int, float)):
            raise TypeError("fallback_share must be a number")
        if not 0.0 < fallback_share <= 1.0:
            raise ValueError(f"fallback_share must be in (0, 1], not {fallback_share!r}")
        self._clock: Final = clock
        self._share: Final = float(fallback_share)
        self._retry_interval: Final = check_seconds("retry_interval", retry_interval, positive=True)
        self._fallback: Final = make_fallback(
            limits,
            fallback_share,
            clock,
            slack=slack,
            stale_after=stale_after,
            infer_chats=infer_chats,
            infer_window=infer_window,
        )
        # Guards _down_since, _next_try and _reminded. Held for O(1); never
        # while the store is asked.
        self._health_lock: Final = threading.Lock()
        # time.monotonic() when the store stopped answering; None while it answers.
        self._down_since: float | None = None
        self._next_try = 0.0
        self._reminded = 0.0
        # True in the thread that tries a store marked down (one at a time).
        self._probing = threading.local()

    # ------------------------------------------------------------ the store

    @abc.abstractmethod
    def _store_decide(self, now: float | None, chat_id: Hashable, group: bool, book: bool) -> float:
        """One decision in the store (``now``: None for the store's clock); may raise."""

    @abc.abstractmethod
    def _store_ban(self, now: float | None, chat_id: Hashable | None, seconds: float) -> None:
        """Record a ban in the store; may raise."""

    def close(self) -> None:
        """Release the store's connections this limiter opened. Idempotent."""

    # ------------------------------------------------------------ decisions

    def _now(self) -> float | None:
        return None if self._clock is None else self._clock()

    def _decide(self, chat_id: Hashable, group: bool, book: bool) -> float:
        if self._may_use_store():
            try:
                wait = self._store_decide(self._now(), chat_id, group, book)
            except self._store_errors as exc:
                self._store_failed(exc)
            else:
                self._store_answered()
                return wait
        return self._fallback._decide(chat_id, group, book)

    def _ban(self, chat_id: Hashable | None, seconds: float) -> None:
        # Kept locally too, so that a store lost later does not forget it.
        self._fallback._ban(chat_id, seconds)
        if self._may_use_store():
            try:
                self._store_ban(self._now(), chat_id, seconds)
            except self._store_errors as exc:
                self._store_failed(exc)
            else:
                self._store_answered()

    # ----------------------------------------------------------- its health

    def _may_use_store(self) -> bool:
        # Unlocked read: _down_since is None while the store answers. A
        # stale read costs one extra try of a failing store, or one local
        # decision (at the conservative share): both safe.
        self._probing.active = False
        if self._down_since is None:
            return True
        now = time.monotonic()
        with self._health_lock:
            if now < self._next_try:
                return False
            self._next_try = now + self._retry_interval  # this caller tries; others wait
        self._probing.active = True
        return True

    def _may_connect(self) -> bool:
        """Whether this thread may open a connection: not while the store is down,
        except to try it again. So an outage costs one connect timeout, not one
        per waiting thread."""
        return self._down_since is None or getattr(self._probing, "active", False)

    def _store_failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._health_lock:
            first = self._down_since is None
            if first:
                self._down_since = now
                self._reminded = now
            remind = not first and now - self._reminded >= _REMIND_EVERY
            if remind:
                self._reminded = now
            self._next_try = now + self._retry_interval
            down_for = now - (self._down_since or now)
        if first:
            logger.error(
                "outbound: the rate limiter's %s is unreachable (%s: %s); sending at a local "
                "share of %g of every limit until it answers again",
                self._store_name,
                type(exc).__name__,
                exc,
                self._share,
            )
        elif remind:
            logger.error(
                "outbound: the rate limiter's %s is still unreachable after %.0fs (%s); "
                "sending at the local share of %g",
                self._store_name,
                down_for,
                type(exc).__name__,
                self._share,
            )

    def _store_answered(self) -> None:
        if self._down_since is None:  # unlocked read, as in _may_use_store
            return
        with self._health_lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            logger.warning(
                "outbound: the rate limiter's %s answers again after %.1fs; back to the "
                "shared budget",
                self._store_name,
                time.monotonic() - since,
            )

    @property
    def degraded(self) -> bool:
        """True while the store is unreachable and the local share is in force."""
        return self._down_since is not None

    def stats(self) -> RateLimiterStats:
        """The fallback's state (what was decided locally while the store was unreachable)."""
        local = self._fallback.stats()
        return RateLimiterStats(
            chats=local.chats,
            groups=local.groups,
            booked=local.booked,
            banned=local.banned,
            global_ban=local.global_ban,
            store="fallback" if self.degraded else "shared",
        )
