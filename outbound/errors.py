"""Errors raised by outbound.

Every error the library raises on purpose derives from :class:`OutboundError`,
and also from the builtin a caller would already catch::

    OutboundError
    ├── QueueFull                      a lane (one key's queue) is full
    ├── DispatcherClosed (RuntimeError) the dispatcher refuses new work
    │   └── BrokenDispatcher (concurrent.futures.thread.BrokenThreadPool)
    │                                  a worker initializer failed
    ├── SendError                      sending one message failed
    │   ├── RateLimited                the platform said "slow down" (HTTP 429)
    │   ├── TransientSendError         worth retrying (5xx, network, timeout)
    │   │   └── SendTimeout (TimeoutError) no answer within the time allowed
    │   ├── MessageExpired (TimeoutError) too old to send: it would go out stale
    │   │                              (also when a 429 asks to wait past the age limit)
    │   └── PermanentSendError         not worth retrying (4xx, bad request)
    └── OutboxError                    the durable outbox
        ├── OutboxFull                 ``max_pending`` reached; nothing written
        ├── DuplicateMessage           an unfinished row has the same dedupe key
        └── StoreError                 the outbox database failed (wraps the
                                       driver's error, chained with ``from``)

A backend failure (a database driver's error, an HTTP client's error) is
wrapped once, chained with ``from`` to the original.
"""

from __future__ import annotations

import math
from concurrent.futures.thread import BrokenThreadPool
from typing import Any, Final, Literal

__all__ = [
    "BrokenDispatcher",
    "DispatcherClosed",
    "DuplicateMessage",
    "MessageExpired",
    "OutboundError",
    "OutboxError",
    "OutboxFull",
    "PermanentSendError",
    "QueueFull",
    "RateLimited",
    "SendError",
    "SendTimeout",
    "StoreError",
    "TransientSendError",
]


class OutboundError(Exception):
    """Base class of every error raised by outbound."""


class QueueFull(OutboundError):
    """A key's lane already holds ``queue_size`` waiting tasks.

    Raised at once by ``submit``; only that key is refused, other keys are
    unaffected.
    """

    def __init__(self, key: object, queue_size: int) -> None:
        super().__init__(f"queue full for key {_key_text(key)}: {queue_size} tasks already waiting")
        self.key = key
        self.queue_size = queue_size

    def __reduce__(self) -> tuple[Any, ...]:
        return _restored, (type(self), self.args, self.__dict__)


def _restored(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """An error of ``cls`` with ``args`` and attributes ``state``, made without its
    ``__init__``: how an error whose ``__init__`` takes other arguments than its
    ``args`` is unpickled (in another process: a pool's result, a task queue's)."""
    error = cls.__new__(cls, *args)
    error.__dict__.update(state)
    return error


def _key_text(key: object) -> str:
    """``repr(key)`` for a message, at most 200 characters; a key whose ``repr`` raises
    (any hashable object is a key) is named by its type: the refusal must be raised."""
    try:
        text = repr(key)
    except BaseException as exc:  # (a SystemExit too: a refusal is no exit; a Ctrl-C is)
        if isinstance(exc, KeyboardInterrupt):
            raise
        return f"<{type(key).__qualname__} object whose repr() raised>"
    return text if len(text) <= 200 else text[:197] + "..."


class DispatcherClosed(OutboundError, RuntimeError):
    """The dispatcher was closed and refuses new work."""


class BrokenDispatcher(DispatcherClosed, BrokenThreadPool):
    """A worker's initializer raised: the dispatcher refuses all work.

    Also a ``concurrent.futures.thread.BrokenThreadPool``, as a
    ``ThreadPoolExecutor`` raises in the same case.
    """


class SendError(OutboundError):
    """Sending one message failed."""


class RateLimited(SendError):
    """The platform refused a send for now (HTTP 429).

    ``retry_after`` is the number of seconds the platform asked to wait (a
    finite number >= 0; a longer wait than :attr:`MAX_RETRY_AFTER`, one day,
    is cut to it: past a day any message is stale, and a ban must end);
    ``scope`` says what must wait: ``"chat"`` (this chat only) or ``"global"``
    (every chat of the bot). ``stated`` is False when the platform did not
    say whose limit it was (real Telegram and Slack never do): ``scope`` is
    then a guess, which a rate limiter may correct (see
    :meth:`outbound.ratelimit.BaseRateLimiter.record_429`).
    """

    #: The longest wait a 429 is taken to ask for, in seconds (one day).
    MAX_RETRY_AFTER: Final = 86_400.0

    #: False for the client-side limiter's own refusal (outside a dispatcher
    #: task), which is no 429 of the platform's: what metrics tell apart. Internal.
    _from_platform: bool = True

    def __init__(
        self,
        retry_after: float,
        scope: Literal["chat", "global"] = "chat",
        message: str | None = None,
        *,
        stated: bool = True,
    ) -> None:
        if scope not in ("chat", "global"):
            raise ValueError(f"scope must be 'chat' or 'global', not {scope!r}")
        if isinstance(retry_after, bool) or not isinstance(retry_after, (int, float)):
            raise TypeError(
                f"retry_after must be a number of seconds, not {type(retry_after).__name__}"
            )
        if not 0.0 <= retry_after < math.inf:  # NaN fails too
            raise ValueError(f"retry_after must be a finite number >= 0, not {retry_after!r}")
        # (compared first: an int too large for a float is a wait past a day too)
        retry_after = (
            self.MAX_RETRY_AFTER if retry_after > self.MAX_RETRY_AFTER else float(retry_after)
        )
        super().__init__(message or f"rate limited ({scope}): retry after {retry_after:g}s")
        self.retry_after = retry_after
        self.scope: Literal["chat", "global"] = scope
        self.stated = bool(stated)

    def __reduce__(self) -> tuple[Any, ...]:
        return _restored, (type(self), self.args, self.__dict__)


class TransientSendError(SendError):
    """A failure that may pass if the send is tried again (5xx, network, timeout)."""


class SendTimeout(TransientSendError, TimeoutError):
    """The send ran out of time (the task's deadline or the sender's timeout).

    Transient: the message may or may not have reached the platform.
    """


class MessageExpired(SendError, TimeoutError):
    """The message was not sent: it is, or would be, past its age limit (``retry(max_total=)``).

    Raised both when a run starts too late and when the next try (after a
    429's ``retry_after``, a backoff, or the rate limiter's wait) would
    start too late; either way it is chained (``__cause__``) to the
    message's last error if there was one, a :class:`RateLimited` or a
    :class:`TransientSendError`. Failing is better than a reply that
    arrives long after it made sense.
    """

    #: The error of the run that raised this one (the 429 it was raised at),
    #: if any: what metrics count once. Internal.
    _ended_on: BaseException | None = None


class PermanentSendError(SendError):
    """A failure that trying again will not fix (a bad request, a blocked bot)."""


class OutboxError(OutboundError):
    """An error of the durable outbox."""


class OutboxFull(OutboxError):
    """``max_pending`` rows are already pending; the new row was not written."""


class DuplicateMessage(OutboxError):
    """An unfinished outbox row already has this dedupe key; nothing was written."""


class StoreError(OutboxError):
    """The outbox database failed: a driver error, a closed connection, a bad schema.

    Always chained (``from``) to the driver's own exception. Whether the
    caller's transaction is still usable depends on that error; nothing was
    written by the failed call.
    """
