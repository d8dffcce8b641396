"""TeleBotSender and SlackSender: the real client libraries against the PlatformSimulator.

Real HTTP over loopback, no mocks. Each group is skipped when its library
(extra ``telegram``: pyTelegramBotAPI; extra ``slack``: slack_sdk) is not
installed.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
from canned_http import (
    QUOTED_ANSWERS,
    SECRET,
    assert_no_secret,
    canned_server,
    held_by,
    raw_server,
    reachable,
)

from outbound import Dispatcher
from outbound.errors import PermanentSendError, RateLimited, SendTimeout, TransientSendError
from outbound.messages import MethodMessage, Sender, SendRequest, SendResult, TextMessage
from outbound.middleware import chain, retry, timeout
from outbound.reply import Outbound
from outbound.simulator import Fault, PlatformSimulator

WAIT = 10.0


@pytest.fixture
def sim() -> Iterator[PlatformSimulator]:
    with PlatformSimulator() as simulator:
        yield simulator


def texts(sim: PlatformSimulator, chat_id: int | str) -> list[str]:
    return [m["text"] for m in sim.received(chat_id)]


def text(chat_id: int | str, body: str = "hello") -> SendRequest:
    return SendRequest(chat_id, TextMessage(body))


# ================================================================ pyTelegramBotAPI


@pytest.fixture
def telebot(sim: PlatformSimulator, monkeypatch: pytest.MonkeyPatch) -> Any:
    module = pytest.importorskip(
        "telebot", reason="pyTelegramBotAPI is not installed (extra 'telegram')"
    )
    monkeypatch.setattr(module.apihelper, "API_URL", sim.url + "/bot{0}/{1}")
    monkeypatch.setattr(module.apihelper, "RETRY_ON_ERROR", False)
    return module


@pytest.fixture
def bot(sim: PlatformSimulator, telebot: Any) -> Any:
    return telebot.TeleBot(sim.token, threaded=False)


def telebot_sender(bot: Any, **options: Any) -> Any:
    contrib = pytest.importorskip("outbound.contrib.telebot")
    return contrib.TeleBotSender(bot, **options)


def test_telebot_sends_text_and_returns_the_message_id(sim: PlatformSimulator, bot: Any) -> None:
    sender = telebot_sender(bot)
    assert isinstance(sender, Sender)
    result = sender.send(text(42, "hi"))
    assert isinstance(result, SendResult)
    assert result.message_id == 1
    assert result.raw is not None
    assert result.raw["ok"] is True
    assert result.raw["result"]["text"] == "hi"
    assert sender.send(text(42, "again")).message_id == 2
    assert texts(sim, 42) == ["hi", "again"]


def test_telebot_text_options_reach_the_platform(sim: PlatformSimulator, bot: Any) -> None:
    sender = telebot_sender(bot)
    sender.send(SendRequest(7, TextMessage("*b*", parse_mode="MarkdownV2")))
    params = sim.received(7)[0]["params"]
    assert params["text"] == "*b*"
    assert params["parse_mode"] == "MarkdownV2"
    assert "timeout" not in params  # pyTelegramBotAPI's HTTP timeout, not a Bot API parameter


def test_telebot_method_message_uses_bot_api_names(sim: PlatformSimulator, bot: Any) -> None:
    sender = telebot_sender(bot)
    markup = {"inline_keyboard": [[{"text": "ok", "callback_data": "1"}]]}
    message = MethodMessage(
        "sendPhoto",
        {"photo": "file-id-1", "caption": "look", "reply_markup": markup, "has_spoiler": True},
    )
    result = sender.send(SendRequest(-100, message))
    assert result.message_id == 1
    (record,) = sim.received(-100)
    assert record["method"] == "sendPhoto"
    params = record["params"]
    assert params["photo"] == "file-id-1"
    assert params["caption"] == "look"
    assert params["has_spoiler"] == "true"
    assert params["chat_id"] == "-100"
    assert "timeout" not in params
    assert json.loads(params["reply_markup"]) == markup


@pytest.mark.parametrize(("scope", "expected"), [("chat", "chat"), ("global", "global")])
def test_telebot_429_is_rate_limited(
    sim: PlatformSimulator, bot: Any, telebot: Any, scope: str, expected: str
) -> None:
    sim.inject(Fault("rate_limit", chat_id=5, retry_after=2.5, scope=scope))  # type: ignore[arg-type]
    with pytest.raises(RateLimited) as caught:
        telebot_sender(bot).send(text(5))
    assert caught.value.retry_after == 2.5
    assert caught.value.scope == expected
    _unchained(caught.value)
    assert sim.received(5) == []


def test_telebot_5xx_and_dropped_connections_are_transient(
    sim: PlatformSimulator, bot: Any, telebot: Any
) -> None:
    sender = telebot_sender(bot)
    sim.inject(Fault("error", status=503))
    with pytest.raises(TransientSendError) as caught:
        sender.send(text(1))
    assert not isinstance(caught.value, SendTimeout)
    _unchained(caught.value)
    sim.inject(Fault("drop"))
    with pytest.raises(TransientSendError) as dropped:
        sender.send(text(1))
    # Described by the types of requests' error, not chained: its text quotes
    # the URL, where pyTelegramBotAPI puts the token and the message's text.
    assert dropped.value.__cause__ is None
    assert "ConnectionError" in str(dropped.value)
    assert sender.send(text(1)).message_id == 1


def test_telebot_a_kept_error_holds_none_of_the_clients_objects(
    sim: PlatformSimulator, bot: Any
) -> None:
    """The error of a dropped connection held requests' error (a local of the
    send's frame, which its traceback holds), and through its frames the
    thread's session and pooled socket, which the thread's next send reused: a
    kept error kept that socket open after the thread retired."""
    import requests  # noqa: PLC0415

    sender = telebot_sender(bot)
    sim.inject(Fault("drop"))
    with pytest.raises(TransientSendError) as caught:
        sender.send(text(1))
    assert sender.send(text(1)).message_id is not None
    held = held_by(caught.value)
    assert not [
        v
        for v in held
        if isinstance(v, (requests.Session, requests.Response, requests.RequestException))
    ]


def test_telebot_bad_requests_are_permanent(sim: PlatformSimulator, telebot: Any) -> None:
    sim.configure(max_text_length=10)
    good = telebot_sender(telebot.TeleBot(sim.token, threaded=False))
    with pytest.raises(PermanentSendError) as caught:
        good.send(text(1, "x" * 11))
    _unchained(caught.value)
    assert "400" in str(caught.value)
    wrong = telebot_sender(telebot.TeleBot("999:wrong-token", threaded=False))
    with pytest.raises(PermanentSendError, match="401"):
        wrong.send(text(1))
    assert sim.received(1) == []


@pytest.mark.parametrize("client", ["TelegramSender", "TeleBotSender"])
def test_a_group_upgraded_to_a_supergroup_names_the_new_chat_on_the_cause(
    telebot: Any, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    """A send to a group that became a supergroup is refused with the new chat's id
    in ``parameters.migrate_to_chat_id``: both senders' errors carry it on their
    cause, a TelegramError, so a caller can send again to the new chat."""
    from outbound.telegram import TelegramError, TelegramSender  # noqa: PLC0415

    answer = {
        "ok": False,
        "error_code": 400,
        "description": "Bad Request: group chat was upgraded to a supergroup chat",
        "parameters": {"migrate_to_chat_id": -1001234567890},
    }
    with canned_server(400, json.dumps(answer).encode(), _CLOSING) as url:
        if client == "TelegramSender":
            sender: Any = TelegramSender(_BOT_TOKEN, base_url=url)
        else:
            monkeypatch.setattr(telebot.apihelper, "API_URL", url + "/bot{0}/{1}")
            sender = telebot_sender(telebot.TeleBot(_BOT_TOKEN, threaded=False))
        with pytest.raises(PermanentSendError, match="upgraded to a supergroup") as caught:
            sender.send(SendRequest(-42, TextMessage(SECRET)))
    cause = caught.value.__cause__
    assert isinstance(cause, TelegramError)
    assert cause.status == 400
    assert cause.parameters["migrate_to_chat_id"] == -1001234567890
    assert "upgraded to a supergroup" in cause.description
    assert_no_secret(caught.value)
    _no_token(caught.value)


@pytest.mark.parametrize("status", [429, 503])
def test_telebot_the_cause_of_an_answers_error_holds_no_token(
    telebot: Any, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    """The answer's TelegramError quotes its description as the send error does,
    the token masked; of its parameters, the numbers (texts there may quote the
    request's URL, which holds the token and the text)."""
    import pickle  # noqa: PLC0415

    from outbound.telegram import TelegramError  # noqa: PLC0415

    answer = {
        "ok": False,
        "error_code": status,
        "description": f"Too Many Requests: bot{_BOT_TOKEN} retry after 3",
        "parameters": {
            "retry_after": 3,
            "path": f"/bot{_BOT_TOKEN}/sendMessage?chat_id=1&text={SECRET}",
            "token": _BOT_TOKEN,
            "echo": {"text": SECRET},
        },
    }
    with canned_server(status, json.dumps(answer).encode(), _CLOSING) as url:
        monkeypatch.setattr(telebot.apihelper, "API_URL", url + "/bot{0}/{1}")
        sender = telebot_sender(telebot.TeleBot(_BOT_TOKEN, threaded=False))
        with pytest.raises((RateLimited, TransientSendError)) as caught:
            sender.send(SendRequest(1, TextMessage(SECRET)))
    cause = caught.value.__cause__
    assert isinstance(cause, TelegramError)
    assert (cause.status, dict(cause.parameters)) == (status, {"retry_after": 3})
    assert "retry after 3" in cause.description
    _no_token(caught.value)
    assert_no_secret(caught.value)
    kept = pickle.dumps(cause)
    assert _BOT_TOKEN.encode() not in kept
    assert SECRET.encode() not in kept


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (SendRequest("42", TextMessage("x")), ValueError),
        (SendRequest(1, TextMessage("x" * 4097)), ValueError),
        (SendRequest(1, MethodMessage("send/Photo", {})), ValueError),
        (SendRequest(1, MethodMessage("getUpdates", {"timeout": 5})), ValueError),
        (SendRequest(1, MethodMessage("sendMessage", {"text": " "})), ValueError),
        (SendRequest(1, MethodMessage("sendPhoto", {"photo": object()})), TypeError),
    ],
)
def test_telebot_validate_refuses_bad_input(
    sim: PlatformSimulator, bot: Any, request_: SendRequest, error: type[Exception]
) -> None:
    sender = telebot_sender(bot)
    with pytest.raises(error):
        sender.validate(request_)
    if error is ValueError:
        with pytest.raises(error):
            sender.send(request_)
    assert sim.stats().requests == 0


def test_telebot_refuses_pytelegrambotapi_retries(
    bot: Any, telebot: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telebot.apihelper, "RETRY_ON_ERROR", True)
    with pytest.raises(ValueError, match="RETRY_ON_ERROR"):
        telebot_sender(bot)


def test_telebot_timeout_outside_a_task(sim: PlatformSimulator, bot: Any) -> None:
    sender = telebot_sender(bot, timeout=0.2)
    sim.inject(Fault("slow", delay=5.0))
    start = time.monotonic()
    with pytest.raises(SendTimeout):
        sender.send(text(1))
    assert time.monotonic() - start < 2.0


def test_telebot_end_to_end_deadline_and_retry(sim: PlatformSimulator, bot: Any) -> None:
    sender = chain(retry(base_delay=0.01, max_attempts=3), timeout())(telebot_sender(bot))
    sim.inject(
        Fault("slow", chat_id=1, delay=5.0),
        Fault("rate_limit", chat_id=2, retry_after=0.05),
    )
    with Dispatcher(max_inflight=4, send_timeout=0.3) as dispatcher:
        out = Outbound(dispatcher, sender)
        start = time.monotonic()
        slow = out.reply(1, TextMessage("slow"))
        after = out.reply(1, TextMessage("after"))
        limited = [out.reply(2, TextMessage(f"m{i}")) for i in range(3)]
        # The slow answer is cut by the task's deadline; the retry runs again.
        assert after.result(WAIT).message_id is not None
        assert slow.result(WAIT).message_id is not None
        assert [f.result(WAIT).message_id for f in limited] == [1, 2, 3]
        assert time.monotonic() - start < 5.0
    assert texts(sim, 2) == ["m0", "m1", "m2"]
    assert texts(sim, 1)[-2:] == ["slow", "after"]


def test_telebot_end_to_end_timeout_is_reported(sim: PlatformSimulator, bot: Any) -> None:
    sim.inject(Fault("slow", chat_id=1, delay=5.0))
    with Dispatcher(max_inflight=2, send_timeout=0.3) as dispatcher:
        out = Outbound(dispatcher, telebot_sender(bot))
        start = time.monotonic()
        cut = out.reply(1, TextMessage("slow"))
        after = out.reply(1, TextMessage("after"))
        assert isinstance(cut.exception(WAIT), SendTimeout)
        assert after.result(WAIT).message_id == 2
        assert time.monotonic() - start < 2.0


# ====================================================================== slack_sdk


@pytest.fixture
def slack_sdk() -> Any:
    return pytest.importorskip("slack_sdk", reason="slack_sdk is not installed (extra 'slack')")


@pytest.fixture
def client(sim: PlatformSimulator, slack_sdk: Any) -> Any:
    return slack_sdk.WebClient(token=sim.token, base_url=sim.url + "/api/")


def slack_sender(client: Any, **options: Any) -> Any:
    contrib = pytest.importorskip("outbound.contrib.slack")
    return contrib.SlackSender(client, **options)


def test_slack_sends_text_and_returns_the_ts(sim: PlatformSimulator, client: Any) -> None:
    sender = slack_sender(client)
    assert isinstance(sender, Sender)
    result = sender.send(text("C01", "hi"))
    assert isinstance(result.message_id, str)
    assert result.message_id
    assert result.raw is not None
    assert result.raw["ok"] is True
    assert result.raw["channel"] == "C01"
    second = sender.send(text("C01", "again"))
    assert second.message_id != result.message_id
    assert texts(sim, "C01") == ["hi", "again"]
    assert sim.received("C01")[0]["platform"] == "slack"


def test_slack_method_message_goes_through_api_call(sim: PlatformSimulator, client: Any) -> None:
    blocks = [{"type": "section", "text": {"type": "mrkdwn", "text": "*hi*"}}]
    message = MethodMessage("chat.postMessage", {"blocks": blocks, "unfurl_links": False})
    result = slack_sender(client).send(SendRequest("C02", message))
    assert result.message_id
    (record,) = sim.received("C02")
    assert record["params"]["blocks"] == blocks
    assert record["params"]["channel"] == "C02"


@pytest.mark.parametrize(("scope", "expected"), [("chat", "chat"), ("global", "global")])
def test_slack_429_is_rate_limited(
    sim: PlatformSimulator, client: Any, slack_sdk: Any, scope: str, expected: str
) -> None:
    sim.inject(Fault("rate_limit", retry_after=0.25, scope=scope))  # type: ignore[arg-type]
    with pytest.raises(RateLimited) as caught:
        slack_sender(client).send(text("C01"))
    assert caught.value.retry_after == 0.25
    assert caught.value.scope == expected
    _unchained(caught.value)


def test_slack_own_retry_handlers_never_sleep_in_the_sender(
    sim: PlatformSimulator, slack_sdk: Any
) -> None:
    retries = slack_sdk.http_retry
    handlers = [
        retries.RateLimitErrorRetryHandler(max_retry_count=5),
        retries.ConnectionErrorRetryHandler(),
    ]
    client = slack_sdk.WebClient(
        token=sim.token, base_url=sim.url + "/api/", retry_handlers=handlers, timeout=7
    )
    sender = slack_sender(client)
    sim.inject(Fault("rate_limit", retry_after=5.0), Fault("drop"))
    start = time.monotonic()
    with pytest.raises(RateLimited) as caught:
        sender.send(text("C01"))
    assert caught.value.retry_after == 5.0
    with pytest.raises(TransientSendError):
        sender.send(text("C01"))
    assert time.monotonic() - start < 2.0
    assert sim.stats().requests == 2  # one request each: no retry by slack_sdk
    assert client.retry_handlers == handlers
    assert client.timeout == 7


def test_slack_5xx_and_dropped_connections_are_transient(
    sim: PlatformSimulator, client: Any, slack_sdk: Any
) -> None:
    sender = slack_sender(client)
    sim.inject(Fault("error", status=502))
    with pytest.raises(TransientSendError) as caught:
        sender.send(text("C01"))
    assert not isinstance(caught.value, SendTimeout)
    _unchained(caught.value)
    sim.inject(Fault("drop"))
    with pytest.raises(TransientSendError):
        sender.send(text("C01"))
    assert sender.send(text("C01")).message_id
    assert sim.stats().requests == 3


@pytest.mark.parametrize("body", [b"[1]", b"42", b'"ok"', b"null"])
def test_slack_an_answer_whose_json_is_not_an_object_is_transient(
    slack_sdk: Any, body: bytes
) -> None:
    """slack_sdk raised AttributeError out of send for a 200 with ``[1]``: retry took
    it for a bug and failed the message at once."""
    with canned_server(200, body) as url:
        sender = slack_sender(slack_sdk.WebClient(token="xoxb-1", base_url=url + "/api/"))
        with pytest.raises(TransientSendError):
            sender.send(SendRequest("C1", TextMessage("hi")))


def test_slack_errors_are_permanent(sim: PlatformSimulator, slack_sdk: Any) -> None:
    base = sim.url + "/api/"
    wrong = slack_sender(slack_sdk.WebClient(token="xoxb-wrong", base_url=base))
    with pytest.raises(PermanentSendError, match="invalid_auth") as caught:
        wrong.send(text("C01"))
    _unchained(caught.value)
    sender = slack_sender(slack_sdk.WebClient(token=sim.token, base_url=base))
    with pytest.raises(PermanentSendError, match="unknown_method"):
        sender.send(SendRequest("C01", MethodMessage("chat.noSuchMethod", {"text": "x"})))
    lax = slack_sender(slack_sdk.WebClient(token=sim.token, base_url=base), max_text_length=50_000)
    with pytest.raises(PermanentSendError, match="msg_too_long"):
        lax.send(text("C01", "x" * 40_001))
    assert sim.received("C01") == []


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (SendRequest(42, TextMessage("x")), TypeError),
        (SendRequest(" C01", TextMessage("x")), ValueError),
        (SendRequest("C01", TextMessage("x" * 40_001)), ValueError),
        (SendRequest("C01", TextMessage("x", parse_mode="HTML")), ValueError),
        (SendRequest("C01", MethodMessage("postMessage", {"text": "x"})), ValueError),
        (SendRequest("C01", MethodMessage("chat.postMessage", {})), TypeError),
        (SendRequest("C01", MethodMessage("chat.update", {"ts": object()})), TypeError),
    ],
)
def test_slack_validate_refuses_bad_input(
    sim: PlatformSimulator, client: Any, request_: SendRequest, error: type[Exception]
) -> None:
    sender = slack_sender(client)
    with pytest.raises(error):
        sender.validate(request_)
    assert sim.stats().requests == 0


def test_slack_refuses_an_async_or_foreign_client(slack_sdk: Any) -> None:
    with pytest.raises(TypeError):
        slack_sender(object())


def test_slack_timeout_outside_a_task(sim: PlatformSimulator, client: Any) -> None:
    sender = slack_sender(client, timeout=0.2)
    sim.inject(Fault("slow", delay=5.0))
    start = time.monotonic()
    with pytest.raises(SendTimeout):
        sender.send(text("C01"))
    assert time.monotonic() - start < 2.0
    assert client.timeout == 30


def test_slack_end_to_end_deadline_and_retry(sim: PlatformSimulator, client: Any) -> None:
    sender = chain(retry(base_delay=0.01, max_attempts=3), timeout())(slack_sender(client))
    sim.inject(
        Fault("slow", chat_id="C01", delay=5.0),
        Fault("rate_limit", chat_id="C02", retry_after=0.05),
    )
    with Dispatcher(max_inflight=4, send_timeout=0.3) as dispatcher:
        out = Outbound(dispatcher, sender)
        start = time.monotonic()
        slow = out.reply("C01", TextMessage("slow"))
        after = out.reply("C01", TextMessage("after"))
        limited = [out.reply("C02", TextMessage(f"m{i}")) for i in range(3)]
        assert after.result(WAIT).message_id
        assert slow.result(WAIT).message_id
        assert all(f.result(WAIT).message_id for f in limited)
        assert time.monotonic() - start < 5.0
    assert texts(sim, "C02") == ["m0", "m1", "m2"]
    assert texts(sim, "C01")[-2:] == ["slow", "after"]


def test_slack_end_to_end_timeout_is_reported(sim: PlatformSimulator, client: Any) -> None:
    sim.inject(Fault("slow", chat_id="C01", delay=5.0))
    with Dispatcher(max_inflight=2, send_timeout=0.3) as dispatcher:
        out = Outbound(dispatcher, slack_sender(client))
        start = time.monotonic()
        cut = out.reply("C01", TextMessage("slow"))
        after = out.reply("C01", TextMessage("after"))
        assert isinstance(cut.exception(WAIT), SendTimeout)
        assert after.result(WAIT).message_id
        assert time.monotonic() - start < 2.0


# ================================================================ both


def test_telebot_a_description_quoting_a_url_of_the_text_is_kept_whole(
    telebot: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the request's own path is cut from its query on: a URL of the message's
    own in Telegram's parse error lost the rest of the description ("at byte
    offset 0"), and a "retry after 30" after one was read as 1 s; a wait is never
    read from a cut query (the text, which could set it)."""
    # (A Mini App link's path begins with "/bot" too.)
    said = 'Bad Request: can\'t parse entities: Unsupported start tag "https://t.me/botany/s?q=1"'
    quoted = f"/bot{_BOT_TOKEN}/sendMessage?chat_id=1&text=please retry after 86400"
    answers: list[tuple[int, str, float | None]] = [
        (400, f"{said} at byte offset 0", None),
        (429, "Too Many: /x?b=1, retry after 30", 30.0),
        (429, f"Not Found: {quoted}", 1.0),
    ]
    for status, description, wait in answers:
        answer = {"ok": False, "error_code": status, "description": description}
        headers = {"Content-Type": "application/json", "Connection": "close"}
        with canned_server(status, json.dumps(answer).encode(), headers) as url:
            monkeypatch.setattr(telebot.apihelper, "API_URL", url + "/bot{0}/{1}")
            sender = telebot_sender(telebot.TeleBot(_BOT_TOKEN, threaded=False))
            with pytest.raises((PermanentSendError, RateLimited)) as caught:
                sender.send(SendRequest(1, TextMessage("<https://a.example/s?q=1>")))
        if wait is None:
            assert str(caught.value).endswith(f"{said} at byte offset 0")
        else:
            assert isinstance(caught.value, RateLimited)
            assert caught.value.retry_after == wait


def test_slack_an_error_that_is_no_error_code_is_not_quoted(client: Any) -> None:
    """The answer's "error" went into the send error as it was: a gateway that echoes
    the request put the token and the text in it (and in the log lines)."""
    echo = f"echo: POST /api/chat.postMessage Authorization: Bearer xoxb-1 text={SECRET}"
    body = json.dumps({"ok": False, "error": echo}).encode()
    with canned_server(400, body, {"Content-Type": "application/json"}) as url:
        client.base_url = url + "/api/"
        with pytest.raises(PermanentSendError, match="not a Slack error code") as caught:
            slack_sender(client).send(SendRequest("C01", TextMessage(SECRET)))
    assert_no_secret(caught.value)
    assert "xoxb" not in str(caught.value)


@pytest.mark.parametrize("answer", sorted(QUOTED_ANSWERS))
def test_telebot_an_answer_the_client_quotes_keeps_the_text_out_of_the_error(
    telebot: Any, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    with raw_server(QUOTED_ANSWERS[answer]) as url:
        monkeypatch.setattr(telebot.apihelper, "API_URL", url + "/bot{0}/{1}")
        sender = telebot_sender(telebot.TeleBot("1:x", threaded=False))
        with pytest.raises(TransientSendError) as caught:
            sender.send(SendRequest(1, TextMessage(SECRET)))
    assert "the answer could not be read" in str(caught.value)
    assert_no_secret(caught.value)


_BOT_TOKEN = "123456:SECRET-bot-token"
_CLOSING = {"Content-Type": "application/json", "Connection": "close"}


def _unchained(error: BaseException) -> None:
    """The client's error, which holds the request (its URL, the token and the text in
    pyTelegramBotAPI's; the token in slack_sdk's arguments), is neither the send
    error's cause nor its context: it was the cause of every answer's error. (An
    answer's error may have the answer's TelegramError for its cause, made by the
    sender: no client error behind it.)"""
    from outbound.telegram import TelegramError  # noqa: PLC0415

    cause = error.__cause__
    if cause is not None:
        assert type(cause) is TelegramError
        assert cause.payload is None
        assert cause.__cause__ is None
        assert cause.__context__ is None
    assert error.__context__ is None


def _no_token(error: BaseException) -> None:
    """As assert_no_secret, for the bot token: its context too (``raise ... from
    None`` only hides it from a traceback)."""
    import traceback  # noqa: PLC0415

    printed = "".join(traceback.format_exception(error))
    assert "SECRET-bot-token" not in printed, printed
    for e in reachable(error):
        assert "SECRET-bot-token" not in f"{e!s} {e!r}", f"{type(e).__name__}: {e!r}"


def test_telebot_a_connection_refused_keeps_the_token_and_the_text_out(
    telebot: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """pyTelegramBotAPI puts the token and every parameter, the text too, in the
    URL; requests quotes the URL in its errors: the error said both, and so did
    the logging middleware's line and the chained cause."""
    import socket  # noqa: PLC0415

    from outbound.middleware import logging as logged  # noqa: PLC0415

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    monkeypatch.setattr(telebot.apihelper, "API_URL", f"http://127.0.0.1:{port}/bot{{0}}/{{1}}")
    sender = chain(logged())(telebot_sender(telebot.TeleBot(_BOT_TOKEN, threaded=False)))
    with caplog.at_level("DEBUG", logger="outbound"), pytest.raises(TransientSendError) as caught:
        sender.send(SendRequest(42, TextMessage(SECRET)))
    assert "Connection refused" in str(caught.value)
    assert_no_secret(caught.value)
    _no_token(caught.value)
    assert "4111" not in caplog.text
    assert "SECRET-bot-token" not in caplog.text


@pytest.mark.parametrize(
    ("status", "body"),
    [(502, b"<html>proxy: " + SECRET.encode() + b"</html>"), (200, b"{" + SECRET.encode())],
    ids=["502 page", "200 cut short"],
)
def test_telebot_an_answer_that_echoes_the_text_is_not_chained(
    telebot: Any, monkeypatch: pytest.MonkeyPatch, status: int, body: bytes
) -> None:
    """pyTelegramBotAPI's errors for an answer that is not a Bot API one quote its
    body, which may echo the message's text: chained, a logged traceback said it."""
    with canned_server(status, body, {"Content-Type": "text/html", "Connection": "close"}) as url:
        monkeypatch.setattr(telebot.apihelper, "API_URL", url + "/bot{0}/{1}")
        sender = telebot_sender(telebot.TeleBot(_BOT_TOKEN, threaded=False))
        with pytest.raises(TransientSendError) as caught:
            sender.send(SendRequest(1, TextMessage(SECRET)))
    assert_no_secret(caught.value)
    _no_token(caught.value)


@pytest.mark.parametrize(
    ("status", "error"),
    [(404, PermanentSendError), (500, TransientSendError), (429, RateLimited)],
)
@pytest.mark.parametrize("shape", ["Bot API", "not ok"])
@pytest.mark.parametrize(
    "written", ["as it is", "percent-encoded", "test environment", "encoded twice", "all encoded"]
)
def test_telebot_an_answer_quoting_the_requests_path_keeps_the_token_out(
    telebot: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    status: int,
    error: type[Exception],
    shape: str,
    written: str,
) -> None:
    """A proxy's or a self-hosted Bot API server's "Not Found: /bot<token>/sendMessage":
    the description went into the error, the log and the chained cause as it was;
    and once masked as it is, so did a token percent-encoded ("%3A" for ":"), and
    the text in the path's query (pyTelegramBotAPI sends it there); and
    pyTelegramBotAPI's own DEBUG record of the answer said the token."""
    from outbound.middleware import logging as logged  # noqa: PLC0415

    if written == "percent-encoded":  # (the query's "?" too)
        path = f"/bot{_BOT_TOKEN.replace(':', '%3A')}/sendMessage%3Fchat_id=1&text={SECRET}"
    elif written == "test environment":  # (Telegram's: /test/ before the method)
        path = f"/bot{_BOT_TOKEN}/test/sendMessage?chat_id=1&text={SECRET}"
    elif written == "encoded twice":  # (only the secret part masked then)
        path = f"/bot{_BOT_TOKEN.replace(':', '%253A')}/sendMessage?chat_id=1&text={SECRET}"
    elif written == "all encoded":
        token = _BOT_TOKEN.replace(":", "%3A")
        path = f"%2Fbot{token}%2FsendMessage%3Fchat_id%3D1%26text%3D{SECRET}"
    else:  # (the query quoted decoded: spaces and all)
        path = f"/bot{_BOT_TOKEN}/sendMessage?chat_id=1&text={SECRET}"
    answer: dict[str, object] = {"description": f"Not Found: {path}"}
    if shape == "Bot API":
        answer.update(ok=False, error_code=status)
    body = json.dumps(answer).encode()
    headers = {"Content-Type": "application/json", "Connection": "close"}
    with canned_server(status, body, headers) as url:
        monkeypatch.setattr(telebot.apihelper, "API_URL", url + "/bot{0}/{1}")
        sender = chain(logged())(telebot_sender(telebot.TeleBot(_BOT_TOKEN, threaded=False)))
        with (
            caplog.at_level("DEBUG", logger="outbound"),
            caplog.at_level("DEBUG", logger="TeleBot"),
            pytest.raises(error) as caught,
        ):
            sender.send(SendRequest(1, TextMessage(SECRET)))
    if not (shape == "not ok" and status == 500):  # (that one is not shown)
        assert "Not Found: " in str(caught.value)
        assert str(caught.value).endswith("?...")
    _no_token(caught.value)
    assert_no_secret(caught.value)
    assert "SECRET-bot-token" not in caplog.text
    assert "The server returned" in caplog.text  # (pyTelegramBotAPI's record was taken)


def test_telebot_a_token_that_is_not_ascii_is_masked_and_the_error_is_a_send_error(
    telebot: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyTelegramBotAPI takes a token with an en dash pasted in (requests sends it
    percent-encoded): the mask raised UnicodeEncodeError inside the error
    handling, the answer's description (the token in it) its context."""
    token = "123456:SECRET\u2013bot-token"
    quoted = "123456%3ASECRET%E2%80%93bot-token"
    body = json.dumps(
        {"ok": False, "error_code": 404, "description": f"Not Found: /bot{quoted}/sendMessage"}
    ).encode()
    headers = {"Content-Type": "application/json", "Connection": "close"}
    with canned_server(404, body, headers) as url:
        monkeypatch.setattr(telebot.apihelper, "API_URL", url + "/bot{0}/{1}")
        sender = telebot_sender(telebot.TeleBot(token, threaded=False))
        with pytest.raises(PermanentSendError) as caught:
            sender.send(SendRequest(1, TextMessage("hi")))
    assert "Not Found: /bot<token>/sendMessage" in str(caught.value)
    printed = "".join(traceback.format_exception(caught.value))
    assert "SECRET" not in printed, printed


@pytest.mark.parametrize(
    ("token", "base_url"),
    [
        ("xoxb-SEC\nRET", "https://slack.com/api/"),  # a line break
        ("xoxb SECRET", "https://slack.com/api/"),
        ("xoxb-1", "http://127.0.0.1:9/api/ "),
        ("xoxb-1", "localhost/api/"),  # no scheme
    ],
)
def test_slack_a_client_no_request_can_use_is_refused_naming_the_setting(
    slack_sdk: Any, sim: PlatformSimulator, token: str, base_url: str
) -> None:
    """Taken, every send failed: a bare ValueError quoting the token (http.client's
    "Invalid header value b'Bearer ...'"), or an InvalidURL retried as transient."""
    with pytest.raises(ValueError, match=r"Slack client's (token|base_url)") as caught:
        slack_sender(slack_sdk.WebClient(token=token, base_url=base_url))
    assert "SECRET" not in str(caught.value)
    # Changed on the client afterwards: refused at the send, nothing sent.
    client = slack_sdk.WebClient(token="xoxb-1", base_url=sim.url + "/api/")
    sender = slack_sender(client)
    client.token, client.base_url = token, base_url
    with pytest.raises(ValueError, match="Slack client's") as caught:
        sender.send(text("C1", "hi"))
    assert "SECRET" not in str(caught.value)
    assert sim.stats().requests == 0


def test_slack_an_answer_not_json_keeps_its_body_out_of_the_error(
    slack_sdk: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """slack_sdk's error for it is "Received a response in a non-JSON format: " and
    the body, which may echo the message's text: it went into the send error,
    the logging middleware's line and the chained cause."""
    from outbound.middleware import logging as logged  # noqa: PLC0415

    body = b"<html>" + SECRET.encode() + b"</html>"
    with canned_server(200, body, {"Content-Type": "text/html", "Connection": "close"}) as url:
        sender = chain(logged())(
            slack_sender(slack_sdk.WebClient(token="xoxb-1", base_url=url + "/api/"))
        )
        with (
            caplog.at_level("DEBUG", logger="outbound"),
            pytest.raises(TransientSendError, match="not JSON") as caught,
        ):
            sender.send(SendRequest("C1", TextMessage(SECRET)))
    assert_no_secret(caught.value)
    # (slack_sdk's own logger says the body: its records are not ours)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("outbound")]
    assert ours
    assert not [line for line in ours if "4111" in line]


@pytest.mark.parametrize("answer", sorted(QUOTED_ANSWERS))
def test_slack_an_answer_the_client_quotes_keeps_the_text_out_of_the_error(
    slack_sdk: Any, answer: str
) -> None:
    with raw_server(QUOTED_ANSWERS[answer]) as url:
        sender = slack_sender(slack_sdk.WebClient(token="xoxb-1", base_url=url + "/api/"))
        with pytest.raises(TransientSendError) as caught:
            sender.send(SendRequest("C1", TextMessage(SECRET)))
    assert "the answer could not be read" in str(caught.value)
    assert_no_secret(caught.value)
