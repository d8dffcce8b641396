"""A lock granted in the order it was asked for: :class:`FairLock`.

``threading.Lock`` is not fair: a thread that releases it and asks again at
once usually takes it back before a waiter wakes, so under contention one
waiter may wait many turns. A limiter whose one connection serves every
thread of the process must bound each thread's wait by its timeout (past
it, the limiter falls back to its local share), so it takes turns in order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: Makes the lock a waiter waits on until its turn (tests replace it).
_new_gate: Callable[[], Any] = threading.Lock
#: Tries at leaving the queue when exceptions (Ctrl-C) keep interrupting it.
_SETTLE_TRIES = 16


class FairLock:
    """A mutual-exclusion lock handed to its waiters first come, first served.

    Each :meth:`acquire` takes a ticket; :meth:`release` hands the lock to the
    next ticket still waiting (a ticket that gave up, by its timeout or an
    exception, is passed over). Thread-safe; :meth:`acquire` blocks up to its
    timeout, :meth:`release` never blocks. Not reentrant.
    """

    __slots__ = ("__weakref__", "_gates", "_gone", "_mutex", "_next", "_serving")

    def __init__(self) -> None:
        # Guards the fields below; held for O(1) bookkeeping only.
        self._mutex = threading.Lock()
        self._next = 0  # the next ticket to hand out
        self._serving = 0  # the ticket that holds the lock (free if == _next)
        self._gates: dict[int, Any] = {}  # tickets waiting: released on their turn
        self._gone: set[int] = set()  # tickets that gave up before their turn

    def _at_fork_reinit(self) -> None:
        """In a forked child: free, with no one waiting (the holder and the waiters
        were threads of the parent). See :mod:`outbound._fork`."""
        self._mutex = threading.Lock()
        self._next = self._serving = 0
        self._gates = {}
        self._gone = set()

    def acquire(self, timeout: float) -> bool:
        """Wait for the lock up to ``timeout`` seconds (>= 0); True if it is now held.

        A ticket whose turn came as its wait ended holds the lock (True).
        If the call raises (a ``KeyboardInterrupt`` in the wait or in the
        bookkeeping), its ticket is given up: its turn, if it came, is
        passed on, so the lock is never left held by no one.
        """
        gate = _new_gate()  # before a ticket is taken: nothing to undo if it fails
        gate.acquire()
        me = -1
        queued = False  # waiting with ticket ``me``: the finally leaves the queue
        interrupted = True
        held = False
        try:
            with self._mutex:
                try:
                    me = self._next
                    self._next = me + 1
                    if self._serving == me:
                        interrupted = False
                        return True
                    self._gates[me] = gate
                    queued = True
                except BaseException:
                    if not queued and self._next == me + 1:  # taken (the mutex is held)
                        self._drop_locked(me)
                    raise
            gate.acquire(timeout=min(max(0.0, timeout), threading.TIMEOUT_MAX))
            interrupted = False
        finally:
            # Leave the queue: keep the lock if the turn came and nothing
            # raised, else give the ticket up. Inline, not a call (a call's
            # entry is where a pending Ctrl-C is raised); done again if a
            # Ctrl-C interrupts it, and that exception raised after.
            caught: BaseException | None = None
            tries = _SETTLE_TRIES if queued else 0
            while tries:
                tries -= 1
                try:
                    with self._mutex:
                        if self._serving == me and not interrupted and caught is None:
                            self._gates.pop(me, None)
                            held = True
                        else:
                            held = False
                            self._drop_locked(me)
                    tries = 0
                except BaseException as exc:
                    held = False
                    caught = caught or exc
            if caught is not None:
                raise caught
        return held

    def release(self) -> None:
        """Hand the lock to the next waiting ticket (or leave it free). Never blocks."""
        with self._mutex:
            if self._serving == self._next:
                raise RuntimeError("release of an unheld FairLock")
            self._advance_locked()

    def locked(self) -> bool:
        """Whether some thread holds the lock now (a snapshot)."""
        with self._mutex:
            return self._serving != self._next

    def _drop_locked(self, me: int) -> None:
        """Give ticket ``me`` up: pass the turn on if it came, else skip it when it does."""
        self._gates.pop(me, None)
        if self._serving == me:
            self._advance_locked()
        elif me > self._serving:
            self._gone.add(me)

    def _advance_locked(self) -> None:
        serving = self._serving + 1
        gone = self._gone
        while serving in gone:
            gone.discard(serving)
            serving += 1
        self._serving = serving
        gate = self._gates.get(serving)
        if gate is not None:
            gate.release()
