"""Observation hooks of the dispatcher: :class:`Hooks` and :class:`DispatchInfo`.

Hooks are plain callables, called by the dispatcher outside its internal
locks, in the thread that did the work (the submitting thread for
``on_queued`` and ``on_rejected``, the worker thread for ``on_start`` and
``on_done``). A hook must be quick and thread-safe; whatever it raises is
logged under the ``outbound`` logger and changes nothing else.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields

from ._log import quiet
from .errors import _key_text

__all__ = ["DispatchInfo", "Hooks"]


@dataclass(frozen=True, slots=True)
class DispatchInfo:
    """What happened to one task, given to ``Hooks.on_done``.

    ``queue_len`` is the number of tasks still waiting in the lane when this
    one started; ``queue_latency`` the seconds from ``submit`` to the start
    of the (last) run; ``run_latency`` the seconds the run took; ``error``
    the exception the task raised, or ``None``.
    """

    key: Hashable
    queue_len: int
    queue_latency: float
    run_latency: float
    error: BaseException | None = None

    def __repr__(self) -> str:
        # (The key as errors name it: any hashable object is one, and its repr may
        # raise, or be 5,000 digits that str() of an int refuses.)
        return (
            f"DispatchInfo(key={_key_text(self.key)}, queue_len={self.queue_len!r}, "
            f"queue_latency={self.queue_latency!r}, run_latency={self.run_latency!r}, "
            f"error={self.error!r})"
        )


@dataclass(frozen=True, slots=True)
class Hooks:
    """Callbacks that observe a dispatcher; every one is optional.

    - ``on_queued(key, queue_len)``: a task was accepted; ``queue_len`` is the
      number of tasks now waiting in its lane. Called once the task is
      queued: it may have started, even finished, and a ``drain()`` or
      ``shutdown()`` in another thread may have returned by then.
    - ``on_start(key)``: a task is about to run; called for every run, so
      again when a task that raised :class:`~outbound.Defer` runs again.
    - ``on_done(info)``: a task finished (returned or raised), once, when
      its future is resolved with that outcome (see :class:`DispatchInfo`);
      a run that deferred is not "done", and a task cancelled (before it
      started, or while deferred, by ``force_close``) gets no ``on_done``,
      whichever step the cancellation reached it at.
    - ``on_rejected(key, error)``: ``submit`` refused a task with ``error``
      (:class:`~outbound.errors.QueueFull` or
      :class:`~outbound.errors.DispatcherClosed`) and is about to raise it.

    Each field is checked here, not in the workers: a value that is not
    callable, or whose signature cannot take the arguments above, raises
    ``TypeError`` naming the hook (callables without a signature, such as
    some builtins, are taken as they are). Immutable; thread-safe.
    """

    on_queued: Callable[[Hashable, int], object] | None = None
    on_start: Callable[[Hashable], object] | None = None
    on_done: Callable[[DispatchInfo], object] | None = None
    on_rejected: Callable[[Hashable, BaseException], object] | None = None

    def __post_init__(self) -> None:
        """Refuse, at construction, a hook that could only fail inside the workers."""
        for field in fields(self):
            hook = getattr(self, field.name)
            if hook is not None:
                _check_hook(field.name, hook)


# The positional arguments each hook is called with.
_SIGNATURES = {
    "on_queued": ("key", "queue_len"),
    "on_start": ("key",),
    "on_done": ("info",),
    "on_rejected": ("key", "error"),
}


def _check_hook(name: str, hook: object) -> None:
    """``hook`` must be callable, and accept its arguments where its signature is known."""
    params = _SIGNATURES[name]
    expected = f"{name}({', '.join(params)})"
    if not callable(hook):
        raise TypeError(
            f"Hooks.{name} must be callable or None, not {type(hook).__name__}; "
            f"it is called as {expected}"
        )
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return
    try:
        signature.bind(*params)
    except TypeError as exc:
        raise TypeError(
            f"Hooks.{name} is called as {expected}, but {hook!r} has the signature "
            f"{signature}: {exc}"
        ) from None


def call_hook(name: str, hook: Callable[..., object], *args: object) -> None:
    """Call ``hook(*args)``; log and swallow whatever it raises.

    Even a ``BaseException`` such as ``SystemExit``: a hook must not stop a
    worker thread and stall its lane. Only a ``KeyboardInterrupt`` in the
    main thread goes on, so that Ctrl-C still stops a program.
    """
    try:
        hook(*args)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is (
            threading.main_thread()
        ):
            raise
        quiet.exception("outbound hook %s raised; ignored", name)
