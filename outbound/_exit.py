"""Bounded shutdown of live dispatchers at interpreter exit."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Protocol

from ._compat import interpreter_exiting, register_before_thread_join

__all__ = ["forget", "register"]

logger = logging.getLogger("outbound")


class _Closable(Protocol):
    @property
    def exit_timeout(self) -> float | None: ...

    def close(self) -> None: ...

    def shutdown(self, timeout: float | None = None) -> bool: ...


# Guards _live, _registered and _exiting; held only to read or change them.
_lock = threading.Lock()
_live: weakref.WeakSet[_Closable] = weakref.WeakSet()
_registered = False
# Set when _shutdown_all begins: a dispatcher made later would not be waited for.
_exiting = False


def register(dispatcher: _Closable) -> bool:
    """Give ``dispatcher`` its ``exit_timeout`` to finish when the interpreter exits.

    Like ``concurrent.futures``, the hook runs before the interpreter joins
    its threads (see :mod:`outbound._compat`), so no thread is started
    during finalization; plain ``atexit`` is the fallback. Returns False if
    the interpreter's exit has begun (the hook ran, or threads are being
    joined): nobody would wait for the dispatcher's work, so it must refuse
    work. Thread-safe.
    """
    global _registered
    with _lock:
        if _exiting or interpreter_exiting():
            return False
        _live.add(dispatcher)
        if _registered:
            return True
        _registered = True
    register_before_thread_join(_shutdown_all)
    return True


def forget(dispatcher: _Closable) -> None:
    """Do not wait for ``dispatcher`` at interpreter exit (its owner gave up on what is
    left, within a bound of its own). Thread-safe."""
    with _lock:
        _live.discard(dispatcher)


def live_after_fork() -> list[_Closable]:
    """In a forked child: the live dispatchers, with this module's lock rebuilt.

    A parent thread may have held the lock at the fork; the child has only
    the forking thread, so a new lock is safe to make.
    """
    global _lock
    _lock = threading.Lock()
    return list(_live)


def _shutdown_all() -> None:
    global _exiting
    with _lock:
        _exiting = True
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
