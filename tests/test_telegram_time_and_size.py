"""TelegramSender's time and size bounds: one connect deadline for every address
of a host, the request's write given the time left (not the connect's), and
an answer too long to read refused as a transport error (a declared length
was allocated at once: ``OverflowError`` or ``MemoryError``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import types
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
from canned_http import raw_server
from interrupts import line_of
from sending_thread import sending
from test_telegram_close_edges import _listener_not_accepting, linux_only

from outbound import telegram
from outbound.errors import SendTimeout, TransientSendError
from outbound.messages import SendRequest, SendResult, TextMessage
from outbound.telegram import TelegramSender

REQUEST = SendRequest(1, TextMessage("hello"))


@linux_only
def test_one_connect_deadline_for_every_address_of_a_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each address got the whole connect timeout again: three addresses that do
    not answer held a send with timeout=1 for 3 s."""
    with contextlib.ExitStack() as stack:
        ports = [stack.enter_context(_listener_not_accepting()) for _ in range(3)]
        found = [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port))
            for port in ports
        ]
        monkeypatch.setattr(telegram, "_listed", lambda *args: list(found))
        s = TelegramSender("1:x", base_url="http://127.0.0.1:9", timeout=1.0, connect_timeout=1.0)
        began = time.monotonic()
        with pytest.raises(SendTimeout):
            s.send(REQUEST)
        took = time.monotonic() - began
    assert took < 1.8, f"the send took {took:.2f} s with a timeout of 1 s"


def test_the_request_is_written_with_the_time_left_not_the_connects() -> None:
    """After a new connection's connect, the request's write kept the connect's
    timeout: a connect_timeout shorter than the send's cut a slow upload short
    (and a longer one let the write outlive the deadline)."""
    held: list[float] = []
    line = line_of(TelegramSender._exchange, "_local_deadline.deadline = deadline")

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == line and not held:
            sock = frame.f_locals["conn"].sock
            held.append(sock.gettimeout())
        return local

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is TelegramSender._exchange.__code__ else None

    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 37\r\n\r\n" + b'{"ok":true,"result":{"message_id":1}}'
    )
    with raw_server(answer) as url:
        s = TelegramSender("1:x", base_url=url, timeout=30.0, connect_timeout=1.0)
        thread, outcome = sending(s, REQUEST, trace)
        thread.join(10)
        assert not thread.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], SendResult), outcome
    assert outcome[0].message_id == 1
    assert len(held) == 1
    assert held[0] > 20.0, f"the write's timeout was {held[0]}, with 30 s left"


@contextlib.contextmanager
def _answer(head: bytes) -> Iterator[str]:
    with raw_server(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + head) as url:
        yield url


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: 99999999999999999999\r\n\r\n{}",
        b"Content-Length: 9223372036854775807\r\n\r\n{}",
        b"Content-Length: 1099511627776\r\n\r\n{}",
        b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n{}",
        # (http.client passed a negative chunk size on: the read raised ValueError,
        # bad input's error, never retried)
        b"Transfer-Encoding: chunked\r\n\r\n-5\r\n{}\r\n0\r\n\r\n",
    ],
    ids=["past-64-bits", "2**63-1", "1-TiB", "chunk-of-2**64", "chunk-of-minus-5"],
)
def test_an_answer_that_declares_too_much_is_a_transport_error(head: bytes) -> None:
    with _answer(head) as url:
        s = TelegramSender("1:x", base_url=url, timeout=10.0)
        with pytest.raises(TransientSendError, match="declares") as info:
            s.send(REQUEST)
    assert not isinstance(info.value, SendTimeout)


class _SlowConnect(socket.socket):
    """A socket whose connect takes a second before it begins (a SYN dropped and
    sent again, say)."""

    def connect(self, address: Any) -> None:
        threading.Event().wait(1.0)  # (the time the connect takes: what is tested)
        super().connect(address)


def test_the_tls_handshake_has_what_the_connect_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TLS handshake was given the timeout its TCP connect began with, again: a
    connect of a second, then a server that never answers the handshake, held a
    send with timeout=2 for 3 s."""
    module = types.SimpleNamespace(**vars(socket))
    module.socket = _SlowConnect
    monkeypatch.setattr(telegram, "socket", module)
    # (A listener that never accepts: the kernel completes the connect, and
    # nothing answers the ClientHello.)
    with socket.create_server(("127.0.0.1", 0), backlog=4) as listener:
        port = listener.getsockname()[1]
        s = TelegramSender(
            "1:x", base_url=f"https://127.0.0.1:{port}", timeout=2.0, connect_timeout=10.0
        )
        began = time.monotonic()
        with pytest.raises(SendTimeout):
            s.send(REQUEST)
        took = time.monotonic() - began
        s.close()
    assert took < 2.6, f"the send took {took:.2f} s with a timeout of 2 s"


def test_an_answer_that_runs_past_the_most_read_is_a_transport_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No length, read to the end of the connection: a never-ending answer was read
    into memory until the deadline."""
    monkeypatch.setattr(telegram, "_MAX_ANSWER", 1 << 20)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            with contextlib.suppress(OSError):
                while not stop.is_set():
                    conn.sendall(b"x" * 65536)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        s = TelegramSender("1:x", base_url=f"http://127.0.0.1:{listener.getsockname()[1]}")
        with pytest.raises(TransientSendError, match="past the most read") as info:
            s.send(REQUEST)
        assert not isinstance(info.value, SendTimeout)
        # The answer's socket is closed with the error still held (the answer,
        # not the connection, held it: the server wrote on until it was dropped).
        thread.join(10)
        assert not thread.is_alive(), "the answer's connection was left open"
    finally:
        stop.set()
        thread.join(10)
        listener.close()


_SENT = b'{"ok":true,"result":{"message_id":7}}'


_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (
    len(_SENT),
    _SENT,
)

_CUT_IN_CHUNK = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s" % (
    len(_SENT) + 1,
    _SENT,
)


@pytest.mark.parametrize(
    ("answer", "reset"),
    [
        # Chunked, the connection closed (or reset) before the closing 0-chunk.
        (_CHUNKED, False),
        (_CHUNKED, True),
        (_CHUNKED + b"0\r\n", True),  # reset in the trailer
        (_CHUNKED[:-2], True),  # reset before the chunk's CRLF
        # A stated length past the body, the connection closed (or reset) after it.
        (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(_SENT) + 10, _SENT), False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(_SENT) + 10, _SENT), True),
        # No length stated, not chunked: the body ends with the connection, here a reset.
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + _SENT, True),
        (b"HTTP/1.0 200 OK\r\n\r\n" + _SENT, True),
        # Inside the chunk that holds the whole answer (its last byte, a newline
        # as many servers write, not come): the stdlib kept only whole chunks.
        (_CUT_IN_CHUNK, False),
        (_CUT_IN_CHUNK, True),
        # The framing after a whole chunk is broken: a size that is negative,
        # past the most read, a size or trailer line past the longest line.
        (_CHUNKED + b"-5\r\n", False),
        (_CHUNKED + b"ffffffffffff\r\n", False),
        (_CHUNKED + b"1" * 70_000, False),
        (_CHUNKED + b"0\r\n" + b"x" * 70_000, False),
    ],
    ids=[
        "chunked-no-last-chunk",
        "chunked-reset",
        "chunked-reset-in-trailer",
        "chunked-reset-before-crlf",
        "length-past-the-body",
        "length-past-the-body-reset",
        "until-close-reset",
        "http-1.0-reset",
        "cut-inside-the-chunk",
        "reset-inside-the-chunk",
        "negative-chunk-size",
        "chunk-size-past-the-most-read",
        "chunk-size-line-too-long",
        "trailer-line-too-long",
    ],
)
def test_a_whole_answer_saying_sent_with_its_framing_cut_is_sent(
    answer: bytes, reset: bool
) -> None:
    """The platform said "sent" in full, and only the HTTP framing was cut (the
    connection closed or reset) or broken after it: it was a transport error,
    and the retry layer sent the message a second time."""
    with raw_server(answer, reset=reset) as url:
        s = TelegramSender("1:x", base_url=url, timeout=10.0)
        result = s.send(REQUEST)
        s.close()
    assert result.message_id == 7


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(_SENT) + 1, _SENT),
        _CHUNKED,
    ],
    ids=["length-past-the-body", "chunked-no-last-chunk"],
)
def test_a_whole_answer_saying_sent_whose_framing_stalls_is_sent_at_the_deadline(
    answer: bytes,
) -> None:
    """The whole "sent" answer came, and then nothing (the connection held open,
    the framing never ended): a timeout at the deadline, and sent again; the
    bytes in hand said sent."""
    with raw_server(answer, hold=True) as url:
        s = TelegramSender("1:x", base_url=url, timeout=0.5)
        result = s.send(REQUEST)
        s.close()
    assert result.message_id == 7


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n" + _SENT[:-3], "200, its JSON cut"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"
            + b'{"ok":false,"error_code":400,"description":"Bad Request"}',
            "200 saying not ok",
        ),
        (
            b"HTTP/1.1 400 Bad Request\r\nContent-Length: 99\r\n\r\n"
            + b'{"ok":false,"error_code":400,"description":"Bad Request"}',
            "a 400",
        ),
        (
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + _SENT[:-3],
            "200 until the connection ends, its JSON cut",
        ),
    ],
    ids=["json-cut", "ok-false", "status-400", "until-close-json-cut"],
)
@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_any_other_answer_cut_short_stays_a_transport_error(
    answer: bytes, status: str, reset: bool
) -> None:
    with raw_server(answer, reset=reset) as url:
        s = TelegramSender("1:x", base_url=url, timeout=10.0)
        with pytest.raises(TransientSendError) as info:
            s.send(REQUEST)
        s.close()
    assert not isinstance(info.value, SendTimeout), status
