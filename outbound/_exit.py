"""Bounded shutdown of live dispatchers at interpreter exit."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Protocol

from ._compat import register_before_thread_join

__all__ = ["register"]

logger = logging.getLogger("outbound")


class _Closable(Protocol):
    @property
    def exit_timeout(self) -> float | None: ...

    def close(self) -> None: ...

    def shutdown(self, timeout: float | None = None) -> bool: ...


# Guards _live and _registered; held only to add to or copy the set.
_lock = threading.Lock()
_live: weakref.WeakSet[_Closable] = weakref.WeakSet()
_registered = False


def register(dispatcher: _Closable) -> None:
    """Give ``dispatcher`` its ``exit_timeout`` to finish when the interpreter exits.

    Like ``concurrent.futures``, the hook runs before the interpreter joins
    its threads (see :mod:`outbound._compat`), so no thread is started
    during finalization; plain ``atexit`` is the fallback. Thread-safe.
    """
    global _registered
    with _lock:
        _live.add(dispatcher)
        if _registered:
            return
        _registered = True
    register_before_thread_join(_shutdown_all)


def live_after_fork() -> list[_Closable]:
    """In a forked child: the live dispatchers, with this module's lock rebuilt.

    A parent thread may have held the lock at the fork; the child has only
    the forking thread, so a new lock is safe to make.
    """
    global _lock
    _lock = threading.Lock()
    return list(_live)


def _shutdown_all() -> None:
    with _lock:
        dispatchers = list(_live)
    for dispatcher in dispatchers:
        dispatcher.close()
    # One bound for all: they finish concurrently, so each gets what is left
    # of its own exit_timeout counted from now, not after the others.
    start = time.monotonic()
    for dispatcher in dispatchers:
        bound = dispatcher.exit_timeout
        left = None if bound is None else max(0.0, bound - (time.monotonic() - start))
        try:
            if not dispatcher.shutdown(left):
                logger.warning(
                    "outbound: %r did not finish within exit_timeout=%s; the rest is dropped",
                    dispatcher,
                    dispatcher.exit_timeout,
                )
        except Exception:
            logger.exception("outbound: error while shutting down at exit")
