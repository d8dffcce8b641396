"""Answers slack_sdk cannot read (a proxy's Latin-1 page, an unknown charset, JSON
nested too deep, an int past 4,300 digits) are mapped by their HTTP status, as the
other senders map them: a 429 keeps its Retry-After, the others are transient."""

from __future__ import annotations

import pytest
from canned_senders import canned, slack_sender

from outbound.errors import RateLimited, TransientSendError
from outbound.messages import SendRequest, TextMessage
from outbound.middleware import rate_limit
from outbound.ratelimit import RateLimiter, RateLimits

DEEP = b"[" * 100_000 + b"]" * 100_000
LATIN1_PAGE = b"<html><body><h1>Service indisponible \xe9</h1></body></html>"
HUGE_INT = b'{"ok":false,"error":"ratelimited","n":' + b"9" * 5000 + b"}"
JSON = ("Content-Type", "application/json")

CASES_429 = [
    pytest.param([JSON], DEEP, id="nested-too-deep"),
    pytest.param(
        [("Content-Type", "text/html")], LATIN1_PAGE, id="latin1-page"
    ),  # UnicodeDecodeError
    pytest.param(
        [("Content-Type", "application/json; charset=x-unknown")],
        b'{"ok":false,"error":"ratelimited"}',
        id="unknown-charset",  # LookupError
    ),
    pytest.param([JSON], HUGE_INT, id="int-past-4300-digits"),  # ValueError
]


@pytest.mark.parametrize(("headers", "body"), CASES_429)
def test_slack_429_it_cannot_read_keeps_its_retry_after(
    headers: list[tuple[str, str]], body: bytes
) -> None:
    with canned() as server:
        server.answer(429, body, [*headers, ("Retry-After", "20")])
        limiter = RateLimiter(RateLimits())
        sender = rate_limit(limiter)(slack_sender(server.url))
        with pytest.raises(RateLimited) as info:
            sender.send(SendRequest("C01", TextMessage("hi")))
        assert info.value.retry_after == 20.0
        assert limiter.acquire("C01", book=False) == pytest.approx(20.0, abs=0.5)


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        pytest.param(502, [("Content-Type", "text/html")], LATIN1_PAGE, id="502-latin1-page"),
        pytest.param(503, [JSON], DEEP, id="503-nested-too-deep"),
        pytest.param(200, [JSON], DEEP, id="200-nested-too-deep"),
        pytest.param(200, [JSON], HUGE_INT.replace(b"false", b"true"), id="200-huge-int"),
        # (decoded by the sender's own request, not slack_sdk's: they left send()
        # raw, a UnicodeDecodeError quoting the body)
        pytest.param(200, [("Content-Type", "text/html")], LATIN1_PAGE, id="200-latin1-page"),
        pytest.param(
            200,
            [("Content-Type", "application/json; charset=x-unknown")],
            b'{"ok":true}',
            id="200-unknown-charset",
        ),
    ],
)
def test_slack_other_answers_it_cannot_read_are_transient(
    status: int, headers: list[tuple[str, str]], body: bytes
) -> None:
    with canned() as server:
        server.answer(status, body, headers)
        with pytest.raises(TransientSendError):
            slack_sender(server.url).send(SendRequest("C01", TextMessage("hi")))
