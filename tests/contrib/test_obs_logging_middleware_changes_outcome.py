"""middleware.logging() changes no outcome when it cannot show the chat id (repr()
of an int past 4,300 digits raises ValueError): a sent message stays sent, and a
failure goes up as it was."""

from __future__ import annotations

import logging
import sys

import pytest

from outbound import Dispatcher, Outbound
from outbound.errors import PermanentSendError
from outbound.messages import SendRequest, SendResult
from outbound.middleware import chain, metrics
from outbound.middleware import logging as log_sends

pytestmark = pytest.mark.skipif(
    not hasattr(sys, "get_int_max_str_digits"), reason="no int/str digit limit here"
)

HUGE_CHAT = 10**5000  # an int chat id SendRequest accepts


class Delivered:
    def __init__(self) -> None:
        self.chats: list[int | str] = []

    def send(self, request: SendRequest) -> SendResult:
        self.chats.append(request.chat_id)
        return SendResult(1)


class Refused:
    def send(self, request: SendRequest) -> SendResult:
        raise PermanentSendError("chat not found")


@pytest.fixture
def debug_logging() -> object:
    log = logging.getLogger("outbound.send")
    old = log.level
    log.setLevel(logging.DEBUG)
    yield log
    log.setLevel(old)


def test_a_sent_message_is_not_reported_failed_by_the_logging_layer(debug_logging: object) -> None:
    platform = Delivered()
    metered = metrics()
    with Dispatcher() as dispatcher:
        out = Outbound(dispatcher, chain(metered, log_sends())(platform))
        future = out.reply_text(HUGE_CHAT, "hello")
        error = future.exception(timeout=10)
    assert platform.chats == [HUGE_CHAT]  # the platform took it
    assert error is None, f"sent, but the future failed with {error!r}"
    assert metered.snapshot().sent == 1


def test_a_failure_goes_up_as_it_was() -> None:
    # WARNING is enabled by default: no logging configuration needed.
    metered = metrics()
    with Dispatcher() as dispatcher:
        out = Outbound(dispatcher, chain(metered, log_sends())(Refused()))
        error = out.reply_text(HUGE_CHAT, "hello").exception(timeout=10)
    assert isinstance(error, PermanentSendError), f"got {error!r} instead"
    assert dict(metered.snapshot().failed) == {"PermanentSendError": 1}
