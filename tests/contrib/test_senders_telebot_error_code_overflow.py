"""TeleBotSender maps an error answer whose error_code is a number too large for a
float (1e400, read as inf) by its HTTP status: a 429 keeps its retry_after; and
one whose error_code and HTTP status disagree by whichever says more."""

from __future__ import annotations

import pytest
from canned_senders import canned, telebot_sender

from outbound.errors import PermanentSendError, RateLimited, TransientSendError
from outbound.messages import SendRequest, TextMessage


@pytest.mark.parametrize(
    ("code", "wait"),
    [(b"1e400", 20), (b"400", 7)],
    ids=["an error_code past a float", "another error_code"],
)
def test_an_http_429_is_rate_limited_and_keeps_its_wait(
    monkeypatch: pytest.MonkeyPatch, code: bytes, wait: int
) -> None:
    with canned() as server:
        server.answer(
            429,
            b'{"ok":false,"error_code":%s,"description":"Too Many Requests",'
            b'"parameters":{"retry_after":%d}}' % (code, wait),
        )
        with pytest.raises(RateLimited) as info:
            telebot_sender(server.url, monkeypatch).send(SendRequest(42, TextMessage("hi")))
        assert info.value.retry_after == float(wait)


def test_a_400_with_an_infinite_error_code_is_permanent(monkeypatch: pytest.MonkeyPatch) -> None:
    with canned() as server:
        server.answer(400, b'{"ok":false,"error_code":1e400,"description":"Bad Request"}')
        with pytest.raises(PermanentSendError):
            telebot_sender(server.url, monkeypatch).send(SendRequest(42, TextMessage("hi")))


@pytest.mark.parametrize("code", [0, -1, 1, 400])
@pytest.mark.parametrize("status", [502, 503, 504])
def test_an_http_5xx_with_an_error_code_of_its_own_is_transient(
    monkeypatch: pytest.MonkeyPatch, status: int, code: int
) -> None:
    # A gateway's answer in the Bot API's shape, its own code in it: the
    # message was dropped as permanent, never tried again.
    body = b'{"ok":false,"error_code":%d,"description":"upstream unavailable"}' % code
    with canned() as server:
        server.answer(status, body)
        with pytest.raises(TransientSendError):
            telebot_sender(server.url, monkeypatch).send(SendRequest(42, TextMessage("hi")))
