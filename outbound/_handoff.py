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

One wake-up at a time, while tasks are short. When the tasks that ended
lately ran for less than ``SHORT`` seconds on average (``ran``), a
scheduler wakes nobody while a worker it (or another) woke has not looked
at ``ready`` yet (``waking``); that worker, once it took a job, wakes the
next one if it still sees jobs ready (the dispatcher's ``_pass_on``). A
burst of short jobs thus wakes threads one after the other, each as the
previous one starts, instead of one thread per job at once: a thread that
is already running takes most of them, and the others are never woken.
Otherwise (long or blocking tasks, or none ended in the last ``FAST_FOR``
seconds: a new burst may block) every job wakes a worker of its own, so
that blocking tasks all start at once even when a woken thread is slow to
run. Whether a woken worker passes the wake-up on depends not on the
mode but on ``chained`` (below), so a mode that changes mid-burst
leaves no job behind. ``waking`` is read and written
without a lock; why no job is left behind:

- it is set only by a waker, after it popped a worker and before it
  releases it, and cleared only by a worker right after it consumed a
  release, before it looks at ``ready``: while it is set, some woken
  worker has yet to clear it and look;
- a scheduler reads it after pushing its job, and a woken worker reads
  ``ready`` after clearing it (and after taking its own job): if the
  scheduler saw it set, the worker's read comes after the push, so it
  sees the job (or the job was taken) and passes the wake-up on;
- two wakers may both see it clear and wake two workers, and a worker
  may clear it while another woken one has not looked yet: both cost only
  a wake-up more, never one less.

A woken worker that was slow to run (the GIL or the OS kept it waiting
more than ``LATE`` seconds) wakes a worker per job left at once instead,
and turns the mode to long: one at a time, a burst of blocking tasks would
pay that delay once per task. Its delay counts from its wake-up
(``woke_at``), but for a worker a scheduler woke (not one woken by a
worker passing the wake-up on, ``hop``): for it, from the last job a
scheduler left to it. While a thread submits a burst it holds the GIL, and
the worker it woke for the first job cannot run; that wait is the burst's
own, not a slow thread. (Counted from the first job, a burst of a hundred
short tasks submitted in a few milliseconds, on a slow machine, made the
woken worker late, and it woke every idle thread for tasks it would have
run itself.) The next worker in the chain, woken by that one, is judged
from its own wake-up: a thread that goes on submitting and working between
its submits, holding the GIL, delays the chain by one hop, not for good.
Nor is a worker late whose wait saw ``PROGRESS`` jobs or more taken
(``taken``): the GIL was held by workers running short tasks, which drain
the queue faster than woken threads would.

Woken workers pass the wake-up on only while ``chained`` is set, so that
one wake-up per job (long tasks) wakes nobody twice and grows no thread
for a job a woken worker is about to take. A waker that may skip sets it
before it reads ``waking``; the woken worker it skips for reads it after
clearing ``waking``, so it sees it set. It is cleared under the
dispatcher's lock, by a worker that found ``ready`` empty (every job a
wake-up was left for has been taken by then, and schedulers push, and set
it, under that lock too), and by a late worker once it woke or started a
worker for every job left.

What the hand-off does not decide: whether a job may start now (a pause),
and whether the pool may grow; the dispatcher does, under its lock.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Generic, Protocol, TypeVar

from ._compat import TIMEOUT_MAX

__all__ = ["FAST_FOR", "LATE", "PROGRESS", "SHORT", "Handoff", "Sleeper"]

_monotonic = time.monotonic

#: Tasks shorter than this on average (seconds, wall time) are short: a
#: thread already running gets to the next job before a woken one would.
SHORT = 0.0005
#: How long the last short task keeps wake-ups one at a time (seconds).
FAST_FOR = 0.05
#: A woken worker this late to look (seconds) wakes one per job left...
LATE = 0.003
#: ... unless this many jobs were taken since it was woken (the queue drains).
PROGRESS = 4


def _short(now: float, fast_until: float) -> bool:
    """Whether wake-ups go one at a time now (tests pin it)."""
    return now < fast_until


# Weight of the newest run in the average: one long task after many short
# ones turns one-at-a-time wake-ups off (0.125 x its time > SHORT).
_WEIGHT = 0.125


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

    __slots__ = (
        "chained",
        "fast_until",
        "hop",
        "idle",
        "pace",
        "ready",
        "taken",
        "waking",
        "woke_at",
        "woke_taken",
    )

    def __init__(self) -> None:
        self.ready: deque[J] = deque()
        # Most recently idle last: woken first, so the coldest threads retire.
        self.idle: list[W] = []
        # A worker was woken and has not looked at ``ready`` yet: it passes
        # the wake-up on. Read and written without a lock: see the module.
        self.waking = False
        # A wake-up may have been left to a woken worker since ``ready`` was
        # last seen empty under the dispatcher's lock: woken workers pass it
        # on. Written without a lock (cleared under it): see the module.
        self.chained = False
        # When wake_one last woke a worker, or a scheduler left a job to the
        # worker it woke (time.monotonic()): how late a woken worker is to
        # look (see the dispatcher's _pass_on).
        self.woke_at = 0.0
        # The last wake-up was a worker passing one on, not a scheduler's:
        # jobs left to the woken worker do not date it anew (see the
        # module). Read and written without a lock: a stale value only
        # misjudges one worker's lateness.
        self.hop = False
        # Jobs taken from ``ready`` so far, and as of woke_at. Counted
        # without a lock: a lost count only misjudges one worker's lateness.
        self.taken = 0
        self.woke_taken = 0
        # The average run time of the tasks (seconds; long until measured),
        # and until when wake-ups go one at a time (see ran()). Written by
        # workers without a lock: a lost update only delays a change of mode.
        self.pace = 1.0
        self.fast_until = 0.0

    def ran(self, seconds: float, now: float) -> None:
        """A task ended at ``now`` after running ``seconds``: keep the pace of tasks.

        Called by a worker after each task, without a lock.
        """
        pace = self.pace + (seconds - self.pace) * _WEIGHT
        self.pace = pace
        self.fast_until = now + FAST_FOR if pace < SHORT else 0.0

    # ------------------------------------------------------------ schedulers

    def push(self, job: J) -> None:
        """Queue ``job`` last (wake nobody: see :meth:`wake_one`)."""
        self.ready.append(job)

    def push_front(self, job: J) -> None:
        """Queue ``job`` first (a job given back, or the first to run after a pause)."""
        self.ready.appendleft(job)

    def wake_one(self, *, chain: bool = True, hop: bool = False) -> bool:
        """See that an idle worker looks at ``ready``; False if none is idle. Call it after a push.

        While tasks are short and a worker woken earlier has not looked yet,
        wake nobody more: that worker finds the job, and wakes one more if it
        leaves any behind (see the module). ``chain=False``: wake one anyway.
        ``hop``: a worker passes a wake-up on (not a scheduler).
        """
        # Unlocked reads: set, a woken worker has yet to look at ``ready``
        # (after this push); clear, this call wakes one (see the module).
        # The mode may be stale: either way the job is seen.
        now = _monotonic()
        if chain and _short(now, self.fast_until):
            self.chained = True  # before reading waking: see the module
            if self.waking:
                if not (hop or self.hop):
                    # The woken worker's lateness counts from here: the time
                    # this scheduler held the GIL (a burst of submits) says
                    # nothing of how slow the OS or the GIL is to run it.
                    self.woke_at = now
                    self.woke_taken = self.taken
                return True
        try:
            worker = self.idle.pop()
        except IndexError:
            return False
        self.waking = True
        self.woke_at = now
        self.woke_taken = self.taken
        self.hop = hop
        worker.wake.release()
        return True

    def wake_all(self) -> None:
        """Wake every idle worker (to look again, or to exit)."""
        while True:
            try:
                worker = self.idle.pop()
            except IndexError:
                return
            self.waking = True
            worker.wake.release()

    # --------------------------------------------------------------- workers

    def take(self) -> J | None:
        """The next ready job, or None. Never blocks."""
        try:
            job = self.ready.popleft()
        except IndexError:
            return None
        self.taken += 1
        return job

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
            self.waking = False

    def sleep(self, worker: W, timeout: float) -> bool:
        """Wait until woken (True) or ``timeout`` seconds pass, unlisted (False)."""
        if worker.wake.acquire(timeout=min(timeout, TIMEOUT_MAX)):
            self.waking = False
            return True
        try:
            self.idle.remove(worker)
        except ValueError:  # woken just as the timeout fired
            worker.wake.acquire()
            self.waking = False
            return True
        return False
