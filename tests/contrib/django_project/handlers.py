"""The outbox handler of the test project: replies on the platform, waits for the result."""

from __future__ import annotations

from outbound import current_context
from outbound.contrib.django import reply_text
from outbound.outbox import OutboxMessage


def greet(message: OutboxMessage) -> None:
    reply_text(message.payload["chat_id"], message.payload["text"]).result(timeout=10)


def stall(message: OutboxMessage) -> None:
    """Say so on the platform, then hold the row until the relay is forced to stop."""
    reply_text(message.payload["chat_id"], "stalling").result(timeout=10)
    current_context().wait_cancelled(30.0)
