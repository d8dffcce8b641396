"""HTTP servers on loopback that give every POST one canned answer (tests of odd answers)."""

from __future__ import annotations

import http.server
import socket
import struct
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def canned_server(
    status: int, body: bytes, headers: Mapping[str, str] | None = None
) -> Iterator[str]:
    """Serve ``status``, ``headers`` and ``body`` to every POST; yields the base URL."""
    extra = dict(headers or {"Content-Type": "application/json"})

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(status)
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Handler) as url:
        yield url


@contextmanager
def raw_answer_server(answer: bytes) -> Iterator[str]:
    """Answer every POST, once read whole, with the bytes ``answer``, then close the
    connection; yields the base URL. (Read whole, unlike :func:`raw_server`: a
    request left unread made the close a reset, which the client may see
    before the answer.)"""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.wfile.write(answer)
            self.close_connection = True

    with serving(Handler) as url:
        yield url


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threading HTTP server on loopback with ``handler``; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


def read_head(conn: socket.socket) -> bytes:
    """Read a request from ``conn`` up to the end of its head (a blank line), or
    until the peer closes; what was read. Blocks on ``conn``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _read_body(conn: socket.socket, request: bytes) -> None:
    """Read the rest of a request whose head (and maybe more) is ``request``: its
    ``Content-Length`` bytes of body. Blocks on ``conn``."""
    head, _, body = request.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk


@contextmanager
def raw_server(answer: bytes, *, reset: bool = False, hold: bool = False) -> Iterator[str]:
    """Answer every connection's first request with the bytes ``answer`` (a broken
    answer: no status line, a chunk size that is not one...), then close it
    (``reset``: abort it, a TCP reset after the bytes, as a proxy may; ``hold``:
    only once the server stops, the connection held open and silent till then);
    yields the base URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                request = read_head(conn)
                if reset:  # (the whole request first: a reset before it is read fails its send)
                    _read_body(conn, request)
                conn.sendall(answer)
                if hold:
                    stop.wait(30)
                if reset:  # (the bytes sent stay readable before the reset)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    serving = threading.Thread(target=serve)
    serving.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        serving.join(10)
        listener.close()


SECRET = "my card number is 4111"

#: Answers whose bytes echo a message's text where an HTTP client quotes them
#: in its errors: a status line that is not one (a proxy lost it), and a chunk
#: size that is not one.
QUOTED_ANSWERS = {
    "not HTTP": b'{"ok": true, "result": {"text": "' + SECRET.encode() + b'"}}\r\n',
    "bad chunk": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + SECRET.encode() + b"\r\n"
    ),
    # (a status line's first word that is not a version: UnknownProtocol quotes it)
    "unknown protocol": (
        b"HTTP/9" + SECRET.replace(" ", "").encode() + b" 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    ),
}


def reachable(error: BaseException) -> list[BaseException]:
    """``error`` and every error its cause and context lead to, whether a traceback
    prints them or not (``raise ... from None`` only hides its context)."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is not None and all(e is not seen for seen in found):
            found.append(e)
            todo += [e.__cause__, e.__context__]
    return found


def held_by(error: BaseException) -> list[object]:
    """Every value the frames of ``error``'s tracebacks hold as locals, those of
    every error it leads to (its cause, its context, and an error held there
    as a local), while ``error`` is kept: what a kept error keeps alive."""
    found: list[object] = []
    todo: list[BaseException] = [error]
    errors: list[BaseException] = []
    while todo:
        for e in reachable(todo.pop()):
            if any(e is seen for seen in errors):
                continue
            errors.append(e)
            tb = e.__traceback__
            while tb is not None:
                for value in list(tb.tb_frame.f_locals.values()):
                    found.append(value)
                    if isinstance(value, BaseException):
                        todo.append(value)
                tb = tb.tb_next
    return found


def assert_no_secret(error: BaseException) -> None:
    """``error``, and every error a traceback of it prints or its context holds, says
    nothing of SECRET."""
    import traceback  # noqa: PLC0415

    printed = "".join(traceback.format_exception(error))
    assert "4111" not in printed, printed
    for e in reachable(error):
        assert "4111" not in f"{e!s} {e!r}", f"{type(e).__name__} in the chain: {e!r}"
