"""A drop-in ``concurrent.futures.Executor`` with per-key order: :class:`KeyedExecutor`."""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import os
import sys
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from typing_extensions import ParamSpec

from .dispatcher import Dispatcher, DispatcherStats

__all__ = ["KeyedExecutor"]

P = ParamSpec("P")
T = TypeVar("T")

_counter = itertools.count()


def _workers(value: object) -> int:
    """``max_workers`` as the stdlib takes it: any number > 0 (``os.cpu_count() / 2``,
    a NumPy integer), a fraction rounded up (the stdlib starts threads while it has
    fewer than it), but not a bool; ``TypeError``/``ValueError`` naming it otherwise
    (checked here: the dispatcher would name it max_inflight)."""
    count: int
    if isinstance(value, bool):  # a mistake, as everywhere in this library
        raise TypeError("max_workers must be a number or None, not bool")
    if isinstance(value, numbers.Integral):
        count = operator.index(value)
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"max_workers must be a finite number, not {value!r}")
        count = math.ceil(float(value))
    else:
        raise TypeError(f"max_workers must be a number or None, not {type(value).__name__}")
    if count <= 0:  # (a fraction rounds up: count > 0 exactly when it is > 0)
        raise ValueError("max_workers must be greater than 0")
    return count


def _default_workers() -> int:
    count = getattr(os, "process_cpu_count", os.cpu_count)()
    return min(32, (count or 1) + 4)


class KeyedExecutor(Executor):
    """A ``ThreadPoolExecutor`` replacement that can also keep per-key order.

    Built like ``ThreadPoolExecutor(max_workers=None, thread_name_prefix="",
    initializer=None, initargs=())`` and keeping its contract: ``submit``
    runs tasks unordered, ``map``, ``shutdown(wait=True, *,
    cancel_futures=False)``, a failing initializer breaks the executor
    (``BrokenThreadPool``), the context manager shuts down with ``wait=True``.
    :meth:`submit_keyed` adds per-key FIFO: tasks of one key run one at a
    time in submission order, keys concurrently.

    The initializer runs in each worker thread before its first task, as
    in the stdlib, in a copy of the ``contextvars`` context the executor
    was made in. Unlike the stdlib, tasks run in a copy of their
    submitter's context (as ``asyncio.to_thread`` does), so a
    ``ContextVar`` set by the initializer is not visible to tasks; use
    ``threading.local`` for per-thread state.

    ``queue_size`` (keyword-only) bounds the tasks waiting per key; ``None``
    (the default, like the stdlib) leaves lanes unbounded. Inside a task,
    :func:`~outbound.current_context` works and has no deadline.

    Thread-safe. ``submit`` and ``submit_keyed`` never block; ``shutdown``
    blocks only with ``wait=True``. At interpreter exit, queued work is
    finished first, as the stdlib does.

    Known differences from the stdlib: a worker idle for 30 s leaves (the
    stdlib's stay until shutdown), so a later task starts a new thread and
    the initializer runs in it again (keep per-thread setup idempotent, or
    release what it takes when the thread ends); an executor dropped without
    ``shutdown()`` keeps its idle threads until then (the stdlib's leave at
    once); and asyncio takes only a ``ThreadPoolExecutor`` as a loop's
    *default* executor (``loop.run_in_executor(executor, ...)`` with this
    one works).
    """

    def __init__(
        self,
        max_workers: int | None = None,
        thread_name_prefix: str = "",
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        *,
        queue_size: int | None = None,
    ) -> None:
        max_workers = _default_workers() if max_workers is None else _workers(max_workers)
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        self._dispatcher = Dispatcher(
            max_inflight=max_workers,
            queue_size=sys.maxsize if queue_size is None else queue_size,
            send_timeout=math.inf,
            thread_name_prefix=thread_name_prefix or f"KeyedExecutor-{next(_counter)}",
            initializer=initializer,
            initargs=initargs,
            exit_timeout=None,
        )
        self._max_workers = max_workers

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the pool, in no particular order; return its future.

        Raises ``RuntimeError`` after ``shutdown`` and ``BrokenThreadPool``
        once an initializer failed; ``TypeError`` at once if ``fn`` is not
        callable (where ``ThreadPoolExecutor`` returns a future that fails
        with it). Never blocks.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        return self._dispatcher._submit_keyless(fn, args, kwargs)

    def submit_keyed(
        self, key: Hashable, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` after every earlier task of ``key``; return its future.

        Raises ``QueueFull`` only when ``queue_size`` was given and is
        reached, ``RuntimeError`` after ``shutdown``, ``TypeError`` if
        ``fn`` is not callable. Never blocks.
        """
        return self._dispatcher.submit(key, fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new tasks; cancel the waiting ones if ``cancel_futures``; with ``wait``,
        block until every task finished and every thread exited. Idempotent.

        With ``cancel_futures`` the waiting futures are resolved when this
        returns, also those another thread's ``force_close`` (or
        ``cancel_futures``) took and has not reached yet: this resolves them
        itself (see ``Dispatcher.force_close``); without ``wait`` it waits
        for no thread.
        """
        dispatcher = self._dispatcher
        dispatcher.close()
        if cancel_futures:
            dispatcher._cancel_queued()
        if wait:
            dispatcher.shutdown()

    def stats(self) -> DispatcherStats:
        """A snapshot of the underlying dispatcher's counters."""
        return self._dispatcher.stats()

    def __repr__(self) -> str:
        s = self._dispatcher.stats()
        return (
            f"<{type(self).__name__} state={s.state.value} max_workers={self._max_workers} "
            f"queued={s.queued} running={s.running} threads={s.threads}>"
        )
