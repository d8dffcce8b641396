"""TelegramSender against the PlatformSimulator over real loopback HTTP."""

from __future__ import annotations

import logging
import math
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
from canned_http import (
    QUOTED_ANSWERS,
    SECRET,
    assert_no_secret,
    canned_server,
    held_by,
    raw_server,
)
from outbound_process import run_script_ok
from sending_thread import sending

from outbound import (
    Dispatcher,
    Outbound,
    PermanentSendError,
    RateLimited,
    TransientSendError,
    middleware,
)
from outbound._secret import TokenMask
from outbound.errors import SendTimeout
from outbound.messages import MethodMessage, Sender, SendRequest, SendResult, TextMessage
from outbound.simulator import Fault, PlatformSimulator
from outbound.telegram import TelegramError, TelegramSender


@pytest.fixture
def sim() -> Iterator[PlatformSimulator]:
    with PlatformSimulator() as simulator:
        yield simulator


@pytest.fixture
def sender(sim: PlatformSimulator) -> Iterator[TelegramSender]:
    with TelegramSender(sim.token, base_url=sim.url, timeout=5.0) as s:
        yield s


def text(chat_id: int | str, body: str = "hello") -> SendRequest:
    return SendRequest(chat_id, TextMessage(body))


def texts(sim: PlatformSimulator, chat_id: int | str) -> list[str]:
    return [m["text"] for m in sim.received(chat_id)]


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        pause.wait(0.01)
    return True


# ------------------------------------------------------------------ success


def test_is_a_sender(sender: TelegramSender) -> None:
    assert isinstance(sender, Sender)


def test_send_text_returns_message_id_and_raw(
    sim: PlatformSimulator, sender: TelegramSender
) -> None:
    result = sender.send(text(42, "hi"))
    assert isinstance(result, SendResult)
    assert result.message_id == 1
    assert result.raw is not None
    assert result.raw["result"]["text"] == "hi"
    assert sender.send(text(42)).message_id == 2
    assert texts(sim, 42) == ["hi", "hello"]


def test_text_options_are_sent(sim: PlatformSimulator, sender: TelegramSender) -> None:
    sender.send(
        SendRequest(1, TextMessage("*b*", parse_mode="MarkdownV2", disable_notification=True))
    )
    params = sim.received(1)[0]["params"]
    assert params == {
        "chat_id": 1,
        "text": "*b*",
        "parse_mode": "MarkdownV2",
        "disable_notification": True,
    }


def test_method_message_goes_to_its_method_with_the_chat(
    sim: PlatformSimulator, sender: TelegramSender
) -> None:
    request = SendRequest(-100, MethodMessage("sendPhoto", {"photo": "file-1", "chat_id": 5}))
    assert sender.send(request).message_id == 1
    record = sim.received(-100)[0]
    assert record["method"] == "sendPhoto"
    assert record["params"] == {"photo": "file-1", "chat_id": -100}


def test_channel_username(sim: PlatformSimulator, sender: TelegramSender) -> None:
    sender.send(text("@news_channel", "x"))
    assert texts(sim, "@news_channel") == ["x"]


@pytest.mark.parametrize(
    ("base_url", "address"),
    [
        ("http://[::1]", ("::1", 80)),
        ("https://[2001:db8::1]/", ("2001:db8::1", 443)),
        ("http://[::1]:8081", ("::1", 8081)),
    ],
)
def test_an_ipv6_base_url_without_a_port_goes_to_its_host(
    base_url: str, address: tuple[str, int]
) -> None:
    """http.client reads a port off a bare IPv6 host: "http://[::1]" went to host "",
    port 1 ("::1" split at its last colon), "https://[2001:db8::1]/" to "2001:db8:"."""
    with TelegramSender("1:x", base_url=base_url) as s:
        conn = s._connection().conn
        assert (conn.host, conn.port) == address


def test_base_url_with_a_trailing_slash() -> None:
    with PlatformSimulator() as sim, TelegramSender(sim.token, base_url=sim.url + "/") as s:
        assert s.send(text(1)).message_id == 1


@pytest.mark.parametrize(
    "base_url",
    [
        "http://127.0.0.1:8081/ ",  # a trailing space from a config file
        "http://127.0.0.1:8081/api\x01",
        "http://127.0.0.1:8081/t\u00e9l\u00e9gram",
        "http://127.0.0.1:8081/api?x=1",
        "http://127.0.0.1:8081/api#top",
        "http://[fe80::1%25eth0]:8081",  # an IPv6 zone: no address lookup takes it
        "http://a b:8081",
        "http://user:SECRET-token@h:8081",  # no sender sends a user or password
        # (a name the lookup takes as IDNA, which refuses it: every send raised
        # UnicodeError, a ValueError, "bad input", never retried)
        "http://a..example:8081",
        "http://.example:8081",
        "http://" + "a" * 64 + ".example:8081",
    ],
)
def test_a_base_url_no_request_line_can_carry_is_refused_at_construction(base_url: str) -> None:
    # It was accepted, and every send failed: a TransientSendError (retried)
    # quoting the request line, the bot token in it, logged by logging().
    with pytest.raises(ValueError, match="base_url") as raised:
        TelegramSender("123456:SECRET-token", base_url=base_url)
    assert "SECRET-token" not in str(raised.value)


@pytest.mark.parametrize(
    "base_url",
    [
        "http://[::1]:8081",
        "https://proxy.example/tg/api/",
        "http://h:1/a%20b",
        "https://b\u00fccher.example",  # (sent as IDNA, as http.client does)
        "HTTPS://API.TELEGRAM.ORG",
        "http://api.telegram.org.:80",  # (a root's empty label, last)
        "http://" + "a" * 63 + ".example",
    ],
)
def test_base_urls_a_request_line_carries_are_taken(base_url: str) -> None:
    TelegramSender("123:abc", base_url=base_url).close()


def test_order_per_chat_through_a_dispatcher(
    sim: PlatformSimulator, sender: TelegramSender
) -> None:
    futures: list[Future[SendResult]] = []
    with Dispatcher(max_inflight=4, queue_size=16, send_timeout=5.0) as d:
        for i in range(10):
            for chat in range(6):
                futures.append(d.submit(chat, sender.send, text(chat, f"{chat}:{i}")))
        for f in futures:
            f.result(timeout=10)
    for chat in range(6):
        assert texts(sim, chat) == [f"{chat}:{i}" for i in range(10)]
    assert sim.stats().connections <= 4


# ------------------------------------------------------------------ error mapping


def test_per_chat_429_is_rate_limited_for_the_chat() -> None:
    with PlatformSimulator(chat_rate=1.0) as sim, TelegramSender(sim.token, base_url=sim.url) as s:
        s.send(text(1))
        with pytest.raises(RateLimited) as exc:
            s.send(text(1))
        assert exc.value.scope == "chat"
        assert 0.9 <= exc.value.retry_after <= 1.0
        cause = exc.value.__cause__
        assert isinstance(cause, TelegramError)
        assert cause.status == 429
        assert s.send(text(2)).message_id == 1


def test_global_429_is_rate_limited_globally() -> None:
    with (
        PlatformSimulator(global_rate=1.0) as sim,
        TelegramSender(sim.token, base_url=sim.url) as s,
    ):
        s.send(text(1))
        with pytest.raises(RateLimited) as exc:
            s.send(text(2))
        assert exc.value.scope == "global"
        assert 0 < exc.value.retry_after <= 1.0


def test_group_429_is_rate_limited_for_the_chat() -> None:
    with (
        PlatformSimulator(group_rate=20.0) as sim,
        TelegramSender(sim.token, base_url=sim.url) as s,
    ):
        s.send(text(-7))
        with pytest.raises(RateLimited) as exc:
            s.send(text(-7))
        assert exc.value.scope == "chat"
        assert 2.9 <= exc.value.retry_after <= 3.0


def test_429_without_scope_or_retry_after_defaults(
    sim: PlatformSimulator, sender: TelegramSender
) -> None:
    sim.inject(Fault("rate_limit", retry_after=7.0, scope="group"))
    with pytest.raises(RateLimited) as exc:
        sender.send(text(1))
    assert (exc.value.scope, exc.value.retry_after) == ("chat", 7.0)


def test_400_is_permanent() -> None:
    with (
        PlatformSimulator(max_text_length=10) as sim,
        TelegramSender(sim.token, base_url=sim.url) as s,
    ):
        with pytest.raises(PermanentSendError) as exc:
            s.send(text(1, "x" * 11))
        cause = exc.value.__cause__
        assert isinstance(cause, TelegramError)
        assert cause.status == 400
        assert cause.description == "Bad Request: message is too long"
        assert s.send(text(1, "short")).message_id == 1


def test_wrong_token_is_permanent(sim: PlatformSimulator) -> None:
    with TelegramSender("1:wrong", base_url=sim.url) as s, pytest.raises(PermanentSendError):
        s.send(text(1))


@pytest.mark.parametrize("status", [500, 502, 503])
def test_5xx_is_transient(sim: PlatformSimulator, sender: TelegramSender, status: int) -> None:
    sim.inject(Fault("error", status=status))
    with pytest.raises(TransientSendError) as exc:
        sender.send(text(1))
    assert not isinstance(exc.value, SendTimeout)
    assert isinstance(exc.value.__cause__, TelegramError)
    assert exc.value.__cause__.status == status
    assert sender.send(text(1)).message_id == 1


def test_dropped_connection_is_transient_and_the_next_send_reconnects(
    sim: PlatformSimulator, sender: TelegramSender
) -> None:
    sender.send(text(1, "before"))
    sim.inject(Fault("drop"))
    with pytest.raises(TransientSendError) as exc:
        sender.send(text(1, "lost"))
    assert isinstance(exc.value.__cause__, ConnectionError)
    sender.send(text(1, "after"))
    assert texts(sim, 1) == ["before", "after"]
    assert sim.stats().connections == 2


def test_a_kept_error_holds_no_open_connection_of_its_thread(
    sim: PlatformSimulator, sender: TelegramSender
) -> None:
    """The error of a dropped connection held the thread's slot (its traceback's
    frames), and the thread's next send reconnected that same slot: a kept
    error (a failed future, a dead-letter list) kept its socket open after the
    thread retired, one descriptor per retired thread. The next send takes a
    new slot; the one the error holds is closed."""
    from outbound.telegram import _Connection  # noqa: PLC0415

    sim.inject(Fault("drop"))
    with pytest.raises(TransientSendError) as exc:
        sender.send(text(1, "lost"))
    sender.send(text(1, "after"))  # (this thread connects again)
    slots = [v for v in held_by(exc.value) if isinstance(v, _Connection)]
    assert slots, "(the test sees no slot in the error's frames)"
    assert all(slot.conn.sock is None for slot in slots)
    assert texts(sim, 1) == ["after"]


def test_connection_refused_is_transient() -> None:
    sim = PlatformSimulator().start()
    url = sim.url
    sim.stop()
    with TelegramSender("1:x", base_url=url) as s, pytest.raises(TransientSendError) as exc:
        s.send(text(1))
    assert isinstance(exc.value.__cause__, OSError)


def test_slow_answer_past_the_task_deadline_times_out(
    sim: PlatformSimulator, sender: TelegramSender
) -> None:
    sim.inject(Fault("slow", delay=30.0, chat_id=1))
    with Dispatcher(max_inflight=4, queue_size=8, send_timeout=0.5) as d:
        start = time.monotonic()
        slow = d.submit(1, sender.send, text(1, "slow"))
        with pytest.raises(TransientSendError) as exc:
            slow.result(timeout=10)
        elapsed = time.monotonic() - start
        after = d.submit(1, sender.send, text(1, "next")).result(timeout=10)
    assert isinstance(exc.value, SendTimeout)
    assert isinstance(exc.value, TimeoutError)
    assert isinstance(exc.value.__cause__, TimeoutError)
    assert 0.4 <= elapsed < 2.0
    assert after.message_id == 2
    assert texts(sim, 1) == ["slow", "next"]


def test_default_timeout_outside_a_task(sim: PlatformSimulator) -> None:
    sim.inject(Fault("slow", delay=30.0))
    with TelegramSender(sim.token, base_url=sim.url, timeout=0.3) as s:
        start = time.monotonic()
        with pytest.raises(SendTimeout):
            s.send(text(1))
        assert time.monotonic() - start < 2.0


# ------------------------------------------------------------------ connections


def test_one_thread_reuses_one_connection(sim: PlatformSimulator, sender: TelegramSender) -> None:
    for i in range(30):
        sender.send(text(i % 3, str(i)))
    stats = sim.stats()
    assert stats.delivered == 30
    assert stats.connections == 1


def test_each_thread_has_its_own_connection(sim: PlatformSimulator, sender: TelegramSender) -> None:
    barrier = threading.Barrier(3, timeout=10)
    errors: list[BaseException] = []

    def work(chat: int) -> None:
        try:
            sender.send(text(chat))
            barrier.wait()
            for _ in range(5):
                sender.send(text(chat))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(chat,)) for chat in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert sim.stats().connections == 3
    assert sim.stats().delivered == 18


def test_reconnects_after_the_server_closed_an_idle_connection() -> None:
    with (
        PlatformSimulator(idle_timeout=0.1) as sim,
        TelegramSender(sim.token, base_url=sim.url) as s,
    ):
        s.send(text(1))
        assert wait_until(lambda: sim.stats().open_connections == 0)
        assert s.send(text(1)).message_id == 2
        assert sim.stats().connections == 2


def test_close_closes_connections_and_refuses_sends(sim: PlatformSimulator) -> None:
    s = TelegramSender(sim.token, base_url=sim.url)
    s.send(text(1))
    assert sim.stats().open_connections == 1
    s.close()
    assert wait_until(lambda: sim.stats().open_connections == 0)
    with pytest.raises(RuntimeError):
        s.send(text(1))
    s.close()
    assert "closed" in repr(s)


def test_close_ends_a_send_waiting_for_its_answer(sim: PlatformSimulator) -> None:
    # Closing the connection did not wake the read of a send in another
    # thread: it waited out its deadline (30 s), then returned the answer.
    s = TelegramSender(sim.token, base_url=sim.url, timeout=30.0)
    sim.inject(Fault("slow", delay=30.0, chat_id=1))
    sender, outcome = sending(s, text(1))
    assert sim.wait_received(1, timeout=5)
    s.close()
    sender.join(5)
    assert not sender.is_alive(), "the send still waits for its answer"
    assert len(outcome) == 1
    assert isinstance(outcome[0], TransientSendError)
    assert "closed" in str(outcome[0])
    with pytest.raises(RuntimeError):
        s.send(text(1))


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (text(1, "x" * 4097), ValueError),
        (text("12345"), ValueError),
        (text("C0123ABC"), ValueError),
        (text("@ab"), ValueError),
        (SendRequest(1, MethodMessage("sendMessage", {"text": ""})), ValueError),
        (SendRequest(1, MethodMessage("sendMessage", {})), TypeError),
        (SendRequest(1, MethodMessage("send/Message", {"text": "x"})), ValueError),
        (SendRequest(1, MethodMessage("sendPhoto", {"photo": object()})), TypeError),
        # Method names are case-insensitive: these went out with 5,000 characters.
        (SendRequest(1, MethodMessage("sendmessage", {"text": "x" * 5000})), ValueError),
        (SendRequest(1, MethodMessage("SENDMESSAGE", {"text": "x" * 5000})), ValueError),
        (SendRequest(1, MethodMessage("editMessageText", {"text": "x" * 4097})), ValueError),
        # Past 64 bits (and past 4,300 digits: str() of it raised in the task).
        (text(2**63), ValueError),
        (text(-(2**63) - 1), ValueError),
        (text(10**5000), ValueError),
        # Parse modes the Bot API does not have ("unsupported parse_mode", a 400
        # at send time: an outbox row dead-lettered late).
        (SendRequest(1, TextMessage("x", parse_mode="Markdown2")), ValueError),
        (SendRequest(1, TextMessage("x", parse_mode="HTML5")), ValueError),
        (
            SendRequest(1, MethodMessage("sendMessage", {"text": "x", "parse_mode": "bold"})),
            ValueError,
        ),
        (
            SendRequest(1, MethodMessage("editMessageText", {"text": "x", "parse_mode": 1})),
            ValueError,
        ),
    ],
)
def test_validate_refuses_bad_input_and_send_sends_nothing(
    sim: PlatformSimulator, sender: TelegramSender, request_: SendRequest, error: type[Exception]
) -> None:
    with pytest.raises(error):
        sender.validate(request_)
    with pytest.raises(error):
        sender.send(request_)
    assert sim.stats().requests == 0


def test_validate_accepts_good_input(sender: TelegramSender) -> None:
    sender.validate(text(1, "x" * 4096))
    sender.validate(text(-1001234567890))
    sender.validate(text(2**63 - 1))
    sender.validate(text(-(2**63)))
    sender.validate(SendRequest(1, MethodMessage("editMessageText", {"text": "x" * 4096})))
    sender.validate(text("@news_channel"))
    sender.validate(SendRequest(1, MethodMessage("sendPhoto", {"photo": "f"})))
    for mode in ("HTML", "html", "MarkdownV2", "markdownv2", "Markdown", ""):
        sender.validate(SendRequest(1, TextMessage("x", parse_mode=mode)))
        sender.validate(
            SendRequest(1, MethodMessage("sendMessage", {"text": "x", "parse_mode": mode}))
        )


def test_validate_refuses_what_is_not_a_request(sender: TelegramSender) -> None:
    with pytest.raises(TypeError):
        sender.validate("hello")  # type: ignore[arg-type]


def test_max_text_length_is_configurable(sim: PlatformSimulator) -> None:
    with TelegramSender(sim.token, base_url=sim.url, max_text_length=5) as s:
        with pytest.raises(ValueError):
            s.validate(text(1, "123456"))
        s.validate(text(1, "12345"))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"token": ""},
        {"token": "a/b"},
        {"base_url": "ftp://example.org"},
        {"timeout": 0},
        {"connect_timeout": -1},
        {"max_text_length": 0},
        {"timeout": math.nan},
        {"timeout": math.inf},
    ],
)
def test_constructor_refuses_bad_arguments(kwargs: dict[str, object]) -> None:
    arguments: dict[str, object] = {"token": "1:x", **kwargs}
    with pytest.raises(ValueError):
        TelegramSender(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": True},
        {"connect_timeout": "5"},
        {"max_text_length": 2.5},
        {"max_text_length": True},
    ],
)
def test_constructor_refuses_arguments_of_the_wrong_type(kwargs: dict[str, object]) -> None:
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        TelegramSender("1:x", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["timeout", "task"])
def test_a_time_limit_past_what_a_socket_takes_means_no_limit(
    sim: PlatformSimulator, where: str
) -> None:
    """1e10 s is past threading.TIMEOUT_MAX, which a socket refuses (OverflowError):
    the message went out, then the read of its answer failed, so a retry sent it twice."""
    if where == "timeout":
        with TelegramSender(sim.token, base_url=sim.url, timeout=1e10, connect_timeout=1e10) as s:
            assert s.send(text(42, "once")).message_id is not None
    else:
        sender = middleware.retry()(TelegramSender(sim.token, base_url=sim.url))
        with Outbound(None, sender, send_timeout=1e10) as out:
            assert out.reply_text(42, "once").result(timeout=10).message_id is not None
    assert texts(sim, 42) == ["once"]


@pytest.mark.parametrize("status", [429, 503, 200])
def test_an_answer_nested_too_deep_to_decode_is_mapped_by_its_status(status: int) -> None:
    # json.loads raises RecursionError, not ValueError, for it: it went up raw.
    body = b"[" * 100_000 + b"]" * 100_000
    headers = {"Content-Type": "application/json", "Retry-After": "7"}
    with (
        canned_server(status, body, headers) as url,
        TelegramSender("1:x", base_url=url) as s,
    ):
        if status == 429:
            with pytest.raises(RateLimited) as limited:
                s.send(text(42))
            assert limited.value.retry_after == 7.0
        else:  # a 200 that is not a Bot API answer may not come from the platform
            with pytest.raises(TransientSendError, match="not a Bot API answer"):
                s.send(text(42))


@pytest.mark.parametrize("token", ["1:ab c", "1:abc\r\nX-Evil: 1", "1:abc?x=1", "1:abc#", "1:%2F"])
def test_a_token_that_would_change_the_request_is_refused_without_being_shown(
    token: str,
) -> None:
    # It goes into the request's path as it is: a space, a line break, a
    # query or a fragment would make another request, or fail at each send
    # with the token in the error.
    with pytest.raises(ValueError, match="must be a bot token") as refused:
        TelegramSender(token)
    assert token not in str(refused.value)
    with pytest.raises(ValueError, match="must be a bot token"):
        PlatformSimulator(token=token)


def test_a_real_shaped_token_is_taken() -> None:
    TelegramSender("123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw-_.~").close()


# ------------------------------------------------------------------ secrecy


def test_never_logs_text_or_token(
    sim: PlatformSimulator, sender: TelegramSender, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "the-secret-message-body"
    caplog.set_level(logging.DEBUG, logger="outbound")
    sender.send(text(1, secret))
    sim.inject(Fault("error"), Fault("drop"), Fault("rate_limit"))
    for _ in range(3):
        with pytest.raises((TransientSendError, RateLimited)) as exc:
            sender.send(text(1, secret))
        assert secret not in str(exc.value)
        assert sim.token not in str(exc.value)
    assert secret not in caplog.text
    assert sim.token not in caplog.text
    assert sim.token not in repr(sender)


def test_an_answer_trickled_slowly_is_cut_at_the_deadline() -> None:
    """Each read's timeout is what is left of the whole send, not a fresh one."""
    body = b'{"ok":true,"result":{"message_id":1}}'
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: "
        + b"a" * 400
        + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            for i in range(0, len(answer), 4):
                if stop.wait(0.05):  # 4 bytes every 50 ms: each read is quick
                    return
                try:
                    conn.sendall(answer[i : i + 4])
                except OSError:
                    return

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        port = server.getsockname()[1]
        with TelegramSender("1:x", base_url=f"http://127.0.0.1:{port}", timeout=0.5) as sender:
            start = time.monotonic()
            with pytest.raises(SendTimeout):
                sender.send(SendRequest(1, TextMessage("hi")))
            # The whole answer would take ~6 s at that pace.
            assert time.monotonic() - start < 3.0
    finally:
        stop.set()
        thread.join(10)
        server.close()


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        # Valid JSON, 400 digits: float() of it raised OverflowError out of send.
        (b'{"ok":false,"error_code":429,"parameters":{"retry_after":' + b"9" * 400 + b"}}", {}),
        # JSON's 1e400 reads as infinity; it was taken for no retry_after (1 s).
        (b'{"ok":false,"error_code":429,"parameters":{"retry_after":1e400}}', {}),
        (b'{"ok":false,"error_code":429}', {"Retry-After": "9" * 400}),
        (b'{"ok":false,"error_code":429}', {"Retry-After": "1e400"}),
    ],
)
def test_a_429_whose_retry_after_overflows_a_float_is_a_rate_limit_of_a_day(
    body: bytes, headers: dict[str, str]
) -> None:
    with (
        canned_server(429, body, {"Content-Type": "application/json", **headers}) as url,
        TelegramSender("1:x", base_url=url) as s,
        pytest.raises(RateLimited) as exc,
    ):
        s.send(text(42))
    assert exc.value.retry_after == RateLimited.MAX_RETRY_AFTER


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (404, PermanentSendError),
        (500, TransientSendError),
        (429, RateLimited),
        (200, PermanentSendError),
    ],
)
@pytest.mark.parametrize(
    "written",
    [
        "as it is",
        "JSON-escaped",
        "UTF-16",
        "percent-encoded",
        "percent-encoded, lower case",
        "percent-encoded and JSON-escaped",
    ],
)
def test_an_answer_quoting_the_requests_path_keeps_the_token_out(
    status: int, error: type[Exception], written: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy's or a self-hosted Bot API server's "Not Found: /bot<token>/sendMessage":
    the description went into the error, its TelegramError and the log as it was;
    and once masked in the answer's bytes, so did one written with JSON escapes
    ("\\u003a" for ":"), the same text once decoded, and one percent-encoded
    ("%3A"), as a proxy may quote a path."""
    token = "123456:SECRET-bot-token"
    quoted = {
        "JSON-escaped": token.replace(":", "\\u003a"),
        "percent-encoded": token.replace(":", "%3A"),
        "percent-encoded, lower case": token.replace(":", "%3a").replace("-", "%2d"),
        "percent-encoded and JSON-escaped": token.replace(":", "\\u00253A"),
    }.get(written, token)
    body = (
        b'{"ok":false,"error_code":%d,"description":"Not Found: /bot%s/sendMessage",'
        b'"parameters":{"echo":"%s"}}' % (status, quoted.encode(), quoted.encode())
    )
    if written == "UTF-16":  # (JSON that json.loads reads from bytes)
        body = body.decode().encode("utf-16")
    with (
        canned_server(status, body) as url,
        TelegramSender(token, base_url=url) as telegram,
        caplog.at_level(logging.DEBUG),
    ):
        with pytest.raises(error) as caught:
            middleware.logging()(telegram).send(text(42))
    # (Escaped, the secret part is masked first: "/bot123456:<token>/...".)
    assert "<token>/sendMessage" in str(caught.value)
    assert "SECRET-bot-token" not in str(caught.value)
    cause = caught.value.__cause__
    assert isinstance(cause, TelegramError)
    secret = "SECRET-bot-token"  # (in every form of the token above)
    assert secret not in repr((cause.description, cause.parameters, cause.payload))
    printed = "".join(traceback.format_exception(caught.value))
    assert secret not in printed, printed
    assert secret not in caplog.text


@pytest.mark.parametrize(
    ("said", "masked"),
    [
        ("/bot123456:AAH-secret_part.of~it/x", "/bot<token>/x"),
        ("/bot123456%3AAAH-secret_part.of~it/x", "/bot<token>/x"),
        ("/bot123456%3aAAH%2Dsecret%5fpart.of~it/x", "/bot<token>/x"),
        ("only AAH-secret_part.of~it", "only <token>"),  # its secret part alone
        ("AAH-secret_part.of~i", "AAH-secret_part.of~i"),  # a piece of it: not the token
        ("100% 123456", "100% 123456"),
    ],
)
def test_the_token_mask_finds_every_form_of_the_token(said: str, masked: str) -> None:
    mask = TokenMask("123456:AAH-secret_part.of~it")
    assert mask.text(said) == masked
    assert mask.data(said.encode()) == masked.encode()
    assert mask.found(said) is (said != masked)


def test_the_token_mask_takes_a_token_that_is_not_ascii() -> None:
    # (pyTelegramBotAPI takes any token: an en dash pasted in goes out as the
    # percent-encoded bytes of its UTF-8. The mask raised UnicodeEncodeError.)
    mask = TokenMask("123456:AAH\u2013secret_part_of_it")
    said = "/bot123456%3AAAH%E2%80%93secret_part_of_it/x and AAH\u2013secret_part_of_it"
    assert mask.text(said) == "/bot<token>/x and <token>"
    assert mask.data(said.encode()) == b"/bot<token>/x and <token>"
    assert TokenMask("1:\ud800").text("x") == "x"  # (never raises)


def test_a_short_secret_part_is_masked_within_the_token_only() -> None:
    # (A test's "1:x": every "x" of an answer masked would garble it.)
    mask = TokenMask("1:x")
    assert mask.text("x 1:x 1%3Ax") == "x <token> <token>"
    assert not mask.found("x")


@pytest.mark.parametrize(
    "written", ["as it is", "JSON-escaped", "UTF-16", "UTF-32", "UTF-8 with a BOM"]
)
def test_a_success_answer_echoing_the_token_keeps_it_out_of_the_result(written: str) -> None:
    """The token masked in the answer's bytes, then looked for again in the decoded
    answer only where the bytes could hide it (an escape, a NUL of UTF-16 or UTF-32):
    every way it can be written comes out masked in ``SendResult.raw``."""
    token = "123456:SECRET-bot-token"
    quoted = token.replace(":", "\\u003a") if written == "JSON-escaped" else token
    body = b'{"ok":true,"result":{"message_id":7,"text":"%s"}}' % quoted.encode()
    encoding = {"UTF-16": "utf-16", "UTF-32": "utf-32", "UTF-8 with a BOM": "utf-8-sig"}
    if written in encoding:
        body = body.decode().encode(encoding[written])
    with canned_server(200, body) as url, TelegramSender(token, base_url=url) as telegram:
        result = telegram.send(text(42))
    assert result.message_id == 7
    assert result.raw is not None
    assert result.raw["result"]["text"] in ("<token>", "123456:<token>")


@pytest.mark.parametrize("answer", sorted(QUOTED_ANSWERS))
def test_an_answer_the_client_quotes_is_transient_and_its_text_is_not_logged(
    answer: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken proxy sends the Bot API's JSON, which echoes the message, without a
    status line, or a chunk size that is not one: the error (and so the logging
    middleware's line, and any traceback) quoted it."""
    with (
        raw_server(QUOTED_ANSWERS[answer]) as url,
        TelegramSender("1:x", base_url=url) as telegram,
        caplog.at_level(logging.DEBUG),
    ):
        sender = middleware.logging()(telegram)
        with pytest.raises(TransientSendError) as exc:
            sender.send(text(42, SECRET))
    assert "the answer could not be read" in str(exc.value)
    assert_no_secret(exc.value)
    assert "send failed" in caplog.text
    assert "4111" not in caplog.text


@pytest.mark.parametrize("interim", [b"103 Early Hints", b"102 Processing", b"100 Continue"])
def test_interim_answers_before_the_real_one_are_skipped(interim: bytes) -> None:
    """A "103 Early Hints" (or any 1xx) before the real 200 was taken as the
    answer: a delivered message was reported as refused."""
    body = b'{"ok":true,"result":{"message_id":7}}'
    answer = (
        b"HTTP/1.1 " + interim + b"\r\nLink: </style.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 " + interim + b"\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    with raw_server(answer) as url, TelegramSender("1:x", base_url=url, timeout=5.0) as telegram:
        result = telegram.send(text(42))
    assert result.message_id == 7


def test_close_racing_sends_in_other_threads_fails_them_only_as_documented(
    sim: PlatformSimulator,
) -> None:
    """close() closed the connections of sends running in other threads under
    them: http.client, not made for that, failed a send with a raw
    AttributeError (its socket None), which retry() does not retry. Rounds of
    four threads sending while close() comes at a varying point, under a
    short switch interval."""
    bad: list[BaseException] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for round_ in range(60):
            s = TelegramSender(sim.token, base_url=sim.url, timeout=5)
            stop = threading.Event()
            started = threading.Barrier(5, timeout=10)

            def worker(chat: int, s: TelegramSender = s, stop: threading.Event = stop) -> None:
                started.wait()
                while not stop.is_set():
                    caption = "x" * (200_000 if chat % 2 else 10)
                    try:
                        s.send(
                            SendRequest(chat, MethodMessage("sendDocument", {"caption": caption}))
                        )
                    except TransientSendError:
                        pass  # a send running as close() came
                    except RuntimeError as exc:
                        if "closed" not in str(exc):
                            bad.append(exc)
                        return  # a send after close()
                    except Exception as exc:
                        bad.append(exc)
                        return

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(1, 5)]
            for thread in threads:
                thread.start()
            before = sim.stats().delivered
            started.wait()
            # close() while sends run: after a few more were delivered.
            assert sim.wait_received(before + 1 + round_ % 7, timeout=10)
            s.close()
            stop.set()
            for thread in threads:
                thread.join(10)
            assert not any(thread.is_alive() for thread in threads)
            assert bad == [], f"round {round_}: {bad[0]!r}"
    finally:
        sys.setswitchinterval(switch)


_CLOSE_IN_A_CHILD = """
import os, threading
from outbound.messages import SendRequest, TextMessage
from outbound.simulator import Fault, PlatformSimulator
from outbound.telegram import TelegramSender

with PlatformSimulator() as sim:
    sender = TelegramSender(sim.token, base_url=sim.url, timeout=30)
    sender.send(SendRequest(2, TextMessage("warm")))  # the main thread's connection too
    sim.inject(Fault("slow", delay=3.0, chat_id=1))
    result = []
    thread = threading.Thread(
        target=lambda: result.append(sender.send(SendRequest(1, TextMessage("hello"))))
    )
    thread.start()
    assert sim.wait_received(1, chat_id=1, timeout=10)  # delivered, its answer to come
    pid = os.fork()
    if pid == 0:  # a worker process closes the sender it inherited, and exits
        try:
            sender.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    thread.join(15)
    assert len(result) == 1 and result[0].message_id is not None, result
    # and the parent's sender goes on
    assert sender.send(SendRequest(2, TextMessage("again"))).message_id is not None
    assert sim.stats().delivered == 3
print("ok")
"""


def test_close_in_a_forked_child_leaves_the_parents_sends_alone() -> None:
    """close() in a child shut down the connections it inherited, the parent's:
    the parent's send waiting for its answer failed (the message delivered, a
    retry sent it twice; Django's shutdown() in a forked worker does this)."""
    run_script_ok(_CLOSE_IN_A_CHILD)


_FORK_WHILE_READING = """
import os, signal, socket, sys, threading, time
from outbound.messages import SendRequest, TextMessage
from outbound.telegram import TelegramSender
from outbound_process import wait_until_reading_a_body

mode = sys.argv[1]
release = threading.Event()
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(8)

def serve():
    conn, _ = server.accept()
    data = b""
    while b"\\r\\n\\r\\n" not in data:
        data += conn.recv(65536)
    body = b'{"ok":true,"result":{"message_id":1}}'
    conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body))
    release.wait(30)  # the head now, the body once the child is done
    conn.sendall(body)

threading.Thread(target=serve, daemon=True).start()
sender = TelegramSender("123:abc", base_url="http://127.0.0.1:%d" % server.getsockname()[1])
result = []
worker = threading.Thread(
    target=lambda: result.append(sender.send(SendRequest(1, TextMessage("hi"))))
)
worker.start()

wait_until_reading_a_body(worker)
pid = os.fork()
if pid == 0:  # a worker process: it closes the sender it inherited, or just ends
    if mode == "close":
        sender.close()
        os._exit(0)
    sys.exit(0)  # (the finalizers run)
deadline = time.monotonic() + 15
while os.waitpid(pid, os.WNOHANG)[0] == 0:
    if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise SystemExit("the child hung in " + mode)
    time.sleep(0.01)
release.set()
worker.join(15)
assert len(result) == 1 and result[0].message_id == 1, result
print("ok")
"""


@pytest.mark.parametrize("mode", ["close", "exit"])
def test_a_child_forked_while_a_send_reads_its_answer_closes_and_ends(mode: str) -> None:
    """Closing a connection closes the answer read on it, whose reader's lock the
    parent's reading thread held at the fork: the child's close(), or its plain
    exit (the connections' finalizers), waited for that thread for good."""
    run_script_ok(_FORK_WHILE_READING, mode)


def test_close_closes_the_idle_connections_of_threads_that_live_on(
    sim: PlatformSimulator,
) -> None:
    """Threads of a pool that sent once and live on: their connections were shut
    down but kept open (a descriptor each, for as long as the sender and the
    threads lived), and a second close() from one of them left its own too."""
    s = TelegramSender(sim.token, base_url=sim.url)
    sent, done = threading.Barrier(5, timeout=10), threading.Event()

    def pool_thread(chat: int) -> None:
        s.send(text(chat))
        sent.wait()
        done.wait(10)
        s.close()  # a second close(), from a thread whose connection it holds

    threads = [threading.Thread(target=pool_thread, args=(n,)) for n in range(1, 5)]
    for thread in threads:
        thread.start()
    sent.wait()
    slots = list(s._connections)
    assert len(slots) == 4
    s.close()
    assert [slot.conn.sock for slot in slots] == [None] * 4
    done.set()
    for thread in threads:
        thread.join(10)
    assert wait_until(lambda: sim.stats().open_connections == 0)
