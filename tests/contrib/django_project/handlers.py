"""The outbox handler of the test project: replies on the platform, waits for the result."""

from __future__ import annotations

import threading

import relay_crash  # noqa: F401  (a relay that fails when a test says so)

from outbound import PermanentSendError, current_context
from outbound.contrib.django import get_outbound, reply_text
from outbound.outbox import OutboxMessage


def greet(message: OutboxMessage) -> None:
    reply_text(message.payload["chat_id"], message.payload["text"]).result(timeout=10)


def stall(message: OutboxMessage) -> None:
    """Say so on the platform, then hold the row until the relay is forced to stop."""
    reply_text(message.payload["chat_id"], "stalling").result(timeout=10)
    current_context().wait_cancelled(30.0)


def stubborn(message: OutboxMessage) -> None:
    """Say so on the platform, then ignore the relay's cancellation for a minute."""
    reply_text(message.payload["chat_id"], "stubborn").result(timeout=10)
    threading.Event().wait(60.0)


def impatient(message: OutboxMessage) -> None:
    """Queue a send that takes a minute (a slow platform) and give up waiting for it
    after half a second: it is still being sent when a drain ends."""
    dispatcher = get_outbound().dispatcher
    dispatcher.submit(message.payload["chat_id"], threading.Event().wait, 60.0).result(0.5)


def fire(message: OutboxMessage) -> None:
    """Queue a send that takes a minute (a slow platform) and return at once: the
    row is sent, the send goes on."""
    get_outbound().dispatcher.submit(message.payload["chat_id"], threading.Event().wait, 60.0)


def flaky(message: OutboxMessage) -> None:
    """Fail every time: retried."""
    raise RuntimeError(f"the platform is down for chat {message.payload['chat_id']}")


def refused(message: OutboxMessage) -> None:
    """Fail for good: dead at once."""
    raise PermanentSendError(f"chat {message.payload['chat_id']} blocked the bot")
