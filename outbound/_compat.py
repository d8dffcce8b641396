"""Every reliance of the core on interpreter internals, in one place.

Each item says what is relied on, why, and the CPython versions it was
checked on (3.10.13, 3.11.7, 3.12.1, 3.13.0; ``concurrent/futures/_base.py``
is byte-identical from 3.11 to 3.13 and differs from 3.10 only in the
``TimeoutError`` alias). ``tests/test_compat.py`` fails loudly when a
running interpreter no longer matches; at run time a mismatch makes the
core fall back to documented behaviour (a plain ``Future``, plain
``atexit``) instead of misbehaving.

Not internals, but relied on and documented by Python: ``deque.append``,
``deque.appendleft`` and ``deque.popleft``, and ``list.append``,
``list.pop`` and ``list.remove``, are each atomic (thread-safe) calls, on
the free-threaded build too (each object serializes its own operations).
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

# 1. The state names of concurrent.futures.Future (module _base). LazyFuture
#    (outbound/_future.py) changes a future's state itself, so it must use
#    the very strings the stdlib compares with. Checked: 3.10-3.13.
from concurrent.futures._base import (
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    PENDING,
    RUNNING,
)

__all__ = [
    "CANCELLED",
    "CANCELLED_AND_NOTIFIED",
    "FINISHED",
    "FUTURE_FIELDS",
    "PENDING",
    "RUNNING",
    "TIMEOUT_MAX",
    "future_layout_problem",
    "interpreter_exiting",
    "register_before_thread_join",
    "unlimited_past_max",
]

# 2. The instance layout of concurrent.futures.Future: the fields that
#    Future.__init__ sets, each read and written by the stdlib's methods and
#    by wait()/as_completed() (_waiters, _state, _condition). LazyFuture
#    defers _condition, _waiters and _done_callbacks, and relies on every
#    stdlib path reaching the condition through the ``_condition`` attribute
#    and touching ``_waiters``/``_done_callbacks`` only while holding it or
#    for a future that can no longer change. It also overrides
#    ``_invoke_callbacks`` (called by set_result, set_exception and cancel
#    after the state change). Checked: 3.10-3.13.
FUTURE_FIELDS = frozenset(
    {"_condition", "_state", "_result", "_exception", "_waiters", "_done_callbacks"}
)


def future_layout_problem() -> str | None:
    """What differs in this interpreter's ``Future`` from the layout relied on; None if nothing."""
    try:
        fields = frozenset(vars(Future()))
    except Exception as exc:  # a Future without __dict__
        return f"concurrent.futures.Future() has no instance dict: {exc!r}"
    if fields != FUTURE_FIELDS:
        return f"Future fields are {sorted(fields)}, expected {sorted(FUTURE_FIELDS)}"
    states = (PENDING, RUNNING, CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED)
    if len(set(states)) != 5 or not all(isinstance(s, str) for s in states):
        return f"unexpected Future state constants: {states!r}"
    if Future()._state != PENDING:
        return "a new Future is not PENDING"
    for name in ("_invoke_callbacks", "set_running_or_notify_cancel"):
        if not callable(getattr(Future, name, None)):
            return f"Future.{name} is missing"
    return None


# 3. threading._register_atexit (3.9+, CPython only): runs a function before
#    the interpreter joins non-daemon threads at exit, as
#    concurrent.futures.thread does; plain atexit runs too late for worker
#    threads to be started or joined cleanly. Checked: 3.10-3.13.
def register_before_thread_join(fn: Callable[[], None]) -> None:
    """Call ``fn`` at exit before threads are joined, or with ``atexit`` where that is missing."""
    hook: Callable[[Callable[[], None]], None] | None = getattr(threading, "_register_atexit", None)
    try:
        if hook is None:
            raise RuntimeError("threading._register_atexit is not available")
        hook(fn)
    except RuntimeError:  # missing, or the interpreter is already exiting
        atexit.register(fn)


# 5. threading._SHUTTING_DOWN (3.9+, CPython only): set once threading's exit
#    hooks begin (before non-daemon threads are joined), which is when
#    threading._register_atexit starts to refuse. Checked: 3.10-3.13.
#    sys.is_finalizing() is the documented fallback, true later.
def interpreter_exiting() -> bool:
    """True once the interpreter's exit has begun (threads being joined, or later)."""
    return bool(getattr(threading, "_SHUTTING_DOWN", False)) or sys.is_finalizing()


# 4. Not an internal: the longest timeout a lock or condition accepts
#    (threading.TIMEOUT_MAX, 9223372036.0 s on Linux). A longer one raises
#    OverflowError inside the waiting thread; every wait of the core is
#    clamped to it (a wait that long is, in practice, forever).
TIMEOUT_MAX: float = threading.TIMEOUT_MAX


def unlimited_past_max(seconds: float | None) -> float | None:
    """``seconds`` for a wait or a socket: ``None`` (no limit) past ``TIMEOUT_MAX``, which
    neither can take (``OverflowError``); a wait that long is forever. Pure."""
    return None if seconds is not None and seconds > TIMEOUT_MAX else seconds
