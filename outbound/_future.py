"""A :class:`concurrent.futures.Future` whose condition variable is made on first use.

``Future.__init__`` builds a ``threading.Condition``: an ``RLock``, a deque
of waiters and five bound methods, about 1.5 KiB and most of the cost of
creating a future. A dispatcher holds many futures that nobody waits on yet
(up to ``queue_size`` per chat, for every chat), so :class:`LazyFuture`
makes the condition only when a method of the future first needs it. It is
a real ``Future`` subclass: ``concurrent.futures.wait``, ``as_completed``
and every method work unchanged, since they all reach the condition through
the ``_condition`` attribute.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures._base import PENDING
from typing import Any, TypeVar

T = TypeVar("T")

# Guards the first creation of a future's condition, so that two threads
# touching a new future at once share one condition. Held for a few
# microseconds, once per future that is ever waited on or resolved.
_creation_lock = threading.Lock()


class LazyFuture(Future[T]):
    """A ``Future`` that allocates its ``threading.Condition`` lazily.

    Thread-safe like ``Future``: the lazy creation is double-checked under a
    module lock, so every thread sees the same condition.
    """

    def __init__(self) -> None:
        # Future.__init__ is deliberately not called: it would build the
        # condition at once. These are the other fields it sets.
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        cond: threading.Condition | None = self.__dict__.get("_cond")
        if cond is None:
            with _creation_lock:
                cond = self.__dict__.get("_cond")
                if cond is None:
                    cond = self.__dict__["_cond"] = threading.Condition()
        return cond
