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
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Final

from typing_extensions import Self

from .dispatcher import Dispatcher
from .errors import DispatcherClosed
from .messages import ChatId, Message, Sender, SendRequest, SendResult, TextMessage

__all__ = ["Outbound"]


def _failed(error: BaseException) -> Future[SendResult]:
    future: Future[SendResult] = Future()
    future.set_exception(error)
    return future


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

    Thread-safe; :meth:`reply` and :meth:`reply_text` never block and never
    raise; :meth:`close` blocks until what it made has drained (or its
    ``timeout``).
    """

    __slots__ = ("_closed", "_dispatcher", "_lock", "_owns_dispatcher", "_sender", "_validate")

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
        # Guards _closed; nobody waits on it.
        self._lock: Final = threading.Lock()
        self._closed = False

    @property
    def dispatcher(self) -> Dispatcher:
        return self._dispatcher

    @property
    def sender(self) -> Sender:
        return self._sender

    def reply(
        self, chat_id: ChatId, message: Message, *, idempotency_key: str | None = None
    ) -> Future[SendResult]:
        """Queue ``message`` for ``chat_id``; return the future of its :class:`SendResult`.

        Never raises: an invalid request (``TypeError``/``ValueError`` from
        :class:`~outbound.messages.SendRequest`, or what the sender's
        ``validate`` raises), :class:`~outbound.errors.QueueFull` and
        :class:`~outbound.errors.DispatcherClosed` come back inside an
        already resolved future, and nothing is sent. Never blocks.
        """
        try:
            if self._closed:  # unlocked read: a reply racing close() may still be accepted
                raise DispatcherClosed("this Outbound is closed")
            request = SendRequest(chat_id, message, idempotency_key)
            if self._validate is not None:
                self._validate(request)
            return self._dispatcher.submit(request.chat_id, self._sender.send, request)
        except Exception as error:
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
        except Exception as error:
            return _failed(error)
        return self.reply(chat_id, message, idempotency_key=idempotency_key)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new replies; shut down the dispatcher this Outbound made, if any.

        A made dispatcher is shut down (what was accepted still goes out)
        within ``timeout`` seconds (``None``: as long as it takes); returns
        True if it finished in time (always True for a dispatcher it was
        given, which is left running). Idempotent.
        """
        with self._lock:
            self._closed = True
        if self._owns_dispatcher:
            return self._dispatcher.shutdown(timeout)
        return True

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
        return f"<Outbound sender={self._sender!r} dispatcher={self._dispatcher!r}>"
