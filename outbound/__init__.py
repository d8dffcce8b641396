"""outbound: send things out of synchronous Python programs in order, at the
platform's pace, without losing them.

The core is :class:`Dispatcher`: tasks per key (per chat) in strict FIFO
order, keys concurrently on a bounded thread pool, full queues refused at
once. :class:`KeyedExecutor` offers the same as a drop-in
``concurrent.futures.Executor``. :class:`Outbound` sends messages through a
:class:`Sender` (see :mod:`outbound.middleware` and
:mod:`outbound.telegram`); :mod:`outbound.outbox` keeps them durably.
"""

from __future__ import annotations

import logging

from .context import Defer, TaskContext, current_context, narrow_deadline, time_allowed
from .dispatcher import Dispatcher, DispatcherStats, State
from .errors import (
    BrokenDispatcher,
    DispatcherClosed,
    DuplicateMessage,
    MessageExpired,
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
from .messages import (
    ChatId,
    Message,
    MethodMessage,
    Sender,
    SendRequest,
    SendResult,
    TextMessage,
    check_json_params,
    check_text,
)
from .reply import Outbound

__version__ = "0.1.0"

__all__ = [
    "BrokenDispatcher",
    "ChatId",
    "Defer",
    "DispatchInfo",
    "Dispatcher",
    "DispatcherClosed",
    "DispatcherStats",
    "DuplicateMessage",
    "Hooks",
    "KeyedExecutor",
    "Message",
    "MessageExpired",
    "MethodMessage",
    "Outbound",
    "OutboundError",
    "OutboxError",
    "OutboxFull",
    "PermanentSendError",
    "QueueFull",
    "RateLimited",
    "SendError",
    "SendRequest",
    "SendResult",
    "SendTimeout",
    "Sender",
    "State",
    "StoreError",
    "TaskContext",
    "TextMessage",
    "TransientSendError",
    "__version__",
    "check_json_params",
    "check_text",
    "current_context",
    "narrow_deadline",
    "time_allowed",
]

logging.getLogger("outbound").addHandler(logging.NullHandler())
