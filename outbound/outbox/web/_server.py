"""The status page over HTTP, on the standard library's server: ``outbox serve``."""

from __future__ import annotations

import contextlib
import http.server
import io
import ipaddress
import logging
import math
import os
import socket
import sys
import threading
import time
from typing import Any

from outbound._fork import renewed_after_fork
from outbound._http import ConnectionThreadsServer, DeadlineReader
from outbound.outbox._base import Store, check_seconds

from ._monitor import StatusMonitor
from ._page import json_answer, page_answer

__all__ = ["DEFAULT_PORT", "SECURITY_HEADERS", "StatusServer"]

logger = logging.getLogger("outbound.outbox.web")

#: The port ``outbox serve`` listens on unless told otherwise.
DEFAULT_PORT = 8321

#: Seconds a connection may take to send its request (line and headers, all
#: of it: one that trickles a byte at a time is dropped too) before it is dropped.
_REQUEST_TIMEOUT = 10.0

#: Connections served at once; one past that is closed at once (each holds a
#: thread until its request is in or _REQUEST_TIMEOUT passed).
_MAX_CONNECTIONS = 100

#: Sent with the page and its JSON: the page is self-contained (it fetches
#: itself, nothing else), is never cached, and may not be framed by another site.
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'none'"
    ),
}


def _is_loopback(address: str) -> bool:
    """True if ``address``, as a bound socket names it, is a loopback address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "outbound-status"
    timeout = _REQUEST_TIMEOUT
    #: When the request being read must be in (time.monotonic()).
    deadline = math.inf

    def setup(self) -> None:
        super().setup()
        # The whole request, not each read, within _REQUEST_TIMEOUT (see handle_one_request).
        what = f"no whole request within {_REQUEST_TIMEOUT:g}s"
        reader = DeadlineReader(self.connection, lambda: self.deadline, self.rfile, what)
        self.rfile = io.BufferedReader(reader)

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + _REQUEST_TIMEOUT
        super().handle_one_request()

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _refuse(self) -> None:
        # (RFC 9110: a 405 says which methods are allowed.)
        self._allow = "GET, HEAD"
        self._send(405, "text/plain; charset=utf-8", b"read-only: GET and HEAD only\n", True)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse

    #: The Allow header of the answer being sent (None: none).
    _allow: str | None = None

    def end_headers(self) -> None:
        # Every answer, the standard library's own errors (400, 414, 501) included.
        if self._allow is not None:
            self.send_header("Allow", self._allow)
            self._allow = None
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        super().end_headers()

    def _answer(self, *, body: bool) -> None:
        owner = self.server.owner
        if not owner.host_allowed(self.headers.get("Host")):
            # A page of another site that resolved its own name to this
            # loopback address (DNS rebinding) must not read the outbox.
            self._send(421, "text/plain; charset=utf-8", b"unexpected Host header\n", body)
            return
        path = self.path.split("?", 1)[0]
        if path == "/":
            status, content_type, payload = owner.page()
        elif path == "/status.json":
            status, content_type, payload = owner.json()
        else:
            status, content_type, payload = 404, "text/plain; charset=utf-8", b"not found\n"
        self._send(status, content_type, payload, body)

    def _send(self, status: int, content_type: str, payload: bytes, body: bool) -> None:
        self.connection.settimeout(_REQUEST_TIMEOUT)  # (the answer's writes: not what was left)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)


class _HTTPServer(ConnectionThreadsServer):
    """One thread per connection; :meth:`server_close` ends the open ones and joins them."""

    thread_name = "outbound-status-request"
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], owner: StatusServer, family: int) -> None:
        self.address_family = family
        self.owner = owner
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.open_connections() > _MAX_CONNECTIONS:  # (this one counted: see get_request)
            logger.debug("%s refused: %d connections served", client_address[0], _MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer is routine: one debug line, no traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            logger.debug("%s went away: %s", client_address[0], error)
        else:
            logger.warning("answering %s failed", client_address[0], exc_info=True)

    def server_close(self) -> None:
        super().server_close()
        self.close_connections()
        self.join_threads(time.monotonic() + _REQUEST_TIMEOUT)
        self.close_left()


class StatusServer:
    """The read-only status page of one outbox over HTTP: ``/`` and ``/status.json``.

    ``StatusServer(store, host="127.0.0.1", port=8321, *, refresh=2.0)``
    binds at once (``OSError`` when it cannot; port 0 takes a free one, see
    :attr:`url`). ``store`` may also be a :class:`StatusMonitor`. It binds
    to the loopback address unless told otherwise; bound to a loopback
    address (however ``host`` spells it), requests naming another host
    (DNS rebinding) are refused. There is no authentication:
    to show the page to others, mount it in an app behind the app's login
    (the Flask blueprint, the Django view).

    :meth:`serve_forever` blocks until :meth:`close`; :meth:`start` serves
    on a thread of its own. One thread per connection; a database error is
    shown on the page (HTTP 503) and the server goes on. Thread-safe.
    """

    def __init__(
        self,
        store: Store | StatusMonitor,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        refresh: float = 2.0,
    ) -> None:
        self.monitor = store if isinstance(store, StatusMonitor) else StatusMonitor(store)
        self.refresh = check_seconds("refresh", refresh, zero=True, maximum=3600.0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int from 0 to 65535, not {port!r}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._httpd = _HTTPServer((host, port), self, family)
        self.host = host
        bound = str(self._httpd.server_address[0])
        self.port = int(self._httpd.server_address[1])
        #: True when bound to a loopback address: only this machine can connect.
        #: Decided by the address bound, however ``host`` spelled it.
        self.loopback = _is_loopback(bound)
        names = {"localhost", "127.0.0.1", "[::1]"}
        names.update(f"[{name}]" if ":" in name else name for name in (host.lower(), bound))
        self._allowed_hosts = {f"{name}:{self.port}" for name in names}
        if self.port == 80:
            # A Host without a port means the scheme's default one (RFC 9110).
            self._allowed_hosts |= names
        # Guards _thread, _loop and _closed; made new in a forked child.
        # Reentrant: close() may run in a signal handler on a thread in here.
        self._lock = renewed_after_fork(threading.RLock())
        self._pid = 0  # the process whose loop serves (see close)
        self._forgotten = 0  # a process that closed its inherited copies
        self._running = threading.Event()  # the loop began (see _serve)
        self._ended = threading.Event()  # ... and ended
        self._thread: threading.Thread | None = None  # started by start()
        self._loop: threading.Thread | None = None  # running serve_forever()
        self._closed = False

    @property
    def url(self) -> str:
        """The page's address, e.g. ``http://127.0.0.1:8321/``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}/"

    def __repr__(self) -> str:
        return f"<StatusServer {self.url} table={self.monitor.store.table!r}>"

    def host_allowed(self, header: str | None) -> bool:
        """True unless bound to loopback and ``header`` names another host or port (no
        port: 80)."""
        if not self.loopback:
            return True
        return header is not None and header.lower() in self._allowed_hosts

    def page(self) -> tuple[int, str, bytes]:
        """The HTML page: (HTTP status, content type, body)."""
        # (Relative: the page may be served behind a proxy's prefix.)
        status, text = page_answer(self.monitor, refresh=self.refresh, json_url="status.json")
        return status, "text/html; charset=utf-8", text.encode("utf-8", "replace")

    def json(self) -> tuple[int, str, bytes]:
        """``/status.json``: (HTTP status, content type, body)."""
        status, body = json_answer(self.monitor)
        return status, "application/json", body

    def serve_forever(self) -> None:
        """Serve until :meth:`close` is called from another thread (or an exception such
        as ``KeyboardInterrupt`` ends it). Blocks."""
        with self._lock:
            if self._closed or self._loop is not None:
                raise RuntimeError("the status server is closed, or serving already")
            self._loop = threading.current_thread()
            self._pid = os.getpid()
        self._serve()

    def _serve_in_thread(self) -> None:
        # _loop was set to this thread by start(); close() shuts the loop down.
        self._serve()

    def _serve(self) -> None:
        """socketserver's loop, with what :meth:`close` needs to know: whether it
        runs (``_running``) and when it ended (``_ended``)."""
        self._running.set()
        try:
            self._httpd.serve_forever(poll_interval=0.1)
        except ValueError:
            # Closed before the loop began (a close() from a signal handler
            # that landed here): no socket left to serve.
            if not self._closed:
                raise
        finally:
            self._ended.set()

    def start(self) -> StatusServer:
        """Serve on a thread of its own; returns self. Idempotent."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the status server is closed")
            if self._loop is not None and self._pid != os.getpid():
                raise RuntimeError(
                    f"this status server serves in process {self._pid}, which started it; "
                    "start a StatusServer of this process's own"
                )
            if self._loop is not None and self._thread is None:
                raise RuntimeError("the status server is serving already")
            if self._thread is None:
                self._thread = self._loop = threading.Thread(
                    target=self._serve_in_thread, name="outbound-status-server", daemon=True
                )
                self._pid = os.getpid()
                self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, end open connections and release the port. Idempotent; blocks
        until the serving threads ended, but for a request still reading the store
        past 10 s (waiting for a lock, a connection): its thread is left to end
        with that reading, and its answer is dropped. In a forked child of the
        process that started it, closes the child's copies of the sockets only
        (the parent serves on): start a server in each process that serves."""
        with self._lock:
            loop, thread = self._loop, self._thread
            # (Before _closed: a fork while the parent was closing copied
            # _closed set, and the child's copies still open.)
            inherited = loop is not None and self._pid != os.getpid()
            if inherited:
                if self._forgotten == os.getpid():
                    return
                self._forgotten = os.getpid()
            elif self._closed:
                return
            self._closed = True
        if inherited:
            # A forked child's copy: its serving loop runs in the parent only
            # (waiting for it would wait forever). Close the child's copies of
            # the sockets; the parent serves on, its connections too.
            self._httpd.forget_inherited()
            return
        if loop is not None:
            # socketserver's stop flag (what its shutdown() sets) ends the loop
            # at its next turn, or at once if it has yet to begin. Waited for
            # only from another thread and once the loop runs: shutdown() would
            # wait forever for a loop that never began (a close() from a
            # signal handler inside start()), or for itself (one that
            # interrupted serve_forever() on its thread).
            self._httpd._BaseServer__shutdown_request = True  # type: ignore[attr-defined]
            if loop is not threading.current_thread() and self._running.is_set():
                self._ended.wait()
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join()
        if loop is not None:
            # Stop the listening socket for every process: a forked child's
            # copy would otherwise keep the port, and queue clients no one
            # answers, for as long as it lives.
            with contextlib.suppress(OSError):
                self._httpd.socket.shutdown(socket.SHUT_RDWR)
        self._httpd.server_close()

    def __enter__(self) -> StatusServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
