"""Loopback HTTP servers standing in for Slack and Telegram: one canned answer per POST.

Headers are a list of (name, value) pairs, so the same header may be sent twice.
It counts the POSTs it received (what "sent twice" means).
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Canned:
    def __init__(self) -> None:
        self.status = 200
        self.headers: list[tuple[str, str]] = [("Content-Type", "application/json")]
        self.body = b"{}"
        self.posts = 0
        self.authorizations: list[str | None] = []  # each request's Authorization
        self.lock = threading.Lock()
        self.url = ""

    def answer(
        self, status: int, body: bytes, headers: list[tuple[str, str]] | None = None
    ) -> None:
        self.status = status
        self.body = body
        self.headers = (
            list(headers) if headers is not None else [("Content-Type", "application/json")]
        )


@contextmanager
def canned() -> Iterator[Canned]:
    state = Canned()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with state.lock:
                state.posts += 1
                state.authorizations.append(self.headers.get("Authorization"))
            self.send_response(state.status)
            for name, value in state.headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(state.body)))
            self.send_header("Connection", "close")  # (its thread ends: joined at the close)
            self.end_headers()
            self.wfile.write(state.body)

        do_GET = do_POST

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        serving.join(10)
        server.server_close()


def telebot_sender(url: str, monkeypatch, token="1:x", **options):  # type: ignore[no-untyped-def]
    """A TeleBotSender over a real telebot.TeleBot (of ``token``) pointed at ``url``."""
    import telebot  # noqa: PLC0415

    from outbound.contrib.telebot import TeleBotSender  # noqa: PLC0415

    monkeypatch.setattr(telebot.apihelper, "API_URL", url + "/bot{0}/{1}")
    monkeypatch.setattr(telebot.apihelper, "RETRY_ON_ERROR", False)
    return TeleBotSender(telebot.TeleBot(token, threaded=False), **options)


def slack_sender(url: str, **options):  # type: ignore[no-untyped-def]
    """A SlackSender over a real slack_sdk.WebClient pointed at ``url``."""
    import slack_sdk  # noqa: PLC0415

    from outbound.contrib.slack import SlackSender  # noqa: PLC0415

    return SlackSender(slack_sdk.WebClient(token="xoxb-1", base_url=url + "/api/"), **options)


def telegram_sender(url: str, **options):  # type: ignore[no-untyped-def]
    from outbound.telegram import TelegramSender  # noqa: PLC0415

    return TelegramSender("1:x", base_url=url, **options)


#: A Bot API answer to sendMessage that pyTelegramBotAPI reads in full.
TG_OK = b'{"ok":true,"result":{"message_id":7,"date":0,"chat":{"id":42,"type":"private"}}}'
#: A Slack answer to chat.postMessage.
SLACK_OK = b'{"ok":true,"channel":"C01","ts":"1700000000.000100"}'


def sender_of(kind: str, url: str, monkeypatch):  # type: ignore[no-untyped-def]
    """``(sender, chat)``: a sender of ``kind`` ("telegram", "telebot", "slack")
    pointed at ``url``, and a chat id it takes; skipped if its client is missing."""
    import pytest  # noqa: PLC0415

    if kind == "slack":
        pytest.importorskip("slack_sdk")
        return slack_sender(url), "C1"
    if kind == "telebot":
        pytest.importorskip("telebot")
        return telebot_sender(url, monkeypatch), 42
    return telegram_sender(url), 42
