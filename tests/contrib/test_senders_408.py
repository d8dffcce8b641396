"""An HTTP 408 (the server, or a gateway, gave up waiting for the request and did
not act on it) is transient for every sender, whatever its body says: in the Bot
API's shape it was permanent for TeleBotSender and TelegramSender (the message
dropped), while TeleBotSender retried the same 408 with any other body."""

from __future__ import annotations

import pytest
from canned_senders import canned, sender_of

from outbound.errors import PermanentSendError, TransientSendError
from outbound.messages import SendRequest, TextMessage

TELEGRAM = b'{"ok":false,"error_code":408,"description":"Request Timeout"}'
SLACK = b'{"ok":false,"error":"request_timeout_at_the_gateway"}'


@pytest.mark.parametrize("sender", ["telegram", "telebot", "slack"])
def test_a_408_is_transient(monkeypatch: pytest.MonkeyPatch, sender: str) -> None:
    with canned() as server:
        server.answer(408, SLACK if sender == "slack" else TELEGRAM)
        made, chat = sender_of(sender, server.url, monkeypatch)
        with pytest.raises(TransientSendError) as caught:
            made.send(SendRequest(chat, TextMessage("hi")))
    assert not isinstance(caught.value, PermanentSendError)
