"""Helpers shared by the dispatcher's tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT = 10.0


def blocker(
    started: threading.Event, release: threading.Event, value: object = None
) -> Callable[[], object]:
    """A task that says it started, then waits (bounded) to be released."""

    def task() -> object:
        started.set()
        assert release.wait(TIMEOUT), "blocker was never released"
        return value

    return task


def returning(value: T) -> Callable[[], T]:
    """A task that returns ``value``, bound now (as ``lambda i=i: i`` would, but typed)."""
    return lambda: value


def on_a_worker() -> bool:
    """Whether the calling thread is a dispatcher's worker."""
    return threading.current_thread().name.startswith("outbound-worker")


def until(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> bool:
    """Poll a state that no event reports; bounded."""
    tick = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return True
        tick.wait(0.005)
    return predicate()


class Counter:
    """Counts events; ``wait_for(n)`` blocks (bounded) until ``n`` happened."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.n = 0

    def hit(self) -> None:
        with self._cond:
            self.n += 1
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = TIMEOUT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.n >= n, timeout)
