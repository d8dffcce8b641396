"""outbound: send things out of synchronous Python programs in order, at the
platform's pace, without losing them.

The core is :class:`Dispatcher`: tasks per key (per chat) in strict FIFO
order, keys concurrently on a bounded thread pool, full queues refused at
once. :class:`KeyedExecutor` offers the same as a drop-in
``concurrent.futures.Executor``.
"""

from __future__ import annotations

import logging

from .context import Defer, TaskContext, current_context
from .dispatcher import Dispatcher, DispatcherStats, State
from .errors import (
    BrokenDispatcher,
    DispatcherClosed,
    DuplicateMessage,
    OutboundError,
    OutboxError,
    OutboxFull,
    PermanentSendError,
    QueueFull,
    RateLimited,
    SendError,
    SendTimeout,
    StoreError,
    TransientSendError,
)
from .executor import KeyedExecutor
from .hooks import DispatchInfo, Hooks

__version__ = "0.1.0"

__all__ = [
    "BrokenDispatcher",
    "Defer",
    "DispatchInfo",
    "Dispatcher",
    "DispatcherClosed",
    "DispatcherStats",
    "DuplicateMessage",
    "Hooks",
    "KeyedExecutor",
    "OutboundError",
    "OutboxError",
    "OutboxFull",
    "PermanentSendError",
    "QueueFull",
    "RateLimited",
    "SendError",
    "SendTimeout",
    "State",
    "StoreError",
    "TaskContext",
    "TransientSendError",
    "__version__",
    "current_context",
]

logging.getLogger("outbound").addHandler(logging.NullHandler())
