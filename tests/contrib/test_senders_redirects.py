"""Redirects and what logs the URL: SlackSender followed a 301/302/303 as a GET
(the message dropped, the other server's "ok" taken for its post) with the
token in its Authorization header, wherever the Location said; a Location that
is not a URL came out of both client senders as a raw ValueError (bad input,
never retried); urllib3 logged pyTelegramBotAPI's URL, the token in it."""

from __future__ import annotations

import logging

import pytest
from canned_senders import SLACK_OK, TG_OK, canned, slack_sender, telebot_sender

from outbound.errors import PermanentSendError, TransientSendError
from outbound.messages import SendRequest, TextMessage

TOKEN = "123456:ABCdefGHIjklMNOpqrSTUvwxYZ0123456"


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_slack_follows_no_redirect(status: int) -> None:
    pytest.importorskip("slack_sdk")
    with canned() as target, canned() as front:
        target.answer(200, SLACK_OK)
        front.answer(status, b"", [("Location", target.url + "/api/chat.postMessage?x=1")])
        sender = slack_sender(front.url)
        with pytest.raises(PermanentSendError, match="redirect") as info:
            sender.send(SendRequest("C1", TextMessage("hello")))
        assert target.posts == 0
    assert f"'{target.url}/api/chat.postMessage'" in str(info.value)  # (not its query)


@pytest.mark.parametrize("location", ["http://[::1/x", "http://" + "a" * 64 + ".example/"])
@pytest.mark.parametrize("kind", ["slack", "telebot"])
def test_a_redirect_to_no_url_is_a_send_error(
    kind: str, location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("slack_sdk" if kind == "slack" else "telebot")
    with canned() as front:
        front.answer(302, b"", [("Location", location)])
        if kind == "slack":
            sender = slack_sender(front.url)
            chat: str | int = "C1"
        else:
            sender = telebot_sender(front.url, monkeypatch)
            chat = 1
        with pytest.raises((PermanentSendError, TransientSendError)):
            sender.send(SendRequest(chat, TextMessage("hello")))


def test_urllib3_logs_no_telebot_token(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("telebot")
    with canned() as server, caplog.at_level(logging.DEBUG):
        server.answer(200, TG_OK)
        sender = telebot_sender(server.url, monkeypatch, token=TOKEN)
        sender.send(SendRequest(42, TextMessage("hello")))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("urllib3")]
    assert any("/sendMessage" in line for line in lines), lines  # (it logged the URL)
    assert not any(TOKEN in line or "ABCdefGHI" in line for line in lines), lines
