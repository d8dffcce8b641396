"""Every sender reads a Retry-After header sent twice, or joined into one by a
proxy ("30, 30", as requests also joins a repeated field), as its first value;
and parse_retry_after, which they share, the first value or date of a joined one."""

from __future__ import annotations

import pytest
from canned_senders import canned, sender_of

from outbound.errors import RateLimited
from outbound.messages import SendRequest, TextMessage
from outbound.retry import parse_retry_after

TELEGRAM = b'{"ok":false,"error_code":429,"description":"Too Many Requests"}'
SLACK = b'{"ok":false,"error":"ratelimited"}'
JSON = ("Content-Type", "application/json")
SENT_TWICE = [JSON, ("Retry-After", "30"), ("Retry-After", "30")]
JOINED = [JSON, ("Retry-After", "30, 30")]


@pytest.mark.parametrize("headers", [SENT_TWICE, JOINED], ids=["sent twice", "joined"])
@pytest.mark.parametrize("sender", ["telegram", "telebot", "slack"])
def test_a_senders_retry_after_sent_twice_or_joined_reads_as_the_first(
    monkeypatch: pytest.MonkeyPatch, sender: str, headers: list[tuple[str, str]]
) -> None:
    # (A joined one read as no value: SlackSender came back after 1 s, not 30.)
    with canned() as server:
        server.answer(429, SLACK if sender == "slack" else TELEGRAM, headers)
        made, chat = sender_of(sender, server.url, monkeypatch)
        with pytest.raises(RateLimited) as info:
            made.send(SendRequest(chat, TextMessage("hi")))
        assert info.value.retry_after == 30.0


NOW = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30, 30", 30.0),
        ("30,45", 30.0),
        (" 7 , x", 7.0),
        ("Wed, 21 Oct 2015 07:28:30 GMT, Wed, 21 Oct 2015 07:29:00 GMT", 30.0),
        ("Wed, 21 Oct 2015 07:28:30 GMT, 90", 30.0),
        ("Wed, 21 Oct 2015 07:28:30 GMT", 30.0),  # one date: its own comma
        ("-5, 30", None),  # the first is not one: not the second either
        ("x, 30", None),
        (",", None),
        ("nan, 30", None),
    ],
)
def test_a_joined_retry_after_reads_as_its_first_value(value: str, seconds: float | None) -> None:
    assert parse_retry_after(value, clock=lambda: NOW) == seconds
    assert parse_retry_after(value.encode(), clock=lambda: NOW) == seconds
