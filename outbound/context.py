"""What a running task can know about itself: :func:`current_context`, and :class:`Defer`.

Inside a task run by a :class:`~outbound.Dispatcher`, :func:`current_context`
returns a :class:`TaskContext`: the task's key, its deadline, and whether
the dispatcher was force-closed. This is the ``ctx`` of the Go design the
library comes from. Python cannot interrupt a thread, so the deadline and
the cancellation are cooperative: code that does I/O turns ``remaining()``
into its timeouts and checks ``cancelled`` between steps.

A task raises :class:`Defer` to say "not now, keep my place": the
dispatcher puts it back at the head of its lane and parks the lane (or, with
``scope="all"``, every lane) for the given delay, without holding a thread
or a concurrency permit meanwhile.
"""

from __future__ import annotations

import contextvars
import math
import numbers
import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Protocol, cast

from ._compat import TIMEOUT_MAX
from .errors import SendTimeout, _key_text, _restored

__all__ = ["Defer", "TaskContext", "current_context", "narrow_deadline", "time_allowed"]


def _seconds(name: str, value: object) -> float:
    """``value`` as a float of seconds >= 0 (``math.inf`` allowed), else an error naming ``name``.

    The core's one check of a delay or a timeout: a ``bool`` or a non-number
    is a ``TypeError`` (``Defer(True)`` is a mistake, not one second); a
    negative number or NaN a ``ValueError``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not value >= 0:  # NaN fails too
        raise ValueError(f"{name} must be a number of seconds >= 0, not {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int past what a float holds: longer than any wait
        return math.inf


def _instant(name: str, value: object) -> float:
    """``value`` as a float ``time.monotonic()`` instant, else an error naming ``name``.

    Any real number (``numbers.Real``: NumPy's too); a ``bool`` or anything
    else is a ``TypeError``, NaN a ``ValueError``; an int past what a float
    holds is an instant after (or before) any other (``+-inf``).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a time.monotonic() instant, not {type(value).__name__}")
    try:
        instant = float(value)
    except OverflowError:  # an int (or a Fraction) past what a float holds
        instant = math.inf if cast("float", value) > 0 else -math.inf
    if math.isnan(instant):
        raise ValueError(f"{name} must be a time.monotonic() instant, not NaN")
    return instant


def _check_scope(scope: object) -> None:
    """Raise ``ValueError`` unless ``scope`` is a ``Defer`` scope ("lane" or "all")."""
    if scope not in ("lane", "all"):
        raise ValueError(f"Defer scope must be 'lane' or 'all', not {scope!r}")


class _StateHolder(Protocol):
    """Where a task's ``state`` dict lives (the dispatcher's task record)."""

    state: dict[str, Any] | None


class _State:
    """A ``state`` holder for a context that belongs to no task."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None


class TaskContext:
    """The running task's view of itself. Read-only; safe to share between threads.

    - ``key``: the lane's key (``None`` for a keyless task of a
      :class:`~outbound.KeyedExecutor`).
    - ``deadline``: a ``time.monotonic()`` instant, the start of this run
      plus the dispatcher's ``send_timeout``.
    - ``attempt``: 1 for the first run, 2 after one :class:`Defer`, and so on.
    - ``submitted_at``: the ``time.monotonic()`` instant of ``submit``.
    - ``state``: a dict that lives as long as the task, across the runs a
      :class:`Defer` causes: middleware keeps per-message state there
      (namespace the keys, e.g. ``"outbound.retry.failures"``).
    """

    __slots__ = ("_cancel", "_holder", "attempt", "deadline", "key", "submitted_at")

    def __init__(
        self,
        key: Hashable,
        deadline: float,
        attempt: int,
        submitted_at: float,
        cancel: threading.Event,
        holder: _StateHolder | None = None,
    ) -> None:
        self.key = key
        self.deadline = deadline
        self.attempt = attempt
        self.submitted_at = submitted_at
        self._cancel = cancel
        self._holder: _StateHolder = holder if holder is not None else _State()

    @property
    def state(self) -> dict[str, Any]:
        """Per-task scratch space, kept across re-runs; only the running task uses it."""
        holder = self._holder
        if holder.state is None:
            holder.state = {}
        return holder.state

    def with_deadline(self, deadline: float) -> TaskContext:
        """A copy with ``deadline`` (the same task: key, state, cancellation)."""
        return TaskContext(
            self.key, deadline, self.attempt, self.submitted_at, self._cancel, self._holder
        )

    def remaining(self) -> float:
        """Seconds left before the deadline; ``0.0`` once it has passed. Never blocks."""
        return max(0.0, self.deadline - time.monotonic())

    @property
    def cancelled(self) -> bool:
        """True once the dispatcher was force-closed: the task should stop soon."""
        return self._cancel.is_set()

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block until the task is cancelled or ``timeout`` seconds pass; return ``cancelled``.

        Use it instead of ``time.sleep`` so that ``force_close`` cuts the wait short.
        """
        if timeout is not None:
            timeout = _seconds("timeout", timeout)
        if timeout is None or timeout <= TIMEOUT_MAX:
            return self._cancel.wait(timeout)
        # Longer than a lock can wait: wait in pieces until the deadline.
        deadline = time.monotonic() + timeout
        while not self._cancel.wait(min(deadline - time.monotonic(), TIMEOUT_MAX)):
            if time.monotonic() >= deadline:
                return False
        return True

    def __repr__(self) -> str:
        return (
            f"<TaskContext key={_key_text(self.key)} attempt={self.attempt} "
            f"remaining={self.remaining():.3f}s cancelled={self.cancelled}>"
        )


#: What the dispatcher records when a task starts: the arguments of its
#: TaskContext, built only if the task asks for it.
PendingContext = tuple[Hashable, float, int, float, threading.Event, _StateHolder]


class _Current(threading.local):
    """The running task's context in this thread.

    ``raw`` is None outside a task, a :class:`TaskContext`, or the
    arguments of one (``start_task``): most tasks never ask, so the object
    is made on the first read of ``context``. Thread-confined.
    """

    raw: TaskContext | PendingContext | None = None

    @property
    def context(self) -> TaskContext | None:
        raw = self.raw
        if type(raw) is tuple:
            raw = self.raw = TaskContext(*raw)
        return raw  # type: ignore[return-value]

    @context.setter
    def context(self, value: TaskContext | None) -> None:
        self.raw = value


_current = _Current()


def _task_context() -> TaskContext | None:
    """The context of the dispatcher task running in this thread; None outside one,
    also within :func:`narrow_deadline` there (whose context is a task's for
    timeouts only: nothing can be deferred outside a task). Never blocks."""
    ctx = _current.context
    if ctx is None or type(ctx._holder) is _State:
        return None
    return ctx


def current_context() -> TaskContext:
    """Return the :class:`TaskContext` of the task running in this thread.

    Raises ``RuntimeError`` when called outside a task run by a dispatcher.
    Never blocks.
    """
    ctx = _current.context
    if ctx is None:
        raise RuntimeError(
            "outbound.current_context() called outside a task: it is only "
            "available inside a function run by a Dispatcher or KeyedExecutor"
        )
    return ctx


def time_allowed(default: float, what: str = "the send") -> float:
    """Seconds an I/O call may take now: the running task's ``remaining()``, or
    ``default`` outside a task or without a deadline.

    Raises :class:`~outbound.errors.SendTimeout` if the task's deadline has
    already passed, so nothing is started that could not finish, and on
    behalf of a relay's handler once the relay's lease on the message (as
    last renewed, less a third) has passed: the message may be another
    relay's by then, or the relay let it go (the handler failed, or ran past
    its timeout). On behalf of a handler means in it, and in a task it
    submitted to a dispatcher (a reply it queued, the context copied at
    ``submit``) until it has returned and its outcome was written. Never
    blocks.
    """
    ctx = _current.context
    if ctx is None:
        return default
    # (Inside a task only: a context copied in a handler for other work, a
    # dispatcher's made there for its initializer, does not carry it along.)
    fence = _fence.get()
    if fence is not None and fence.lapsed():
        raise SendTimeout(
            f"{what}: not begun, the relay's lease on the message may have passed to another"
        )
    remaining = ctx.remaining()
    if math.isinf(remaining):
        return default
    if remaining <= 0.0:
        raise SendTimeout(f"{what}: the task's deadline passed before it started")
    return remaining


class _Leased(Protocol):
    """What holds a lease: the ``time.monotonic()`` instant it ends (it may move);
    whether its handler returned and its outcome was kept (then the sends it
    queued go on whatever the lease: no other relay runs the message again);
    and whether the message was let go otherwise (to be run again, or never:
    then no send begins for it)."""

    lease_until: float
    returned: bool
    released: bool


class _Fence:
    """A relay handler's lease, as :func:`time_allowed` checks it. Immutable."""

    __slots__ = ("_leased", "_margin")

    def __init__(self, leased: _Leased, margin: float) -> None:
        self._leased = leased
        self._margin = margin

    def lapsed(self) -> bool:
        """Whether the message was let go, or the lease, as last renewed, less the
        margin, has passed; never once its handler returned and its outcome was
        kept. (Unlocked reads of single attributes.)"""
        leased = self._leased
        if leased.returned:
            return False
        return leased.released or time.monotonic() >= leased.lease_until - self._margin


# The lease of the relay handler the running code works for: set in the
# handler's task, and so in the copy of its context each submit from it takes.
_fence: contextvars.ContextVar[_Fence | None] = contextvars.ContextVar(
    "outbound_lease_fence", default=None
)


def _bind_to_lease(leased: _Leased, margin: float) -> contextvars.Token[_Fence | None] | None:
    """From now on :func:`time_allowed` in the running task, and in the tasks it
    submits, also refuses once ``leased.lease_until - margin`` has passed (until
    ``leased.returned``); returns what to give :func:`_restore_context` after.
    Outside a task: nothing changes. Thread-confined. (Not a context manager: a
    relay does this for every message.)"""
    if _current.context is None:
        return None
    return _fence.set(_Fence(leased, margin))


def _restore_context(token: contextvars.Token[_Fence | None] | None) -> None:
    """Undo :func:`_bind_to_lease`."""
    if token is not None:
        _fence.reset(token)


@contextmanager
def narrow_deadline(deadline: float) -> Iterator[TaskContext]:
    """Within the block, :func:`current_context` reports a deadline no later than ``deadline``.

    ``deadline`` is a ``time.monotonic()`` instant. Inside a task the
    context is the task's own, with the sooner of the two deadlines; outside
    a task it is a context of its own (key ``None``, never cancelled), so
    that code which takes its I/O timeouts from ``current_context()`` works
    there too (middleware still takes it for "outside a task": nothing is
    deferred there). ``deadline`` must be a number, not NaN; an int past
    what a float holds is ``math.inf``. Restores the previous context on
    exit. Thread-confined.
    """
    deadline = _instant("deadline", deadline)
    previous = _current.context
    if previous is None:
        now = time.monotonic()
        narrowed = TaskContext(None, deadline, 1, now, threading.Event())
    else:
        narrowed = previous.with_deadline(min(deadline, previous.deadline))
    _current.context = narrowed
    try:
        yield narrowed
    finally:
        _current.context = previous


class Defer(Exception):
    """Raised by a task to run again after ``delay`` seconds, keeping its place.

    The task goes back to the head of its lane, so order holds; the lane is
    parked on the dispatcher's timer and its worker thread and permit serve
    other lanes meanwhile. With ``scope="all"`` every lane is paused for
    ``delay`` (a platform-wide rate limit); running tasks finish, none
    starts. The task's future stays unresolved until a later run returns or
    raises something else. ``delay`` is a number of seconds >= 0; one longer
    than ``threading.TIMEOUT_MAX`` (``math.inf`` included) means "until
    ``force_close()``". A ``bool`` is a ``TypeError``.

    It is an ``Exception``: code between the task and the one that raises it
    (a sender decorator, say) must let it through, not swallow it in an
    ``except Exception``.
    """

    def __init__(self, delay: float, *, scope: Literal["lane", "all"] = "lane") -> None:
        delay = _seconds("Defer delay", delay)
        _check_scope(scope)
        super().__init__(f"defer {scope} for {delay:g}s")
        self.delay = delay
        self.scope: Literal["lane", "all"] = scope

    def __reduce__(self) -> tuple[Any, ...]:
        return _restored, (type(self), self.args, self.__dict__)
