"""TeleBotSender takes a 200 that says "ok": true for sent, whatever its result
(missing, null, true, "abc"), as TelegramSender does: a SendResult without a
message_id, never a retry that sends the message again."""

from __future__ import annotations

import pytest
from canned_senders import canned, telebot_sender, telegram_sender

from outbound.messages import SendRequest, TextMessage
from outbound.middleware import chain, retry, timeout
from outbound.reply import Outbound

ANSWERS = [
    pytest.param(b'{"ok":true}', id="no-result"),
    pytest.param(b'{"ok":true,"result":null}', id="result-null"),
    pytest.param(b'{"ok":true,"result":true}', id="result-true"),
    pytest.param(b'{"ok":true,"result":"abc"}', id="result-str"),
]


@pytest.mark.parametrize("body", ANSWERS)
def test_builtin_sender_takes_it_as_sent(body: bytes) -> None:  # passes: the reference
    with canned() as server:
        server.answer(200, body)
        assert (
            telegram_sender(server.url).send(SendRequest(42, TextMessage("hi"))).message_id is None
        )


@pytest.mark.parametrize("body", ANSWERS)
def test_telebot_sender_takes_it_as_sent(body: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    with canned() as server:
        server.answer(200, body)
        result = telebot_sender(server.url, monkeypatch).send(SendRequest(42, TextMessage("hi")))
        assert result.message_id is None


def test_telebot_ok_true_without_result_is_not_sent_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    with canned() as server:
        server.answer(200, b'{"ok":true}')
        sender = chain(retry(max_attempts=3, base_delay=0.01, max_delay=0.01), timeout())(
            telebot_sender(server.url, monkeypatch)
        )
        with Outbound(None, sender) as out:
            future = out.reply_text(42, "pay 100 EUR to Bob")
            try:
                future.result(timeout=10)
            except Exception:
                pass
        assert server.posts == 1  # the platform took it once
        assert future.exception() is None
