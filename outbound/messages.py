"""What is sent: messages, requests, results, and the :class:`Sender` protocol.

A :class:`Sender` sends one :class:`SendRequest` and returns a
:class:`SendResult`, or raises one of the send errors of
:mod:`outbound.errors` (:class:`~outbound.errors.RateLimited`,
:class:`~outbound.errors.TransientSendError`,
:class:`~outbound.errors.PermanentSendError`). A sender runs inside a
dispatcher task, so its deadline is ``outbound.current_context().deadline``.

All the data classes here are immutable and safe to share between threads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ChatId",
    "Message",
    "MethodMessage",
    "SendRequest",
    "SendResult",
    "Sender",
    "TextMessage",
    "check_json_params",
    "check_text",
]

#: A chat's id: an int (Telegram; negative for groups) or a str (Slack channel, ``@name``).
ChatId = int | str


@dataclass(frozen=True, slots=True)
class TextMessage:
    """A plain text message. ``text`` must be a non-empty ``str``.

    Platform limits (Telegram: 4096 characters) are checked by the sender's
    ``validate`` before anything is queued.
    """

    text: str
    parse_mode: str | None = None
    disable_notification: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"TextMessage.text must be a str, not {type(self.text).__name__}")
        if not self.text.strip():
            raise ValueError("TextMessage.text must not be empty")
        if self.parse_mode is not None and not isinstance(self.parse_mode, str):
            raise TypeError(
                "TextMessage.parse_mode must be a str or None, "
                f"not {type(self.parse_mode).__name__}"
            )
        if not isinstance(self.disable_notification, bool):
            raise TypeError(
                "TextMessage.disable_notification must be a bool, "
                f"not {type(self.disable_notification).__name__}"
            )


@dataclass(frozen=True, slots=True)
class MethodMessage:
    """Any other platform call: a method name and its parameters.

    For example ``MethodMessage("sendPhoto", {"photo": file_id})`` for
    Telegram or ``MethodMessage("chat.postMessage", {"blocks": [...]})`` for
    Slack. The sender adds the target chat.
    """

    method: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError("MethodMessage.method must be a non-empty str")
        if not isinstance(self.params, Mapping):
            raise TypeError("MethodMessage.params must be a mapping")


Message = TextMessage | MethodMessage


@dataclass(frozen=True, slots=True)
class SendRequest:
    """One message to one chat. ``idempotency_key`` lets a platform or a
    handler recognise a retry of the same message."""

    chat_id: ChatId
    message: Message
    idempotency_key: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.chat_id, bool) or not isinstance(self.chat_id, (int, str)):
            raise TypeError(f"chat_id must be an int or a str, not {type(self.chat_id).__name__}")
        if isinstance(self.chat_id, str) and not self.chat_id:
            raise ValueError("chat_id must not be empty")
        if not isinstance(self.message, (TextMessage, MethodMessage)):
            raise TypeError(
                "message must be a TextMessage or a MethodMessage, "
                f"not {type(self.message).__name__}"
            )


@dataclass(frozen=True, slots=True)
class SendResult:
    """What the platform answered: the new message's id and the raw response."""

    message_id: int | str | None
    raw: Mapping[str, Any] | None = None


@runtime_checkable
class Sender(Protocol):
    """Sends one message. Must be thread-safe: many workers call it at once.

    ``send`` blocks for the I/O, bounded by the running task's deadline
    (``outbound.current_context().remaining()``), and returns a
    :class:`SendResult` or raises a send error.
    """

    def send(self, request: SendRequest) -> SendResult: ...


def check_text(text: object, max_length: int) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``text`` is a non-empty str of at most
    ``max_length`` characters: the check every platform sender's ``validate`` makes."""
    if not isinstance(text, str):
        raise TypeError(f"the text must be a str, not {type(text).__name__}")
    if not text.strip():
        raise ValueError("the text must not be empty")
    if len(text) > max_length:
        raise ValueError(f"the text is {len(text)} characters long, over the limit of {max_length}")


def check_json_params(message: MethodMessage) -> None:
    """Raise ``TypeError`` unless the parameters of ``message`` encode as JSON."""
    try:
        json.dumps(dict(message.params))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the parameters of {message.method} are not JSON: {exc}") from exc
