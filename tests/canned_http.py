"""An HTTP server on loopback that gives every POST one canned answer (tests of odd answers)."""

from __future__ import annotations

import http.server
import socket
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

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        serving.join(10)
        server.server_close()


@contextmanager
def not_http_server(answer: bytes) -> Iterator[str]:
    """Answer every connection's first request with ``answer`` (no status line: not
    HTTP), then close it; yields the base URL."""
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
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    request += chunk
                conn.sendall(answer)

    serving = threading.Thread(target=serve)
    serving.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        serving.join(10)
        listener.close()
