"""SlackSender and TeleBotSender check their settings as TelegramSender does, when
built: a max_text_length that is not an int >= 1 (NaN would turn validate()'s length
check off) and a timeout that is a bool or not a finite number > 0 are refused."""

from __future__ import annotations

import math

import pytest
from canned_senders import slack_sender, telebot_sender, telegram_sender

URL = "http://127.0.0.1:9"  # never contacted


def make(which: str, monkeypatch: pytest.MonkeyPatch, **options: object):  # type: ignore[no-untyped-def]
    if which == "slack":
        return slack_sender(URL, **options)
    if which == "telebot":
        return telebot_sender(URL, monkeypatch, **options)
    return telegram_sender(URL, **options)


@pytest.mark.parametrize("which", ["telegram", "slack", "telebot"])
@pytest.mark.parametrize("value", [math.nan, 2.5])
def test_a_max_text_length_that_is_not_an_int_is_refused(
    which: str, value: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises((TypeError, ValueError)):
        make(which, monkeypatch, max_text_length=value)


@pytest.mark.parametrize("which", ["telegram", "slack", "telebot"])
def test_a_bool_timeout_is_refused(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError):
        make(which, monkeypatch, timeout=True)
