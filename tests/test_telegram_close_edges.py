"""TelegramSender.close() at its edges: over TLS, during a connect, in a child
forked during a connect, and a Ctrl-C landing anywhere in a send."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from canned_http import raw_server, read_head
from interrupts import held_at, interrupt_after_call, line_of
from outbound_process import run_script_ok
from sending_thread import sending

from outbound import TransientSendError, telegram
from outbound.errors import SendTimeout
from outbound.messages import SendRequest, TextMessage
from outbound.simulator import Fault, PlatformSimulator
from outbound.telegram import TelegramSender

SEND_METHODS = ("_round_trip", "_connection", "_exchange", "_open")

CERT = str(Path(__file__).parent / "data" / "localhost.pem")  # key and certificate

linux_only = pytest.mark.skipif(
    not os.path.exists("/proc/net/tcp"), reason="reads socket states from Linux's /proc/net/tcp"
)


def text(chat_id: int) -> SendRequest:
    return SendRequest(chat_id, TextMessage("hello"))


def _assert_failed_as_closed(thread: threading.Thread, outcome: list[Any]) -> None:
    thread.join(10)
    assert not thread.is_alive(), "the send still waits"
    assert len(outcome) == 1
    assert isinstance(outcome[0], TransientSendError), repr(outcome[0])
    assert "closed" in str(outcome[0])


# -------------------------------------------------------------------- TLS


@contextlib.contextmanager
def _stalling_tls_server(stage: str) -> Iterator[tuple[str, threading.Event]]:
    """An HTTPS server on loopback that stalls its first connection for good at
    ``stage``: "handshake" (it never answers the TLS hello), "answer" (it reads
    one request and never answers) or "body" (it answers with the head of an
    answer that closes the connection, and 5 bytes of its body of 40). Its URL,
    and an event set once it got there."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(CERT)
    listener = socket.create_server(("127.0.0.1", 0))
    came, done = threading.Event(), threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with contextlib.ExitStack() as stack:
            stack.enter_context(conn)
            if stage in ("answer", "body"):
                tls = stack.enter_context(context.wrap_socket(conn, server_side=True))
                if b"\r\n\r\n" not in read_head(tls):
                    return
                if stage == "body":
                    tls.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 40\r\nConnection: close\r\n\r\n" + b'{"ok"'
                    )
            came.set()
            done.wait(60)  # (past the tests' joins: set as each test ends)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{listener.getsockname()[1]}", came
    finally:
        done.set()
        thread.join(10)
        listener.close()


@pytest.fixture
def trust_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTPS connections made from here on trust the test certificate."""
    monkeypatch.setattr(
        ssl, "_create_default_https_context", lambda: ssl.create_default_context(cafile=CERT)
    )


@pytest.mark.usefixtures("trust_localhost")
def test_close_ends_a_send_waiting_for_its_answer_over_tls() -> None:
    with _stalling_tls_server("answer") as (url, came):
        s = TelegramSender("1:x", base_url=url, timeout=60)
        thread, outcome = sending(s, text(1))
        assert came.wait(10)
        s.close()
        _assert_failed_as_closed(thread, outcome)


@pytest.mark.usefixtures("trust_localhost")
def test_close_ends_a_send_reading_the_body_of_an_answer_that_closes_the_connection() -> None:
    """Such an answer takes the socket from the connection (http.client's
    getresponse()), and over TLS close() found nothing to end: the send read on
    past close(), and went through if the rest of the answer came."""
    with _stalling_tls_server("body") as (url, came):
        s = TelegramSender("1:x", base_url=url, timeout=60)
        hold, at_read, read = _exchange_held_at("raw = response.read()")
        thread, outcome = sending(s, text(1), hold)
        try:
            assert at_read.wait(10), "the send never read an answer's body"
            assert came.wait(10)
            s.close()
        finally:
            read.set()
        _assert_failed_as_closed(thread, outcome)


def test_close_ends_a_send_waiting_in_its_tls_handshake() -> None:
    """The stdlib's connection has its TLS socket only once the handshake is done:
    close() found no socket to shut down, and the send waited out connect_timeout."""
    with _stalling_tls_server("handshake") as (url, came):
        s = TelegramSender("1:x", base_url=url, connect_timeout=60, timeout=120)
        thread, outcome = sending(s, text(1))
        assert came.wait(10)
        s.close()
        _assert_failed_as_closed(thread, outcome)


@pytest.mark.usefixtures("trust_localhost")
def test_close_over_tls_does_not_pull_the_tls_state_from_under_a_read() -> None:
    """close() shut the connection down with ``SSLSocket.shutdown()``, which drops the
    TLS object a read in the sending thread was about to use: the send failed
    with a raw AttributeError (not retried) instead of a TransientSendError.
    The read is held right before it uses that object while close() runs."""
    read_line = line_of(ssl.SSLSocket.read, "self._sslobj.read(len, buffer)")
    held, go_on = threading.Event(), threading.Event()
    trace = held_at(ssl.SSLSocket.read.__code__, read_line, held, go_on)

    with _stalling_tls_server("answer") as (url, _):
        s = TelegramSender("1:x", base_url=url, timeout=60)
        thread, outcome = sending(s, text(1), trace)
        assert held.wait(10), "the send never read its answer"
        s.close()
        go_on.set()
        _assert_failed_as_closed(thread, outcome)


def _exchange_held_at(fragment: str) -> tuple[Any, threading.Event, threading.Event]:
    """A trace function holding a send in ``_exchange`` at the line holding
    ``fragment``; the event set once it got there, and the one that lets it go on."""
    reached, go_on = threading.Event(), threading.Event()
    code, line = TelegramSender._exchange.__code__, line_of(TelegramSender._exchange, fragment)
    return held_at(code, line, reached, go_on), reached, go_on


def test_a_second_close_beside_a_first_ends_the_sends_before_it_returns() -> None:
    """Two close() at once (a shutdown hook and the application): the second found
    the connections taken by the first, not yet ended, and returned; a send then
    went out after close() returned."""
    with PlatformSimulator() as sim:
        s = TelegramSender(sim.token, base_url=sim.url, timeout=10)
        hold, at_write, write = _exchange_held_at('conn.request("POST", path, body, headers)')
        assert s.send(text(1)).message_id is not None  # (the main thread's connection)
        thread, outcome = sending(s, text(2), hold)
        try:
            assert at_write.wait(10)  # a send about to write its request
            at_look, look = threading.Event(), threading.Event()
            first = threading.Thread(
                target=_traced,
                args=(
                    s.close,
                    held_at(
                        TelegramSender.close.__code__,
                        line_of(TelegramSender.close, "pid = os.getpid()"),
                        at_look,
                        look,
                    ),
                ),
            )
            first.start()
            assert at_look.wait(10)  # the first close() took the connections
            s.close()  # the second returns...
        finally:
            write.set()  # ... and the send goes on
            thread.join(10)
            look.set()
            first.join(10)
        _assert_failed_as_closed(thread, outcome)
        assert sim.received(2) == []


def _traced(function: Callable[[], object], trace: Any) -> None:
    sys.settrace(trace)
    try:
        function()
    finally:
        sys.settrace(None)


# ---------------------------------------------------------------- connects


def _socket_states(port: int) -> dict[int, str]:
    """The inodes of this machine's IPv4 TCP sockets connecting or connected to
    ``port`` on loopback, with their state (hex, as /proc/net/tcp gives it)."""
    states: dict[int, str] = {}
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            if int(fields[2].split(":")[1], 16) == port:
                states[int(fields[9])] = fields[3]
    return states


SYN_SENT = "02"


@contextlib.contextmanager
def _listener_not_accepting() -> Iterator[int]:
    """A port whose connects hang: its listen queue is full, so the kernel drops
    the SYNs of later connects (they stay SYN_SENT, retried)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        yield port
    finally:
        filler.close()
        listener.close()


def _wait_for_state(port: int, state: str) -> bool:
    deadline = threading.Event()
    for _ in range(1000):  # 10 s
        if state in _socket_states(port).values():
            return True
        deadline.wait(0.01)
    return False


@linux_only
def test_close_ends_a_send_waiting_in_its_connect() -> None:
    """close() could not reach a socket still connecting (not yet the connection's):
    a send stuck in its connect waited out connect_timeout (here 60 s)."""
    with _listener_not_accepting() as port:
        s = TelegramSender("1:x", base_url=f"http://127.0.0.1:{port}", connect_timeout=60)
        thread, outcome = sending(s, text(1))
        assert _wait_for_state(port, SYN_SENT)
        s.close()
        _assert_failed_as_closed(thread, outcome)


def test_a_send_whose_connect_comes_after_close_sends_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A send past close()'s look at the connections, about to connect: it must not
    connect and send once close() returned."""
    entered, go_on = threading.Event(), threading.Event()
    lookup = socket.getaddrinfo

    def held_lookup(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert go_on.wait(10)
        return lookup(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", held_lookup)
    with PlatformSimulator() as sim:
        s = TelegramSender(sim.token, base_url=sim.url)
        thread, outcome = sending(s, text(1))
        assert entered.wait(10)
        s.close()
        go_on.set()
        _assert_failed_as_closed(thread, outcome)
        assert sim.stats().requests == 0


def socket_inodes() -> set[str]:
    """The sockets this process has descriptors of ("socket:[inode]")."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (one closed meanwhile)
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:["):
                found.add(target)
    return found


def sockets_of_a_child_after_close(sender: TelegramSender) -> set[str]:
    """Fork; the child closes ``sender`` (which it inherited) and exits: the sockets it
    still had then."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sender.close()
            os.write(write, " ".join(socket_inodes()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        left = set(answer.read().decode().split())
    assert os.waitpid(pid, 0)[1] == 0
    return left


_FORK_WHILE_CONNECTING = """
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from test_telegram_close_edges import (
    SYN_SENT, _listener_not_accepting, _socket_states, sockets_of_a_child_after_close,
)
from outbound.messages import SendRequest, TextMessage
from outbound.telegram import TelegramSender

with _listener_not_accepting() as port:
    sender = TelegramSender("1:x", base_url="http://127.0.0.1:%d" % port, connect_timeout=60)
    worker = threading.Thread(target=lambda: sender.send(SendRequest(1, TextMessage("hi"))))
    worker.daemon = True
    worker.start()
    deadline = time.monotonic() + 10
    while True:
        connecting = [i for i, s in _socket_states(port).items() if s == SYN_SENT]
        if connecting:
            break
        assert time.monotonic() < deadline, "the send never connected"
        time.sleep(0.01)
    left = sockets_of_a_child_after_close(sender)
    assert "socket:[%d]" % connecting[0] not in left, "the child kept the socket being connected"
    sender.close()
    worker.join(10)
    assert not worker.is_alive()
print("ok")
"""


@linux_only
def test_a_child_forked_while_a_send_connects_closes_its_copy_of_that_socket() -> None:
    """The child's close() closed its copies of the connections' sockets, not of one
    still connecting at the fork (not yet the connection's): it kept the parent's
    connection open for as long as it lived."""
    run_script_ok(_FORK_WHILE_CONNECTING, str(Path(__file__).parent))


# ----------------------------------------------------------------- Ctrl-C


@pytest.fixture(scope="module")
def sim() -> Iterator[PlatformSimulator]:
    with PlatformSimulator() as simulator:
        yield simulator


#: Where a send's calls are made: its methods, and the connect under them.
_SEND_PATH = {
    **{name: getattr(TelegramSender, name).__code__ for name in SEND_METHODS},
    "_connect": telegram._connect.__code__,
    "_Lookup.addresses": telegram._Lookup.addresses.__code__,
    "HTTPConnection.connect": http.client.HTTPConnection.connect.__code__,
}


def _url_for(sim: PlatformSimulator, function: str) -> str:
    """The simulator's URL; by a host name for the lookup (an address needs none:
    a Ctrl-C as its thread was made left a lookup in flight that no thread would
    end, and every later connect of the sender waited for it)."""
    return sim.url.replace("127.0.0.1", "localhost") if function.startswith("_Lookup") else sim.url


def _send_interrupted(s: TelegramSender, function: str, n: int) -> bool:
    """A send with a Ctrl-C as the ``n``-th call of ``function`` returns; whether it came."""
    profile, fired = interrupt_after_call(_SEND_PATH[function], n)
    sys.setprofile(profile)
    try:
        s.send(text(2))
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)
    return bool(fired)


def _none_open(sim: PlatformSimulator) -> bool:
    """Whether the simulator's every connection was closed (within 10 s)."""
    pause = threading.Event()
    for _ in range(1000):
        if sim.stats().open_connections == 0:
            return True
        pause.wait(0.01)
    return False


@pytest.mark.parametrize(
    ("function", "fresh"),
    [
        (function, fresh)
        for function in _SEND_PATH
        for fresh in (False, True)
        if fresh or function in SEND_METHODS[:3]  # (a connection reused is not opened)
    ],
)
def test_a_ctrl_c_anywhere_in_a_send_leaves_the_sender_whole(
    sim: PlatformSimulator, function: str, fresh: bool
) -> None:
    """A Ctrl-C as any call of a send returns (where CPython runs signal handlers):
    - just after a send marked its connection busy, the connection stayed busy,
      and close() then left it open for good;
    - between reading an answer's head and its body, the connection kept the
      answer unread: the thread's next send went out and then failed, so it was
      sent twice;
    - as the connect returned its socket, before the connection had it: close()
      left that socket open.
    Whatever the point: close() then closes every connection; and the next send
    of the thread is sent once and succeeds."""
    points = 0
    for n in range(1, 200):
        s = TelegramSender(sim.token, base_url=_url_for(sim, function), timeout=10)
        if not fresh:
            s.send(text(1))  # a connection to reuse
        if not _send_interrupted(s, function, n):
            s.close()
            break
        points += 1
        assert not any(slot.busy for slot in list(s._connections)), f"call {n}: left busy"
        s.close()
        assert _none_open(sim), f"call {n}: a connection left open by close()"
        s = TelegramSender(sim.token, base_url=_url_for(sim, function), timeout=10)
        if not fresh:
            s.send(text(1))
        assert _send_interrupted(s, function, n)
        before = len(sim.received(3))
        assert s.send(text(3)).message_id is not None, f"call {n}"
        assert len(sim.received(3)) == before + 1, f"call {n}: sent twice"
        s.close()
        assert _none_open(sim), f"call {n}: a connection left open by close()"
    assert points > 0


_CLOSE_PATH = {
    "close": TelegramSender.close.__code__,
    "_close_connection": telegram._close_connection.__code__,
    "end": telegram._Connection.end.__code__,
}


@pytest.mark.parametrize("function", sorted(_CLOSE_PATH))
def test_a_ctrl_c_anywhere_in_close_leaves_the_next_close_to_finish_it(function: str) -> None:
    """close() let go of every connection before closing any, and a connection's
    close ran at most once: a Ctrl-C inside it left idle connections open and a
    busy send waiting, and a second close() did nothing."""
    points = 0
    with PlatformSimulator() as sim:
        for n in range(1, 200):
            s = TelegramSender(sim.token, base_url=sim.url, timeout=30)
            sent, done = threading.Barrier(3, timeout=10), threading.Event()

            def idle(chat: int, s: TelegramSender = s, sent: threading.Barrier = sent) -> None:
                s.send(text(chat))
                sent.wait()
                done.wait(10)

            pool = [threading.Thread(target=idle, args=(chat,)) for chat in (5, 6)]
            for thread in pool:
                thread.start()
            sent.wait()
            idle_slots = list(s._connections)
            sim.inject(Fault("slow", delay=30.0, chat_id=9))
            waiting = len(sim.received(9)) + 1
            busy, outcome = sending(s, text(9))
            try:
                assert sim.wait_received(waiting, chat_id=9, timeout=10)  # (its answer to come)
                profile, fired = interrupt_after_call(_CLOSE_PATH[function], n)
                sys.setprofile(profile)
                try:
                    s.close()
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.setprofile(None)
                s.close()  # (the second: finishes what the first left)
                _assert_failed_as_closed(busy, outcome)
                left = [slot for slot in idle_slots if slot.conn.sock is not None]
                assert left == [], f"call {n}: an idle connection left open"
            finally:
                done.set()
                for thread in pool:
                    thread.join(10)
                busy.join(10)
            if not fired:
                break
            points += 1
    assert points > 0


_EXIT_WHILE_A_DAEMON_THREAD_READS = """
import socket, threading
from outbound.messages import SendRequest, TextMessage
from outbound.telegram import TelegramSender
from outbound_process import wait_until_reading_a_body

server = socket.create_server(("127.0.0.1", 0))

def serve():
    conn, _ = server.accept()
    data = b""
    while b"\\r\\n\\r\\n" not in data:
        data += conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 100\\r\\n\\r\\n")  # no body, ever
    threading.Event().wait(120)

threading.Thread(target=serve, daemon=True).start()
url = "http://127.0.0.1:%d" % server.getsockname()[1]
sender = TelegramSender("1:x", base_url=url, timeout=100)
request = SendRequest(1, TextMessage("hi"))
reader = threading.Thread(target=sender.send, args=(request,), daemon=True)
reader.start()

wait_until_reading_a_body(reader)
print("ok")  # and exit, the sender never closed
"""


def test_the_interpreter_exits_while_a_daemon_threads_send_reads_its_answer() -> None:
    """The connections' finalizers ran at exit and closed the connection of a daemon
    thread's send reading its answer: the close waited for that read to end (its
    deadline, here 100 s; the run allows 60)."""
    run_script_ok(_EXIT_WHILE_A_DAEMON_THREAD_READS, timeout=60)


_CLOSE_IN_A_SIGNAL_HANDLER = """
import inspect, signal, sys
from outbound.messages import SendRequest, TextMessage
from outbound.simulator import PlatformSimulator
from outbound.telegram import TelegramSender

with PlatformSimulator() as sim:
    sender = TelegramSender(sim.token, base_url=sim.url, timeout=5)
    closed = []

    def on_term(signum, frame):  # a shutdown hook
        sender.close()
        closed.append(True)

    signal.signal(signal.SIGTERM, on_term)
    lines, first = inspect.getsourcelines(TelegramSender._round_trip)
    line = next(first + i for i, text in enumerate(lines) if "slot.busy = True" in text)

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not closed:
            signal.raise_signal(signal.SIGTERM)  # as the send holds its connection's lock
        return local

    def trace(frame, event, arg):
        return local if frame.f_code is TelegramSender._round_trip.__code__ else None

    sys.settrace(trace)
    try:
        sender.send(SendRequest(1, TextMessage("hi")))
    except RuntimeError:
        pass  # (closed)
    finally:
        sys.settrace(None)
    assert closed
    assert sim.stats().requests == 0  # (nothing sent once closed)
print("ok")
"""


def test_close_in_a_signal_handler_that_interrupted_a_send_returns() -> None:
    """A shutdown hook (SIGTERM) calling close() as the main thread's send held its
    connection's lock waited for that lock, held by the frame it interrupted,
    for good."""
    run_script_ok(_CLOSE_IN_A_SIGNAL_HANDLER, timeout=60)


def test_a_timeout_does_not_chain_a_transport_error_that_quotes_the_token() -> None:
    """A proxy echoing the request line ("POST /bot<token>/sendMessage HTTP/1.1"):
    masked on the TransientSendError path, but a SendTimeout, when the deadline
    passed before the error was handled, chained it as it was, and a logged
    traceback printed the token. The thread is held at that check past its
    deadline."""
    token = "123456:SECRET-bot-token"
    line = line_of(TelegramSender._exchange, "if time.monotonic() >= deadline:")

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == line:
            left = frame.f_locals["deadline"] - time.monotonic()
            threading.Event().wait(max(0.0, left) + 0.05)  # (until the deadline passed)
        return local

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is TelegramSender._exchange.__code__ else None

    answer = b"POST /bot" + token.encode() + b"/sendMessage HTTP/1.1\r\n\r\n"
    with raw_server(answer) as url, TelegramSender(token, base_url=url, timeout=2) as s:
        thread, outcome = sending(s, text(1), trace)
        thread.join(10)
    assert len(outcome) == 1
    assert isinstance(outcome[0], SendTimeout), repr(outcome[0])
    printed = "".join(traceback.format_exception(outcome[0]))
    assert token not in printed, printed
