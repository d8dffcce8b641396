"""The per-key ordered dispatcher: :class:`Dispatcher`.

A *lane* is the queue of one key (one chat). Tasks of one key run one at a
time in submission order; lanes run concurrently on a bounded pool of
worker threads, at most ``max_inflight`` tasks at once.

How it works. ``submit`` appends the task to its key's lane. A lane that did
not exist is created and scheduled: handed to an idle worker, or put on the
ready queue and, if the pool may grow, a new worker thread is started for
it. A worker that owns a lane runs up to ``quantum`` of its tasks, then
puts the lane at the back of the ready queue if other work waits
(fairness), or keeps going if none does. While a lane is owned, ``submit``
only appends to it: a hot chat costs no thread wake-up per message. A lane
whose queue is empty is removed from the table at once, so an idle chat
costs nothing and its key is not kept alive. A task that raises
:class:`~outbound.context.Defer` goes back to the head of its lane and the
lane is *parked* on one shared timer thread; its worker serves other lanes
meanwhile.

Locking. ``Dispatcher._lock`` guards the lifecycle, the creation of lanes,
the idle workers, the timers and the pause; each lane's own ``lock`` guards
that lane (see :class:`~outbound._lane.Lane`). Order: ``Dispatcher._lock``
before a lane's lock, never the reverse. The hot paths take no global lock:
a submit to a lane that exists takes only that lane's lock, a worker takes
the next task of its lane with an atomic ``deque.popleft`` and the next
ready lane with another. Locks are held for O(1) bookkeeping (O(n) in
``force_close`` and ``stats``), never while user code runs: tasks, hooks
and future callbacks all run with no internal lock held.
"""

from __future__ import annotations

import contextvars
import enum
import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future
from concurrent.futures._base import CANCELLED
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, TypeVar

from typing_extensions import ParamSpec, Self

from . import _exit
from ._future import LazyFuture
from ._lane import Job, Lane, Task, Worker
from .context import Defer, TaskContext, _current
from .errors import BrokenDispatcher, DispatcherClosed, QueueFull
from .hooks import DispatchInfo, Hooks, call_hook

__all__ = ["Dispatcher", "DispatcherStats", "State"]

logger = logging.getLogger("outbound")

P = ParamSpec("P")
T = TypeVar("T")

_monotonic = time.monotonic
# Said by _append_locked for a full lane (see there).
_LANE_FULL: Final = QueueFull(None, 0)
# Longest drain() sleeps before it looks again without being woken.
_DRAIN_RECHECK = 0.05
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
    """A snapshot of a dispatcher's counters, taken under its lock.

    ``lanes`` counts lanes that hold work (queued, running or parked);
    ``queued`` tasks accepted and not yet started (parked ones included);
    ``running`` worker threads busy with a task (or between two);
    ``parked`` lanes waiting on the timer; ``threads`` live worker threads,
    ``idle_threads`` those waiting for work; ``paused_for`` seconds left of
    a :meth:`Dispatcher.pause`.
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

    - ``max_inflight``: at most this many tasks run at once; the pool never
      has more worker threads (each holds a permit of a
      ``threading.BoundedSemaphore`` of this size for its whole life).
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
        self.exit_timeout: Final = exit_timeout

        self._reset(State.OPEN, cancelled=False, broken_reason=None)
        _exit.register(self)
        _register_fork_hook()

    def _reset(self, state: State, *, cancelled: bool, broken_reason: str | None) -> None:
        """Build the runtime state: locks, tables, counters. No thread is started."""
        # The concurrency cap. A worker thread is started only with a permit
        # taken without waiting, holds it for its whole life and returns it
        # as it exits; a thread runs one task at a time, so at most
        # max_inflight tasks run. Nothing ever waits on it: work is only
        # handed to threads that exist, so no worker can sit on a lane
        # waiting for a permit (the seed's ForceClose leak), and a parked
        # lane holds neither a thread nor a permit.
        self._permits = threading.BoundedSemaphore(self._max_inflight)

        # Guards the fields marked "guarded" below (see the module
        # docstring for the lanes). Waiters: drain()/shutdown() on
        # _drained, the timer thread on _timer_cond.
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._timer_cond = threading.Condition(self._lock)
        # Set by force_close(); TaskContext.cancelled reads it.
        self._cancel = threading.Event()
        if cancelled:
            self._cancel.set()

        # guarded: lifecycle, only moves forward (see State).
        self._state = state
        # key -> lane, exactly the lanes that hold work. Entries are added
        # under _lock and removed by the lane's retirer under the lane's
        # lock; read anywhere (dict.get is atomic) as a hint that the lane's
        # own lock then confirms. Replaced by a new dict only under _lock.
        self._lanes: dict[Hashable, Lane] = {}
        # Lanes and keyless tasks waiting for a worker, in order. Pushed
        # under _lock; popped by workers without it: every push and pop is
        # one atomic deque call.
        self._ready: deque[Job] = deque()
        # Idle workers, most recently idle last (woken first, so the coldest
        # threads retire). Appended to by a worker going idle and popped by
        # whoever pushes work, each one atomic list call. No wake-up is
        # lost: a scheduler pushes to _ready and then pops _idle; a worker
        # appends to _idle and then looks in _ready: one of the two sees
        # the other (both objects serialize their own operations).
        self._idle: list[Worker] = []
        # guarded: the workers of live threads (started and not yet returned).
        self._workers: set[Worker] = set()
        # guarded: every thread this dispatcher started that may be alive;
        # shutdown() joins them. Pruned when a thread is added.
        self._threads: list[threading.Thread] = []
        self._thread_ids = itertools.count(1)
        # guarded: keyless tasks (KeyedExecutor.submit) accepted and not yet
        # resolved. The dispatcher is drained when this is 0 and _lanes is
        # empty: a lane stays in the table until its last task finished.
        self._keyless = 0
        # guarded: parked lanes, deferred keyless tasks and pause ends (None),
        # as a heap of (due, seq, item). The timer thread waits on it.
        self._timers: list[tuple[float, int, Job | None]] = []
        self._timer_seq = itertools.count()
        self._timer_thread: threading.Thread | None = None
        # guarded: no lane starts before this monotonic instant (0: no
        # pause). Read without the lock as a hint.
        self._paused_until = 0.0
        # guarded: threads in drain(); read without the lock as a hint.
        self._drain_waiters = 0
        # guarded: why the dispatcher broke (State.BROKEN).
        self._broken_reason: str | None = broken_reason
        # The process that owns the threads and locks above (see _after_fork).
        self._pid = os.getpid()

    def _after_fork(self) -> None:
        """In a forked child: start afresh, empty, with new locks and no threads.

        The parent's threads do not exist in the child, and any lock may
        have been held by one of them at the fork, so nothing of the
        runtime state is reused. The parent's queued tasks stay the
        parent's: the child neither runs nor resolves its copies of them.
        An open dispatcher stays open; a closing one is closed.
        """
        state = self._state
        if state is State.CLOSING:
            state = State.CLOSED
        self._reset(state, cancelled=self._cancel.is_set(), broken_reason=self._broken_reason)

    def _check_pid(self) -> None:
        """Rebuild after a fork that bypassed ``os.register_at_fork`` hooks."""
        if self._pid != os.getpid():
            with _fork_lock:
                if self._pid != os.getpid():
                    self._after_fork()

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
        if self._pid != os.getpid():
            self._check_pid()
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        try:
            lane = self._lanes.get(key)
        except TypeError:
            raise TypeError(f"key must be hashable, not {type(key).__name__}") from None
        future: LazyFuture[T] = LazyFuture()
        task = Task(future, fn, args, kwargs, _copy_context(), _monotonic())
        start: list[Worker] | None = None
        error: BaseException | None = None
        queue_len = 0
        if lane is not None:
            # Fast path: the key has a lane; only its lock is needed.
            with lane.lock:
                if not lane.dead:
                    error = self._append_locked(lane, task)
                    queue_len = len(lane.tasks)
        if not queue_len and error is None:
            # Slow path: no lane, or it just retired. Lanes are created only
            # under _lock, and a lane retires only with its queue empty and
            # its lock held, leaving the table in the same step. So a submit
            # either finds a live lane (whose owner will see the new task
            # before it can retire the lane) or creates the only lane of the
            # key, with one owner: the seed's worker self-delete race, which
            # gave two workers one chat, cannot happen.
            new_lane = Lane(key)
            new_lane.tasks.append(task)
            with self._lock:
                if self._state is not State.OPEN:
                    error = self._closed_error()
                else:
                    lane = self._lanes.get(key)
                    if lane is not None:
                        with lane.lock:
                            if not lane.dead:
                                error = self._append_locked(lane, task)
                                queue_len = len(lane.tasks)
                    if not queue_len and error is None:
                        self._lanes[key] = new_lane
                        queue_len = 1
                        start = self._schedule_locked(new_lane)
        if error is not None:
            if error is _LANE_FULL:
                error = QueueFull(key, self._queue_size)
            if self._hooks.on_rejected is not None:
                call_hook("on_rejected", self._hooks.on_rejected, key, error)
            raise error
        if start:
            self._start_workers(start)
        if self._hooks.on_queued is not None:
            call_hook("on_queued", self._hooks.on_queued, key, queue_len)
        return future

    def _append_locked(self, lane: Lane, task: Task) -> BaseException | None:
        """Append ``task`` to a live lane, or say why not. ``lane.lock`` held.

        The state is read under the lane's lock: ``force_close`` changes it
        before it empties the lanes under their locks, so no task can slip
        into a lane after ``force_close`` emptied it.
        """
        if self._state is not State.OPEN:
            return self._closed_error()
        if len(lane.tasks) >= self._queue_size:
            return _LANE_FULL  # the QueueFull is built unlocked: it formats the key
        lane.tasks.append(task)
        return None

    def _submit_keyless(self, fn: Callable[..., T], args: Any, kwargs: Any) -> Future[T]:
        """Queue a task that belongs to no lane (KeyedExecutor.submit): unordered."""
        self._check_pid()
        future: LazyFuture[T] = LazyFuture()
        task = Task(future, fn, args, kwargs, _copy_context(), _monotonic())
        with self._lock:
            if self._state is not State.OPEN:
                raise self._closed_error()
            self._keyless += 1
            start = self._schedule_locked(task)
        if start:
            self._start_workers(start)
        return future

    def _closed_error(self) -> DispatcherClosed:
        if self._state is State.BROKEN:
            return BrokenDispatcher(self._broken_reason or "a worker initializer failed")
        return DispatcherClosed("dispatcher is closed: cannot accept new tasks")

    # -------------------------------------------------------------- scheduling

    def _schedule_locked(self, job: Job) -> list[Worker] | None:
        """Queue ``job`` and wake an idle worker for it, or grow the pool if it may.

        Returns new workers for the caller to start once it released _lock.
        """
        self._ready.append(job)
        if self._paused_until and not self._pause_over_locked():
            return None  # the pause's end wakes workers
        try:
            worker = self._idle.pop()
        except IndexError:
            return self._grow_locked()
        worker.wake.release()  # it takes a job from _ready itself
        return None

    def _dispatch_locked(self) -> list[Worker] | None:
        """Wake an idle worker per queued job, then grow (after a pause or an unpark)."""
        if self._paused_until and not self._pause_over_locked():
            return None
        woken = 0
        for _ in range(len(self._ready)):
            try:
                self._idle.pop().wake.release()
            except IndexError:
                break
            woken += 1
        # The woken workers have not taken their jobs yet: grow only for
        # the jobs beyond them.
        return self._grow_locked(len(self._ready) - woken)

    def _wake_all_idle(self) -> None:
        """Wake every idle worker (to exit, or to look again)."""
        while True:
            try:
                worker = self._idle.pop()
            except IndexError:
                return
            worker.wake.release()

    def _unidle(self, worker: Worker) -> bool:
        """Take ``worker`` off the idle list; False if a waker took it first."""
        try:
            self._idle.remove(worker)
        except ValueError:
            return False
        return True

    def _grow_locked(self, most: int | None = None) -> list[Worker] | None:
        """Start a worker per queued job (at most ``most``) while the permits last."""
        ready = self._ready
        new: list[Worker] | None = None
        workers = self._workers
        while (
            ready
            and (most is None or most > 0)
            and len(workers) < self._max_inflight
            and self._permits.acquire(False)
        ):
            if most is not None:
                most -= 1
            try:
                job = ready.popleft()
            except IndexError:
                self._permits.release()
                break
            worker = Worker(job)
            workers.add(worker)
            if new is None:
                new = []
            new.append(worker)
        return new

    def _pause_over_locked(self) -> bool:
        if _monotonic() >= self._paused_until:
            self._paused_until = 0.0
            return True
        return False

    def _start_workers(self, workers: list[Worker]) -> None:
        for worker in workers:
            name = f"{self._thread_name_prefix}-worker-{next(self._thread_ids)}"
            thread = threading.Thread(target=self._work, args=(worker,), name=name, daemon=True)
            with self._lock:
                self._threads = [t for t in self._threads if t.ident is None or t.is_alive()]
                self._threads.append(thread)
            try:
                thread.start()
            except BaseException as exc:  # e.g. "can't start new thread"
                logger.error("outbound: cannot start a worker thread: %r", exc)
                with self._lock:
                    self._threads.remove(thread)
                    self._workers.discard(worker)
                    if worker.job is not None:
                        self._ready.appendleft(worker.job)
                        worker.job = None
                    stranded = not self._workers and bool(self._ready)
                    if stranded and self._state is State.OPEN:
                        self._state = State.CLOSING
                    failed = self._drop_queued_locked() if stranded else []
                self._permits.release()
                error = DispatcherClosed(f"cannot start a worker thread: {exc!r}")
                for task in failed:
                    _resolve_failed(task, error)

    # ------------------------------------------------------------------ worker

    def _work(self, worker: Worker) -> None:
        """Body of a worker thread. It holds one permit for its whole life."""
        try:
            if self._initializer is not None:
                try:
                    self._initializer(*self._initargs)
                except BaseException:
                    logger.critical("outbound: worker initializer raised", exc_info=True)
                    self._break(worker)
                    return
            job = worker.job
            worker.job = None
            while job is not None:
                if type(job) is Task:
                    self._run_keyless(worker, job)
                else:
                    assert type(job) is Lane
                    self._run_lane(worker, job)
                job = None  # keep nothing of the finished job alive while idle
                job = self._next_job(worker)
        finally:
            # Under _lock, with the grow check: a job pushed after this worker
            # left _workers but before its permit came back must not strand.
            with self._lock:
                self._workers.discard(worker)
                self._permits.release()
                start = (
                    self._grow_locked() if self._ready and not self._should_exit_locked() else None
                )
            if start:
                self._start_workers(start)

    def _next_job(self, worker: Worker) -> Job | None:
        """Take the next ready job, or idle until woken to look again; None: retire.

        While the dispatcher is open this takes no lock (see ``_idle``); once
        it is closing, the checks and the registration are made under _lock,
        where the last worker out wakes the idle ones to exit.
        """
        ready = self._ready
        lock = self._lock
        while True:
            if not self._paused_until:  # unlocked hint; checked under the lock below
                try:
                    return ready.popleft()
                except IndexError:
                    pass
            if self._state is not State.OPEN or self._paused_until:
                with lock:
                    if self._should_exit_locked():
                        self._workers.discard(worker)
                        return None
                    if not (self._paused_until and not self._pause_over_locked()):
                        try:
                            return ready.popleft()
                        except IndexError:
                            pass
                    if not self._lanes:
                        self._lanes = {}  # give back what a burst of keys grew it to
                    self._idle.append(worker)
            else:
                self._idle.append(worker)
                job = None
                try:
                    job = ready.popleft()  # pushed before we were listed?
                except IndexError:
                    pass
                if job is not None or self._state is not State.OPEN or self._paused_until:
                    if not self._unidle(worker):
                        worker.wake.acquire()  # a waker listed us: take its release
                    if job is not None:
                        return job
                    continue
            if worker.wake.acquire(timeout=self._idle_timeout):
                continue  # woken: look again
            if not self._unidle(worker):
                worker.wake.acquire()  # woken just as the timeout fired
                continue
            with lock:
                if ready and not self._should_exit_locked():
                    continue
                # Idle too long: retire. Work scheduled later gets a new thread.
                if not self._lanes:
                    self._lanes = {}  # give back what a burst of keys grew it to
                self._workers.discard(worker)
                return None

    def _should_exit_locked(self) -> bool:
        return self._state is State.BROKEN or (
            self._state is not State.OPEN and not self._lanes and not self._keyless
        )

    def _run_lane(self, worker: Worker, lane: Lane) -> None:
        """Own ``lane`` for one turn: up to ``quantum`` tasks, or more if nothing waits."""
        try:
            with lane.lock:
                if lane.dead:
                    return  # retired by force_close while it waited in the ready queue
                if not lane.tasks:
                    emptied = self._retire_locked(lane)
                else:
                    emptied = False
                    lane.active = True
                    task = lane.tasks.popleft()
                    queue_len = len(lane.tasks)
            if emptied:
                self._lanes_emptied()
            if not lane.active:
                return
            budget = self._quantum
            tasks = lane.tasks
            while True:
                deferred = self._execute(worker, lane, task, queue_len)
                budget -= 1
                if deferred is not None and self._park(lane, task, deferred):
                    return
                if not self._paused_until and (budget > 0 or not self._ready):
                    # The owner takes from the head without the lock (see Lane).
                    try:
                        task = tasks.popleft()
                    except IndexError:
                        pass
                    else:
                        queue_len = len(tasks)
                        if budget <= 0:
                            budget = self._quantum
                        continue
                with lane.lock:
                    if tasks and not self._paused_until and (budget > 0 or not self._ready):
                        task = tasks.popleft()  # appended since the pop above
                        queue_len = len(tasks)
                        if budget <= 0:
                            budget = self._quantum
                        continue
                    if not tasks:
                        emptied = self._retire_locked(lane)
                    else:
                        lane.active = False  # yields its turn
                if not tasks:
                    if emptied:
                        self._lanes_emptied()
                    return
                start = None
                with self._lock:
                    if self._paused_until and not self._pause_over_locked():
                        self._ready.appendleft(lane)  # first in line when the pause ends
                    else:
                        start = self._schedule_locked(lane)  # fairness: behind the others
                if start:
                    self._start_workers(start)
                return
        finally:
            # A failed future's traceback reaches this frame (f_back of _execute).
            lane = task = tasks = None  # type: ignore[assignment]

    def _run_keyless(self, worker: Worker, task: Task) -> None:
        deferred = self._execute(worker, None, task, 0)
        try:
            self._finish_keyless(task, deferred)
        finally:
            task = deferred = None  # type: ignore[assignment]

    def _finish_keyless(self, task: Task, deferred: Defer | None) -> None:
        cancelled = False
        with self._lock:
            if deferred is not None:
                if not self._cancel.is_set():
                    if deferred.scope == "all":
                        self._pause_locked(deferred.delay)
                        self._ready.appendleft(task)
                    else:
                        self._add_timer_locked(_monotonic() + deferred.delay, task)
                    return
                cancelled = True
            self._keyless -= 1
            self._maybe_drained_locked()
        if cancelled:
            _resolve_cancelled(task)

    def _park(self, lane: Lane, task: Task, defer: Defer) -> bool:
        """Put a deferred task back at its lane's head and park the lane per ``defer``.

        Returns False if ``force_close`` came meanwhile: then the task is
        resolved as cancelled instead and the caller goes on with the lane.
        """
        with self._lock:
            if not self._cancel.is_set():
                with lane.lock:
                    lane.tasks.appendleft(task)
                    lane.active = False
                    lane.parked = defer.scope == "lane"
                if defer.scope == "all":
                    self._pause_locked(defer.delay)
                    self._ready.appendleft(lane)
                else:
                    self._add_timer_locked(_monotonic() + defer.delay, lane)
                return True
        _resolve_cancelled(task)
        return False

    def _retire_locked(self, lane: Lane) -> bool:
        """``lane`` is empty: take it out of the table for good. ``lane.lock`` held.

        Its key is no longer referenced; a later submit creates a new lane.
        Returns True if the table is now empty (the caller then calls
        ``_lanes_emptied`` once it released the lane's lock).
        """
        lane.dead = True
        lane.active = False
        lane.parked = False
        lanes = self._lanes
        if lanes.get(lane.key) is lane:
            del lanes[lane.key]
        return not lanes

    def _lanes_emptied(self) -> None:
        """The table looked empty after a retire: tell drain() and a closing pool.

        Skipped (an unlocked read as a hint) while open with nobody in
        drain(), to keep _lock off the path of a pool that runs many
        short-lived keys; drain() re-checks on its own every few tens of
        milliseconds, so no wake-up can be lost for good.
        """
        if self._state is State.OPEN and not self._drain_waiters:
            return
        with self._lock:
            self._maybe_drained_locked()

    def _maybe_drained_locked(self) -> None:
        """If nothing is left, wake drain(); once closed, also let the threads go."""
        if self._lanes or self._keyless:
            return
        # A dict never shrinks: after a burst over many keys, give its
        # memory back. Unlocked readers of the old, empty dict just take the
        # slow path of submit.
        self._lanes = {}
        self._drained.notify_all()
        if self._state is State.OPEN:
            return
        if self._state is State.CLOSING:
            self._state = State.CLOSED
        self._wake_all_idle()
        self._timer_cond.notify_all()

    def _execute(
        self, worker: Worker, lane: Lane | None, task: Task, queue_len: int
    ) -> Defer | None:
        """Run one task and resolve its future; return the Defer it raised, if any.

        Called with no lock held. Never raises. After ``force_close`` no
        task starts: one a worker already held is cancelled here.
        """
        future = task.future
        hooks = self._hooks
        if self._cancel.is_set():
            _resolve_cancelled(task)
            return None
        if task.attempt == 0:
            try:
                if not future.set_running_or_notify_cancel():
                    return None  # the caller cancelled the future while it waited
            except RuntimeError:  # the caller resolved it while it waited
                return None
        key = None if lane is None else lane.key
        task.attempt += 1
        if hooks.on_start is not None:
            call_hook("on_start", hooks.on_start, key)
        start = _monotonic()
        _current.context = TaskContext(
            key, start + self._send_timeout, task.attempt, task.submitted_at, self._cancel, task
        )
        error: BaseException | None = None
        result: Any = None
        worker.busy = True
        try:
            result = task.context.run(task.fn, *task.args, **task.kwargs)
        except BaseException as exc:
            error = exc
        finally:
            # Not busy before the future resolves: whoever sees the result
            # sees this task counted out of stats().running.
            worker.busy = False
            _current.context = None
        if isinstance(error, Defer):
            if not self._cancel.is_set():
                return error
            error = CancelledError("dispatcher was force-closed while the task deferred")
        _set_future(future, result, error)
        del result
        if hooks.on_done is not None:
            end = _monotonic()
            info = DispatchInfo(key, queue_len, start - task.submitted_at, end - start, error)
            call_hook("on_done", hooks.on_done, info)
            del info
        # A failed future's traceback holds this frame: keep nothing else alive.
        task = lane = key = error = None  # type: ignore[assignment]
        return None

    # ------------------------------------------------------- timers and pauses

    def pause(self, delay: float) -> None:
        """Start no task on any lane for ``delay`` seconds; running tasks go on.

        For a platform-wide rate limit. A later, longer pause extends it.
        Thread-safe; never blocks.
        """
        delay = float(delay)
        if not 0.0 <= delay < math.inf:
            raise ValueError(f"delay must be a finite number >= 0, not {delay!r}")
        self._check_pid()
        with self._lock:
            self._pause_locked(delay)

    def _pause_locked(self, delay: float) -> None:
        until = _monotonic() + delay
        if until > self._paused_until:
            self._paused_until = until
            self._add_timer_locked(until, None)

    def _add_timer_locked(self, due: float, item: Job | None) -> None:
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
                    if self._should_exit_locked():
                        timers.clear()  # only pause ends can be left: nothing to wake
                        self._timer_thread = None
                        return
                    if not timers:
                        if not (self._timer_cond.wait(self._idle_timeout) or timers):
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
                    if type(item) is Task:
                        self._ready.append(item)
                    elif type(item) is Lane:
                        with item.lock:
                            due = item.parked and not item.dead
                            item.parked = False
                        if due:
                            self._ready.append(item)
                item = None  # keep no lane (and key) alive until the next timer
                start = self._dispatch_locked()
            if start:
                self._start_workers(start)

    # --------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Refuse new work; what was accepted still runs. Idempotent; never blocks."""
        self._check_pid()
        with self._lock:
            if self._state is State.OPEN:
                self._state = State.CLOSING
                self._maybe_drained_locked()

    def drain(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running, or ``timeout`` seconds pass.

        Returns True if drained. On an open dispatcher new work may arrive
        right after. ``None`` waits without limit. Raises ``RuntimeError``
        from a task or hook of this dispatcher, which would wait for itself.
        """
        _check_timeout(timeout)
        self._check_pid()
        if self._is_own_thread():
            raise RuntimeError("drain() called from a task or hook of the same dispatcher")
        deadline = None if timeout is None else _monotonic() + timeout
        with self._lock:
            self._drain_waiters += 1
            try:
                while self._lanes or self._keyless:
                    left = _DRAIN_RECHECK if deadline is None else deadline - _monotonic()
                    if left <= 0:
                        return False
                    self._drained.wait(min(left, _DRAIN_RECHECK))
                return True
            finally:
                self._drain_waiters -= 1

    def shutdown(self, timeout: float | None = None) -> bool:
        """``close()``, then wait up to ``timeout`` for the work and the threads to end.

        Returns True if everything accepted finished and every thread exited.
        Idempotent; safe from any thread but a task of this dispatcher
        (which would wait for itself: it raises ``RuntimeError``).
        """
        _check_timeout(timeout)
        if self._is_own_thread():
            raise RuntimeError("shutdown() called from a task or hook of the same dispatcher")
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
        tasks see ``current_context().cancelled`` and finish on their own. A
        task that a worker had already taken at that instant may still start,
        and then sees ``cancelled``; no other task starts. Idempotent; never
        blocks on tasks.
        """
        self._check_pid()
        with self._lock:
            if self._state is State.OPEN:
                self._state = State.CLOSING
            self._cancel.set()
            dropped = self._drop_queued_locked()
        for task in dropped:
            _resolve_cancelled(task)

    def _cancel_queued(self) -> None:
        """Cancel what waits but let running tasks be (Executor.shutdown(cancel_futures))."""
        with self._lock:
            dropped = self._drop_queued_locked()
        for task in dropped:
            _resolve_cancelled(task)

    def _drop_queued_locked(self) -> list[Task]:
        """Take every task that is not running out of the dispatcher.

        The caller resolves them once it released _lock. Tasks are taken one
        ``popleft`` at a time, since workers pop concurrently without the
        lock: each task goes to exactly one side.
        """
        dropped: list[Task] = []
        # Copies: retirers and workers change the table and the ready queue
        # without _lock; copy() takes each object's own lock in one step.
        for lane in self._lanes.copy().values():
            with lane.lock:
                tasks = lane.tasks
                while tasks:
                    try:
                        dropped.append(tasks.popleft())
                    except IndexError:
                        break
                if not lane.active:  # owned by the ready queue or the timer
                    self._retire_locked(lane)
        ready = self._ready
        while ready:
            try:
                job = ready.popleft()
            except IndexError:
                break
            if type(job) is Task:
                dropped.append(job)
                self._keyless -= 1
        for _, _, item in self._timers:
            if type(item) is Task:
                dropped.append(item)
                self._keyless -= 1
        self._timers.clear()
        self._paused_until = 0.0
        self._timer_cond.notify_all()
        self._maybe_drained_locked()
        return dropped

    def _break(self, worker: Worker) -> None:
        """A worker's initializer raised: fail everything queued and refuse new work."""
        reason = "a worker initializer raised; the dispatcher is broken"
        with self._lock:
            self._workers.discard(worker)
            if worker.job is not None:
                self._ready.appendleft(worker.job)
                worker.job = None
            self._state = State.BROKEN
            self._broken_reason = reason
            dropped = self._drop_queued_locked()
            self._wake_all_idle()
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
        self._check_pid()
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
        """A snapshot of the counters, taken under the dispatcher's lock.

        O(lanes); never blocks on tasks.
        """
        self._check_pid()
        with self._lock:
            lanes = list(self._lanes.copy().values())  # copies: see _drop_queued_locked
            queued = sum(len(lane.tasks) for lane in lanes)
            queued += sum(1 for job in self._ready.copy() if type(job) is Task)
            queued += sum(1 for _, _, item in self._timers if type(item) is Task)
            paused_for = max(0.0, self._paused_until - _monotonic()) if self._paused_until else 0.0
            return DispatcherStats(
                state=self._state,
                lanes=len(lanes),
                queued=queued,
                running=sum(1 for worker in self._workers if worker.busy),
                parked=sum(1 for lane in lanes if lane.parked),
                threads=len(self._workers),
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


def _resolve_cancelled(task: Task) -> None:
    """Resolve a task that will not run as cancelled, waking every kind of waiter."""
    future = task.future
    if task.attempt == 0:  # never started: a plain cancellation
        if future.cancel() and future._state == CANCELLED:  # not notified yet
            future.set_running_or_notify_cancel()  # wakes wait() and as_completed()
    else:  # it ran and deferred, so the future is running and cannot cancel()
        _set_future(future, None, CancelledError("dispatcher was force-closed"))


def _resolve_failed(task: Task, error: BaseException) -> None:
    """Fail a task that will not run with ``error`` (a caller's cancel stands)."""
    if task.attempt == 0:
        try:
            if not task.future.set_running_or_notify_cancel():
                return
        except RuntimeError:  # resolved by the caller
            return
    _set_future(task.future, None, error)


# ------------------------------------------------------------------- fork

# Serializes rebuilding a dispatcher found in a forked child by _check_pid.
_fork_lock = threading.Lock()
_fork_hook_registered = False


def _register_fork_hook() -> None:
    """Rebuild every live dispatcher in a forked child (once per process)."""
    global _fork_hook_registered
    with _fork_lock:
        if _fork_hook_registered:
            return
        _fork_hook_registered = True
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)


def _after_fork_in_child() -> None:
    global _fork_lock
    _fork_lock = threading.Lock()
    for dispatcher in _exit.live_after_fork():
        if isinstance(dispatcher, Dispatcher):
            dispatcher._after_fork()
