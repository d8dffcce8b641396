"""TeleBotSender reads a Retry-After header sent twice (requests joins the two as
"30, 30") as the first one, as TelegramSender and SlackSender do."""

from __future__ import annotations

import pytest
from canned_senders import canned, telebot_sender, telegram_sender

from outbound.errors import RateLimited
from outbound.messages import SendRequest, TextMessage

BODY = b'{"ok":false,"error_code":429,"description":"Too Many Requests"}'
HEADERS = [("Content-Type", "application/json"), ("Retry-After", "30"), ("Retry-After", "30")]


def test_builtin_reads_the_repeated_header() -> None:  # passes: the reference
    with canned() as server:
        server.answer(429, BODY, HEADERS)
        with pytest.raises(RateLimited) as info:
            telegram_sender(server.url).send(SendRequest(42, TextMessage("hi")))
        assert info.value.retry_after == 30.0


def test_telebot_reads_the_repeated_header(monkeypatch: pytest.MonkeyPatch) -> None:
    with canned() as server:
        server.answer(429, BODY, HEADERS)
        with pytest.raises(RateLimited) as info:
            telebot_sender(server.url, monkeypatch).send(SendRequest(42, TextMessage("hi")))
        assert info.value.retry_after == 30.0
