"""A :class:`concurrent.futures.Future` whose condition variable is made only when needed.

``Future.__init__`` builds a ``threading.Condition``: an ``RLock``, a deque
of waiters and five bound methods, about 1.5 KiB and several microseconds,
most of the cost of a future. A dispatcher holds many futures that nobody
waits on (up to ``queue_size`` per chat, for every chat), and most are
resolved before anyone looks at them. :class:`LazyFuture` therefore makes
the condition only when a method that waits or registers interest first
needs it (``result``, ``add_done_callback``, ``wait``, ``as_completed``...),
and resolves a future that nobody waits on under a small plain lock.

It is a real ``Future`` subclass: every stdlib method and function works
unchanged, since they all reach the condition through ``_condition``.

Why this is race-free: a guard lock (one of a few, picked by the future's
id) serializes the creation of the condition with every state change made
while there is no condition. A state change first takes the guard; if the condition does not
exist yet, it changes the state there, and no one can be waiting (waiting
needs the condition, whose creation needs the guard). If the condition
exists, it releases the guard and does exactly what ``Future`` does, under
the condition, so waiters and the waiter lists of ``wait``/``as_completed``
see the change atomically as they do with a plain ``Future``. Without a
condition there are no done-callbacks to run either: ``add_done_callback``
makes the condition before it appends.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, InvalidStateError
from concurrent.futures._base import (
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    PENDING,
    RUNNING,
)
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = frozenset({CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED})


# Guards the creation of a future's condition and its state changes while
# it has none (see the module docstring). Striped by id() so that a future
# costs no lock of its own; each is held for a few bytecodes.
_GUARDS = tuple(threading.Lock() for _ in range(64))


def _guard(future: object) -> threading.Lock:
    return _GUARDS[(id(future) >> 4) & 63]


def _new_guards_after_fork() -> None:
    """A parent thread may have held a guard at the fork: the child gets new ones."""
    global _GUARDS
    _GUARDS = tuple(threading.Lock() for _ in range(64))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_guards_after_fork)


class LazyFuture(Future[T]):
    """A ``Future`` that allocates its ``threading.Condition`` on first need.

    Thread-safe exactly like ``Future``.
    """

    # Future.__init__ is deliberately not called: it would build the
    # condition at once. Every other field it sets has a class default here
    # until first written, so a new future allocates nothing but itself.
    # The waiter and callback lists are made with the condition: the stdlib
    # only appends to them while holding it.
    _state = PENDING
    _result: Any = None
    _exception: BaseException | None = None
    _waiters: Any = ()
    _done_callbacks: Any = ()

    def __init__(self) -> None:
        pass

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        cond: threading.Condition | None = self.__dict__.get("_cond")
        if cond is None:
            with _guard(self):
                cond = self.__dict__.get("_cond")
                if cond is None:
                    self._waiters = []
                    self._done_callbacks = []
                    cond = self.__dict__["_cond"] = threading.Condition()
        return cond

    def _unwatched(self) -> threading.Condition | None:
        """Take the guard; return the condition if one exists (guard released),
        else None with the guard still held: the caller changes the state and
        releases it with ``_release``."""
        _guard(self).acquire()
        cond: threading.Condition | None = self.__dict__.get("_cond")
        if cond is not None:
            _guard(self).release()
        return cond

    def _release(self) -> None:
        _guard(self).release()

    def cancel(self) -> bool:
        cond = self._unwatched()
        if cond is not None:
            return super().cancel()
        try:
            state = self._state
            if state in (RUNNING, FINISHED):
                return False
            if state in (CANCELLED, CANCELLED_AND_NOTIFIED):
                return True
            self._state = CANCELLED
        finally:
            self._release()
        return True

    def set_running_or_notify_cancel(self) -> bool:
        cond = self._unwatched()
        if cond is not None:
            return super().set_running_or_notify_cancel()
        try:
            if self._state == CANCELLED:
                self._state = CANCELLED_AND_NOTIFIED
                return False
            if self._state == PENDING:
                self._state = RUNNING
                return True
        finally:
            self._release()
        raise RuntimeError("Future in unexpected state")

    def set_result(self, result: T) -> None:
        cond = self._unwatched()
        if cond is not None:
            super().set_result(result)
            return
        try:
            if self._state in _DONE:
                raise InvalidStateError(f"{self._state}: <LazyFuture at {id(self):#x}>")
            self._result = result
            self._state = FINISHED
        finally:
            self._release()

    def set_exception(self, exception: BaseException | None) -> None:
        cond = self._unwatched()
        if cond is not None:
            super().set_exception(exception)
            return
        try:
            if self._state in _DONE:
                raise InvalidStateError(f"{self._state}: <LazyFuture at {id(self):#x}>")
            self._exception = exception
            self._state = FINISHED
        finally:
            self._release()
