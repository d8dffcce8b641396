"""An interim "103 Early Hints" answer before the real one.

TelegramSender skips every 1xx. urllib (slack_sdk) and requests
(pyTelegramBotAPI) skip only "100 Continue" and take a 103 for the answer,
so the two senders over them cannot tell whether the call was made: they
raise TransientSendError, and a retry sends again (at least once, as the
README says; never a delivered message reported as refused for good).
"""

from __future__ import annotations

import pytest
from canned_http import raw_server
from canned_senders import SLACK_OK, TG_OK, slack_sender, telebot_sender, telegram_sender

from outbound.errors import TransientSendError
from outbound.messages import SendRequest, TextMessage


def answer(body: bytes) -> bytes:
    return (
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def test_the_builtin_sender_skips_the_interim_answer() -> None:
    with raw_server(answer(TG_OK)) as url:
        assert telegram_sender(url).send(SendRequest(42, TextMessage("hi"))).message_id == 7


def test_telebot_takes_it_for_a_transient_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    with raw_server(answer(TG_OK)) as url:
        sender = telebot_sender(url, monkeypatch)
        with pytest.raises(TransientSendError, match="HTTP 103"):
            sender.send(SendRequest(42, TextMessage("hi")))


def test_slack_takes_it_for_a_transient_failure() -> None:
    with raw_server(answer(SLACK_OK)) as url:
        with pytest.raises(TransientSendError):
            slack_sender(url).send(SendRequest("C01", TextMessage("hi")))
