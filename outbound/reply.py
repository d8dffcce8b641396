"""Replying from a handler: :class:`Outbound`, the seed's ``Context.Reply``.

Reply semantics (the framework's contract)::

    future = outbound.reply(chat_id, message)

    guaranteed       the message was accepted into the dispatcher (queued in
                     its chat's lane or running), or the future already holds
                     the reason it was not (QueueFull, DispatcherClosed, bad
                     input); reply() itself never raises
    guaranteed       the send goes on after the calling handler returns
    guaranteed       messages to one chat leave in the order reply() was
                     called, one at a time; other chats go concurrently
    guaranteed       the future is resolved eventually: a SendResult, the
                     send error, or a cancellation by force_close()
    not guaranteed   that it was sent successfully
    not guaranteed   that the platform received it
    not guaranteed   that a message id is known

To rely on any of the last three, wait on the future, with a timeout::

    result = outbound.reply(chat_id, message).result(timeout=10)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Final

from typing_extensions import Self

from outbound._fork import renewed_after_fork

from ._future import _interrupts, failed_future
from .dispatcher import Dispatcher
from .errors import DispatcherClosed
from .messages import (
    ChatId,
    Message,
    Sender,
    SendRequest,
    SendResult,
    TextMessage,
    _chat_key_of,
)
from .retry import check_number

__all__ = ["Outbound"]


# Dispatchers whose lanes keyed by bare chat ids belong to an Outbound already.
_bare_keys: weakref.WeakSet[Dispatcher] = weakref.WeakSet()
# Guards _bare_keys; held for O(1).
_bare_keys_lock: Final = renewed_after_fork(threading.Lock())


def _failed(error: BaseException) -> Future[SendResult]:
    failed: Future[SendResult] = failed_future(error)
    return failed


class Outbound:
    """Sends messages through ``sender`` as tasks of ``dispatcher``, one lane per chat.

    ``sender`` is a :class:`~outbound.messages.Sender`, usually a platform
    sender wrapped in :mod:`outbound.middleware`. If it has a
    ``validate(request)`` method, each request is checked with it before it
    is queued, so that bad input fails at once, before any request goes
    out. See the module docstring for what a reply guarantees.

    ``dispatcher`` may be ``None``: the ``Outbound`` then makes its own
    :class:`~outbound.Dispatcher` (``dispatcher_options`` are its keyword
    arguments) and :meth:`close` shuts it down. Use it as a context
    manager, or call :meth:`close`, to stop accepting replies and shut down
    what it made; a dispatcher it was given is left running for its owner.

    Several ``Outbound`` objects (say, two bots) may share one dispatcher:
    each has lanes of its own, so one bot's chat 42 never waits behind the
    other bot's chat 42. The first ``Outbound`` on a dispatcher keys its
    lanes by the chat id itself (what hooks, ``QueueFull.key`` and
    ``current_context().key`` show), each later one by ``(outbound,
    chat_id)``: see :meth:`lane_key`.

    Thread-safe; :meth:`reply` and :meth:`reply_text` never block and never
    raise; :meth:`close` blocks until what it made has drained (or its
    ``timeout``).
    """

    __slots__ = (
        "__weakref__",
        "_bare",
        "_chat_key",
        "_closed",
        "_dispatcher",
        "_lock",
        "_owns_dispatcher",
        "_sender",
        "_validate",
    )

    def __init__(
        self, dispatcher: Dispatcher | None, sender: Sender, **dispatcher_options: Any
    ) -> None:
        if dispatcher is not None and not isinstance(dispatcher, Dispatcher):
            raise TypeError(f"dispatcher must be an outbound.Dispatcher, not {dispatcher!r}")
        if dispatcher is not None and dispatcher_options:
            raise TypeError("dispatcher options are for a dispatcher the Outbound makes itself")
        if not callable(getattr(sender, "send", None)):
            raise TypeError(f"sender must have a send(request) method: {sender!r}")
        self._owns_dispatcher: Final = dispatcher is None
        self._dispatcher: Final = (
            Dispatcher(**dispatcher_options) if dispatcher is None else dispatcher
        )
        self._sender: Final = sender
        validate = getattr(sender, "validate", None)
        self._validate: Final[Callable[[SendRequest], object] | None] = (
            validate if callable(validate) else None
        )
        self._chat_key: Final = _chat_key_of(sender)
        # Guards _closed; nobody waits on it.
        self._lock: Final = renewed_after_fork(threading.Lock())
        self._closed = False
        with _bare_keys_lock:
            self._bare: Final = self._dispatcher not in _bare_keys
            _bare_keys.add(self._dispatcher)

    @property
    def dispatcher(self) -> Dispatcher:
        return self._dispatcher

    @property
    def sender(self) -> Sender:
        return self._sender

    def lane_key(self, chat_id: ChatId) -> Hashable:
        """The dispatcher key of this Outbound's lane for ``chat_id``.

        The chat as the sender knows it (its ``chat_key(chat_id)``, if it has
        one: Telegram's ``"@Name"`` and ``"@name"`` are one chat, one lane)
        for the first Outbound made on its dispatcher, ``(self, that)`` for
        each later one, so that Outbounds sharing a dispatcher never share a
        lane. Never blocks.
        """
        chat = chat_id if self._chat_key is None else self._chat_key(chat_id)
        return chat if self._bare else (self, chat)

    def reply(
        self, chat_id: ChatId, message: Message, *, idempotency_key: str | None = None
    ) -> Future[SendResult]:
        """Queue ``message`` for ``chat_id``; return the future of its :class:`SendResult`.

        Never raises (but a Ctrl-C in the main thread): an invalid request
        (``TypeError``/``ValueError`` from :class:`~outbound.messages.SendRequest`,
        or whatever the sender's ``validate`` raises),
        :class:`~outbound.errors.QueueFull` and
        :class:`~outbound.errors.DispatcherClosed` come back inside an
        already resolved future, and nothing is sent. Never blocks.
        """
        try:
            if self._closed:  # unlocked read: a reply racing close() may still be accepted
                raise DispatcherClosed("this Outbound is closed")
            request = SendRequest(chat_id, message, idempotency_key)
            if self._validate is not None:
                self._validate(request)
            return self._dispatcher.submit(
                self.lane_key(request.chat_id), self._sender.send, request
            )
        except (
            BaseException
        ) as error:  # (a validate raising SystemExit: no less an invalid request)
            if _interrupts(error):
                raise
            return _failed(error)

    def reply_text(
        self,
        chat_id: ChatId,
        text: str,
        *,
        parse_mode: str | None = None,
        disable_notification: bool = False,
        idempotency_key: str | None = None,
    ) -> Future[SendResult]:
        """:meth:`reply` with a :class:`~outbound.messages.TextMessage` of ``text``.

        An empty or non-``str`` text comes back inside the future. Never
        raises, never blocks.
        """
        try:
            message = TextMessage(text, parse_mode, disable_notification)
        except BaseException as error:  # (a str subclass's strip() raising SystemExit)
            if _interrupts(error):
                raise
            return _failed(error)
        return self.reply(chat_id, message, idempotency_key=idempotency_key)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new replies; shut down the dispatcher this Outbound made, if any.

        A made dispatcher is shut down (what was accepted still goes out)
        within ``timeout`` seconds (``None``: as long as it takes); returns
        True if it finished in time (always True for a dispatcher it was
        given, which is left running). Called from a task, hook or
        done-callback of that dispatcher, which cannot wait for itself, it
        closes the dispatcher (what was accepted still goes out) and returns
        False at once; a later call from another thread waits. Idempotent.
        """
        if timeout is not None:  # before any change
            timeout = check_number("timeout", timeout, allow_inf=True)
        with self._lock:
            self._closed = True
        if not self._owns_dispatcher:
            return True
        try:
            return self._dispatcher.shutdown(timeout)
        except RuntimeError:  # from one of its own threads: it would wait for itself
            self._dispatcher.close()
            return False

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        # Short, and O(1): it names a later Outbound's lanes, (outbound, chat_id),
        # in QueueFull and DispatchInfo (a dispatcher's repr reads its stats).
        return (
            f"<Outbound sender={type(self._sender).__name__} "
            f"dispatcher=0x{id(self._dispatcher):x} at 0x{id(self):x}>"
        )
