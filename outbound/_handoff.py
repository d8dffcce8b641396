"""How work reaches a worker thread: :class:`Handoff`, ready jobs and idle workers.

Schedulers push jobs; workers take them. Neither side takes a lock of the
hand-off: each step is one atomic call on a ``deque`` or a ``list`` (see
:mod:`outbound._compat`), and the two objects are used in an order that
loses no wake-up:

- a scheduler appends its job to ``ready``, then pops a worker from
  ``idle`` and wakes it;
- a worker that found ``ready`` empty appends itself to ``idle``, then
  looks in ``ready`` once more before it sleeps.

Each object serializes its own operations, so of a scheduler's pop from
``idle`` and a worker's second look in ``ready``, at least one sees the
other's append: either the worker is woken, or it finds the job. A worker
that found a job after listing itself takes itself off the list; if a
scheduler popped it first, that scheduler has released (or will release)
its wake lock, and the worker consumes that release so that a stale wake-up
never reaches its next sleep.

What the hand-off does not decide: whether a job may start now (a pause),
and whether the pool may grow; the dispatcher does, under its lock.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Protocol, TypeVar

from ._compat import TIMEOUT_MAX

__all__ = ["Handoff", "Sleeper"]


class _Wake(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


class Sleeper(Protocol):
    """A worker as the hand-off sees it: a binary semaphore released to wake it."""

    @property
    def wake(self) -> _Wake: ...


J = TypeVar("J")
W = TypeVar("W", bound=Sleeper)


class Handoff(Generic[J, W]):
    """Ready jobs (FIFO) and idle workers (most recently idle first). Lock-free; see the module."""

    __slots__ = ("idle", "ready")

    def __init__(self) -> None:
        self.ready: deque[J] = deque()
        # Most recently idle last: woken first, so the coldest threads retire.
        self.idle: list[W] = []

    # ------------------------------------------------------------ schedulers

    def push(self, job: J) -> None:
        """Queue ``job`` last (wake nobody: see :meth:`wake_one`)."""
        self.ready.append(job)

    def push_front(self, job: J) -> None:
        """Queue ``job`` first (a job given back, or the first to run after a pause)."""
        self.ready.appendleft(job)

    def wake_one(self) -> bool:
        """Wake one idle worker; False if none is idle. Call it after a push."""
        try:
            worker = self.idle.pop()
        except IndexError:
            return False
        worker.wake.release()
        return True

    def wake_all(self) -> None:
        """Wake every idle worker (to look again, or to exit)."""
        while self.wake_one():
            pass

    # --------------------------------------------------------------- workers

    def take(self) -> J | None:
        """The next ready job, or None. Never blocks."""
        try:
            return self.ready.popleft()
        except IndexError:
            return None

    def list_idle(self, worker: W) -> J | None:
        """List ``worker`` as idle, then look once more; return a job found then.

        With a job returned, ``worker`` is no longer listed and has no
        pending wake-up. With None, it is listed: it must :meth:`sleep`, or
        :meth:`unlist` itself.
        """
        self.idle.append(worker)
        job = self.take()
        if job is not None:
            self.unlist(worker)
        return job

    def unlist(self, worker: W) -> None:
        """Take a listed ``worker`` off the idle list, consuming a wake-up already sent."""
        try:
            self.idle.remove(worker)
        except ValueError:  # a scheduler popped it: its release comes, or came
            worker.wake.acquire()

    def sleep(self, worker: W, timeout: float) -> bool:
        """Wait until woken (True) or ``timeout`` seconds pass, unlisted (False)."""
        if worker.wake.acquire(timeout=min(timeout, TIMEOUT_MAX)):
            return True
        try:
            self.idle.remove(worker)
        except ValueError:  # woken just as the timeout fired
            worker.wake.acquire()
            return True
        return False
