"""Messages, requests and the checks that senders share."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from outbound import (
    Dispatcher,
    MethodMessage,
    SendRequest,
    SendTimeout,
    TextMessage,
    check_json_params,
    check_text,
    narrow_deadline,
    time_allowed,
)


def test_text_message_refuses_empty_and_non_str() -> None:
    with pytest.raises(ValueError, match="empty"):
        TextMessage("   ")
    with pytest.raises(TypeError, match="str"):
        TextMessage(42)  # type: ignore[arg-type]
    assert TextMessage("hi").text == "hi"


def test_method_message_needs_a_name_and_a_mapping() -> None:
    with pytest.raises(ValueError, match="method"):
        MethodMessage("")
    with pytest.raises(TypeError, match="mapping"):
        MethodMessage("sendPhoto", [("photo", "x")])  # type: ignore[arg-type]


@pytest.mark.parametrize("chat_id", [True, 1.5, None, b"1", ""])
def test_send_request_refuses_bad_chat_ids(chat_id: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        SendRequest(chat_id, TextMessage("hi"))  # type: ignore[arg-type]


def test_send_request_is_immutable() -> None:
    request = SendRequest(1, TextMessage("hi"), idempotency_key="k")
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.chat_id = 2  # type: ignore[misc]


def test_check_text_names_the_problem() -> None:
    check_text("x" * 10, 10)
    with pytest.raises(ValueError, match="11 characters long, over the limit of 10"):
        check_text("x" * 11, 10)
    with pytest.raises(ValueError, match="empty"):
        check_text("", 10)
    with pytest.raises(TypeError, match="NoneType"):
        check_text(None, 10)


def test_check_json_params() -> None:
    check_json_params(MethodMessage("sendPhoto", {"photo": "id", "caption": None}))
    with pytest.raises(TypeError, match="sendPhoto"):
        check_json_params(MethodMessage("sendPhoto", {"photo": object()}))


def test_time_allowed_outside_and_inside_a_task() -> None:
    assert time_allowed(7.5) == 7.5
    with narrow_deadline(time.monotonic() + 2.0):
        assert 0.0 < time_allowed(30.0) <= 2.0
    with narrow_deadline(time.monotonic() - 1.0), pytest.raises(SendTimeout, match="sending"):
        time_allowed(30.0, "sending")
    with Dispatcher(max_inflight=1, send_timeout=math.inf) as d:
        assert d.submit("k", time_allowed, 3.0).result(timeout=10) == 3.0
    with Dispatcher(max_inflight=1, send_timeout=1.0) as d:
        assert 0.0 < d.submit("k", time_allowed, 30.0).result(timeout=10) <= 1.0
