"""429s as the real platforms send them, replayed over HTTP to every sender.

The answers below are the platforms' own shapes, as recorded in public
logs and documented by Telegram (``ResponseParameters.retry_after``) and
Slack (``Retry-After``, ``error: ratelimited``): neither says whose limit
was hit. Each sender must map them to ``RateLimited(retry_after,
stated=False)``; the stand-in platform's ``real_429s`` mode must answer in
the same shapes.
"""

from __future__ import annotations

import email.utils
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from outbound.errors import PermanentSendError, RateLimited, TransientSendError
from outbound.messages import SendRequest, TextMessage
from outbound.simulator import Fault, PlatformSimulator
from outbound.telegram import TelegramSender

#: A recorded answer: status, headers, body.
Answer = tuple[int, dict[str, str], bytes]

# Telegram, as pyTelegramBotAPI logged it: HTTP 429, no Retry-After header.
TELEGRAM_429: Answer = (
    429,
    {},
    b'{"ok":false,"error_code":429,"description":"Too Many Requests: retry after 15",'
    b'"parameters":{"retry_after":15}}',
)
# An answer that names the wait only in its description.
TELEGRAM_429_TEXT_ONLY: Answer = (
    429,
    {},
    b'{"ok":false,"error_code":429,"description":"Too Many Requests: retry after 7"}',
)
# Slack: HTTP 429 with Retry-After in whole seconds and a plain error body.
SLACK_429: Answer = (429, {"Retry-After": "30"}, b'{"ok":false,"error":"ratelimited"}')


class Replay(ThreadingHTTPServer):
    """Answers every request with ``answer`` (status, headers, body)."""

    daemon_threads = True
    answer: Answer = (200, {}, b"{}")
    #: Send the body in a later TCP segment than the headers.
    split = False


class _Handler(BaseHTTPRequestHandler):
    server: Replay

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        status, headers, body = self.server.answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.server.split:
            self.wfile.flush()
            time.sleep(0.05)  # the network between the two segments, not a synchronization
        self.wfile.write(body)

    do_GET = do_POST

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def replay() -> Iterator[Replay]:
    server = Replay(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def url(server: Replay) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def request(chat: int | str) -> SendRequest:
    return SendRequest(chat, TextMessage("hello"))


@pytest.mark.parametrize(
    ("answer", "seconds"), [(TELEGRAM_429, 15.0), (TELEGRAM_429_TEXT_ONLY, 7.0)]
)
def test_telegram_sender_reads_real_429s(
    replay: Replay, answer: tuple[int, dict[str, str], bytes], seconds: float
) -> None:
    replay.answer = answer
    with TelegramSender("1:x", base_url=url(replay)) as sender, pytest.raises(RateLimited) as info:
        sender.send(request(42))
    assert (info.value.retry_after, info.value.scope, info.value.stated) == (seconds, "chat", False)


def test_telebot_sender_reads_real_429s(replay: Replay, monkeypatch: pytest.MonkeyPatch) -> None:
    telebot = pytest.importorskip("telebot", reason="pyTelegramBotAPI is not installed")
    contrib = pytest.importorskip("outbound.contrib.telebot")
    monkeypatch.setattr(telebot.apihelper, "API_URL", url(replay) + "/bot{0}/{1}")
    monkeypatch.setattr(telebot.apihelper, "RETRY_ON_ERROR", False)
    replay.answer = TELEGRAM_429
    sender = contrib.TeleBotSender(telebot.TeleBot("1:x", threaded=False))
    with pytest.raises(RateLimited) as info:
        sender.send(request(42))
    assert (info.value.retry_after, info.value.scope, info.value.stated) == (15.0, "chat", False)


def test_slack_sender_reads_real_429s(replay: Replay) -> None:
    slack_sdk = pytest.importorskip("slack_sdk", reason="slack_sdk is not installed")
    contrib = pytest.importorskip("outbound.contrib.slack")
    replay.answer = SLACK_429
    client = slack_sdk.WebClient(token="xoxb-1", base_url=url(replay) + "/api/")
    with pytest.raises(RateLimited) as info:
        contrib.SlackSender(client).send(request("C01"))
    assert (info.value.retry_after, info.value.scope, info.value.stated) == (30.0, "chat", False)


def test_the_stand_in_answers_in_the_recorded_shapes() -> None:
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    def post(address: str) -> tuple[int, dict[str, str], dict[str, Any]]:
        data = json.dumps({"chat_id": 1, "channel": "C1", "text": "x"}).encode()
        req = urllib.request.Request(
            address,
            data,
            {"Content-Type": "application/json", "Authorization": f"Bearer {sim.token}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())

    with PlatformSimulator(real_429s=True) as sim:
        sim.inject(Fault("rate_limit", retry_after=14.2, scope="global"))
        status, _, body = post(f"{sim.url}/bot{sim.token}/sendMessage")
        recorded = json.loads(TELEGRAM_429[2])
        assert status == 429
        assert body == recorded  # rounded up to whole seconds, no scope
        sim.inject(Fault("rate_limit", retry_after=29.5, scope="chat"))
        status, headers, body = post(f"{sim.url}/api/chat.postMessage")
        assert status == 429
        assert body == json.loads(SLACK_429[2])
        assert headers["Retry-After"] == "30"


def test_an_answer_that_closes_the_connection_is_read_whole(replay: Replay) -> None:
    # HTTP/1.0 (the connection closes after the answer), body in its own
    # segment: the sender must still read the body, not a closed socket.
    replay.split = True
    replay.answer = TELEGRAM_429
    with TelegramSender("1:x", base_url=url(replay)) as sender:
        for _ in range(3):
            with pytest.raises(RateLimited) as info:
                sender.send(request(42))
            assert info.value.retry_after == 15.0
        replay.answer = (200, {}, b'{"ok":true,"result":{"message_id":9}}')
        assert sender.send(request(42)).message_id == 9


# ------------------------------------------- answers pyTelegramBotAPI cannot read


#: A body nested too deep for ``json.loads``, which raises RecursionError for it.
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.fixture
def telebot_sender(replay: Replay, monkeypatch: pytest.MonkeyPatch) -> Any:
    telebot = pytest.importorskip("telebot", reason="pyTelegramBotAPI is not installed")
    contrib = pytest.importorskip("outbound.contrib.telebot")
    monkeypatch.setattr(telebot.apihelper, "API_URL", url(replay) + "/bot{0}/{1}")
    monkeypatch.setattr(telebot.apihelper, "RETRY_ON_ERROR", False)
    return contrib.TeleBotSender(telebot.TeleBot("1:x", threaded=False))


@pytest.mark.parametrize(
    "body",
    [
        b'{"ok":false,"description":"Too Many Requests: retry after 20"}',  # no error_code
        b'{"ok":false,"error_code":429}',  # no description
        b'{"error":"rate limited"}',  # no "ok": a proxy's answer
        b"[]",  # not an object
        b"not json at all",
        pytest.param(DEEP, id="nested-too-deep"),  # json.loads raises RecursionError
    ],
)
def test_telebot_sender_maps_a_429_it_cannot_read(
    replay: Replay, telebot_sender: Any, body: bytes
) -> None:
    from outbound.middleware import rate_limit  # noqa: PLC0415
    from outbound.ratelimit import RateLimiter, RateLimits  # noqa: PLC0415

    replay.answer = (429, {"Retry-After": "20"}, body)
    limiter = RateLimiter(RateLimits())
    with pytest.raises(RateLimited) as info:
        rate_limit(limiter)(telebot_sender).send(request(42))
    assert info.value.retry_after == 20.0
    assert limiter.acquire(42, book=False) == pytest.approx(20.0, abs=0.5)  # recorded


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (502, b'{"message":"Bad Gateway"}', TransientSendError),
        (503, b"[1, 2]", TransientSendError),
        pytest.param(503, DEEP, TransientSendError, id="503-nested-too-deep"),
        pytest.param(200, DEEP, TransientSendError, id="200-nested-too-deep"),
        (200, b'{"result":{"message_id":1}}', TransientSendError),  # no "ok"
        (403, b'{"ok":false,"description":"Forbidden: bot was blocked"}', PermanentSendError),
    ],
)
def test_telebot_sender_maps_other_answers_it_cannot_read(
    replay: Replay, telebot_sender: Any, status: int, body: bytes, error: type[Exception]
) -> None:
    replay.answer = (status, {}, body)
    with pytest.raises(error):
        telebot_sender.send(request(42))


def test_telebot_sender_takes_a_sent_message_it_cannot_read_as_sent(
    replay: Replay, telebot_sender: Any
) -> None:
    replay.answer = (200, {}, b'{"ok":true,"result":{"message_id":5}}')  # no chat, no date
    result = telebot_sender.send(request(42))
    assert result.message_id is None  # it went out: not an error, not to be retried
    assert result.raw == {"ok": True, "result": None}


# ------------------------------------------------------ Retry-After as an HTTP date


def http_date(seconds_ahead: float) -> str:
    return email.utils.formatdate(time.time() + seconds_ahead, usegmt=True)


def test_every_sender_reads_a_retry_after_date(replay: Replay, telebot_sender: Any) -> None:
    slack_sdk = pytest.importorskip("slack_sdk", reason="slack_sdk is not installed")
    contrib = pytest.importorskip("outbound.contrib.slack")
    slack = contrib.SlackSender(slack_sdk.WebClient(token="xoxb-1", base_url=url(replay) + "/api/"))
    cases: list[tuple[Any, bytes, int | str]] = [
        (TelegramSender("1:x", base_url=url(replay)), b'{"ok":false,"error_code":429}', 42),
        (telebot_sender, b'{"ok":false,"error_code":429,"description":"Too Many"}', 42),
        (slack, b'{"ok":false,"error":"ratelimited"}', "C01"),
    ]
    for sender, body, chat in cases:
        replay.answer = (429, {"Retry-After": http_date(30)}, body)
        with pytest.raises(RateLimited) as info:
            sender.send(request(chat))
        assert 27.0 <= info.value.retry_after <= 30.0, sender  # whole seconds in a date
        replay.answer = (429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, body)
        with pytest.raises(RateLimited) as info:
            sender.send(request(chat))
        assert info.value.retry_after == 0.0  # a date past: no wait
        replay.answer = (429, {"Retry-After": "99999999999"}, body)
        with pytest.raises(RateLimited) as info:
            sender.send(request(chat))
        assert info.value.retry_after == RateLimited.MAX_RETRY_AFTER  # a day at most
