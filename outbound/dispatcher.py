"""The per-key ordered dispatcher: :class:`Dispatcher`.

A *lane* is the queue of one key (one chat). Tasks of one key run one at a
time in submission order; lanes run concurrently on a bounded pool of
worker threads, at most ``max_inflight`` tasks at once.

How it works, in one paragraph. ``submit`` appends the task to its key's
lane. A lane that did not exist is created and made *ready*: handed to an
idle worker, or to a new worker thread if the pool may still grow, or else
put on the ready queue for the next worker that finishes its turn. A worker
holding a lane runs up to ``quantum`` of its tasks, then puts the lane at
the back of the ready queue if other lanes wait (fairness), or keeps going
if none do. While a lane is held, ``submit`` only appends to it: a hot chat
costs no thread wake-up per message. A lane whose queue is empty is removed
from the table at once, so an idle chat costs nothing and its key is not
kept alive. A task that raises :class:`~outbound.context.Defer` goes back to
the head of its lane and the lane is *parked* on one shared timer thread;
its worker and permit serve other lanes meanwhile.

Locking. One lock, ``_lock``, guards every field below that is marked
"guarded". It is held only for O(1) bookkeeping (and O(n) in ``force_close``
and the like), never while user code runs: tasks, hooks and future
callbacks all run with no internal lock held.
"""

from __future__ import annotations

import atexit
import contextvars
import enum
import heapq
import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, TypeVar

from typing_extensions import ParamSpec, Self

from ._future import LazyFuture
from .context import Defer, TaskContext, _current
from .errors import BrokenDispatcher, DispatcherClosed, QueueFull
from .hooks import DispatchInfo, Hooks, call_hook

__all__ = ["Dispatcher", "DispatcherStats", "State"]

logger = logging.getLogger("outbound")

P = ParamSpec("P")
T = TypeVar("T")

_monotonic = time.monotonic
_copy_context = contextvars.copy_context


class State(enum.Enum):
    """Lifecycle of a :class:`Dispatcher`; it only moves down this list."""

    #: Accepting work.
    OPEN = "open"
    #: ``close()``/``shutdown()``/``force_close()`` was called: new work is
    #: refused, what was accepted still runs (or was cancelled by force_close).
    CLOSING = "closing"
    #: Closed and nothing is left queued or running; threads are exiting.
    CLOSED = "closed"
    #: A worker initializer failed: all queued work failed with
    #: :class:`~outbound.errors.BrokenDispatcher`, new work is refused.
    BROKEN = "broken"


@dataclass(frozen=True, slots=True)
class DispatcherStats:
    """A snapshot of a dispatcher, taken under its lock (consistent at one instant).

    ``lanes`` counts lanes that hold work (queued, running or parked);
    ``queued`` tasks accepted and not yet started (parked ones included);
    ``running`` tasks running now; ``parked`` lanes waiting on the timer;
    ``threads`` live worker threads, ``idle_threads`` those waiting for work.
    """

    state: State
    lanes: int
    queued: int
    running: int
    parked: int
    threads: int
    idle_threads: int
    max_inflight: int
    cancelled: bool
    paused_for: float


class _Task:
    """One accepted call. Dropped by the dispatcher as soon as it is resolved."""

    __slots__ = ("args", "attempt", "context", "fn", "future", "kwargs", "submitted_at")

    def __init__(
        self,
        future: Future[Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: contextvars.Context,
        submitted_at: float,
    ) -> None:
        self.future = future
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.context = context
        self.submitted_at = submitted_at
        self.attempt = 0


class _Lane:
    """The queue of one key.

    A lane is in ``Dispatcher._lanes`` exactly while it holds work, and then
    it has exactly one owner: the ready queue, one worker (``active``), or
    the timer (``parked``). All fields are guarded by ``Dispatcher._lock``.
    """

    __slots__ = ("active", "key", "parked", "tasks")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        # The per-lane queue: fixed capacity, O(1) push and pop, refuse when
        # full, as the seed's ring buffer. collections.deque is the fastest
        # way Python has: append/popleft are single C calls with no index
        # arithmetic in bytecode, and its 64-slot blocks grow and shrink with
        # the content, so an almost-empty lane does not pay for queue_size
        # preallocated slots as a list-backed ring would. Capacity is
        # checked in submit (len() is O(1)); maxlen is not used because it
        # silently drops from the other end instead of refusing.
        self.tasks: deque[_Task] = deque()
        self.active = False
        self.parked = False


class _Worker:
    """A pool thread's mailbox. ``item`` is guarded by ``Dispatcher._lock``."""

    __slots__ = ("item", "wake")

    def __init__(self, item: _Lane | _Task | None) -> None:
        self.item = item
        # Binary semaphore: released once by whoever hands this idle worker
        # an item (or asks it to stop); the worker waits on it while idle.
        self.wake = threading.Lock()
        self.wake.acquire()


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 or None, not {timeout!r}")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, not {value!r}")
    return value


def _positive_seconds(name: str, value: object, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not (value > 0 and (allow_inf or math.isfinite(value))):
        raise ValueError(f"{name} must be a finite number of seconds > 0, not {value!r}")
    return float(value)


class Dispatcher:
    """Runs tasks per key in strict FIFO order, keys concurrently, on a bounded pool.

    - ``max_inflight``: at most this many tasks run at once (a
      ``threading.BoundedSemaphore``), and the pool never has more threads.
    - ``queue_size``: at most this many tasks *wait* in one lane (the running
      one has left it); ``submit`` to a full lane raises
      :class:`~outbound.errors.QueueFull` at once, for that key only.
    - ``send_timeout``: seconds from a task's start to the deadline that
      :func:`~outbound.current_context` reports (``math.inf``: no deadline).
    - ``hooks``: optional :class:`~outbound.Hooks`.
    - ``quantum``: tasks a lane runs in one turn before other ready lanes get
      theirs.
    - ``idle_timeout``: seconds an idle worker thread waits before it retires.
    - ``thread_name_prefix``, ``initializer``, ``initargs``: as for
      ``ThreadPoolExecutor``; an initializer that raises breaks the
      dispatcher (:class:`~outbound.errors.BrokenDispatcher`).
    - ``exit_timeout``: at interpreter exit, seconds to let queued work
      finish before the process may end (``None``: wait for all of it).

    Every method is thread-safe. ``submit`` never blocks on a full lane or on
    the pool; ``drain`` and ``shutdown`` block up to their timeout; the
    others return at once. No thread starts before the first ``submit``.
    """

    def __init__(
        self,
        max_inflight: int = 512,
        queue_size: int = 64,
        send_timeout: float = 30.0,
        *,
        hooks: Hooks | None = None,
        quantum: int = 16,
        idle_timeout: float = 30.0,
        thread_name_prefix: str = "outbound",
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        exit_timeout: float | None = 10.0,
    ) -> None:
        self._max_inflight: Final = _positive_int("max_inflight", max_inflight)
        self._queue_size: Final = _positive_int("queue_size", queue_size)
        self._send_timeout: Final = _positive_seconds("send_timeout", send_timeout, allow_inf=True)
        self._quantum: Final = _positive_int("quantum", quantum)
        self._idle_timeout: Final = _positive_seconds("idle_timeout", idle_timeout)
        if hooks is not None and not isinstance(hooks, Hooks):
            raise TypeError(f"hooks must be an outbound.Hooks or None, not {type(hooks).__name__}")
        if not isinstance(thread_name_prefix, str):
            raise TypeError("thread_name_prefix must be a str")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be callable or None")
        if exit_timeout is not None:
            exit_timeout = _positive_seconds("exit_timeout", exit_timeout)
        self._hooks: Final = hooks if hooks is not None else Hooks()
        self._thread_name_prefix: Final = thread_name_prefix or "outbound"
        self._initializer: Final = initializer
        self._initargs: Final = tuple(initargs)
        self._exit_timeout: Final = exit_timeout

        # The concurrency cap. A worker takes a permit before it takes an
        # item (a lane or a keyless task) and gives it back when it lets the
        # item go, so a worker never holds a lane while waiting for a permit
        # (the seed's ForceClose leak). The pool never has more than
        # max_inflight threads, so acquiring never actually waits; the
        # semaphore makes the cap hold by construction, not by arithmetic.
        self._permits: Final = threading.BoundedSemaphore(self._max_inflight)

        # Guards every field marked "guarded" below. Waiters: drain()
        # and shutdown() on _drained, the timer thread on _timer_cond.
        self._lock: Final = threading.Lock()
        self._drained: Final = threading.Condition(self._lock)
        self._timer_cond: Final = threading.Condition(self._lock)
        # Set by force_close(); TaskContext.cancelled reads it.
        self._cancel: Final = threading.Event()

        # guarded: lifecycle, only moves forward (see State).
        self._state = State.OPEN
        # guarded: key -> lane, exactly the lanes that hold work.
        self._lanes: dict[Hashable, _Lane] = {}
        # guarded: lanes and keyless tasks waiting for a worker, in order.
        self._ready: deque[_Lane | _Task] = deque()
        # guarded: idle workers, most recently idle last (taken first, so
        # the coldest threads retire).
        self._idle: list[_Worker] = []
        # guarded: live worker threads (started and not yet returned).
        self._nworkers = 0
        # guarded: every thread this dispatcher started that may be alive;
        # shutdown() joins them. Pruned when a thread is added.
        self._threads: list[threading.Thread] = []
        self._thread_ids = itertools.count(1)
        # guarded: tasks accepted and not yet resolved (queued, running,
        # parked). drain() waits for 0.
        self._outstanding = 0
        # guarded: tasks running now.
        self._running = 0
        # guarded: parked lanes, deferred keyless tasks and pause ends (None),
        # as a heap of (due, seq, item). The timer thread waits on it.
        self._timers: list[tuple[float, int, _Lane | _Task | None]] = []
        self._timer_seq = itertools.count()
        self._timer_thread: threading.Thread | None = None
        # guarded: no item starts before this monotonic instant (0: no pause).
        self._paused_until = 0.0
        # guarded: why the dispatcher broke (State.BROKEN).
        self._broken_reason: str | None = None

        _register_for_exit(self)

    # ------------------------------------------------------------------ submit

    def submit(
        self, key: Hashable, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Queue ``fn(*args, **kwargs)`` on the lane of ``key``; return its future.

        Tasks of one key start in the order they were submitted, each after
        the previous one finished. Raises :class:`~outbound.errors.QueueFull`
        if ``queue_size`` tasks already wait for this key and
        :class:`~outbound.errors.DispatcherClosed` after ``close()``; both call
        ``hooks.on_rejected`` first. Never blocks. The task runs in a copy of
        the caller's ``contextvars`` context.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"key must be hashable, not {type(key).__name__}") from None
        future: LazyFuture[T] = LazyFuture()
        task = _Task(future, fn, args, kwargs, _copy_context(), _monotonic())
        start: list[_Worker] | None = None
        error: BaseException | None = None
        with self._lock:
            if self._state is not State.OPEN:
                error = self._closed_error()
            else:
                lane = self._lanes.get(key)
                if lane is None:
                    # The key has no lane: nobody owns it, so this submit
                    # creates it and makes it ready. A worker removes a lane
                    # only under this lock and only when its queue is empty,
                    # so a submit either finds the lane (and its owner will
                    # see the new task before it can remove the lane) or finds
                    # none (and the new lane has exactly one owner). That is
                    # why the seed's self-delete race cannot happen here.
                    lane = self._lanes[key] = _Lane(key)
                    lane.tasks.append(task)
                    self._outstanding += 1
                    self._ready.append(lane)
                    start = self._dispatch_locked()
                    queue_len = 1
                elif len(lane.tasks) >= self._queue_size:
                    error = QueueFull(key, self._queue_size)
                else:
                    lane.tasks.append(task)
                    self._outstanding += 1
                    queue_len = len(lane.tasks)
        if error is not None:
            if self._hooks.on_rejected is not None:
                call_hook("on_rejected", self._hooks.on_rejected, key, error)
            raise error
        if start:
            self._start_workers(start)
        if self._hooks.on_queued is not None:
            call_hook("on_queued", self._hooks.on_queued, key, queue_len)
        return future

    def _submit_keyless(self, fn: Callable[..., T], args: Any, kwargs: Any) -> Future[T]:
        """Queue a task that belongs to no lane (KeyedExecutor.submit): unordered."""
        future: LazyFuture[T] = LazyFuture()
        task = _Task(future, fn, args, kwargs, _copy_context(), _monotonic())
        with self._lock:
            if self._state is not State.OPEN:
                raise self._closed_error()
            self._outstanding += 1
            self._ready.append(task)
            start = self._dispatch_locked()
        if start:
            self._start_workers(start)
        return future

    def _closed_error(self) -> DispatcherClosed:
        if self._state is State.BROKEN:
            return BrokenDispatcher(self._broken_reason or "a worker initializer failed")
        return DispatcherClosed("dispatcher is closed: cannot accept new tasks")

    # -------------------------------------------------------------- scheduling

    def _dispatch_locked(self) -> list[_Worker] | None:
        """Give ready items to idle workers, then to new workers while the pool may grow.

        Returns the new workers, to be started by the caller after it
        released the lock. Called with ``_lock`` held.
        """
        ready = self._ready
        if not ready or (self._paused_until and not self._pause_over_locked()):
            return None
        idle = self._idle
        while ready and idle:
            worker = idle.pop()
            worker.item = self._claim_locked(ready.popleft())
            worker.wake.release()
        new: list[_Worker] | None = None
        while ready and self._nworkers < self._max_inflight:
            self._nworkers += 1
            if new is None:
                new = []
            new.append(_Worker(self._claim_locked(ready.popleft())))
        return new

    @staticmethod
    def _claim_locked(item: _Lane | _Task) -> _Lane | _Task:
        if type(item) is _Lane:
            item.active = True
        return item

    def _pause_over_locked(self) -> bool:
        if _monotonic() >= self._paused_until:
            self._paused_until = 0.0
            return True
        return False

    def _take_ready_locked(self) -> _Lane | _Task | None:
        """The next ready item for a worker that is free, or None. ``_lock`` held."""
        if not self._ready or (self._paused_until and not self._pause_over_locked()):
            return None
        return self._claim_locked(self._ready.popleft())

    def _start_workers(self, workers: list[_Worker]) -> None:
        for worker in workers:
            name = f"{self._thread_name_prefix}-worker-{next(self._thread_ids)}"
            thread = threading.Thread(target=self._work, args=(worker,), name=name, daemon=True)
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            try:
                thread.start()
            except BaseException as exc:  # e.g. "can't start new thread"
                logger.error("outbound: cannot start a worker thread: %r", exc)
                with self._lock:
                    self._nworkers -= 1
                    if worker.item is not None:
                        self._unclaim_locked(worker.item, front=True)
                        worker.item = None
                    stranded = self._nworkers == 0 and bool(self._ready)
                    failed = self._fail_all_locked() if stranded else []
                for task in failed:
                    _resolve_failed(
                        task, DispatcherClosed(f"cannot start a worker thread: {exc!r}")
                    )

    def _unclaim_locked(self, item: _Lane | _Task, *, front: bool) -> None:
        if type(item) is _Lane:
            item.active = False
        if front:
            self._ready.appendleft(item)
        else:
            self._ready.append(item)

    # ------------------------------------------------------------------ worker

    def _work(self, worker: _Worker) -> None:
        """Body of a worker thread: run items until told to stop or idle too long."""
        if self._initializer is not None:
            try:
                self._initializer(*self._initargs)
            except BaseException:
                logger.critical("outbound: worker initializer raised", exc_info=True)
                self._break(worker)
                return
        item = worker.item
        worker.item = None
        permits = self._permits
        while True:
            while item is not None:
                permits.acquire()
                try:
                    item = self._run_item(item)
                finally:
                    permits.release()
            item = self._wait_for_item(worker)
            if item is None:
                return

    def _wait_for_item(self, worker: _Worker) -> _Lane | _Task | None:
        """Take the next ready item, or idle until one is handed over; None: exit."""
        lock = self._lock
        while True:
            with lock:
                item = self._take_ready_locked()
                if item is not None:
                    return item
                if self._should_exit_locked():
                    self._nworkers -= 1
                    return None
                self._idle.append(worker)
            woken = worker.wake.acquire(timeout=self._idle_timeout)
            with lock:
                item = worker.item
                worker.item = None
                if item is not None:
                    if not woken:
                        # Handed an item after the timeout fired but before we
                        # took the lock: consume that release to re-arm.
                        worker.wake.acquire()
                    return item
                if not woken:
                    # Idle too long: retire. Lanes that become ready later
                    # (a pause ends, a lane is unparked) get a new thread.
                    self._idle.remove(worker)
                    self._nworkers -= 1
                    return None
                # Woken with nothing: a stop request; loop to check.

    def _should_exit_locked(self) -> bool:
        return self._state is State.BROKEN or (
            self._state is not State.OPEN and self._outstanding == 0
        )

    def _run_item(self, item: _Lane | _Task) -> _Lane | _Task | None:
        """Run a keyless task, or one turn of a lane; return the next item or None."""
        if type(item) is _Task:
            with self._lock:
                self._running += 1
            deferred = self._execute(None, item, 0)
            with self._lock:
                self._running -= 1
                if deferred is not None:
                    self._defer_keyless_locked(item, deferred)
                else:
                    self._finished_locked()
                return self._take_ready_locked()
        assert type(item) is _Lane
        return self._run_turn(item)

    def _run_turn(self, lane: _Lane) -> _Lane | _Task | None:
        """Run up to ``quantum`` tasks of ``lane`` (more if no other lane waits)."""
        lock = self._lock
        budget = self._quantum
        with lock:
            if not lane.tasks:  # emptied by force_close before we got it
                return self._release_lane_locked(lane)
            task = lane.tasks.popleft()
            queue_len = len(lane.tasks)
            self._running += 1
        while True:
            deferred = self._execute(lane.key, task, queue_len)
            budget -= 1
            with lock:
                self._running -= 1
                if deferred is not None:
                    lane.tasks.appendleft(task)
                    self._park_locked(lane, deferred)
                    return self._take_ready_locked()
                self._finished_locked()
                if not lane.tasks:
                    return self._release_lane_locked(lane)
                if self._paused_until and not self._pause_over_locked():
                    self._unclaim_locked(lane, front=True)
                    return None
                if budget <= 0:
                    if self._ready:
                        # Fairness: to the back of the ready queue.
                        self._unclaim_locked(lane, front=False)
                        return self._take_ready_locked()
                    budget = self._quantum
                task = lane.tasks.popleft()
                queue_len = len(lane.tasks)
                self._running += 1

    def _release_lane_locked(self, lane: _Lane) -> _Lane | _Task | None:
        """``lane`` is empty: remove it (its key is no longer referenced)."""
        lane.active = False
        if self._lanes.get(lane.key) is lane:
            del self._lanes[lane.key]
        return self._take_ready_locked()

    def _finished_locked(self) -> None:
        self._outstanding -= 1
        if self._outstanding == 0:
            self._drained.notify_all()
            if self._state is not State.OPEN:
                self._became_idle_locked()

    def _became_idle_locked(self) -> None:
        """Closed and nothing outstanding: CLOSED, and let every idle thread go."""
        if self._state is State.CLOSING:
            self._state = State.CLOSED
        for worker in self._idle:
            worker.wake.release()
        self._idle.clear()
        self._timer_cond.notify_all()

    def _execute(self, key: Hashable, task: _Task, queue_len: int) -> Defer | None:
        """Run one task and resolve its future; return the Defer it raised, if any.

        Called with no lock held. Never raises.
        """
        future = task.future
        hooks = self._hooks
        if task.attempt == 0 and not future.set_running_or_notify_cancel():
            return None  # the caller cancelled the future while it waited
        task.attempt += 1
        if hooks.on_start is not None:
            call_hook("on_start", hooks.on_start, key)
        start = _monotonic()
        _current.context = TaskContext(
            key, start + self._send_timeout, task.attempt, task.submitted_at, self._cancel
        )
        error: BaseException | None = None
        try:
            result = task.context.run(task.fn, *task.args, **task.kwargs)
        except Defer as defer:
            if not self._cancel.is_set():
                return defer
            error = CancelledError("dispatcher was force-closed while the task deferred")
            _set_future(future, None, error)
        except BaseException as exc:
            error = exc
            _set_future(future, None, exc)
        else:
            _set_future(future, result, None)
            del result
        finally:
            _current.context = None
        if hooks.on_done is not None:
            end = _monotonic()
            info = DispatchInfo(key, queue_len, start - task.submitted_at, end - start, error)
            call_hook("on_done", hooks.on_done, info)
        return None

    # ----------------------------------------------------------------- parking

    def _park_locked(self, lane: _Lane, defer: Defer) -> None:
        """Park ``lane`` (its deferred task is back at its head) per ``defer``."""
        lane.active = False
        if defer.scope == "all":
            self._pause_locked(defer.delay)
            self._ready.appendleft(lane)
            return
        lane.parked = True
        self._add_timer_locked(_monotonic() + defer.delay, lane)

    def _defer_keyless_locked(self, task: _Task, defer: Defer) -> None:
        if defer.scope == "all":
            self._pause_locked(defer.delay)
            self._ready.appendleft(task)
        else:
            self._add_timer_locked(_monotonic() + defer.delay, task)

    def _pause_locked(self, delay: float) -> None:
        until = _monotonic() + delay
        if until > self._paused_until:
            self._paused_until = until
            self._add_timer_locked(until, None)

    def pause(self, delay: float) -> None:
        """Start no task on any lane for ``delay`` seconds; running tasks go on.

        For a platform-wide rate limit. A later, longer pause extends it.
        Thread-safe; never blocks.
        """
        delay = float(delay)
        if not 0.0 <= delay < math.inf:
            raise ValueError(f"delay must be a finite number >= 0, not {delay!r}")
        with self._lock:
            self._pause_locked(delay)

    def _add_timer_locked(self, due: float, item: _Lane | _Task | None) -> None:
        """Wake ``item`` at ``due``: a parked lane, a deferred keyless task, or a pause end."""
        heapq.heappush(self._timers, (due, next(self._timer_seq), item))
        if self._timer_thread is not None:
            self._timer_cond.notify()
            return
        # Started under the lock: Thread.start() only waits for the new
        # thread to begin, and the new thread takes the lock only afterwards.
        thread = threading.Thread(
            target=self._timer_loop, name=f"{self._thread_name_prefix}-timer", daemon=True
        )
        try:
            thread.start()
        except RuntimeError:  # interpreter shutting down: force_close will resolve them
            logger.error("outbound: cannot start the timer thread", exc_info=True)
            return
        self._timer_thread = thread
        self._threads.append(thread)

    def _timer_loop(self) -> None:
        """Body of the timer thread: unpark lanes and end pauses when due."""
        lock = self._lock
        timers = self._timers
        while True:
            with lock:
                while True:
                    if not timers:
                        if self._state is not State.OPEN and self._outstanding == 0:
                            self._timer_thread = None
                            return
                        if not self._timer_cond.wait(self._idle_timeout) and not timers:
                            self._timer_thread = None
                            return
                        continue
                    delay = timers[0][0] - _monotonic()
                    if delay <= 0:
                        break
                    self._timer_cond.wait(delay)
                now = _monotonic()
                while timers and timers[0][0] <= now:
                    _, _, item = heapq.heappop(timers)
                    if type(item) is _Task:
                        self._ready.append(item)
                    elif type(item) is _Lane and item.parked:
                        item.parked = False
                        self._ready.append(item)
                start = self._dispatch_locked()
            if start:
                self._start_workers(start)

    # --------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Refuse new work; what was accepted still runs. Idempotent; never blocks."""
        with self._lock:
            if self._state is State.OPEN:
                self._state = State.CLOSING
                if self._outstanding == 0:
                    self._became_idle_locked()

    def drain(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running, or ``timeout`` seconds pass.

        Returns True if drained. On an open dispatcher new work may arrive
        right after. ``None`` waits without limit.
        """
        _check_timeout(timeout)
        with self._lock:
            return self._drained.wait_for(lambda: self._outstanding == 0, timeout)

    def shutdown(self, timeout: float | None = None) -> bool:
        """``close()``, then wait up to ``timeout`` for the work and the threads to end.

        Returns True if everything accepted finished and every thread exited.
        Idempotent; safe from any thread but a task of this dispatcher
        (which would wait for itself: it raises ``RuntimeError``).
        """
        _check_timeout(timeout)
        if _current.context is not None and self._is_own_thread():
            raise RuntimeError("shutdown() called from a task of the same dispatcher")
        deadline = None if timeout is None else _monotonic() + timeout
        self.close()
        if not self.drain(timeout):
            return False
        return self._join_threads(deadline)

    def _is_own_thread(self) -> bool:
        with self._lock:
            return threading.current_thread() in self._threads

    def _join_threads(self, deadline: float | None) -> bool:
        with self._lock:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for thread in threads:
            if deadline is None:
                thread.join()
            else:
                thread.join(max(0.0, deadline - _monotonic()))
            if thread.is_alive():
                return False
        return True

    def force_close(self) -> None:
        """Refuse new work, cancel every queued task at once, and flag running ones.

        Queued (and parked) futures are resolved at once as cancelled; running
        tasks see ``current_context().cancelled`` and finish on their own.
        Idempotent; never blocks on the running tasks.
        """
        with self._lock:
            if self._state is State.OPEN:
                self._state = State.CLOSING
            self._cancel.set()
            dropped = self._drop_queued_locked()
        for task in dropped:
            _resolve_cancelled(task)

    def _cancel_queued(self) -> None:
        """Cancel what waits but leave running tasks be (Executor.shutdown(cancel_futures))."""
        with self._lock:
            dropped = self._drop_queued_locked()
        for task in dropped:
            _resolve_cancelled(task)

    def _drop_queued_locked(self) -> list[_Task]:
        """Remove every task that is not running; the caller resolves them unlocked."""
        dropped: list[_Task] = []
        for lane in list(self._lanes.values()):
            dropped.extend(lane.tasks)
            lane.tasks.clear()
            lane.parked = False
            if not lane.active:
                del self._lanes[lane.key]
        for item in self._ready:
            if type(item) is _Task:
                dropped.append(item)
        self._ready.clear()
        for _, _, timed in self._timers:
            if type(timed) is _Task:
                dropped.append(timed)  # a deferred keyless task
        self._timers.clear()
        self._paused_until = 0.0
        self._timer_cond.notify_all()
        self._outstanding -= len(dropped)
        if self._outstanding == 0:
            self._drained.notify_all()
            if self._state is not State.OPEN:
                self._became_idle_locked()
        return dropped

    def _fail_all_locked(self) -> list[_Task]:
        if self._state is State.OPEN:
            self._state = State.CLOSING
        return self._drop_queued_locked()

    def _break(self, worker: _Worker) -> None:
        """A worker's initializer raised: fail everything queued and refuse new work."""
        reason = "a worker initializer raised; the dispatcher is broken"
        with self._lock:
            self._nworkers -= 1
            if worker.item is not None:
                self._unclaim_locked(worker.item, front=True)
                worker.item = None
            self._state = State.BROKEN
            self._broken_reason = reason
            dropped = self._drop_queued_locked()
            for idle in self._idle:
                idle.wake.release()
            self._idle.clear()
        for task in dropped:
            _resolve_failed(task, BrokenDispatcher(reason))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # ----------------------------------------------------------- observation

    @property
    def state(self) -> State:
        """The lifecycle state now."""
        with self._lock:
            return self._state

    @property
    def max_inflight(self) -> int:
        return self._max_inflight

    @property
    def queue_size(self) -> int:
        return self._queue_size

    @property
    def send_timeout(self) -> float:
        return self._send_timeout

    def stats(self) -> DispatcherStats:
        """A consistent snapshot of the counters. O(lanes); never blocks on tasks."""
        with self._lock:
            queued = sum(len(lane.tasks) for lane in self._lanes.values())
            queued += sum(1 for item in self._ready if type(item) is _Task)
            queued += sum(1 for _, _, item in self._timers if type(item) is _Task)
            paused_for = max(0.0, self._paused_until - _monotonic()) if self._paused_until else 0.0
            return DispatcherStats(
                state=self._state,
                lanes=len(self._lanes),
                queued=queued,
                running=self._running,
                parked=sum(1 for lane in self._lanes.values() if lane.parked),
                threads=self._nworkers,
                idle_threads=len(self._idle),
                max_inflight=self._max_inflight,
                cancelled=self._cancel.is_set(),
                paused_for=paused_for,
            )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<{type(self).__name__} state={s.state.value} lanes={s.lanes} queued={s.queued} "
            f"running={s.running} threads={s.threads}/{s.max_inflight}>"
        )


def _set_future(future: Future[Any], result: object, error: BaseException | None) -> None:
    """Resolve a running future; ignore one the caller resolved on its own."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except Exception:  # InvalidStateError: resolved by someone else; nothing to do
        logger.debug("outbound: future already resolved", exc_info=True)


def _resolve_cancelled(task: _Task) -> None:
    """Resolve a task that will not run as cancelled, waking every kind of waiter."""
    future = task.future
    if task.attempt == 0:  # never started: a plain cancellation
        future.cancel()
        future.set_running_or_notify_cancel()  # wakes wait() and as_completed()
    else:  # it ran and deferred, so the future is running and cannot cancel()
        _set_future(future, None, CancelledError("dispatcher was force-closed"))


def _resolve_failed(task: _Task, error: BaseException) -> None:
    """Fail a task that will not run with ``error`` (a caller's cancel stands)."""
    if task.attempt == 0 and not task.future.set_running_or_notify_cancel():
        return
    _set_future(task.future, None, error)


# ------------------------------------------------------------ interpreter exit

_live: weakref.WeakSet[Dispatcher] = weakref.WeakSet()
_live_lock = threading.Lock()
_exit_registered = False


def _register_for_exit(dispatcher: Dispatcher) -> None:
    """Make interpreter exit give ``dispatcher`` its ``exit_timeout`` to finish."""
    global _exit_registered
    with _live_lock:
        _live.add(dispatcher)
        if _exit_registered:
            return
        _exit_registered = True
    # Like concurrent.futures: run before the interpreter joins threads, so
    # that no thread is started during finalization; atexit as a fallback.
    register: Callable[[Callable[[], None]], None] | None = getattr(
        threading, "_register_atexit", None
    )
    try:
        if register is None:
            raise RuntimeError
        register(_shutdown_all_at_exit)
    except RuntimeError:
        atexit.register(_shutdown_all_at_exit)


def _shutdown_all_at_exit() -> None:
    with _live_lock:
        dispatchers: Iterable[Dispatcher] = list(_live)
    for dispatcher in dispatchers:
        dispatcher.close()
    for dispatcher in dispatchers:
        try:
            if not dispatcher.shutdown(dispatcher._exit_timeout):
                logger.warning(
                    "outbound: %r did not finish within exit_timeout=%s; the rest is dropped",
                    dispatcher,
                    dispatcher._exit_timeout,
                )
        except Exception:
            logger.exception("outbound: error while shutting down at exit")
