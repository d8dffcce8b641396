"""The dispatcher's internal records: tasks, lanes, workers. Not public."""

from __future__ import annotations

import contextvars
import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

from . import _fork

__all__ = ["Job", "Lane", "Task", "Worker"]


class Task:
    """One accepted call. Dropped by the dispatcher as soon as it is resolved."""

    __slots__ = ("args", "attempt", "context", "fn", "future", "kwargs", "state", "submitted_at")

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
        #: Runs started so far; 0 until the first (then the future is running).
        self.attempt = 0
        #: TaskContext.state, kept across runs; made on first use.
        self.state: dict[str, Any] | None = None


class Lane:
    """The queue of one key.

    A lane is in the dispatcher's table exactly while it holds work (queued,
    running or parked), and then it has exactly one owner: the ready queue,
    one worker (``active``), or the timer (``parked``). Once removed from
    the table it is ``dead`` for good: a submit still holding it sees that
    and goes to the table again.

    ``lock`` guards every field, with one exception: the worker that owns the
    lane (``active``) takes tasks from the head of ``tasks`` without it.
    ``deque.popleft`` and ``deque.append`` are atomic (documented deque
    thread safety, not the GIL), so that pop cannot clash with a submit
    appending at the tail; everything that must see the queue and a flag
    together (retiring an empty lane, refusing a full one) takes the lock.
    What the unlocked pop means for readers: a length read under the lock
    may already be one too high, so a submit learns that it appended from
    the append itself, never from a length read afterwards.
    """

    __slots__ = ("active", "dead", "held", "key", "lock", "orphan", "parked", "tasks")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        # The per-lane queue: fixed capacity, O(1) push and pop, refuse when
        # full, like a ring buffer. collections.deque is the fastest
        # way Python has: append/popleft are single atomic C calls with no
        # index arithmetic in bytecode, and its 64-slot blocks grow and
        # shrink with the content, so a nearly empty lane does not pay for
        # queue_size preallocated slots as a list-backed ring would. The
        # capacity is checked in submit (len() is O(1)); maxlen is not used
        # because it silently drops from the other end instead of refusing.
        self.tasks: deque[Task] = deque()
        # Waiters: the submitters of this key, its owner, and force_close;
        # each holds it for a few bytecodes.
        self.lock = threading.Lock()
        self.active = False
        self.parked = False
        #: 1 while the head of ``tasks`` is a task that ran and deferred: it
        #: keeps the lane's turn and is not counted as waiting (queue_size).
        self.held = 0
        self.dead = False
        #: Dead, but its table entry could not be removed: its key's hash
        #: changed or raised (see Dispatcher._retire_locked).
        self.orphan = False


#: What a worker runs next: a lane (whose first task it takes itself) or a
#: keyless task of a KeyedExecutor.
Job = Lane | Task


class Worker:
    """A pool thread's mailbox and state.

    ``job``, ``claimed`` and ``thread`` are guarded by the dispatcher's lock.
    """

    __slots__ = ("born", "busy", "claimed", "job", "thread", "wake")

    def __init__(self, job: Job | None) -> None:
        self.job = job
        #: The fork it was made after (:data:`outbound._fork.forks`): in a child
        #: forked since, it is the thread that forked, and serves the parent's
        #: dispatcher state, not the child's.
        self.born = _fork.forks
        #: None until decided, once, under the dispatcher's lock: True when
        #: its thread began to run it (the thread then owns the permit and
        #: the job), False when starting the thread failed first (the
        #: starter gave both back; a thread that begins later just returns).
        self.claimed: bool | None = None
        self.thread: threading.Thread | None = None
        #: Running a task now. Written only by the worker's own thread;
        #: read by stats() as a snapshot.
        self.busy = False
        # Binary semaphore: released once by whoever hands this idle worker
        # a job (or asks it to stop); the worker waits on it while idle.
        self.wake = threading.Lock()
        self.wake.acquire()
