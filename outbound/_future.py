"""The dispatcher's futures: :class:`LazyFuture`, and how the core resolves any future.

``Future.__init__`` builds a ``threading.Condition`` (an ``RLock``, a deque
of waiters and several bound methods: about 1.5 KiB and microseconds, most
of the cost of a future). A dispatcher holds many futures that nobody waits
on (up to ``queue_size`` per chat, for every chat), and most are resolved
before anyone looks at them. :class:`LazyFuture` is a real ``Future``
subclass that makes its condition only when a waiter needs one, and answers
``result()``, ``done()`` and the like of a resolved future without one.

Why this is race-free. A guard lock (one of a few, picked by the future's
id) serializes three things: creating the condition, every state change
made while there is no condition, and every read of the state made without
one. If there is no condition, nobody can be waiting (waiting needs the
condition, whose creation needs the guard) and no done-callback is
registered (``add_done_callback`` makes the condition first), so a state
change under the guard alone is complete. Once the condition exists, every
method does exactly what ``Future`` does, under the condition.

A future that is FINISHED or CANCELLED_AND_NOTIFIED can never change again.
When ``wait()`` or ``as_completed()`` ask such a future for its condition,
they get a shared no-op one (:data:`_SETTLED`) instead of a new
``Condition``: under it they only read the state, which cannot change, and
add and remove their waiter on the future's own ``_waiters`` list (atomic
list calls; nobody ever notifies that waiter, as the future is done). Other
states (PENDING, RUNNING, and CANCELLED, which still moves to
CANCELLED_AND_NOTIFIED) always get a real condition.

:data:`new_future` is ``LazyFuture`` when the running interpreter's
``Future`` has the layout this relies on (see :mod:`outbound._compat`), and
a plain ``Future`` otherwise, with a warning.

What a done-callback raises (even ``SystemExit``) is logged under
``outbound`` and the remaining callbacks still run: a callback must not kill
a worker thread. Only a ``KeyboardInterrupt`` in the main thread goes on to
the caller, after the other callbacks ran. :func:`cancel_future` and
:func:`set_future` resolve a future of either kind without ever raising
what a callback raised (except that ``KeyboardInterrupt``).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import (
    FIRST_COMPLETED,
    CancelledError,
    Future,
    InvalidStateError,
    as_completed,
    wait,
)
from typing import Any, TypeVar, cast

from ._compat import (
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    PENDING,
    RUNNING,
    future_layout_problem,
    unlimited_past_max,
)
from ._log import quiet as _log

__all__ = [
    "LAZY",
    "LazyFuture",
    "cancel_future",
    "failed_future",
    "new_future",
    "resolve_all",
    "set_future",
]

T = TypeVar("T")


_DONE = frozenset({CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED})
# States that no method can leave: see the module docstring.
_SETTLED_STATES = frozenset({CANCELLED_AND_NOTIFIED, FINISHED})


# Guards the creation of a future's condition, its state changes while it
# has none, and unlocked-by-condition reads of its state (see the module
# docstring). Striped by id() so that a future costs no lock of its own;
# each is held for a few bytecodes and never while user code runs.
_GUARDS = tuple(threading.Lock() for _ in range(64))


def _new_guards_after_fork() -> None:
    """A parent thread may have held a guard at the fork: the child gets new ones."""
    global _GUARDS
    _GUARDS = tuple(threading.Lock() for _ in range(64))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_guards_after_fork)


def _interrupts(exc: BaseException) -> bool:
    """True for a Ctrl-C that the caller must see (raised in the main thread)."""
    return isinstance(exc, KeyboardInterrupt) and (
        threading.current_thread() is threading.main_thread()
    )


def _call_callback(fn: Callable[[Any], object], future: Future[Any]) -> BaseException | None:
    """Call one done-callback; log what it raises. Returns a Ctrl-C to re-raise later."""
    try:
        fn(future)
        return None  # (in the try: a Ctrl-C after the call is the callback's)
    except BaseException as exc:
        if _interrupts(exc):
            return exc
        _log.exception("outbound: exception calling callback for %r", future)
    return None


class _Settled:
    """The condition of a future that can no longer change (see the module docstring)."""

    __slots__ = ()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: object) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        return predicate()

    def notify(self, n: int = 1) -> None:
        pass

    def notify_all(self) -> None:
        pass


_SETTLED = _Settled()


class LazyFuture(Future[T]):
    """A ``Future`` that allocates its ``threading.Condition`` only when a waiter needs it.

    Thread-safe exactly like ``Future``; every stdlib function that takes
    futures (``wait``, ``as_completed``, ``asyncio.wrap_future``) works with it.
    """

    # Future.__init__ is deliberately not called: it would build the
    # condition at once. Every field it sets has a class default here until
    # first written, so a new future allocates nothing but itself. The
    # waiter and callback lists are made with the condition: the stdlib
    # only appends to them while holding it.
    _state = PENDING
    _result: Any = None
    _exception: BaseException | None = None
    _waiters: Any = ()
    _done_callbacks: Any = ()
    # The condition, once made; never unset.
    _cond: threading.Condition | None = None
    # Of a cancellation by _cancel_now: the waiters not yet told (guarded by
    # the condition), and whether its callbacks are to run.
    _untold: Any = ()
    _uncalled = False

    __init__ = object.__init__

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        cond = self._cond
        if cond is not None:
            return cond
        with _GUARDS[(id(self) >> 4) & 63]:
            made = self._cond
            if made is not None:
                return made
            if self._state in _SETTLED_STATES:
                if type(self._waiters) is tuple:  # the class default
                    self._waiters = []
                return cast(threading.Condition, _SETTLED)
            self._waiters = []
            self._done_callbacks = []
            cond = self._cond = threading.Condition()
            return cond

    def _invoke_callbacks(self) -> None:
        # One at a time, each taken off the list under the condition: what a
        # call interrupted by a Ctrl-C leaves, the next runs (see _cancel_now),
        # and two callers run each callback once between them.
        interrupt: BaseException | None = None
        cond = self._condition
        while True:
            with cond:
                if not self._done_callbacks:
                    break
                callback = self._done_callbacks.pop(0)
            interrupt = _call_callback(callback, self) or interrupt
        if interrupt is not None:
            raise interrupt

    # ----------------------------------------------------- reads without a condition

    def _peek(self) -> str | None:
        """The state if there is no condition (read under the guard), else None."""
        with _GUARDS[(id(self) >> 4) & 63]:
            if self._cond is not None:
                return None
            return self._state

    def cancelled(self) -> bool:
        state = self._peek()
        if state is None:
            return super().cancelled()
        return state in (CANCELLED, CANCELLED_AND_NOTIFIED)

    def running(self) -> bool:
        state = self._peek()
        if state is None:
            return super().running()
        return state == RUNNING

    def done(self) -> bool:
        state = self._peek()
        if state is None:
            return super().done()
        return state in _DONE

    def result(self, timeout: float | None = None) -> T:
        state = self._peek()
        if state == FINISHED:
            error = self._exception
            if error:  # as Future.__get_result: a falsy exception counts as none
                try:
                    raise error
                finally:
                    # Break the cycle future -> exception -> traceback -> this
                    # frame -> future, as Future.result does.
                    error = None
                    self = None  # type: ignore[assignment]  # noqa: PLW0642
            result: T = self._result
            return result
        if state in (CANCELLED, CANCELLED_AND_NOTIFIED):
            raise CancelledError()
        return super().result(unlimited_past_max(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        state = self._peek()
        if state == FINISHED:
            return self._exception
        if state in (CANCELLED, CANCELLED_AND_NOTIFIED):
            raise CancelledError()
        return super().exception(unlimited_past_max(timeout))

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        with self._condition:
            if self._state not in _DONE:
                self._done_callbacks.append(fn)
                return
        interrupt = _call_callback(fn, self)
        if interrupt is not None:
            raise interrupt

    # ------------------------------------------------------------- state changes

    # Each state change below takes the guard; with no condition made, the
    # change is complete under it (see the module docstring). Otherwise it
    # releases the guard and does what Future does, under the condition.

    def cancel(self) -> bool:
        with _GUARDS[(id(self) >> 4) & 63]:
            if self._cond is None:
                state = self._state
                if state in (RUNNING, FINISHED):
                    return False
                if state == PENDING:
                    self._state = CANCELLED
                return True
        return super().cancel()

    def set_running_or_notify_cancel(self) -> bool:
        with _GUARDS[(id(self) >> 4) & 63]:
            if self._cond is None:
                state = self._state
                if state == PENDING:
                    self._state = RUNNING
                    return True
                if state == CANCELLED:
                    self._state = CANCELLED_AND_NOTIFIED
                    return False
                raise RuntimeError("Future in unexpected state")
        return super().set_running_or_notify_cancel()

    def set_result(self, result: T) -> None:
        with _GUARDS[(id(self) >> 4) & 63]:
            if self._cond is None:
                if self._state in _DONE:
                    raise InvalidStateError(f"{self._state}: <LazyFuture at {id(self):#x}>")
                self._result = result
                self._state = FINISHED
                return
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        with _GUARDS[(id(self) >> 4) & 63]:
            if self._cond is None:
                if self._state in _DONE:
                    raise InvalidStateError(f"{self._state}: <LazyFuture at {id(self):#x}>")
                self._exception = exception
                self._state = FINISHED
                return
        super().set_exception(exception)

    def _cancel_now(self) -> bool:
        """Resolve as cancelled from any state but a final one, RUNNING included.

        Waiters of every kind are woken and the callbacks run once, as for a
        future cancelled before it started. Returns False if the future was
        already FINISHED or CANCELLED_AND_NOTIFIED, and told.

        A call interrupted (a Ctrl-C) after the state changed, while the
        waiters or callbacks were being told, is finished by the next call:
        the waiters not yet told, and the callbacks not yet run, are kept
        with the state (``_untold``, ``_uncalled``), taken one at a time.
        What is taken is told at most once: a Ctrl-C landing right after a
        waiter or a callback was taken, before it is told or run, loses it
        (a window of a few bytecodes, against every step of the telling).
        """
        with _GUARDS[(id(self) >> 4) & 63]:
            if self._cond is None:  # no waiter and no callback
                if self._state in _SETTLED_STATES:
                    return False
                self._state = CANCELLED_AND_NOTIFIED
                return True
        cond = self._condition
        with cond:
            before = self._state
            if before not in _SETTLED_STATES:
                # What is left to tell first, then the state: a call
                # interrupted in between starts over.
                self._untold = list(self._waiters)
                self._uncalled = before != CANCELLED  # cancel() already ran them
                self._state = CANCELLED_AND_NOTIFIED
            elif not (self._untold or self._uncalled):
                return False
            untold = self._untold
            while untold:
                untold.pop().add_cancelled(self)
            cond.notify_all()
        if self._uncalled:
            self._invoke_callbacks()
            self._uncalled = False
        return True


def _self_test() -> str | None:
    """Exercise LazyFuture against the stdlib functions once, single-threaded.

    Plain checks, not ``assert``: they must run under ``python -O`` too.
    """
    try:
        seen: list[object] = []
        done: LazyFuture[int] = LazyFuture()
        done.add_done_callback(seen.append)
        checks = [done.set_running_or_notify_cancel()]
        done.set_result(7)
        checks += [seen == [done], done.result(0) == 7, done.exception(0) is None]
        pending: LazyFuture[int] = LazyFuture()
        result = wait([done, pending], timeout=0, return_when=FIRST_COMPLETED)
        checks += [result.done == {done}, result.not_done == {pending}]
        checks.append(list(as_completed([cast(Future[int], done)], timeout=0)) == [done])
        checks += [pending.cancel(), not pending.set_running_or_notify_cancel()]
        checks.append(wait([pending], timeout=0).done == {pending})
        running: LazyFuture[int] = LazyFuture()
        checks += [running.set_running_or_notify_cancel(), running._cancel_now()]
        checks += [running.cancelled(), running.done()]
    except Exception as exc:
        return f"self-test raised {exc!r}"
    if not all(checks):
        return f"self-test check {checks.index(False)} failed"
    return None


_problem = future_layout_problem() or _self_test()

#: True when the dispatcher's futures are LazyFutures (this interpreter passed the checks).
LAZY: bool = _problem is None

if LAZY:
    new_future: Callable[[], Future[Any]] = LazyFuture
else:  # pragma: no cover - only on an interpreter whose Future changed
    new_future = Future
    warnings.warn(
        f"outbound: concurrent.futures.Future is not laid out as expected ({_problem}); "
        "falling back to plain Futures (correct, but slower and larger)",
        RuntimeWarning,
        stacklevel=2,
    )


def failed_future(error: BaseException) -> Future[Any]:
    """A future already failed with ``error`` (a refusal: bad input, a closed sender).

    A future of the dispatcher's kind, so a done-callback added to it is run
    as the dispatcher's are: what it raises is logged, not raised into the
    code that added it. Thread-safe; never blocks.
    """
    future: Future[Any] = new_future()
    future.set_exception(error)
    return future


def set_future(future: Future[Any], result: object, error: BaseException | None) -> None:
    """Resolve a running future with ``result`` or ``error``; never raises.

    A future the caller resolved on its own is left alone. What its
    callbacks raise is logged (a plain ``Future``'s own callback loop stops
    at a ``BaseException``; the future is resolved all the same).
    """
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:  # resolved by someone else; nothing to do
        _log.debug("outbound: future already resolved", exc_info=True)
    except BaseException:
        _log.exception("outbound: exception calling callback for %r", future)


def cancel_future(future: Future[Any]) -> None:
    """Resolve ``future`` as cancelled, whether it never started or ran and deferred.

    Every kind of waiter wakes; ``cancelled()`` is then True. Raises only a
    main-thread ``KeyboardInterrupt`` from a callback, after the future is
    resolved.
    """
    if type(future) is LazyFuture:
        cast(LazyFuture[Any], future)._cancel_now()
        return
    # A plain Future (fallback): a running one cannot be cancelled, so it fails
    # with CancelledError (result() raises it just the same).
    try:
        if future.cancel():
            try:
                future.set_running_or_notify_cancel()  # wakes wait() and as_completed()
            except RuntimeError:  # already notified
                pass
            return
    except BaseException as exc:  # a callback of cancel(): still notify the waiters
        try:
            future.set_running_or_notify_cancel()
        except RuntimeError:
            pass
        if _interrupts(exc):
            raise
        _log.exception("outbound: exception calling callback for %r", future)
        return
    set_future(future, None, CancelledError("dispatcher was force-closed"))


def resolve_all(todo: list[T], resolve: Callable[[T], None]) -> None:
    """Call ``resolve(item)`` for every item of ``todo``, even if some raise or Ctrl-C lands.

    ``resolve`` must be idempotent: after an interruption, the item that
    was being resolved is resolved again. The first ``BaseException`` is
    re-raised once every item is done; what follows it is logged.
    """
    # (A list, used as it is: a copy would be a call, after which a Ctrl-C
    # could land with every item taken out and none resolved.)
    first: BaseException | None = None
    failed_at = -1
    i = 0
    while True:
        try:
            while i < len(todo):
                resolve(todo[i])
                i += 1  # after resolve: an interruption before this resolves it again
            break
        except BaseException as exc:
            if first is None:
                first = exc
            else:
                _log.error("outbound: error while resolving futures", exc_info=exc)
            if failed_at == i:  # raised twice on one item: give up on that one
                i += 1
            failed_at = i
    if first is not None:
        try:
            raise first
        finally:
            first = None
