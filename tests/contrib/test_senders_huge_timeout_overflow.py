"""A time limit past threading.TIMEOUT_MAX (which a socket cannot take) means no
limit for SlackSender and TeleBotSender, as it does for TelegramSender: the send
goes out, where socket.settimeout would raise OverflowError."""

from __future__ import annotations

import pytest
from canned_senders import SLACK_OK, TG_OK, canned, slack_sender, telebot_sender

from outbound.messages import SendRequest, TextMessage
from outbound.middleware import timeout
from outbound.reply import Outbound


def make(which: str, url: str, monkeypatch: pytest.MonkeyPatch, **options: float):  # type: ignore[no-untyped-def]
    if which == "slack":
        return slack_sender(url, **options), "C01"
    return telebot_sender(url, monkeypatch, **options), 42


@pytest.mark.parametrize("which", ["slack", "telebot"])
def test_a_sender_timeout_past_timeout_max_is_accepted_and_sends(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with canned() as server:
        server.answer(200, SLACK_OK if which == "slack" else TG_OK)
        sender, chat = make(which, server.url, monkeypatch, timeout=1e10)  # accepted here
        result = sender.send(SendRequest(chat, TextMessage("hi")))
        assert result.message_id is not None


@pytest.mark.parametrize("which", ["slack", "telebot"])
def test_a_dispatcher_send_timeout_past_timeout_max_sends(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with canned() as server:
        server.answer(200, SLACK_OK if which == "slack" else TG_OK)
        sender, chat = make(which, server.url, monkeypatch)
        with Outbound(None, timeout()(sender), send_timeout=1e10) as out:
            future = out.reply_text(chat, "hi")
            assert future.result(timeout=10).message_id is not None


@pytest.mark.parametrize("which", ["slack", "telebot"])
def test_middleware_timeout_past_timeout_max_sends(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with canned() as server:
        server.answer(200, SLACK_OK if which == "slack" else TG_OK)
        sender, chat = make(which, server.url, monkeypatch)
        result = timeout(1e10)(sender).send(SendRequest(chat, TextMessage("hi")))
        assert result.message_id is not None
