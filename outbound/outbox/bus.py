"""The in-process event bus: :class:`EventBus`, handlers by event type."""

from __future__ import annotations

import threading
from collections.abc import Callable

from outbound._fork import renewed_after_fork

from ._base import OutboxMessage

__all__ = ["EventBus", "Handler"]

#: A handler receives one message; what it returns is ignored. It raises to
#: fail the delivery (see :class:`~outbound.outbox.Relay` for what each
#: exception means).
Handler = Callable[[OutboxMessage], object]


class EventBus:
    """Handlers subscribed by event type; the relay publishes each row to its type's handlers.

    Several handlers may subscribe to one type: they run in subscription
    order, and the delivery succeeds only if every one returns (a retry
    runs them all again, so each must be idempotent). Thread-safe:
    subscribe and unsubscribe at any time; a delivery uses the handlers
    subscribed when it starts. Never blocks beyond a short internal lock.
    """

    def __init__(self) -> None:
        # Guards _handlers (replaced, never mutated in place, so readers
        # take a snapshot). Held only to read or swap the dict. Made new in a
        # forked child: one a parent thread held at the fork (a relay
        # delivering) stayed held there, and every use hung.
        self._lock = renewed_after_fork(threading.Lock())
        self._handlers: dict[str, tuple[Handler, ...]] = {}

    def subscribe(self, type: str, handler: Handler) -> None:
        """Run ``handler(message)`` for every message of ``type``."""
        if not isinstance(type, str) or not type:
            raise ValueError(f"type must be a non-empty str, not {type!r}")
        if not callable(handler):
            raise TypeError(f"handler must be callable, not {handler.__class__.__name__}")
        with self._lock:
            handlers = dict(self._handlers)
            handlers[type] = (*handlers.get(type, ()), handler)
            self._handlers = handlers

    def unsubscribe(self, type: str, handler: Handler) -> bool:
        """Remove one subscription of ``handler`` to ``type``; False if there was none."""
        with self._lock:
            current = self._handlers.get(type, ())
            if handler not in current:
                return False
            index = current.index(handler)
            handlers = dict(self._handlers)
            rest = current[:index] + current[index + 1 :]
            if rest:
                handlers[type] = rest
            else:
                del handlers[type]
            self._handlers = handlers
            return True

    def handlers(self, type: str) -> tuple[Handler, ...]:
        """The handlers of ``type`` now, in subscription order."""
        with self._lock:
            return self._handlers.get(type, ())

    def types(self) -> frozenset[str]:
        """The types that have at least one handler."""
        with self._lock:
            return frozenset(self._handlers)

    def publish(self, message: OutboxMessage) -> int:
        """Run the handlers of ``message.type`` in this thread; return how many ran.

        Raises ``LookupError`` if none is subscribed; whatever a handler
        raises propagates (the later handlers do not run).
        """
        handlers = self.handlers(message.type)
        if not handlers:
            raise LookupError(f"no handler subscribed for outbox type {message.type!r}")
        for handler in handlers:
            handler(message)
        return len(handlers)

    def __repr__(self) -> str:
        with self._lock:
            n = sum(len(h) for h in self._handlers.values())
            return f"<EventBus types={len(self._handlers)} handlers={n}>"
