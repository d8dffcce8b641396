"""TeleBotSender maps an error answer whose error_code is a number too large for a
float (1e400, read as inf) by its HTTP status: a 429 keeps its retry_after."""

from __future__ import annotations

import pytest
from canned_senders import canned, telebot_sender

from outbound.errors import PermanentSendError, RateLimited
from outbound.messages import SendRequest, TextMessage


def test_a_429_with_an_infinite_error_code_is_rate_limited(monkeypatch: pytest.MonkeyPatch) -> None:
    with canned() as server:
        server.answer(
            429,
            b'{"ok":false,"error_code":1e400,"description":"Too Many Requests",'
            b'"parameters":{"retry_after":20}}',
        )
        with pytest.raises(RateLimited) as info:
            telebot_sender(server.url, monkeypatch).send(SendRequest(42, TextMessage("hi")))
        assert info.value.retry_after == 20.0


def test_a_400_with_an_infinite_error_code_is_permanent(monkeypatch: pytest.MonkeyPatch) -> None:
    with canned() as server:
        server.answer(400, b'{"ok":false,"error_code":1e400,"description":"Bad Request"}')
        with pytest.raises(PermanentSendError):
            telebot_sender(server.url, monkeypatch).send(SendRequest(42, TextMessage("hi")))
