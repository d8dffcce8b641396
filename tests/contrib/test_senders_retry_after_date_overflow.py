"""A 429 whose Retry-After is an HTTP date with an absurd year or zone (which
email.utils cannot turn into a time: OverflowError) is still RateLimited, with the
default wait, and recorded in the limiter, by every sender."""

from __future__ import annotations

import pytest
from canned_senders import canned, slack_sender, telebot_sender, telegram_sender

from outbound.errors import RateLimited
from outbound.messages import SendRequest, TextMessage
from outbound.middleware import rate_limit
from outbound.ratelimit import RateLimiter, RateLimits
from outbound.retry import parse_retry_after

BAD_DATES = [
    "Wed, 21 Oct 99999999999999999999 07:28:00 GMT",  # year past a C long
    "Wed, 21 Oct 2015 07:28:00 +99999999999999999999",  # zone offset past a C int
    "Wed, 21 Oct 2015 99999999999999999999:28:00 GMT",  # hour past a C long
]


@pytest.mark.parametrize("value", BAD_DATES)
def test_parse_retry_after_says_none_for_an_overflowing_date(value: str) -> None:
    assert parse_retry_after(value) is None


@pytest.mark.parametrize("value", BAD_DATES[:1])
@pytest.mark.parametrize("which", ["telegram", "telebot", "slack"])
def test_a_429_with_an_overflowing_retry_after_date_is_rate_limited(
    which: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {
        "telegram": b'{"ok":false,"error_code":429,"description":"Too Many Requests"}',
        "telebot": b'{"ok":false,"error_code":429,"description":"Too Many Requests"}',
        "slack": b'{"ok":false,"error":"ratelimited"}',
    }[which]
    with canned() as server:
        server.answer(429, body, [("Content-Type", "application/json"), ("Retry-After", value)])
        chat: int | str = "C01" if which == "slack" else 42
        if which == "telegram":
            sender = telegram_sender(server.url)
        elif which == "telebot":
            sender = telebot_sender(server.url, monkeypatch)
        else:
            sender = slack_sender(server.url)
        limiter = RateLimiter(RateLimits())
        with pytest.raises(RateLimited) as info:
            rate_limit(limiter)(sender).send(SendRequest(chat, TextMessage("hi")))
        assert info.value.retry_after == 1.0  # the documented default when no wait is read
        assert limiter.acquire(chat, book=False) > 0.0  # the 429 was recorded
