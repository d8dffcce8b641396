"""Running one task: :func:`execute`, the worker's step between taking a task and the next."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import Any

from ._future import cancel_future, set_future
from ._handoff import Handoff
from ._lane import Task, Worker
from .context import Defer, _check_scope, _current, _seconds
from .hooks import DispatchInfo, Hooks, call_hook

__all__ = ["execute"]

_monotonic = time.monotonic


def execute(
    worker: Worker,
    key: Hashable,
    task: Task,
    queue_len: int,
    hooks: Hooks,
    send_timeout: float,
    cancel: threading.Event,
    handoff: Handoff[Any, Any],
) -> Defer | None:
    """Run ``task`` once and resolve its future; return the Defer it raised, if any.

    Called by a worker with no lock held. Never raises: hooks and callbacks
    are guarded, so a worker thread survives whatever they raise. Follows
    the ``Future`` protocol: ``set_running_or_notify_cancel()`` before the
    first run; a future the caller cancelled or resolved while it waited is
    skipped, also one resolved while the task waited out a ``Defer`` (when the
    deferral ends: its lane waits until then). After ``cancel`` is set
    (``force_close``) no task starts.
    Tells ``handoff`` how long the task ran (see :meth:`Handoff.ran`).
    """
    future = task.future
    # Check, then act without a lock: force_close may set the flag right
    # after this check; the task then starts (maybe after force_close
    # returned, if this thread is slow to go on) and sees ``cancelled``, as
    # force_close documents for a task a worker had already taken.
    if cancel.is_set():
        cancel_future(future)
        return None
    if task.attempt == 0:
        try:
            if not future.set_running_or_notify_cancel():
                return None  # the caller cancelled the future while it waited
        except RuntimeError:  # the caller resolved it while it waited
            return None
    elif future.done():  # resolved while deferred (set_result, set_exception): withdrawn
        return None
    task.attempt += 1
    if hooks.on_start is not None:
        call_hook("on_start", hooks.on_start, key)
    start = _monotonic()
    current = _current
    # The TaskContext is built from this only if the task asks for it.
    current.raw = (key, start + send_timeout, task.attempt, task.submitted_at, cancel, task)
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
        current.raw = None
        end = _monotonic()
        handoff.ran(end - start, end)
    if isinstance(error, Defer):
        error = _checked(error)
    if isinstance(error, Defer):
        if not cancel.is_set():
            return error
        # force_close came: cancelled, like a parked task force_close takes
        # out, and like those with no on_done (the task did not finish).
        cancel_future(future)
        task = future = key = error = None  # type: ignore[assignment]
        return None
    set_future(future, result, error)
    del result
    if hooks.on_done is not None:
        info = DispatchInfo(key, queue_len, start - task.submitted_at, end - start, error)
        call_hook("on_done", hooks.on_done, info)
        del info
    # A failed future's traceback holds this frame: keep nothing else alive.
    task = future = key = error = None  # type: ignore[assignment]
    return None


def _checked(defer: Defer) -> BaseException:
    """``defer`` as the dispatcher reads it: a plain :class:`Defer` of its delay and
    scope, each read once here; or the error its attributes make, which fails
    the task (with ``defer`` as its ``__cause__``).

    ``Defer()`` checks its arguments, but its attributes can be changed
    after, or be missing (a subclass that did not call ``Defer.__init__``),
    or be properties that raise or change: the dispatcher reads the copy
    (under its lock, where no user code may run), never the original. A
    delay that is not a number of seconds >= 0 (NaN would hold the timer's
    thread, a string would end the worker's) or a scope other than "lane"
    or "all" fails the task, naming the problem.
    """
    try:
        delay = _seconds("Defer delay", defer.delay)
        scope = defer.scope
        _check_scope(scope)
        plain = Defer(delay, scope="all" if scope == "all" else "lane")
    except BaseException as exc:  # whatever reading it raised: the task's error
        if isinstance(exc, Defer):  # not a deferral: never read again
            exc = TypeError(
                f"a {type(defer).__name__} whose attributes cannot be read: reading them "
                f"raised a {type(exc).__name__}"
            )
        exc.__cause__ = defer
        return exc
    return plain
