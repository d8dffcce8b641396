"""The per-key ordered dispatcher: :class:`Dispatcher`.

A *lane* is the queue of one key (one chat). Tasks of one key run one at a
time in submission order; lanes run concurrently on a bounded pool of
worker threads, at most ``max_inflight`` tasks at once.

How it works. ``submit`` appends the task to its key's lane. A lane that did
not exist is created and scheduled: put on the ready queue of the
:class:`~outbound._handoff.Handoff` and handed to an idle worker, or, if the
pool may grow, to a new worker thread. A worker that owns a lane runs up to
``quantum`` of its tasks, then puts the lane at the back of the ready queue
if other work waits (fairness), or keeps going if none does. While a lane
is owned, ``submit`` only appends to it: a hot chat costs no thread wake-up
per message. Nor does a burst of new lanes while tasks are short: while
a worker that was woken has not looked at the ready queue yet, nobody else
is woken; that worker wakes the next one (or grows the pool) if it leaves
lanes behind, so short tasks are run by the threads already awake. Long
or blocking tasks wake a worker each, so that they all start at once (see
:mod:`outbound._handoff`). A lane whose queue is empty
is removed from the table at once, so an idle chat costs nothing and its
key is not kept alive. A task that raises :class:`~outbound.context.Defer`
goes back to the head of its lane and the lane is *parked* on the
:class:`~outbound._timer.Timer`; its worker serves other lanes meanwhile. The lifecycle is a
:class:`~outbound._lifecycle.Lifecycle` that only moves forward.

Locking. ``Dispatcher._lock`` guards the lifecycle, the creation of lanes,
the pool (workers, threads, permits taken), the pause, and the counters of
work not in a lane; each lane's own ``lock`` guards that lane (see
:class:`~outbound._lane.Lane`); the timer has a lock of its own, taken
after ``_lock`` and never held while calling out. Order: ``_lock``, then a
lane's lock, then the timer's. The hot paths take no global lock: a submit
to a lane that exists takes only that lane's lock, a worker takes the next
task of its lane with an atomic ``deque.popleft`` and the next ready lane
with another. Locks are held for O(1) bookkeeping (O(n) in ``force_close``
and ``stats``), never while user code runs: tasks, hooks and future
callbacks all run with no internal lock held (only a key's ``__hash__``
and ``__eq__`` run under one, as the lane table is looked up).

Each read made without the lock that guards it is marked "unlocked read"
where it happens, with what it may observe and why acting on it is safe;
``tests/test_interleavings.py`` pauses a thread at each of those points.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, NamedTuple, TypeVar

from typing_extensions import ParamSpec, Self

from . import _exit, _fork
from ._compat import TIMEOUT_MAX
from ._future import cancel_future, new_future, resolve_all, set_future
from ._handoff import LATE, PROGRESS, Handoff
from ._lane import Job, Lane, Task, Worker
from ._lifecycle import Lifecycle, State
from ._log import quiet
from ._run import execute
from ._timer import Timer
from .context import Defer, _seconds
from .errors import BrokenDispatcher, QueueFull
from .hooks import Hooks, call_hook

__all__ = ["Dispatcher", "DispatcherStats", "State"]


P = ParamSpec("P")
T = TypeVar("T")

_monotonic = time.monotonic
_getpid = os.getpid
_copy_context = contextvars.copy_context
_OPEN: Final = State.OPEN
# What _append_locked says when it did not append (the errors are built
# unlocked: QueueFull formats the key, which runs user code).
_FULL: Final = -1
_REFUSED: Final = -2
# Longest drain() sleeps before it looks again without being woken.
_DRAIN_RECHECK = 0.05
# Longest shutdown() waits for a pool thread a caller made to begin.
_START_GRACE = 1.0
#: A sentinel no deque of tasks ever holds (``iter(tasks.pop, _NEVER)``).
_NEVER: Final = object()


@dataclass(frozen=True, slots=True)
class DispatcherStats:
    """A snapshot of a dispatcher's counters, taken under its lock.

    ``lanes`` counts lanes that hold work (queued, running or parked);
    ``queued`` tasks accepted and not yet started (parked ones included);
    ``running`` tasks running now (a worker between two tasks is not
    counted); ``parked`` lanes waiting on the timer; ``threads`` live worker
    threads, ``idle_threads`` those waiting for work; ``paused_for`` seconds
    left of a :meth:`Dispatcher.pause`.
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


def _check_timeout(timeout: float | None) -> float | None:
    """``timeout`` as seconds (a float; an int past what one holds is ``inf``), or None."""
    return None if timeout is None else _seconds("timeout", timeout)


def _deadline(timeout: float | None) -> float:
    """The monotonic instant a wait of ``timeout`` ends (``inf``: never)."""
    return math.inf if timeout is None else _monotonic() + timeout


def _ended(thread: threading.Thread) -> bool:
    """Whether ``thread`` began and exited: not one not yet started, nor one
    starting (it has its ident, and is not alive yet), nor one running."""
    if thread.ident is None or thread.is_alive():
        return False
    try:
        thread.join(0)
    except RuntimeError:  # "cannot join thread before it is started": starting
        return False
    return not thread.is_alive()


def _bad_key(key: object, error: Exception) -> TypeError:
    """The error for a key whose ``__hash__`` or ``__eq__`` raised ``error``."""
    if isinstance(error, TypeError) and "unhashable" in str(error):
        return TypeError(f"key must be hashable, not {type(key).__name__}")
    return TypeError(f"key of type {type(key).__name__}: its __hash__ or __eq__ raised {error!r}")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, not {value!r}")
    return value


def _positive_seconds(name: str, value: object) -> float:
    """A number of seconds > 0; ``math.inf`` allowed (never)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not value > 0:  # NaN fails too
        raise ValueError(f"{name} must be a number of seconds > 0, not {value!r}")
    return _seconds(name, value)


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
    - ``idle_timeout``: seconds an idle worker thread waits before it retires
      (``math.inf``: never).
    - ``thread_name_prefix``, ``initializer``, ``initargs``: as for
      ``ThreadPoolExecutor``: ``initializer(*initargs)`` runs once in each
      worker thread, before its first task; an initializer that raises
      breaks the dispatcher (:class:`~outbound.errors.BrokenDispatcher`).
      It runs in a fresh copy of the ``contextvars`` context the dispatcher
      was made in (whichever thread starts the worker); tasks run in a
      copy of their submitter's, so a ``ContextVar`` the initializer sets
      is not seen by tasks: keep per-thread state in ``threading.local``.
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
        self._send_timeout: Final = _positive_seconds("send_timeout", send_timeout)
        self._quantum: Final = _positive_int("quantum", quantum)
        # Waits are cut at TIMEOUT_MAX (292 years on Linux): longer is never.
        self._idle_timeout: Final = min(
            _positive_seconds("idle_timeout", idle_timeout), TIMEOUT_MAX
        )
        if hooks is not None and not isinstance(hooks, Hooks):
            raise TypeError(f"hooks must be an outbound.Hooks or None, not {type(hooks).__name__}")
        if not isinstance(thread_name_prefix, str):
            raise TypeError("thread_name_prefix must be a str")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be callable or None")
        if exit_timeout is not None:
            exit_timeout = _positive_seconds("exit_timeout", exit_timeout)
        self._hooks: Final = hooks if hooks is not None else Hooks()
        # Per thread: how deep it is in on_queued/on_rejected, which run in
        # the submitting thread (drain() there would block its submit).
        self._in_submit_hook: Final = threading.local()
        self._thread_name_prefix: Final = thread_name_prefix or "outbound"
        self._initializer: Final = initializer
        self._initargs: Final = tuple(initargs)
        # The initializer runs in a copy of this, in each worker thread: the
        # same context whichever thread happens to start the worker.
        self._init_context: Final = _copy_context() if initializer is not None else None
        self.exit_timeout: Final = exit_timeout

        self._reset(Lifecycle(), cancelled=False)
        if not _exit.register(self):
            # Made while the interpreter exits: nobody would wait for its
            # threads, so accepted work could be lost. Refuse all of it.
            self._life = Lifecycle(
                State.CLOSED,
                closed_reason="made while the interpreter was exiting, so it would not be "
                "waited for",
            )
        _register_fork_hook()

    def _reset(self, life: Lifecycle, *, cancelled: bool) -> None:
        """Build the runtime state: locks, tables, counters. No thread is started."""
        # The concurrency cap is the size of _workers (below): a worker is
        # added only while there are fewer than max_inflight, under _lock,
        # and leaves as its thread exits; a thread runs one task at a time,
        # so at most max_inflight tasks run. Nothing ever waits for room:
        # work is only handed to threads that exist, so no worker can sit on
        # a lane waiting for one, and a parked lane holds no thread. (A
        # semaphore here could be left locked for good by a Ctrl-C landing
        # inside its acquire.)

        # Guards the fields marked "guarded" below (see the module
        # docstring for the lanes). Waiters: drain()/shutdown() on _drained.
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        # Set by force_close(); TaskContext.cancelled reads it.
        self._cancel = threading.Event()
        if cancelled:
            self._cancel.set()

        # guarded: lifecycle, only moves forward (see State). Unlocked reads
        # are marked where they happen.
        self._life = life
        # key -> lane, exactly the lanes that hold work. Entries are added
        # under _lock and removed by the lane's retirer under the lane's
        # lock; read anywhere (dict.get is atomic) as a hint that the lane's
        # own lock then confirms. Replaced by a new dict only under _lock,
        # and only when empty.
        self._lanes: dict[Hashable, Lane] = {}
        # Dead lanes whose entry in _lanes could not be removed (see
        # _orphan). Appended to under a lane's lock (an atomic list call);
        # emptied, with _lanes replaced, under _lock.
        self._orphans: list[Lane] = []
        self._orphans_unlogged: list[str] = []
        # Ready jobs and idle workers. Jobs are pushed under _lock and taken
        # by workers without it; idle workers list themselves without it
        # (see _handoff for why no wake-up is lost).
        self._handoff: Handoff[Job, Worker] = Handoff()
        # guarded: the workers of live threads (started and not yet returned).
        self._workers: set[Worker] = set()
        # guarded: workers _grow_locked made (in _workers) whose thread no
        # caller has started yet. A Ctrl-C landing as _grow_locked or a
        # caller of it returned leaves some here, with the jobs they took:
        # the interrupted submit, a later submit or drain() starts them.
        self._unstarted: set[Worker] = set()
        # guarded: every thread this dispatcher started that may be alive;
        # shutdown() joins them. Pruned when a thread is added.
        self._threads: list[threading.Thread] = []
        # guarded: shutdown()s joining the threads, waiting for those not yet
        # started too (woken as each starts). Read unlocked by the starters.
        self._joining = 0
        # guarded: a worker thread could not be started and no worker is
        # left to run the ready jobs; the next submit, drain() or timer
        # firing tries again. Read unlocked by submit as a hint.
        self._stranded = False
        self._thread_ids = itertools.count(1)
        # guarded: keyless tasks (KeyedExecutor.submit) accepted and not yet
        # resolved.
        self._keyless = 0
        # guarded: threads resolving futures taken out of the dispatcher
        # (force_close, cancel_futures, a broken pool), outside the lock, each
        # with what it took out and how it resolves it: a force_close or
        # cancel_futures made meanwhile in another thread resolves what they
        # have not reached yet (see _help_resolve). The dispatcher is drained
        # when this is empty, _keyless is 0 and _lanes is empty (a lane stays
        # in the table until its last task finished), so shutdown() is True
        # only once every future is done.
        self._resolvers: list[_Resolver] = []
        # Parked lanes, deferred keyless tasks and pause ends (None).
        self._timer: Timer[Job | None] = Timer(
            self._fire,
            name=f"{self._thread_name_prefix}-timer",
            idle_timeout=self._idle_timeout,
        )
        # guarded: no lane starts before this monotonic instant (0: no
        # pause). Unlocked reads are marked where they happen.
        self._paused_until = 0.0
        # guarded: the end of a pause the timer will fire (<= _paused_until).
        self._pause_armed = 0.0
        # guarded: how many times queued tasks were taken out (force_close,
        # cancel_futures); read without the lock by a worker that gives a job
        # back (see _give_back).
        self._drops = 0
        # guarded: threads in drain(); read without the lock as a hint.
        self._drain_waiters = 0
        # The process that owns the threads and locks above (see _after_fork).
        self._pid = _getpid()

    def _after_fork(self) -> None:
        """In a forked child: start afresh, empty, with new locks and no threads.

        The parent's threads do not exist in the child, and any lock may
        have been held by one of them at the fork, so nothing of the
        runtime state is reused. The parent's queued tasks stay the
        parent's: the child neither runs nor resolves its copies of them.
        An open dispatcher stays open; a closing one is closed.
        """
        self._reset(self._life.after_fork(), cancelled=self._cancel.is_set())

    def _check_pid(self) -> None:
        """Rebuild after a fork that bypassed ``os.register_at_fork`` hooks."""
        if self._pid != _getpid():
            with _fork_lock:
                if self._pid != _getpid():
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
        ``hooks.on_rejected`` first; ``TypeError`` if ``key``'s ``__hash__``
        or ``__eq__`` raises; the error of ``Thread.start`` (say
        ``RuntimeError("can't start new thread")``) if no worker thread can
        be started and none is running. If ``submit`` raises, the task never
        runs, also for a ``KeyboardInterrupt`` from ``hooks.on_queued`` or
        landing inside it (the task's future is then cancelled); one that
        lands after the task started is logged, and the future returned.
        Never blocks. The task runs in a copy of the caller's ``contextvars``
        context. ``key``'s ``__hash__`` and
        ``__eq__`` may run under an internal lock: they must not call back
        into the dispatcher (ints, strings and tuples of them are the norm).
        """
        if self._pid != _getpid():
            self._check_pid()
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        try:
            # Unlocked read: the table may be changing. A lane found here is
            # confirmed live under its own lock below (a retired lane is
            # marked dead in the same step that removes it); a miss, or a
            # dead lane, takes the slow path, which looks again under _lock.
            lane = self._lanes.get(key)
        except Exception as exc:
            raise _bad_key(key, exc) from exc
        future: Future[T] = new_future()
        task = Task(future, fn, args, kwargs, _copy_context(), _monotonic())
        # Tasks waiting in the lane with this one; > 0 exactly when appended.
        queue_len = 0
        # Workers decided under _lock, to start once it is released.
        start: list[Worker] | None = None
        # The lane this submit would make for the key (the slow path).
        new_lane: Lane | None = None
        try:
            if lane is not None:
                # Fast path: the key has a lane; only its lock is needed. This
                # is _append_locked, inlined: the hottest lines of the dispatcher.
                with lane.lock:
                    if not lane.dead:
                        if self._life.state is not _OPEN:
                            queue_len = _REFUSED
                        else:
                            tasks = lane.tasks
                            waiting = len(tasks) - lane.held
                            if waiting >= self._queue_size:
                                queue_len = _FULL
                            else:
                                tasks.append(task)
                                queue_len = waiting + 1
            if queue_len == 0:
                # Slow path: no lane, or it just retired. Lanes are created
                # only under _lock, and a lane retires only with its queue
                # empty and its lock held, leaving the table in the same
                # step. So a submit either finds a live lane (whose owner
                # will see the new task before it can retire the lane) or
                # creates the only lane of the key: a lane never has two
                # owners.
                new_lane = Lane(key)
                new_lane.tasks.append(task)
                with self._lock:
                    if self._life.state is not _OPEN:
                        queue_len = _REFUSED
                    else:
                        try:
                            lane = self._lanes.get(key)
                            if lane is not None:
                                with lane.lock:
                                    if not lane.dead:
                                        queue_len = self._append_locked(lane, task)
                            if queue_len == 0:
                                if lane is not None and lane.orphan:
                                    self._orphans.remove(lane)  # its entry is replaced
                                self._lanes[key] = new_lane
                        except Exception as exc:
                            raise _bad_key(key, exc) from exc
                        if queue_len == 0:
                            lane = new_lane
                            queue_len = 1
                            start = self._schedule_locked(new_lane)
            if queue_len < 0:
                error: BaseException
                if queue_len == _FULL:
                    error = QueueFull(key, self._queue_size)
                else:
                    with self._lock:
                        error = self._life.closed_error()
                if self._hooks.on_rejected is not None:
                    self._submit_hook("on_rejected", self._hooks.on_rejected, key, error)
                raise error
            # Unlocked read of _stranded: set only after a worker could not
            # be started and none is left. A stale False (a start failing at
            # this instant, for the lane this task just joined) leaves the
            # task queued for the next submit, drain() or timer firing, each
            # of which starts a thread again; a stale True costs one lock.
            # Unlocked read of _unstarted too: another caller's workers,
            # which it is about to start, or which a Ctrl-C left unstarted.
            if start or self._stranded or self._unstarted:
                # (start is cleared once they run: a Ctrl-C landing as this
                # call begins leaves them for the handler below)
                failed = self._start_workers(start) if start else self._restart_stranded()
                start = None
                if failed is not None:
                    self._refuse_if_stranded(lane, task, failed)
            if self._hooks.on_queued is not None:
                # call_hook raises only a Ctrl-C in the main thread.
                self._submit_hook("on_queued", self._hooks.on_queued, key, queue_len)
        except BaseException:
            # Interrupted in wake_one, maybe after it set waking: clear it
            # (a wake-up more at worst, see _handoff).
            self._handoff.waking = False
            # A refusal, or a Ctrl-C landing anywhere (before the append,
            # after it, in on_queued): submit may raise only for a task that
            # will not run. A lane it placed in the table gets an owner (a
            # Ctrl-C may have landed between the two); what was decided is
            # started; then the task is taken back by cancelling its future,
            # whether or not it was queued, unless it already started.
            rescued = self._rescue(key, new_lane) if new_lane is not None else None
            if start:
                self._start_workers(start)
            if rescued:
                self._start_workers(rescued)
            if self._unstarted:  # made, then lost to the Ctrl-C before start was set
                self._restart_stranded()
            if future.cancel():
                raise
            quiet.error("outbound: submit interrupted after its task started", exc_info=True)
        return future

    def _submit_hook(self, name: str, hook: Callable[..., object], *args: object) -> None:
        """Call a hook that runs in the submitting thread (see call_hook), marked as one
        of this dispatcher's hooks while it runs: drain() and shutdown() refuse there."""
        local = self._in_submit_hook
        depth = getattr(local, "depth", 0)
        try:
            local.depth = depth + 1
            call_hook(name, hook, *args)
        finally:
            local.depth = depth  # (restored, not decremented: a Ctrl-C may land anywhere)

    def _rescue(self, key: Hashable, lane: Lane) -> list[Worker] | None:
        """See that ``lane``, if a submit placed it in the table, has an owner:
        after a Ctrl-C that landed between placing it and queueing it (or
        waking a worker for it). Returns new workers to start, as
        :meth:`_schedule_locked` does.

        Whether the interrupted push happened cannot be told (a worker may
        have taken the lane from the ready queue and not yet marked it
        active): a lane not seen active, parked or in the ready queue is
        queued again, and a worker that takes a lane another already owns
        leaves it (see _run_lane).
        """
        with self._lock:
            try:
                placed = self._lanes.get(key) is lane
            except Exception:  # the key's __hash__ or __eq__: it was never placed
                return None
            if not placed:
                return None
            with lane.lock:
                if lane.dead or lane.active or lane.parked:
                    return None
            handoff = self._handoff
            # (A copy, made at once: workers take from the queue without this
            # lock, and a take while it was iterated raised RuntimeError.)
            if any(job is lane for job in handoff.ready.copy()):
                if self._stranded:
                    return None  # no thread could start: the next submit or drain() tries
            else:
                handoff.push(lane)
            if self._paused_until and not self._pause_over_locked():
                self._arm_pause_locked()
                return None
            return self._wake_for_ready_locked(chain=False)

    def _refuse_if_stranded(self, lane: Lane | None, task: Task, error: BaseException) -> None:
        """A worker could not be started for work this submit queued: raise ``error``
        with the task taken back, unless a live worker will run it.

        Taken back means its future is cancelled (so it never starts) and,
        where no thread owns its lane, it is removed, so that the lane does
        not outlive it. A Ctrl-C is always raised, after taking the task back.
        """
        if not isinstance(error, KeyboardInterrupt):
            with self._lock:
                if not self._stranded:
                    return  # a live worker takes the job that came back
        if not task.future.cancel():
            if isinstance(error, KeyboardInterrupt):
                quiet.error("outbound: submit interrupted after its task started")
            return  # it started after all: accepted
        if lane is not None:
            emptied = False
            with lane.lock:
                if not lane.active and not lane.dead:
                    try:
                        lane.tasks.remove(task)
                    except ValueError:  # not there any more
                        pass
                    if not lane.tasks and not lane.parked:
                        emptied = self._retire_locked(lane)
            self._report_orphans()
            if emptied:
                self._lanes_emptied()
        raise error

    def _append_locked(self, lane: Lane, task: Task) -> int:
        """Append ``task`` to a live lane; ``lane.lock`` held.

        Returns the number of tasks waiting in the lane with it (>= 1), or
        ``_FULL`` or ``_REFUSED``. The count is known from the append itself:
        the lane's owner pops without the lock, so a length read after the
        append may already miss the new task. The state is read under the
        lane's lock: ``force_close`` changes it before it empties the lanes
        under their locks, so no task can slip into a lane after
        ``force_close`` emptied it.
        """
        if self._life.state is not _OPEN:
            return _REFUSED
        tasks = lane.tasks
        # may count one the owner is taking: a full lane refuses early
        waiting = len(tasks) - lane.held
        if waiting >= self._queue_size:
            return _FULL
        tasks.append(task)
        return waiting + 1

    def _submit_keyless(self, fn: Callable[..., T], args: Any, kwargs: Any) -> Future[T]:
        """Queue a task that belongs to no lane (KeyedExecutor.submit): unordered."""
        self._check_pid()
        future: Future[T] = new_future()
        task = Task(future, fn, args, kwargs, _copy_context(), _monotonic())
        start: list[Worker] | None = None
        queued = False
        woken = False
        try:
            with self._lock:
                if self._life.state is not _OPEN:
                    raise self._life.closed_error()
                # Counted, then queued, with no call between (Python checks
                # for a signal once a call returned, not before it runs): a
                # task counted is one pushed. (Pushed through Handoff.push,
                # a Ctrl-C as it returned left a task pushed and not counted:
                # run, it counted out one too many, and no drain ended.)
                self._keyless += 1
                queued = True
                self._handoff.ready.append(task)
                start = self._wake_or_grow_locked()
                woken = True
            # Unlocked reads of _stranded and _unstarted: see submit.
            if start or self._stranded or self._unstarted:
                failed = self._start_workers(start) if start else self._restart_stranded()
                start = None  # (see submit)
                if failed is not None:
                    self._refuse_if_stranded(None, task, failed)
        except BaseException:
            self._handoff.waking = False  # as in submit
            if not queued:
                raise
            # Interrupted after queueing: see that a worker will take it (it
            # resolves it, cancelled, and counts it out), start what was
            # decided, and take the task back by cancelling its future.
            if not woken:
                with self._lock:
                    start = self._wake_or_grow_locked()
            if start:
                self._start_workers(start)
            if self._unstarted:  # made, then lost to the Ctrl-C before start was set
                self._restart_stranded()
            if future.cancel():
                raise
            return future
        return future

    # -------------------------------------------------------------- scheduling

    def _schedule_locked(self, job: Job) -> list[Worker] | None:
        """Queue ``job`` and wake an idle worker for it, or grow the pool if it may.

        Returns new workers for the caller to start once it released _lock.
        """
        self._handoff.push(job)
        return self._wake_or_grow_locked()

    def _wake_or_grow_locked(self) -> list[Worker] | None:
        """For a job just queued: wake an idle worker, or grow the pool if it may
        (see :meth:`_schedule_locked`)."""
        handoff = self._handoff
        if self._paused_until and not self._pause_over_locked():
            self._arm_pause_locked()
            return None  # the pause's end wakes workers
        if handoff.wake_one():
            # It takes a job from the ready queue itself; a worker woken
            # earlier that has not looked yet takes this one or passes the
            # wake-up on (see Handoff.wake_one).
            return None
        return self._grow_locked()

    def _dispatch_locked(self) -> list[Worker] | None:
        """Wake an idle worker per queued job, then grow (after a pause or an unpark).

        While tasks are short, one wake-up: the woken worker passes it on
        while it sees jobs left (see _pass_on), waking the others or growing
        the pool in turn.
        """
        if self._paused_until and not self._pause_over_locked():
            return None
        return self._wake_for_ready_locked(chain=True)

    def _wake_for_ready_locked(self, *, chain: bool, hop: bool = False) -> list[Worker] | None:
        """Wake an idle worker per ready job (``chain``: one, while tasks are short),
        then grow for the jobs beyond them. ``hop``: a worker passes a wake-up on."""
        handoff = self._handoff
        woken = 0
        for _ in range(len(handoff.ready)):
            if not handoff.wake_one(chain=chain, hop=hop):
                break
            woken += 1
        # The woken workers have not taken their jobs yet: grow only for
        # the jobs beyond them.
        return self._grow_locked(len(handoff.ready) - woken)

    def _grow_locked(self, most: int | None = None) -> list[Worker] | None:
        """Start a worker per queued job (at most ``most``) while fewer than
        ``max_inflight`` run. A Ctrl-C landing here gives every job it took
        back to the head of the ready queue, in order, its worker unlisted."""
        ready = self._handoff.ready
        workers = self._workers
        new: list[Worker] = []
        taken: list[Job] = []
        try:
            while (most is None or most > 0) and len(workers) < self._max_inflight:
                if most is not None:
                    most -= 1
                # The look and the removal, with no call nor backward jump
                # between them: no signal and no other thread (workers take
                # without the lock) can come in between, and the job is
                # listed as taken before Python next checks for either. (A
                # Ctrl-C right after a popleft() returned lost the job:
                # another key's lane, with its accepted tasks.)
                try:
                    job = ready[0]
                except IndexError:  # (a worker took the last one)
                    break
                del ready[0]
                taken.append(job)
                self._handoff.taken += 1
                worker = Worker(job)
                new.append(worker)
                workers.add(worker)
                self._unstarted.add(worker)
        except BaseException:
            for worker in new:
                workers.discard(worker)  # (never started: no thread claims it)
                self._unstarted.discard(worker)
            ready.extendleft(reversed(taken))
            if taken:
                # No thread was started for them: the next submit or drain()
                # grows the pool again (the interrupted submit's own lane
                # is seen to by its handler).
                self._stranded = True
            raise
        return new or None

    def _paused_locked(self) -> bool:
        """A pause is in force: no job starts, and no thread is started for one (the
        timer wakes or grows the pool at its end). _lock held."""
        return bool(self._paused_until) and not self._pause_over_locked()

    def _pause_over_locked(self) -> bool:
        if _monotonic() >= self._paused_until:
            self._paused_until = 0.0
            return True
        return False

    def _start_workers(self, workers: list[Worker]) -> BaseException | None:
        """Start a thread for each of ``workers`` (made by ``_grow_locked``).

        Exception-safe: if building or starting a thread raises (``can't
        start new thread``, ``MemoryError``, a Ctrl-C landing in
        ``Thread.start``), every worker not yet running is given up (its
        permit back, its job back at the head of the ready queue, an idle
        worker woken for it) and the error is logged and returned, not
        raised. A thread that did begin but had not yet claimed its worker
        finds it given up and returns at once, so each permit and job has
        exactly one owner. Called with no lock held.
        """
        i = 0
        try:
            for worker in workers:
                name = f"{self._thread_name_prefix}-worker-{next(self._thread_ids)}"
                thread = threading.Thread(target=self._work, args=(worker,), name=name, daemon=True)
                with self._lock:
                    # Taken in one step under the lock: another caller may
                    # start the same workers at once (_restart_stranded
                    # starting those a Ctrl-C left), or did (a caller
                    # interrupted after this returned starts them again),
                    # or they were given up.
                    fresh = worker.thread is None and worker.claimed is None
                    if fresh:
                        worker.thread = thread
                        self._unstarted.discard(worker)
                        self._track_thread_locked(thread)
                if fresh:
                    thread.start()
                    if self._joining:  # (unlocked read: a shutdown waits for the start)
                        with self._lock:
                            self._drained.notify_all()
                i += 1
        except BaseException as exc:
            self._give_up(workers[i:])
            quiet.error("outbound: cannot start a worker thread: %r", exc)
            return exc
        return None

    def _give_up(self, workers: list[Worker]) -> None:
        """Undo ``_grow_locked`` for the workers whose thread did not claim them."""
        with self._lock:
            handoff = self._handoff
            returned = 0
            for worker in workers:
                if worker.claimed is not None:
                    continue  # its thread runs: it owns its permit and job
                worker.claimed = False
                self._workers.discard(worker)
                self._unstarted.discard(worker)
                thread, worker.thread = worker.thread, None
                # Only one that never began: one that did (a Ctrl-C as its
                # start returned) runs, finds itself given up, and exits;
                # shutdown() waits for it.
                if thread is not None and thread.ident is None and thread in self._threads:
                    self._threads.remove(thread)
                    if self._joining:
                        self._drained.notify_all()
                if worker.job is not None:
                    handoff.push_front(worker.job)
                    worker.job = None
                    returned += 1
            # Push, then wake (see _handoff): an idle worker takes what came back.
            for _ in range(returned):
                if not handoff.wake_one():
                    break
            if self._workers:
                self._stranded = False
            elif handoff.ready:
                # No thread to run the ready jobs: the next submit, drain()
                # or timer firing tries to start one again.
                self._stranded = True

    def _track_thread_locked(self, thread: threading.Thread) -> None:
        """Remember ``thread`` for shutdown(); forget the ones that exited, and those
        never begun that no starter will start (given up)."""
        self._threads = [t for t in self._threads if not _ended(t) and self._to_begin_locked(t)]
        self._threads.append(thread)

    def _restart_stranded(self) -> BaseException | None:
        """If queued work has no thread (a start failed), try to start one again.

        The timer's thread too: what it holds (a deferred lane, a pause's
        end) waits for it. And workers made that no caller started (a
        Ctrl-C landed between): started here, once (see _start_workers).
        """
        with self._lock:
            start = [w for w in self._unstarted if w.thread is None and w.claimed is None]
            if self._stranded and not self._paused_locked():
                # Cleared once grown: a Ctrl-C in the growing leaves it set,
                # for the next submit or drain() to grow again.
                grown = self._grow_locked()
                self._stranded = False
                start += grown or ()
            if self._timer.stranded:
                thread = self._timer.restart()
                if thread is not None:
                    self._track_thread_locked(thread)
                elif self._timer.stranded:
                    self._stranded = True  # the next submit tries again
        self._timer.report()
        if not start:
            return None
        try:
            return self._start_workers(start)
        except BaseException:  # a Ctrl-C as it began: the jobs go back, to be started again
            self._give_up(start)
            raise

    # ------------------------------------------------------------------ worker

    def _work(self, worker: Worker) -> None:
        """Body of a worker thread. It holds one permit for its whole life."""
        with self._lock:
            if worker.claimed is not None or worker.thread is not threading.current_thread():
                # Its starter gave it up (the permit and job are not ours), or
                # it is another thread's: one worker never runs twice.
                return
            worker.claimed = True
        try:
            if self._initializer is not None:
                try:
                    assert self._init_context is not None
                    self._init_context.copy().run(self._initializer, *self._initargs)
                except BaseException:
                    quiet.critical("outbound: worker initializer raised", exc_info=True)
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
                if worker.born != _fork.forks:
                    return  # forked by its task: the child's pool is not its own
                job = self._next_job(worker)
        finally:
            if worker.born == _fork.forks:
                # Under _lock, with the grow check: a job pushed after this
                # worker left _workers but before its permit came back must
                # not strand.
                with self._lock:
                    self._workers.discard(worker)
                    start = (
                        self._grow_locked()
                        if self._handoff.ready
                        and not self._should_exit_locked()
                        and not self._paused_locked()
                        else None
                    )
                if start:
                    self._start_workers(start)  # an error is logged; the work stays queued

    def _next_job(self, worker: Worker) -> Job | None:
        """Take the next ready job, or idle until woken to look again; None: retire.

        While the dispatcher is open and not paused this takes no lock (see
        :mod:`outbound._handoff`) unless a woken worker must grow the pool;
        otherwise the checks and the listing are made under _lock, where the
        last worker out of a closing pool and the end of a pause wake the
        idle ones.

        A worker that was woken (or may have been: a second look that found
        a job) and leaves jobs behind in the ready queue wakes the next
        worker, or grows the pool (:meth:`_pass_on`): schedulers wake nobody
        while a woken worker has not looked yet (see
        :meth:`Handoff.wake_one`).
        """
        handoff = self._handoff
        lock = self._lock
        woken = False
        while True:
            # Unlocked read of _paused_until: a pause that began an instant
            # ago may be missed; the job taken is then given back if a pause
            # is in force after all (it may have come after the pause began:
            # a submit, a Defer(scope="all")). A pause that just ended may
            # still be seen, and the locked path below then checks it again.
            if not self._paused_until:
                drops = self._drops
                job = handoff.take()
                if job is not None and not (self._paused_until and self._give_back(job, drops)):
                    if woken:
                        self._pass_on()
                    return job
            # Unlocked reads of the state and the pause: a change missed here
            # is seen after listing (below), or under the lock.
            if self._life.state is not _OPEN or self._paused_until:
                with lock:
                    if self._should_exit_locked():
                        self._workers.discard(worker)
                        return None
                    job = None
                    if not (self._paused_until and not self._pause_over_locked()):
                        job = handoff.take()
                    if job is None:
                        self._unchain_locked()
                        if not self._has_lanes_locked():
                            self._lanes = {}  # give back what a burst of keys grew it to
                            self._orphans = []
                        handoff.idle.append(worker)
                if job is not None:
                    if woken:
                        self._pass_on()
                    return job
            else:
                drops = self._drops
                job = handoff.list_idle(worker)
                if job is not None:
                    # It may have consumed a wake-up (see Handoff.unlist).
                    if not (self._paused_until and self._give_back(job, drops)):
                        self._pass_on()
                        return job
                    woken = True  # passed on with the next job it takes
                    continue
                if self._life.state is not _OPEN or self._paused_until:
                    handoff.unlist(worker)  # look again, under the lock
                    woken = True  # it may have consumed a wake-up
                    continue
                if handoff.chained:  # unlocked read: a hint (see _unchain_locked)
                    with lock:
                        self._unchain_locked()
            if handoff.sleep(worker, self._idle_timeout):
                woken = True
                continue  # woken: look again
            with lock:
                if handoff.ready and not self._should_exit_locked():
                    continue
                # Idle too long: retire. Work scheduled later gets a new thread.
                if not self._has_lanes_locked():
                    self._lanes = {}  # give back what a burst of keys grew it to
                    self._orphans = []
                self._workers.discard(worker)
                return None

    def _give_back(self, job: Job, drops: int) -> bool:
        """Put back first in line ``job``, taken after an unlocked read saw no pause,
        if a pause is in force now: it may have come after the pause began, and
        must not start during it. False (run it, as if taken just before the
        pause) if the pause is over, or queued tasks were taken out since
        ``drops`` was read (force_close: it then sees ``cancelled``;
        cancel_futures: it was not waiting any more)."""
        with self._lock:
            if self._drops != drops or not self._paused_until or self._pause_over_locked():
                return False
            self._handoff.push_front(job)
            return True

    def _unchain_locked(self) -> None:
        """Clear ``Handoff.chained`` if no job is ready: every job a wake-up was left
        for has been taken (schedulers push, and set it, under _lock too)."""
        handoff = self._handoff
        if not handoff.ready:
            handoff.chained = False

    def _pass_on(self) -> None:
        """A woken worker took a job: if it sees others ready and ``chained`` set (a
        wake-up may have been left to it), wake the next worker, or grow.

        What a scheduler that found a woken worker pending skipped (see
        :meth:`Handoff.wake_one`), done once its job is sure to be seen:
        the caller read the ready queue not empty (an unlocked read) after
        it took its own job. A job pushed after that read was pushed after
        this worker's wake-up was consumed, so its scheduler wakes a worker
        itself; a read that is stale the other way (a busy worker took the
        jobs meanwhile) costs one needless wake-up, or an empty look under
        the lock.
        """
        handoff = self._handoff
        # Unlocked reads: a woken worker a wake-up was left to sees both set
        # (see the module of _handoff); a stale "set" costs a look under _lock.
        if not (handoff.ready and handoff.chained):
            return
        # Unlocked read of woke_at: the last wake-up, this worker's in a chain
        # (one at a time), or the last job a scheduler left to it if a
        # scheduler woke it (see Handoff.hop); a later one only makes it look
        # less late.
        late = (
            _monotonic() - handoff.woke_at > LATE and handoff.taken - handoff.woke_taken < PROGRESS
        )
        if late:
            # The chain is slow (the GIL, the OS): one at a time, a burst of
            # blocking tasks would pay this per task. Wake for every job left.
            handoff.fast_until = 0.0
        elif handoff.wake_one(hop=True):
            return
        with self._lock:
            if not handoff.ready or not handoff.chained:
                return  # taken meanwhile, or every job left has a worker
            if self._paused_until and not self._pause_over_locked():
                return  # the pause's end wakes workers
            start = self._wake_for_ready_locked(chain=not late, hop=True)
            if late:
                handoff.chained = False  # every job left has a worker woken or grown
        if start:
            self._start_workers(start)  # an error is logged; the work stays queued

    def _should_exit_locked(self) -> bool:
        state = self._life.state
        if state is _OPEN:
            return False
        # _has_lanes_locked, inlined: a closing pool asks this for every job.
        lanes = self._lanes
        orphans = self._orphans
        has_lanes = bool(lanes) and (not orphans or len(lanes) > len(orphans))
        return state is State.BROKEN or (not has_lanes and not self._keyless)

    def _has_lanes_locked(self) -> bool:
        """Whether a lane holds work (orphaned entries are dead: see _orphan)."""
        lanes = self._lanes
        orphans = self._orphans
        return bool(lanes) and (not orphans or len(lanes) > len(orphans))

    def _run_lane(self, worker: Worker, lane: Lane) -> None:
        """Own ``lane`` for one turn: up to ``quantum`` tasks, or more if nothing waits."""
        try:
            with lane.lock:
                if lane.dead:
                    return  # retired by force_close while it waited in the ready queue
                if lane.active or lane.parked:
                    # Queued again by a submit that a Ctrl-C interrupted, which
                    # could not tell whether its first push happened: the lane
                    # has its owner (see _rescue).
                    return
                if not lane.tasks:
                    emptied = self._retire_locked(lane)
                else:
                    emptied = False
                    lane.active = True
                    lane.held = 0
                    task = lane.tasks.popleft()
                    queue_len = len(lane.tasks)
            if emptied:
                self._lanes_emptied()
            if not lane.active:
                self._report_orphans()
                return
            budget = self._quantum
            tasks = lane.tasks
            ready = self._handoff.ready
            while True:
                deferred = execute(
                    worker,
                    lane.key,
                    task,
                    queue_len,
                    self._hooks,
                    self._send_timeout,
                    self._cancel,
                    self._handoff,
                )
                budget -= 1
                if worker.born != _fork.forks:
                    # The task forked, and this is the child: the lane is the
                    # parent's (its rebuilt dispatcher has none of its tasks).
                    return
                if deferred is not None and self._park(lane, task, deferred):
                    return
                # Unlocked reads of the pause (see _next_job: a task taken as
                # one began goes back) and of the ready queue (fairness only:
                # a lane seen alone may run one more quantum, a lane seen not
                # alone yields a turn early).
                if not self._paused_until and (budget > 0 or not ready):
                    # The owner takes from the head without the lock (see
                    # Lane): an IndexError only means "look under the lock".
                    drops = self._drops
                    try:
                        task = tasks.popleft()
                    except IndexError:
                        pass
                    else:
                        if not (self._paused_until and self._hand_back(lane, task, drops)):
                            queue_len = len(tasks)
                            if budget <= 0:
                                budget = self._quantum
                            continue
                with lane.lock:
                    if tasks and not self._paused_until and (budget > 0 or not ready):
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
                    self._report_orphans()
                    if emptied:
                        self._lanes_emptied()
                    return
                start = None
                with self._lock:
                    if self._paused_until and not self._pause_over_locked():
                        self._handoff.push_front(lane)  # first in line when the pause ends
                    else:
                        start = self._schedule_locked(lane)  # fairness: behind the others
                self._timer.report()
                if start:
                    self._start_workers(start)
                return
        finally:
            # A failed future's traceback reaches this frame (f_back of execute).
            lane = task = tasks = None  # type: ignore[assignment]

    def _hand_back(self, lane: Lane, task: Task, drops: int) -> bool:
        """Put ``task``, which its lane's owner took as a pause began, back at the head
        of ``lane`` (the owner then yields under the locks, and the lane waits for
        the pause's end). False (run it) if queued tasks were taken out since
        ``drops`` was read: force_close or cancel_futures took the rest of the
        lane, or will, and this one was no longer waiting (after force_close it
        sees ``cancelled``). Under the lane's lock, which a drop takes for each
        lane after counting itself: a drop not yet counted has yet to reach it."""
        with lane.lock:
            if self._drops != drops or lane.dead:
                return False
            lane.tasks.appendleft(task)
            return True

    def _run_keyless(self, worker: Worker, task: Task) -> None:
        deferred = execute(
            worker, None, task, 0, self._hooks, self._send_timeout, self._cancel, self._handoff
        )
        if worker.born != _fork.forks:
            return  # the task forked, and this is the child: not counted here (see _run_lane)
        try:
            self._finish_keyless(task, deferred)
            self._timer.report()
        finally:
            task = deferred = None  # type: ignore[assignment]

    def _finish_keyless(self, task: Task, deferred: Defer | None) -> None:
        cancelled = False
        with self._lock:
            if deferred is not None:
                if not self._cancel.is_set():
                    if deferred.scope == "all":
                        self._pause_locked(deferred.delay)
                        self._handoff.push_front(task)
                    else:
                        self._add_timer_locked(_monotonic() + deferred.delay, task)
                    return
                cancelled = True
            if not cancelled:
                self._keyless -= 1
                self._maybe_drained_locked()
        if cancelled:
            try:
                cancel_future(task.future)
            finally:
                with self._lock:
                    self._keyless -= 1
                    self._maybe_drained_locked()

    def _park(self, lane: Lane, task: Task, defer: Defer) -> bool:
        """Put a deferred task back at its lane's head and park the lane per ``defer``.

        Returns False if ``force_close`` came meanwhile: then the task is
        resolved as cancelled instead and the caller goes on with the lane.
        """
        with self._lock:
            parked = not self._cancel.is_set()
            if parked:
                with lane.lock:
                    lane.tasks.appendleft(task)
                    lane.held = 1
                    lane.active = False
                    lane.parked = defer.scope == "lane"
                if defer.scope == "all":
                    self._pause_locked(defer.delay)
                    self._handoff.push_front(lane)
                else:
                    self._add_timer_locked(_monotonic() + defer.delay, lane)
        if parked:
            self._timer.report()
            return True
        cancel_future(task.future)
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
        # Unlocked reads of the table's size and of _orphans (_lock is not
        # held): only a hint for the caller, which then checks under _lock
        # (_lanes_emptied). Orphans are counted only while their entry is in
        # the table, so the hint can say "not empty" wrongly (a retire
        # elsewhere at this instant: that retirer sees it empty) but never
        # "empty" while a live lane is in the table.
        removed = False
        try:
            if lanes.get(lane.key) is lane:
                del lanes[lane.key]
                removed = True  # (no call between: a Ctrl-C comes after both or before)
                return len(lanes) <= len(self._orphans)
        except Exception:  # logged by _orphan; the worker goes on
            pass
        except BaseException:  # a Ctrl-C: the caller's to handle, once consistent
            # Not once its entry is gone: an orphan counts an entry left in the
            # table, and one too many let the table go with a live lane in it.
            # A flag, not a second lookup: the lookup calls the key's __hash__
            # and __eq__ (user code, which raised or changed to bring us here).
            if not removed:
                self._orphan(lane)
            raise
        self._orphan(lane)
        return len(lanes) <= len(self._orphans)

    def _orphan(self, lane: Lane) -> None:
        """``lane`` is dead but its entry cannot be found: its key's hash changed
        since it was filed (or raised). Count the entry as gone: it is dropped
        with the table once only such entries are left, or replaced by the
        next lane of an equal key that finds it. ``lane.lock`` held.
        """
        lane.orphan = True
        self._orphans.append(lane)
        # Logged by _report_orphans once the locks are let go: a logging
        # handler is the application's code and may call back in.
        self._orphans_unlogged.append(type(lane.key).__name__)

    def _report_orphans(self) -> None:
        """Log the lanes orphaned since the last call (see _orphan). No lock held."""
        unlogged = self._orphans_unlogged
        while unlogged:
            try:
                name = unlogged.pop(0)
            except IndexError:  # taken by another thread meanwhile
                return
            quiet.error(
                "outbound: the hash of a key of type %s changed while its lane was queued, "
                "or raised; keys must be immutable",
                name,
            )

    def _lanes_emptied(self) -> None:
        """The table looked empty after a retire: tell drain() and a closing pool.

        Unlocked read of the state and of _drain_waiters: skipped while open
        with nobody in drain(), to keep _lock off the path of a pool that
        runs many short-lived keys. A drain() that starts right after this
        read is missed, but it re-checks on its own every _DRAIN_RECHECK
        seconds, so no wake-up is lost for good; close() checks under the
        lock itself.
        """
        if self._life.state is _OPEN and not self._drain_waiters:
            return
        with self._lock:
            self._maybe_drained_locked()

    def _maybe_drained_locked(self) -> None:
        """If nothing is left, wake drain(); once closed, also let the threads go."""
        if self._has_lanes_locked() or self._keyless or self._resolvers:
            return
        # A dict never shrinks: after a burst over many keys, give its
        # memory back. Unlocked readers of the old, empty dict just take the
        # slow path of submit.
        self._lanes = {}
        self._orphans = []
        self._drained.notify_all()
        if self._life.state is _OPEN:
            return
        self._life.advance(State.CLOSED)
        self._handoff.wake_all()
        self._timer.stop()  # only pause ends can be left: nothing to wake

    # ------------------------------------------------------- timers and pauses

    def pause(self, delay: float) -> None:
        """Start no task on any lane for ``delay`` seconds; running tasks go on.

        For a platform-wide rate limit. A later, longer pause extends it.
        ``delay`` is a number of seconds >= 0; one past
        ``threading.TIMEOUT_MAX`` (``math.inf`` included) lasts until
        ``force_close``. Thread-safe; never blocks.
        """
        delay = _seconds("delay", delay)
        self._check_pid()
        with self._lock:
            self._pause_locked(delay)
        self._timer.report()

    def _pause_locked(self, delay: float) -> None:
        until = _monotonic() + delay
        if until > self._paused_until:
            # Armed before it is set: a Ctrl-C in between leaves a wake-up
            # with no pause (harmless), never a pause nothing ends for the
            # lanes already queued.
            if self._has_lanes_locked() or self._keyless:
                self._arm_pause_locked(until)
            # else: nothing to wake at its end yet; the first job scheduled
            # during the pause arms it (no thread starts before a submit)
            self._paused_until = until

    def _arm_pause_locked(self, until: float | None = None) -> None:
        """Make sure the timer wakes the workers when the pause ending at ``until``
        (default: the current one) ends."""
        if until is None:
            until = self._paused_until
        if self._pause_armed < until:
            # Marked once added: a Ctrl-C in starting the timer leaves it
            # unmarked, and the next job scheduled arms it again.
            self._add_timer_locked(until, None)
            self._pause_armed = until

    def _add_timer_locked(self, due: float, item: Job | None) -> None:
        """Wake ``item`` at ``due``: a parked lane, a deferred keyless task, or a pause end."""
        # If its thread cannot start, the next add, submit or a waiting
        # drain() starts it again (see _restart_stranded).
        thread = self._timer.add(due, item)
        if thread is not None:
            self._track_thread_locked(thread)
        elif self._timer.stranded:
            self._stranded = True  # read by submit, which then restarts it

    def _fire(self, take: Callable[[], list[Job | None]]) -> None:
        """The timer's callback: unpark lanes, requeue keyless tasks, end pauses.

        The items are taken under _lock, so a force_close() either takes
        them from the timer first or finds them queued after.
        """
        with self._lock:
            items = take()
            handoff = self._handoff
            for item in items:
                if type(item) is Task:
                    # Even after force_close: a worker resolves it as cancelled
                    # and counts it out of _keyless.
                    handoff.push(item)
                elif type(item) is Lane:
                    with item.lock:
                        due = item.parked and not item.dead
                        item.parked = False
                    if due:
                        handoff.push(item)
            item = None  # keep no lane (and key) alive until the next timer
            start = self._dispatch_locked()
        if start:
            self._start_workers(start)  # an error is logged; the work stays queued
        elif self._stranded:
            # Unlocked read: a hint, checked again under the lock. A stale
            # False skips one retry; the next submit or drain() tries.
            self._restart_stranded()

    # --------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Refuse new work; what was accepted still runs. Idempotent; never blocks."""
        self._check_pid()
        with self._lock:
            self._life.advance(State.CLOSING)
            if self._life.state in (State.CLOSING, State.CLOSED):
                # Each time: a Ctrl-C may have cut short an earlier close
                # (or its drained check) after the state moved on; the check
                # is idempotent and does nothing while work is left.
                self._maybe_drained_locked()

    def drain(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued, running or being resolved, or ``timeout`` passes.

        Returns True if drained: then every future accepted so far is done.
        On an open dispatcher new work may arrive right after. ``None`` (or
        ``math.inf``) waits without limit. If queued work has no thread
        because starting one failed, it tries again while it waits (every
        50 ms). Raises ``RuntimeError`` from a
        task, hook or callback of this dispatcher, which would wait for itself.
        """
        timeout = _check_timeout(timeout)
        self._check_pid()
        if self._is_own_thread():
            raise RuntimeError("drain() called from a task or hook of the same dispatcher")
        deadline = _deadline(timeout)
        while True:
            # Queued work with no thread to run it (a worker could not be
            # started): try to start one again, at most every
            # _DRAIN_RECHECK seconds while it keeps failing. Unlocked read:
            # a hint, checked again under the lock; a change it misses is
            # seen at the next recheck.
            if self._stranded or self._timer.stranded or self._unstarted:
                failed = self._restart_stranded()
                if isinstance(failed, KeyboardInterrupt):
                    raise failed
            retry_at = _monotonic() + _DRAIN_RECHECK
            with self._lock:
                self._drain_waiters += 1
                try:
                    while self._has_lanes_locked() or self._keyless or self._resolvers:
                        now = _monotonic()
                        left = deadline - now
                        if left <= 0:
                            return False
                        if (self._stranded or self._timer.stranded) and now >= retry_at:
                            break
                        self._drained.wait(min(left, _DRAIN_RECHECK))
                    else:
                        return True
                finally:
                    self._drain_waiters -= 1

    def shutdown(self, timeout: float | None = None) -> bool:
        """``close()``, then wait up to ``timeout`` for the work and the threads to end.

        Returns True if every future accepted is done, with its hooks and
        callbacks (as ``drain`` does); within what is left of ``timeout``
        it also waits for the threads to exit, which then run nothing more
        (``shutdown(0)`` on a dispatcher with nothing left is True while
        its idle threads are still on their way out). ``None`` (or
        ``math.inf``) waits without limit. Idempotent; safe from any thread
        but a task, hook or callback of this dispatcher (which would wait
        for itself: it raises ``RuntimeError``).
        """
        timeout = _check_timeout(timeout)
        self._check_pid()  # before any lock: one a parent's thread held is held for good here
        if self._is_own_thread():
            raise RuntimeError("shutdown() called from a task or hook of the same dispatcher")
        deadline = _deadline(timeout)
        self.close()
        if not self.drain(None if deadline == math.inf else max(0.0, deadline - _monotonic())):
            return False
        # Closed and drained: no task, hook or callback is left to run. A thread
        # still alive only leaves its loop, and then runs nothing.
        self._join_threads(deadline)
        return True

    def _is_own_thread(self) -> bool:
        if getattr(self._in_submit_hook, "depth", 0):
            return True
        current = threading.current_thread()
        with self._lock:
            return current in self._threads or self._resolves_locked(current)

    def _resolves_locked(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` resolves futures taken out (see _resolvers). _lock held."""
        return any(r.thread is thread for r in self._resolvers)

    def _join_threads(self, deadline: float) -> None:
        """Wait until ``deadline`` (monotonic) at most for the worker threads to exit,
        those a submit made and has yet to start too: it starts them at once, or
        gives them up (one not started is not alive: it was not waited for, and
        ran after shutdown() returned True)."""
        me = threading.current_thread()
        with self._lock:
            self._joining += 1
        # A thread not begun is waited for _START_GRACE at most: its starter
        # starts it at once, or gives it up; only Ctrl-Cs landing in both
        # leave one that never begins (and no shutdown should wait for good).
        # Past the grace its worker is given up here: started late (its
        # starter held up), it finds itself given up and runs nothing.
        grace = _monotonic() + _START_GRACE
        try:
            while True:
                with self._lock:
                    threads = [t for t in self._threads if t is not me and not _ended(t)]
                    if _monotonic() >= grace:
                        self._forsake_locked([t for t in threads if t.ident is None])
                        threads = [t for t in threads if t.ident is not None]
                    else:
                        threads = [t for t in threads if self._to_begin_locked(t)]
                    if any(not t.is_alive() for t in threads):  # (not begun, or beginning)
                        left = deadline - _monotonic()
                        if left <= 0:
                            return
                        # (Woken by the start or the giving up; the recheck
                        # covers a Ctrl-C between the two.)
                        self._drained.wait(min(left, _DRAIN_RECHECK))
                        continue
                if not threads:
                    return
                for thread in threads:
                    while thread.is_alive():
                        left = deadline - _monotonic()
                        if left <= 0:
                            return
                        thread.join(min(left, TIMEOUT_MAX))
        finally:
            with self._lock:
                self._joining -= 1

    def _forsake_locked(self, threads: list[threading.Thread]) -> None:
        """Give up the workers of ``threads``, not begun, whose starter has yet to
        start them: closed and drained, they hold no job; each thread, if it
        is started after all, finds its worker given up and returns before
        the initializer. _lock held."""
        if not threads:
            return
        for worker in [w for w in self._workers if w.thread in threads and w.claimed is None]:
            worker.claimed = False
            self._workers.discard(worker)
            self._unstarted.discard(worker)

    def _to_begin_locked(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` has begun, or is a worker's its starter has yet to start
        (not given up). _lock held."""
        if thread.ident is not None:
            return True
        return any(w.thread is thread and w.claimed is None for w in self._workers)

    def force_close(self) -> None:
        """Refuse new work, cancel every queued task at once, and flag running ones.

        Queued (and parked) futures are resolved at once as cancelled
        (``cancelled()`` is True, whether or not a task had already run and
        deferred); running tasks see ``current_context().cancelled`` and
        finish on their own. A task that a worker had already taken at that
        instant may still start, and then sees ``cancelled``; no other task
        starts. Idempotent; never blocks on
        tasks. Callbacks of the cancelled futures run in this thread; what
        they raise is logged, except a ``KeyboardInterrupt`` in the main
        thread, which is raised here once every future is resolved. A call
        made while another thread still resolves the futures it took (an
        earlier ``force_close`` or ``KeyedExecutor.shutdown(cancel_futures=
        True)`` whose callbacks run) resolves in this thread those it has
        not reached yet, waiting for nothing: every queued future is
        resolved when any call returns (the other thread may still be
        running the callbacks of the one it is at). A call from a callback
        of those futures leaves the rest to the call it runs in.
        """
        self._check_pid()
        dropped: list[Task] = []
        # The list is the caller's, filled in place, and resolved in a
        # finally: an interruption while tasks are being taken out (a key's
        # __hash__ raising, a Ctrl-C) cannot lose one.
        try:
            with self._lock:
                self._life.advance(State.CLOSING)
                self._cancel.set()
                self._drop_queued_locked(dropped, _cancel)
        finally:
            try:
                self._resolve_dropped(dropped, _cancel)
            except BaseException:
                self._resolve_left(dropped, _cancel)  # (a Ctrl-C at that call: see there)
                raise
            finally:
                self._report_orphans()
        self._help_resolve()

    def _help_resolve(self) -> None:
        """Resolve what other threads took out and have not resolved yet (see force_close).

        Each item is resolved once, whoever gets to it first (resolving is
        idempotent), its callbacks in the thread that did. Waits for no
        thread. Not while this thread resolves some itself (a callback that
        called back in): the call it runs in goes on with the rest, and
        helping from there would nest every callback in the one before.
        """
        current = threading.current_thread()
        with self._lock:
            if not self._resolvers or self._resolves_locked(current):
                return
            others = list(self._resolvers)
            # A resolver while it helps: a callback that calls back in does
            # not help again (nor drain() or shutdown(), which would wait
            # for this thread), and drain() waits for it.
            helper = _Resolver(current, [], _cancel)
            self._resolvers.append(helper)
        first: BaseException | None = None
        try:
            for other in others:
                try:
                    resolve_all(other.todo, other.resolve)
                except BaseException as exc:  # a Ctrl-C from a callback: after all of them
                    if first is None:
                        first = exc
        finally:
            with self._lock:
                self._unregister_locked(helper.todo)
        if first is not None:
            try:
                raise first
            finally:
                first = None

    def _cancel_queued(self) -> None:
        """Cancel what waits but let running tasks be (Executor.shutdown(cancel_futures)).

        A pause in force stays in force for the running tasks' re-runs.
        """
        dropped: list[Task] = []
        try:
            with self._lock:
                self._drop_queued_locked(dropped, _cancel, end_pause=False)
        finally:
            try:
                self._resolve_dropped(dropped, _cancel)
            except BaseException:
                self._resolve_left(dropped, _cancel)  # (a Ctrl-C at that call: see there)
                raise
            finally:
                self._report_orphans()
        self._timer.report()
        self._help_resolve()

    def _drop_queued_locked(
        self,
        dropped: list[Task],
        resolve: Callable[[Task], None],
        *,
        end_pause: bool = True,
    ) -> None:
        """Take every task that is not running out of the dispatcher into ``dropped``. _lock held.

        Registers the caller as a resolver first, and ``dropped`` as what it
        resolves with ``resolve`` (other threads may help: see
        _help_resolve); the caller then calls ``_resolve_dropped`` with the
        same ``resolve`` in a ``finally``, once it released _lock. Tasks
        are taken one ``pop`` at a time from the back, since lane owners
        ``popleft`` concurrently without the lock: each task goes to exactly
        one side, and the owner's side is a prefix of the lane.
        What a lane's retiring raises (its key's ``__hash__``) is raised
        once every lane was emptied. ``end_pause``: a pause in force ends
        too (force_close, a broken pool), not for cancel_futures.
        """
        self._resolvers.append(_Resolver(threading.current_thread(), dropped, resolve))
        self._drops += 1  # before any lane is emptied: see _give_back
        first: BaseException | None = None
        # A copy: retirers change the table without _lock; dict.copy() is
        # one atomic call.
        for lane in self._lanes.copy().values():
            for _ in range(2):
                try:
                    self._empty_lane_locked(lane, dropped)
                except BaseException as exc:
                    # Once more: a lane a Ctrl-C left half emptied had no owner
                    # after (the ready queue and the timer are cleared below).
                    if first is None:
                        first = exc
                    continue
                break
        self._drop_jobs_locked(dropped, end_pause=end_pause)
        if first is not None:
            raise first

    def _empty_lane_locked(self, lane: Lane, dropped: list[Task]) -> None:
        """Move ``lane``'s queued tasks to ``dropped`` and retire it unless it runs. _lock held."""
        with lane.lock:
            tasks = lane.tasks
            lane.held = 0
            # From the back, while the owner takes from the front:
            # what it still starts meanwhile is a prefix of the
            # lane, so no task starts after an earlier one of its
            # key was cancelled. Put back in submission order after.
            # One C call moves them: a Ctrl-C cannot land between a
            # pop() and its append() (the task was in neither place:
            # lost, and drain() said True), nor can the owner's popleft.
            start = len(dropped)
            try:
                dropped.extend(iter(tasks.pop, _NEVER))
            except IndexError:  # (emptied)
                pass
            dropped[start:] = dropped[start:][::-1]
            if not lane.active and not lane.dead:  # owned by the ready queue or the timer
                self._retire_locked(lane)

    def _drop_jobs_locked(self, dropped: list[Task], *, end_pause: bool) -> None:
        """Empty the ready queue, the timer and the workers not begun into ``dropped``
        (their keyless tasks; their lanes were emptied). _lock held."""
        # The pause's end stays in the timer (it left with the rest, to be
        # armed again after: a Ctrl-C between the two left it marked armed,
        # with no item, and a running task that deferred waited for a
        # worker's idle timeout). Ended here, it finds no pause when it fires,
        # and a later pause is armed afresh.
        if end_pause:
            self._paused_until = 0.0
            self._pause_armed = 0.0
        # Each keyless task is moved, counted out and filed with no call
        # between (the filing's own call last): a Ctrl-C right after a
        # popleft() returned lost the task (its future never resolved, the
        # count never back to 0: no drain ended). A lane in the queue or the
        # timer needs no filing: it was emptied above.
        ready = self._handoff.ready
        while True:
            try:
                job = ready[0]
            except IndexError:  # (a worker, which takes without _lock, took the last)
                break
            del ready[0]
            if job.__class__ is Task:
                self._keyless -= 1
                dropped.append(job)
        # The deferred ones (of KeyedExecutor.submit) are counted out, then
        # moved in one step; counted back if the move did not happen.
        timer = self._timer
        with timer.lock:  # (the timer's thread takes none meanwhile)
            deferred = timer.count_locked(Task)
            self._keyless -= deferred
            try:
                timer.move_locked(Task, dropped)
            except BaseException:
                if timer.count_locked(Task) == deferred:  # not moved
                    self._keyless += deferred
                raise
        for worker in self._workers:
            # A keyless task handed to a worker whose thread has not begun
            # (the pool grew for it): no thread has taken it yet.
            handed = worker.job
            if worker.claimed is None and handed.__class__ is Task:
                worker.job = None
                self._keyless -= 1
                dropped.append(handed)

    def _resolve_left(self, dropped: list[Task], resolve: Callable[[Task], None]) -> None:
        """After :meth:`_resolve_dropped` raised: a Ctrl-C that a callback raised comes
        after every future is resolved; one at a call of its own (before or in
        resolving, or before unregistering) left futures unresolved, or counted
        for good (no drain, no shutdown ever ended, and this thread's next
        force_close took it for a resolver at work): finish it (idempotent)."""
        if any(not task.future.done() for task in dropped):
            self._resolve_dropped(dropped, resolve)
        else:
            with self._lock:
                self._unregister_locked(dropped)

    def _resolve_dropped(self, dropped: list[Task], resolve: Callable[[Task], None]) -> None:
        """Resolve what ``_drop_queued_locked`` took, then stop counting as a resolver."""
        try:
            if dropped:
                resolve_all(dropped, resolve)
        finally:
            with self._lock:
                self._unregister_locked(dropped)

    def _unregister_locked(self, todo: list[Task]) -> None:
        """The resolver of ``todo`` is done (absent if interrupted before it registered)."""
        for i, resolver in enumerate(self._resolvers):
            if resolver.todo is todo:
                del self._resolvers[i]
                break
        self._maybe_drained_locked()

    def _break(self, worker: Worker) -> None:
        """A worker's initializer raised: fail everything queued and refuse new work."""
        reason = "a worker initializer raised; the dispatcher is broken"
        dropped: list[Task] = []
        fail = functools.partial(_fail, error=BrokenDispatcher(reason))
        try:
            with self._lock:
                self._workers.discard(worker)
                if worker.job is not None:
                    self._handoff.push_front(worker.job)
                    worker.job = None
                self._life.advance(State.BROKEN, reason)
                self._handoff.wake_all()
                self._drop_queued_locked(dropped, fail)
        finally:
            try:
                self._resolve_dropped(dropped, fail)
            except BaseException:
                self._resolve_left(dropped, fail)  # (a Ctrl-C at that call: see there)
                raise
            finally:
                self._report_orphans()

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
            return self._life.state

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
            # a copy: see _drop_queued_locked
            lanes = [lane for lane in self._lanes.copy().values() if not lane.orphan]
            queued = sum(len(lane.tasks) for lane in lanes)
            queued += _count_tasks(self._handoff.ready.copy())
            queued += _count_tasks(self._timer.items())
            queued += _count_tasks(w.job for w in self._workers if w.claimed is None)
            paused_for = max(0.0, self._paused_until - _monotonic()) if self._paused_until else 0.0
            return DispatcherStats(
                state=self._life.state,
                lanes=len(lanes),
                queued=queued,
                running=sum(1 for worker in self._workers if worker.busy),
                parked=sum(1 for lane in lanes if lane.parked),
                threads=len(self._workers),
                idle_threads=len(self._handoff.idle),
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


def _count_tasks(jobs: Iterable[Job | None]) -> int:
    return sum(1 for job in jobs if type(job) is Task)


class _Resolver(NamedTuple):
    """A thread resolving futures taken out of a dispatcher (see Dispatcher._resolvers)."""

    thread: threading.Thread
    todo: list[Task]  # what it took out (a helper: nothing of its own)
    resolve: Callable[[Task], None]


def _cancel(task: Task) -> None:
    """Resolve a task that will not run as cancelled (idempotent)."""
    cancel_future(task.future)


def _fail(task: Task, error: BaseException) -> None:
    """Fail a task that will not run with ``error``; a caller's cancel stands (idempotent)."""
    future = task.future
    if future.done():
        return
    if task.attempt == 0:
        try:
            if not future.set_running_or_notify_cancel():
                return
        except RuntimeError:  # resolved by the caller, or by a previous try
            if future.done():
                return
    set_future(future, None, error)


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
