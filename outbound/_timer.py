"""One timer thread for many due times: :class:`Timer`.

The dispatcher parks deferred lanes and ends pauses here: an item waits in a
heap until its due time, then ``fire`` takes it in the timer's thread.
Nothing else waits: a parked lane holds no worker thread and no permit.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar, cast

from ._compat import TIMEOUT_MAX
from ._log import quiet as _log

__all__ = ["Timer"]

T = TypeVar("T")
U = TypeVar("U")


class Timer(Generic[T]):
    """Calls ``fire(take)`` when items' due time has come, from a thread of its own.

    - ``take()`` returns the due items, in due order, to the first call; later
      calls return ``[]``. Until taken they count as waiting: ``move_locked()``
      moves them and ``items()`` lists them. ``fire`` takes them under
      :attr:`lock`, and a ``move_locked()`` under that same lock then sees each
      item exactly once: either it moves it or ``take()`` returns it. Items
      ``fire`` leaves untaken (it raised first) are dropped.

    - ``add(due, item)``: ``due`` is an instant of ``clock`` (default
      ``time.monotonic``); any finite or infinite value is accepted, waits
      are cut into pieces no longer than ``threading.TIMEOUT_MAX``.
    - ``fire`` runs with no lock of the timer held, one batch at a time, in
      due order; what it raises is logged and the timer goes on.
    - The thread starts with the first ``add`` and exits after
      ``idle_timeout`` seconds with nothing to wait for, or at ``stop()``.
    - ``poke()`` makes the thread read the clock again (for a clock that
      jumps, such as a test's).

    Thread-safe; no method blocks on ``fire``.
    """

    def __init__(
        self,
        fire: Callable[[Callable[[], list[T]]], None],
        *,
        name: str,
        idle_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fire = fire
        self._name = name
        self._idle_timeout = min(idle_timeout, TIMEOUT_MAX)
        self._clock = clock
        # Guards every field below. The timer thread waits on _cond for the
        # earliest due time, a new item, a poke or stop().
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # (due, seq, item): a heap; seq keeps equal due times in add order.
        self._heap: list[tuple[float, int, T]] = []
        # The due batch handed to the running ``fire`` call, until taken.
        self._firing: list[T] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False
        # Why the thread could not start, until report() logs it: not logged
        # where it happens, under this lock and the caller's (the dispatcher's),
        # since a logging handler is the application's code, which may call
        # back in (a handler that submits the error to an admin chat).
        self._unreported: BaseException | None = None

    def add(self, due: float, item: T) -> threading.Thread | None:
        """Fire ``item`` at ``due``. Returns the timer thread if this call started it."""
        with self._lock:
            heapq.heappush(self._heap, (due, next(self._seq), item))
            if self._thread is not None:
                if self._heap[0][2] is item:  # a new earliest: wait for less
                    self._cond.notify()
                return None
            return self._start_locked()

    def report(self) -> None:
        """Log why the thread could not start, if that is not logged yet. Call it with
        no lock held (the caller's neither): see ``_unreported``."""
        if self._unreported is None:  # unlocked read: a failure meanwhile is the next call's
            return
        with self._lock:
            error, self._unreported = self._unreported, None
        if error is not None:
            try:
                _log.error("outbound: cannot start the timer thread", exc_info=error)
            finally:
                del error  # its traceback holds the frames that failed to start it

    @property
    def stranded(self) -> bool:
        """Items wait and no thread runs (starting one failed). Unlocked: a hint."""
        return self._thread is None and bool(self._heap) and not self._stopped

    def restart(self) -> threading.Thread | None:
        """Start the thread if items wait without one; return it if this call started it."""
        with self._lock:
            if self._thread is not None or not self._heap:
                return None
            return self._start_locked()

    def _start_locked(self) -> threading.Thread | None:
        """Start the timer's thread (under the lock); None if stopped or it cannot start."""
        if self._stopped:
            return None
        # Started under the lock: Thread.start() only waits for the new
        # thread to begin, and the new thread takes the lock afterwards.
        # It is the timer's thread only while _thread is it: if starting
        # raises (can't start a thread, MemoryError, a Ctrl-C landing in
        # start() after the thread began), _thread goes back to None, a
        # thread that began anyway returns at once, and the next add
        # starts one; the item stays in the heap for it.
        try:
            thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread = thread
            thread.start()
        except Exception as exc:
            self._thread = None
            self._unreported = exc
            return None
        except BaseException:  # a Ctrl-C: the caller's, once consistent
            self._thread = None
            raise
        return thread

    @property
    def lock(self) -> threading.Lock:
        """The lock over the waiting items: held, ``fire`` takes none of them."""
        return self._lock

    def count_locked(self, cls: type) -> int:
        """How many waiting items (untaken due ones too) are of class ``cls``. :attr:`lock` held."""
        return sum(1 for item in self._waiting_locked() if item.__class__ is cls)

    def move_locked(self, cls: type[U], out: list[U]) -> None:
        """Append the waiting items of class ``cls`` to ``out``, in due order, and take
        out every other item too (unfired) but those that are ``None`` (the
        dispatcher's pause ends: they stay, and fire). :attr:`lock` held.

        Between emptying the timer and the append returning there is no call:
        a Ctrl-C lands before the move (every item still here) or after it
        (those of ``cls`` in ``out``), never with them in neither place.
        """
        self._cond.notify()  # the wake first: it is Python, where a Ctrl-C may land
        moved = cast("list[U]", [i for i in self._waiting_locked() if i.__class__ is cls])
        firing = [item for item in self._firing if item is None]
        heap = [entry for entry in self._heap if entry[2] is None]
        heapq.heapify(heap)
        # In place (the thread keeps a reference to the heap), by statements:
        # no call, so no Ctrl-C, before the extend has returned.
        self._firing[:] = firing
        self._heap[:] = heap
        out.extend(moved)

    def _waiting_locked(self) -> list[T]:
        return self._firing + [item for _, _, item in sorted(self._heap)]

    def items(self) -> list[T]:
        """A snapshot of the waiting items (untaken due ones too), in no particular order."""
        with self._lock:
            return self._firing + [item for _, _, item in self._heap]

    def _take(self) -> list[T]:
        with self._lock:
            items, self._firing = self._firing, []
            return items

    def poke(self) -> None:
        """Make the thread look at the clock again."""
        with self._lock:
            self._cond.notify()

    def stop(self) -> None:
        """Drop what waits and let the thread exit; later adds start none. Idempotent."""
        with self._lock:
            self._stopped = True
            self._firing = []
            self._heap.clear()
            self._cond.notify()

    @property
    def thread(self) -> threading.Thread | None:
        with self._lock:
            return self._thread

    def _run(self) -> None:
        clock = self._clock
        heap = self._heap
        me = threading.current_thread()
        while True:
            with self._lock:
                if self._thread is not me:
                    return  # its start raised in add(): another thread is (or will be) the timer's
                while True:
                    if self._stopped:
                        self._thread = None
                        return
                    if not heap:
                        if not (self._cond.wait(self._idle_timeout) or heap or self._stopped):
                            self._thread = None
                            return
                        continue
                    delay = heap[0][0] - clock()
                    if delay <= 0:
                        break
                    self._cond.wait(min(delay, TIMEOUT_MAX))
                now = clock()
                while heap and heap[0][0] <= now:
                    self._firing.append(heapq.heappop(heap)[2])
            try:
                self._fire(self._take)
            except BaseException:
                _log.exception("outbound: timer callback raised; the timer goes on")
            with self._lock:
                self._firing = []  # what fire left untaken; keep nothing alive until the next batch
