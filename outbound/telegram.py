"""Sending to Telegram over HTTP: :class:`TelegramSender`.

Stdlib ``http.client`` only, with one keep-alive connection per thread
(a dispatcher's workers each reuse theirs). Every request is a ``POST``
of a JSON body to ``<base_url>/bot<token>/<method>``.

How answers map to errors (each chained ``from`` a :class:`TelegramError`
or from the network error)::

    HTTP 429                       RateLimited(retry_after, scope)
    HTTP 5xx or 408, network       TransientSendError
      errors, dropped connections
    timeouts                       SendTimeout (a TransientSendError and a TimeoutError)
    other 4xx, 200 with ok=false   PermanentSendError

Real Telegram answers a 429 with ``{"ok": false, "error_code": 429,
"description": "Too Many Requests: retry after N", "parameters":
{"retry_after": N}}`` (``N`` whole seconds) and never says whose limit it
was: the error is then ``RateLimited(N, "chat", stated=False)``, and the
:func:`~outbound.middleware.rate_limit` middleware's limiter infers the
scope. A ``parameters.scope`` (an extension of
:class:`~outbound.simulator.PlatformSimulator`) is taken as stated:
``"global"`` maps to ``"global"``, ``"chat"`` and ``"group"`` to
``"chat"``. ``retry_after`` comes from ``parameters.retry_after``, else the
``Retry-After`` header (seconds, or an HTTP date), else the description's
"retry after N", else 1 second; a wait longer than a day is cut to a day.

Nothing here logs message text or the bot token, but for what Telegram's own
description of a refusal quotes of the text (``can't parse entities:
Unsupported start tag "..."``), which the error says, and a DEBUG record too.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import http.client
import io
import json
import logging
import math
import os
import re
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Hashable, Mapping
from types import TracebackType
from typing import Any, Final, Literal
from urllib.parse import SplitResult, urlsplit

from typing_extensions import Self

from outbound._compat import unlimited_past_max
from outbound._fork import renewed_after_fork
from outbound._http import DeadlineReader
from outbound._secret import TokenMask, context_dropped, mask_password, transport_error

from .context import time_allowed
from .errors import PermanentSendError, RateLimited, SendTimeout, TransientSendError, _restored
from .messages import (
    ChatId,
    MethodMessage,
    SendRequest,
    SendResult,
    TextMessage,
    check_json_params,
    check_text,
)
from .retry import parse_retry_after, shown_number

__all__ = ["TelegramError", "TelegramSender"]

logger = logging.getLogger("outbound.telegram")

_USERNAME = re.compile(r"@[A-Za-z][A-Za-z0-9_]{3,31}")
_METHOD = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
#: Methods (lower case) whose ``text`` has the limit of a message's text.
_TEXT_METHODS = frozenset({"sendmessage", "editmessagetext"})
#: The Bot API's parse modes (in any case; "" is none): another is refused
#: with "unsupported parse_mode", a 400 at send time.
_PARSE_MODES = frozenset({"", "html", "markdown", "markdownv2"})
# What a bot token may hold: it goes into each request's path as it is.
_TOKEN = re.compile(r"[A-Za-z0-9_:.~-]+")
# What a base_url's path may hold: printable ASCII that a request line takes
# as it is (RFC 3986's characters of a path, and "%" escapes); a space, a
# control character or a non-ASCII letter there failed every send.
_URL_CHARS = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/%\[\]]*")


def check_token(token: object, name: str = "token") -> str:
    """``token`` if it can be a bot token (``123456:ABC-def_...``); else ``ValueError``
    naming ``name``, without the token (a secret). Letters, digits and
    ``_ : . ~ -`` only: each goes into a request's path as it is, where a
    space, ``/``, ``?``, ``#`` or a line break would change the request.
    Shared by the sender, the simulator and the integrations' settings. Pure."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        what = (
            f"a str of {len(token)} characters" if isinstance(token, str) else type(token).__name__
        )
        raise ValueError(
            f"{name} must be a bot token: letters, digits and '_', ':', '.', '~', '-' only "
            f"(no space, '/', '?', '#' or line break), not {what}"
        )
    return token


def check_base_url(base_url: object, name: str = "base_url") -> SplitResult:
    """``base_url`` split, if the Bot API's requests can go to it: an http:// or https://
    URL with a host a connection can reach (a name, international ones too, or an IP
    address; no IPv6 zone), no user or password (no sender sends them), a port that is
    one, a path of printable ASCII that a request line takes as it is, and no query or
    fragment; else ``ValueError`` naming ``name`` (a password in it masked).
    Shared by the sender and the integrations' settings (a value they take is one the
    sender takes). Pure."""
    try:
        parts = urlsplit(base_url) if isinstance(base_url, str) else None
        valid = (
            parts is not None
            and parts.scheme in ("http", "https")
            and _reachable_host(parts.hostname)
            and "@" not in parts.netloc  # (a user or password: no sender sends them)
            and (parts.port is None or parts.port > 0)  # (reading it checks it)
            and _URL_CHARS.fullmatch(parts.path) is not None
            and not parts.query
            and not parts.fragment
        )
    except ValueError:  # a bad port, a bracket not closed
        valid = False
    if not valid:
        raise ValueError(
            f"{name} must be an http:// or https:// URL with a host, a path of printable "
            f"ASCII, and no user, query or fragment, not {mask_password(str(base_url))!r}"
        )
    assert parts is not None
    return parts


def _reachable_host(host: str | None) -> bool:
    """Whether http.client can connect to ``host`` and name it in a request (a name
    goes as IDNA, as it does there and in the lookup: an empty label, "a..b", or
    one over 63 characters cannot)."""
    if not host or any(not c.isprintable() or c.isspace() or c in "%/\\?#@[]" for c in host):
        return False  # ("%": an IPv6 zone, which the address lookup does not take)
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


class TelegramError(Exception):
    """An error answer of the Bot API: the cause of the send error raised.

    ``status`` is the HTTP status, ``description`` the API's text,
    ``parameters`` its ``parameters`` object, ``payload`` the decoded body
    (``None`` if it was not JSON).
    """

    def __init__(
        self,
        status: int,
        description: str,
        parameters: Mapping[str, Any] | None = None,
        payload: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(f"HTTP {status}: {description}")
        self.status = status
        self.description = description
        self.parameters: Mapping[str, Any] = parameters or {}
        self.payload = payload

    def __reduce__(self) -> tuple[Any, ...]:
        return _restored, (type(self), self.args, self.__dict__)


class _Connection:
    """One thread's keep-alive connection; closed when the thread's slot is dropped,
    or by :meth:`TelegramSender.close` (see there)."""

    __slots__ = ("__weakref__", "attempts", "busy", "conn", "lock", "lookup", "pid")

    def __init__(self, conn: http.client.HTTPConnection, lookup: _Lookup) -> None:
        self.conn = conn
        self.lookup = lookup
        self.pid = os.getpid()
        # Guards busy: True while the owning thread sends on conn. Reentrant:
        # close() in a signal handler that interrupted this thread's send.
        self.lock = threading.RLock()
        self.busy = False
        # The sockets conn's connects make, from before each connect: close()
        # can end one, a forked child close its copy (not yet conn.sock).
        self.attempts = _Attempts()
        conn._create_connection = functools.partial(_connect, self.attempts, lookup)  # type: ignore[attr-defined]
        if isinstance(conn, _HTTPSConnection):
            conn.attempts = self.attempts
        # Closes the sockets when this object is collected (its thread ended).
        # Not at the interpreter's exit: a daemon thread may be reading an answer
        # there, and closing its connection would wait for that read to end.
        weakref.finalize(self, _close_connection, conn, self.pid, self.attempts).atexit = False

    def shut(self) -> None:
        """Close the connection (see :func:`_close_connection`); again if a first
        close was cut short (a Ctrl-C), at no cost if not."""
        _close_connection(self.conn, self.pid, self.attempts)

    def end(self) -> None:
        """End the connection for the server and for the thread sending on it: its
        socket (or the one connecting) shut down, which wakes a read or a connect
        waiting on it. Not closed: http.client is not safe to close under a send;
        the sending thread closes it. The raw socket's shutdown: ``SSLSocket``'s
        drops the TLS state a read or write in the other thread is using."""
        self.attempts.ended = True
        self.lookup.wake()  # (a connect waiting for its host's lookup)
        for sock in [self.conn.sock, *self.attempts.sockets]:
            if sock is not None:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Attempts:
    """The sockets of a connection's connects (see :func:`_connect`)."""

    __slots__ = ("ended", "sockets")

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []
        self.ended = False  # (set by close(): no more sockets)


_Address = tuple[int, int, int, str, Any]  # (what socket.getaddrinfo lists)


def _listed(host: str, port: int, flags: int = 0) -> list[_Address]:
    """``socket.getaddrinfo(host, port)`` for TCP, as a plain list of tuples."""
    return list(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, flags))


class _Flight:
    """One lookup of the host's addresses (see :class:`_Lookup`)."""

    __slots__ = ("addresses", "done", "error", "pid")

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.done = False
        self.addresses: list[_Address] = []
        self.error: OSError | None = None


class _Lookup:
    """A sender's lookups of its host name, each bounded by its connect's time.

    ``getaddrinfo`` has no timeout: a resolver that stopped answering held a
    connect for the resolver's own (seconds, tries over), past the send's
    deadline and past ``close()``. The lookup runs in a daemon thread; a
    connect waits for it until its deadline or until the sender is closed
    (:meth:`wake`). One runs at a time: a connect that finds one in flight
    waits for its answer rather than starting another (a silent resolver
    would otherwise pile up a thread per try). Thread-safe; fork-safe (a
    parent's lookup is not waited for in a child: its thread is not there).
    """

    __slots__ = ("_changed", "_flight", "_host", "_port")

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        # Guards _flight and its fields; notified when a lookup ends, and by
        # wake(). Reentrant: close() in a signal handler that interrupted a wait.
        self._changed = renewed_after_fork(threading.Condition(threading.RLock()))
        self._flight: _Flight | None = None

    def addresses(self, timeout: float | None, attempts: _Attempts) -> list[_Address]:
        """The host's addresses (``getaddrinfo``, TCP); ``TimeoutError`` if no answer
        within ``timeout`` seconds (``None``: no limit), ``ConnectionAbortedError``
        once the connection's sender is closed (``attempts.ended``), ``OSError`` for
        the lookup's own failure. Blocks up to ``timeout``."""
        try:
            # A numeric address needs no resolver: no thread.
            return _listed(self._host, self._port, socket.AI_NUMERICHOST)
        except socket.gaierror:
            pass
        except UnicodeError as exc:  # (a name IDNA cannot encode)
            raise OSError(f"cannot look up {self._host}: {exc}") from None
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._changed:
            flight = self._flight
            if flight is None or flight.done or flight.pid != os.getpid():
                flight = _Flight()
                thread = threading.Thread(
                    target=self._look_up, args=(flight,), name="outbound-lookup", daemon=True
                )
                try:
                    thread.start()
                except RuntimeError as exc:  # "can't start new thread"
                    raise OSError(f"cannot look up {self._host}: {exc}") from exc
                # (Recorded once its thread runs: a Ctrl-C before left none in
                # flight that no thread would end, for every later connect.)
                self._flight = flight
            while not flight.done:
                if attempts.ended:
                    raise ConnectionAbortedError("the sender was closed")
                left = deadline - time.monotonic()
                if left <= 0.0:
                    raise TimeoutError(
                        f"the lookup of {self._host} did not answer within the connect's time"
                    )
                self._changed.wait(unlimited_past_max(left))
            if flight.error is not None:
                # (Its own for each connect that waited for it.)
                raise self._failed(flight.error)
            return flight.addresses

    def _failed(self, error: OSError) -> OSError:
        """A copy of the lookup's ``error`` for one connect to raise; an ``OSError``
        naming it if it cannot be copied (a subclass whose ``__init__`` takes other
        arguments than its ``args``)."""
        try:
            fresh = copy.copy(error)
        except Exception:
            fresh = None
        if isinstance(fresh, OSError):
            return fresh
        try:
            said = f": {error}"
        except Exception:  # (its str() raised too)
            said = ""
        shown = (TimeoutError if isinstance(error, TimeoutError) else OSError)(
            f"the lookup of {self._host} failed ({type(error).__name__}{said})"
        )
        shown.__cause__ = error
        return shown

    def _look_up(self, flight: _Flight) -> None:
        """Body of a lookup's thread: ``getaddrinfo``, its answer left in ``flight``."""
        addresses: list[_Address] = []
        error: OSError | None = None
        try:
            addresses = _listed(self._host, self._port)
        except UnicodeError as exc:  # (a name IDNA cannot encode)
            error = OSError(f"cannot look up {self._host}: {exc}")
        except OSError as exc:  # (raised to the connects waiting for it)
            error = exc
        except Exception as exc:  # (a resolver's own: RecursionError, MemoryError)
            error = OSError(f"the lookup of {self._host} failed ({type(exc).__name__})")
            error.__cause__ = exc
        except BaseException:
            error = OSError(f"the lookup of {self._host} was interrupted")
        with self._changed:
            flight.addresses, flight.error = addresses, error
            flight.done = True
            self._changed.notify_all()

    def wake(self) -> None:
        """Wake the connects waiting for a lookup (the sender was closed: they end)."""
        with self._changed:
            self._changed.notify_all()


def _connect(
    attempts: _Attempts,
    lookup: _Lookup,
    address: tuple[str, int],
    timeout: float | None,
    *args: Any,
) -> socket.socket:
    """``socket.create_connection(address, timeout)``, the lookup of its host bounded
    by ``timeout`` too (see :class:`_Lookup`), each socket it tries in
    ``attempts`` from before its connect (a socket not yet returned is not in
    the connection, where close() and a forked child look)."""
    attempts.sockets = []  # (the last connect's: closed, or the connection's now)
    error: OSError | None = None
    host, _ = address
    # (One deadline for the lookup and every address tried: each took its part.)
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    found = lookup.addresses(timeout, attempts)
    for family, kind, proto, _, sockaddr in found:
        left = deadline - time.monotonic()
        if left <= 0.0:
            error = TimeoutError(f"the connect to {host} timed out")
            break
        sock = socket.socket(family, kind, proto)
        attempts.sockets.append(sock)
        # (After the listing: close() shut down what it found listed, or this sees
        # it ended.)
        if attempts.ended:
            sock.close()
            raise ConnectionAbortedError("the sender was closed")
        try:
            sock.settimeout(None if timeout is None else unlimited_past_max(left))
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        if timeout is not None:
            # (What follows on it before the request, a TLS handshake, has what
            # the connect left of its time, not that time again.)
            left = deadline - time.monotonic()
            if left <= 0.0:
                sock.close()
                raise TimeoutError(f"the connect to {host} timed out")
            sock.settimeout(unlimited_past_max(left))
        return sock
    if error is None:
        raise OSError(f"no address found for {host}")
    try:
        raise error
    finally:
        error = None  # (no cycle through the traceback)


def _drop(conn: http.client.HTTPConnection, response: http.client.HTTPResponse | None) -> None:
    """Close ``conn`` and the answer being read on it, after a failed exchange: an
    answer that closes the connection holds the socket itself (not the
    connection), and kept it open while the error that ended its reading lived."""
    try:
        conn.close()
    finally:
        if response is not None:
            with contextlib.suppress(OSError):
                response.close()


def _close_connection(conn: http.client.HTTPConnection, pid: int, attempts: _Attempts) -> None:
    """Close ``conn``; in a process forked since ``pid`` opened it, only this process's
    copies of its sockets' descriptors (the one connected, or being connected at the
    fork). (Closing the connection closes the answer being read on it, whose
    reader's lock a thread of the parent may have held at the fork: it would wait
    for that thread, which is not here, for good.)"""
    if os.getpid() == pid:
        conn.close()
        for sock in attempts.sockets:  # (one a Ctrl-C kept from the connection)
            sock.close()
        return
    descriptors = set()
    for sock in [conn.sock, *attempts.sockets]:
        if sock is not None:
            descriptors.add(sock.detach())  # (-1 if closed, or taken over by TLS)
    for descriptor in descriptors - {-1}:
        with contextlib.suppress(OSError):
            os.close(descriptor)


class _Local(threading.local):
    connection: _Connection | None = None
    #: When the answer being read must be complete (see _DeadlineResponse).
    deadline: float = math.inf


_local_deadline = _Local()


#: The longest answer read, headers and body (a Bot API answer is a few KB): an
#: answer that declares more, or runs past it, is a transport error, not a
#: ``MemoryError`` (``http.client`` allocates a declared length at once).
_MAX_ANSWER: Final = 64 * 1024 * 1024


def _says_sent(raw: bytes) -> bool:
    """Whether ``raw`` is a whole Bot API answer saying ``"ok": true``. Pure."""
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):  # (cut short, or nested too deep)
        return False
    return isinstance(answer, dict) and answer.get("ok") is True


class _DeadlineResponse(http.client.HTTPResponse):
    """An ``HTTPResponse`` whose whole reading (headers and body) ends by a deadline,
    and reads at most ``_MAX_ANSWER`` bytes."""

    def __init__(self, sock: socket.socket, *args: Any, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        #: Every byte of the body read so far, whatever its framing (a chunk's
        #: data, not its size line): what came of an answer whose read failed.
        self.body_read: list[bytes] = []
        keep = self.fp  # the plain file super() made: unread, kept for its socket reference
        deadline = _local_deadline.deadline
        self.fp = io.BufferedReader(
            DeadlineReader(
                sock,
                lambda: deadline,
                keep,
                "the deadline passed while reading the answer",
                limit=_MAX_ANSWER,
            )
        )

    def _safe_read(self, amt: int) -> bytes:
        # (A declared length, or a chunk's: read at once, allocated first. A
        # chunk's may be negative, "-5": http.client passes it on, and the read
        # raised ValueError, which is bad input's.)
        if amt < 0:
            raise http.client.HTTPException(f"the answer declares a chunk of {amt} bytes")
        if amt > _MAX_ANSWER:
            raise http.client.HTTPException(
                f"the answer declares {amt} bytes, past the most read of one ({_MAX_ANSWER})"
            )
        return self._read_parts(amt)

    def read(self, amt: int | None = None) -> bytes:
        # An answer whose body ends with the connection (no length stated, not
        # chunked): read by parts too (the stdlib reads it in one call).
        if (
            amt is not None
            or self.fp is None
            or self.chunked
            or self.length is not None
            or self._method == "HEAD"  # type: ignore[attr-defined]
        ):
            return super().read(amt)
        try:
            return self._read_parts(None)
        finally:
            self._close_conn()  # type: ignore[attr-defined]

    def _read_parts(self, amt: int | None) -> bytes:
        """Read ``amt`` bytes (None: up to the connection's end) by parts, each kept
        in ``body_read`` as it comes: a connection reset (not closed) after the
        answer lost the bytes read with it, and a whole "sent" answer was sent
        again (see _exchange). Raises ``IncompleteRead`` with them if the
        connection ends (or resets) short of ``amt``, or resets."""
        parts: list[bytes] = []
        left = amt
        while left is None or left > 0:
            try:
                part = self.fp.read1(65536 if left is None else left)
            except ConnectionError as exc:
                raise http.client.IncompleteRead(b"".join(parts), left) from exc
            if not part:
                if left is None:
                    break
                raise http.client.IncompleteRead(b"".join(parts), left)
            parts.append(part)
            self.body_read.append(part)
            if left is not None:
                left -= len(part)
        return b"".join(parts)

    # A reset where a chunk's size or the trailer is read: the answer cut there,
    # as a close leaves it (what came of the body is in body_read).
    def _read_next_chunk_size(self) -> int:
        try:
            return super()._read_next_chunk_size()  # type: ignore[misc,no-any-return]
        except ConnectionError as exc:
            raise http.client.IncompleteRead(b"") from exc

    def _read_and_discard_trailer(self) -> None:
        try:
            super()._read_and_discard_trailer()  # type: ignore[misc]
        except ConnectionError as exc:
            raise http.client.IncompleteRead(b"") from exc

    def _read_status(self) -> tuple[str, int, str]:
        # http.client skips only "100 Continue": an interim answer such as
        # "103 Early Hints" before the real one would be taken as the answer
        # (and the message, delivered, reported as refused). Skip them all,
        # with their headers; "101 Switching Protocols" was never asked for.
        while True:
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not (100 <= status < 200) or status == 101:
                return version, status, reason
            http.client.parse_headers(self.fp)


class _HTTPSConnection(http.client.HTTPSConnection):
    """An ``HTTPSConnection`` whose TLS socket is its ``sock`` before the handshake:
    close() can end a handshake that hangs, a forked child close its copy (the
    stdlib's is the connection's only once the handshake is done)."""

    #: Its connection's attempts (set with it): ``ended`` once close() ran.
    attempts: _Attempts

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        context: ssl.SSLContext = self._context  # type: ignore[attr-defined]
        self.sock = context.wrap_socket(
            self.sock, server_hostname=self.host, do_handshake_on_connect=False
        )
        # (Listed: an answer that closes the connection takes its socket from
        # conn.sock, and is read from it; close() ends it here.)
        self.attempts.sockets.append(self.sock)
        # (After sock is the TLS one: close() shut down that one, or the raw one
        # as the wrap took it over, and then this sees it ended.)
        if self.attempts.ended:
            raise ConnectionAbortedError("the sender was closed")
        self.sock.do_handshake()


class TelegramSender:
    """A :class:`~outbound.messages.Sender` for the Telegram Bot API.

    - ``token``: the bot token (never logged, not in ``repr``).
    - ``base_url``: the API root; a simulator's ``url`` for tests.
    - ``max_text_length``: the longest text :meth:`validate` lets through.
    - ``connect_timeout``: the most a TCP (and TLS) connect may take, the
      lookup of the host name included.
    - ``timeout``: the whole send's time limit outside a dispatcher task
      (inside one, the task's ``current_context().remaining()``).

    ``SendRequest.idempotency_key`` is not sent: the Bot API has no such
    thing. An answer is read up to 64 MiB (a Bot API answer is a few KB):
    a longer one is a :class:`~outbound.errors.TransientSendError`.
    Thread-safe: each thread has its own connection. :meth:`send` blocks
    for the round trip, bounded by the deadline; :meth:`validate` and
    :meth:`close` do not block.
    """

    def __init__(
        self,
        token: str,
        *,
        base_url: str = "https://api.telegram.org",
        max_text_length: int = 4096,
        connect_timeout: float = 10.0,
        timeout: float = 30.0,
    ) -> None:
        check_token(token)
        parts = check_base_url(base_url)
        check_sender_settings(max_text_length, connect_timeout=connect_timeout, timeout=timeout)
        self._token = token
        self._mask = TokenMask(token)
        self._https = parts.scheme == "https"
        assert parts.hostname is not None  # (checked above)
        self._host: str = parts.hostname
        # (Named: http.client reads a port off a bare IPv6 host, "::1" as ":1".)
        self._port = parts.port if parts.port is not None else (443 if self._https else 80)
        self._lookup = _Lookup(self._host, self._port)
        self._path = parts.path.rstrip("/")
        self._base_url = base_url
        self._max_text_length = max_text_length
        self._connect_timeout = float(connect_timeout)
        self._timeout = float(timeout)
        self._local = _Local()
        # Guards _connections and _closed. Nobody waits on it.
        self._lock = renewed_after_fork(threading.RLock())  # (reentrant: see _Connection)
        self._connections: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self._closed = False

    @property
    def max_text_length(self) -> int:
        return self._max_text_length

    def chat_key(self, chat_id: ChatId) -> Hashable:
        """The chat as Telegram knows it (see :func:`chat_key`). Pure."""
        return chat_key(chat_id)

    # ------------------------------------------------------------ validation

    def validate(self, request: SendRequest) -> None:
        """Raise ``TypeError``/``ValueError`` if Telegram would refuse ``request``. Never blocks.

        Checks the chat id (an ``int``, or an ``"@channelname"`` ``str``),
        the text (non-empty, at most ``max_text_length`` characters), the
        method name, and that the parameters encode as JSON.
        """
        check_request(request, self._max_text_length)
        if isinstance(request.message, MethodMessage):
            check_json_params(request.message)

    # --------------------------------------------------------------- sending

    def send(self, request: SendRequest) -> SendResult:
        """Send ``request``; return the new message's id and the raw answer.

        Blocks for one HTTP round trip, within the running task's deadline
        (or ``timeout`` outside a task). Raises ``TypeError``/``ValueError``
        for bad input (nothing is sent), :class:`~outbound.errors.RateLimited`,
        :class:`~outbound.errors.TransientSendError` (:class:`SendTimeout`
        for timeouts) or :class:`~outbound.errors.PermanentSendError`.
        """
        check_request(request, self._max_text_length)
        message = request.message
        if isinstance(message, TextMessage):
            method = "sendMessage"
            params: dict[str, Any] = {"chat_id": request.chat_id, "text": message.text}
            if message.parse_mode is not None:
                params["parse_mode"] = message.parse_mode
            if message.disable_notification:
                params["disable_notification"] = True
        else:
            method = message.method
            params = {**message.params, "chat_id": request.chat_id}
        body = json.dumps(params, separators=(",", ":"), allow_nan=False).encode()
        deadline = time.monotonic() + time_allowed(self._timeout, method)
        with context_dropped():  # (an error that quotes the answer: not its context either)
            status, headers, raw = self._round_trip(method, body, deadline)
            return self._interpret(method, status, headers, raw)

    def _connection(self) -> _Connection:
        slot = self._local.connection
        if slot is not None and slot.pid != os.getpid():
            slot.shut()
            slot = None
        if slot is None:
            cls = _HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self._connect_timeout)
            conn.response_class = _DeadlineResponse
            slot = _Connection(conn, self._lookup)
            with self._lock:
                if self._closed:
                    slot.shut()
                    raise RuntimeError("this TelegramSender is closed")
                self._connections.add(slot)
            self._local.connection = slot
        return slot

    def _round_trip(
        self, method: str, body: bytes, deadline: float
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        if self._is_closed():
            self._drop_own_connection()
            raise RuntimeError("this TelegramSender is closed")
        slot = self._connection()
        try:
            with slot.lock:  # (in the try: a Ctrl-C past it leaves no slot busy)
                slot.busy = True
            # (Read after busy: close() closed an idle slot, or leaves this one
            # to this thread, and set _closed first.)
            if self._is_closed():
                raise RuntimeError("this TelegramSender is closed")
            try:
                return self._exchange(slot.conn, method, body, deadline)
            except BaseException:
                # (Its connection was dropped. The error's traceback holds the
                # slot: the thread's next send takes a new one, or a kept
                # error kept its socket open after the thread retired.)
                self._forget(slot)
                raise
        finally:
            with slot.lock:
                slot.busy = False
            if self._is_closed():  # (this thread's to close: see close())
                self._drop_own_connection()

    def _forget(self, slot: _Connection) -> None:
        """This thread's ``slot``, its connection dropped: closed, and not used again."""
        if self._local.connection is slot:
            self._local.connection = None
        with self._lock:
            self._connections.discard(slot)
        slot.shut()

    def _drop_own_connection(self) -> None:
        """Close this thread's connection, if it has one (the sender being closed)."""
        slot, self._local.connection = self._local.connection, None
        if slot is not None:
            slot.shut()

    def _open(self, conn: http.client.HTTPConnection, deadline: float) -> None:
        """Connect ``conn`` within ``deadline``: nothing is sent on a connection made
        after close() (which ends a connect it finds, not one begun after it looked)."""
        self._set_timeout(conn, deadline, connecting=True)
        conn.connect()
        if self._is_closed():
            raise ConnectionAbortedError("the sender was closed")
        # (The request's write has what the connect left of the deadline, not
        # the connect's time again.)
        self._set_timeout(conn, deadline)

    def _exchange(
        self, conn: http.client.HTTPConnection, method: str, body: bytes, deadline: float
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        path = f"{self._path}/bot{self._token}/{method}"
        headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
        response: http.client.HTTPResponse | None = None
        try:
            if conn.sock is not None and _is_dropped(conn.sock):
                logger.debug("telegram: keep-alive connection closed by the server; reconnecting")
                conn.close()
            reused = conn.sock is not None
            try:
                if reused:
                    self._set_timeout(conn, deadline)
                else:
                    self._open(conn, deadline)
                conn.request("POST", path, body, headers)
            except (BrokenPipeError, ConnectionResetError):
                if not reused or self._is_closed():  # (close() shut it: no new one)
                    raise
                # The server closed an idle connection as we wrote: the
                # request did not get through, so one fresh try is safe.
                conn.close()
                self._open(conn, deadline)
                conn.request("POST", path, body, headers)
            _local_deadline.deadline = deadline  # read by _DeadlineResponse
            response = conn.getresponse()
            try:
                raw = response.read()
            except (OSError, http.client.HTTPException):
                # A whole answer saying "sent" whose framing failed after it:
                # cut (the connection ended or reset before a chunked answer's
                # last chunk, inside it, or short of its stated length), broken
                # (a chunk size or trailer line that is not one) or stalled
                # past the deadline. The message went out, and sent again the
                # chat would have it twice. Anything else stays a transport
                # error (or a timeout).
                got = (
                    b"".join(response.body_read) if isinstance(response, _DeadlineResponse) else b""
                )
                if response.status != 200 or not _says_sent(got):
                    raise
                _drop(conn, response)
                return response.status, response.headers, got
            if response.will_close:
                conn.close()
        except TimeoutError as exc:
            _drop(conn, response)
            raise SendTimeout(f"{method}: no answer within the time allowed") from exc
        except (OSError, http.client.HTTPException) as exc:
            _drop(conn, response)
            text, cause = transport_error(exc)
            if self._mask.found(text):  # (a request line quoted: never the token)
                text, cause = self._mask.text(text), None
            if time.monotonic() >= deadline:
                raise SendTimeout(f"{method}: no answer within the time allowed") from cause
            if self._is_closed():
                raise TransientSendError(
                    f"{method}: the sender was closed before the answer came"
                ) from None
            raise TransientSendError(f"{method}: {text}") from cause
        except BaseException:
            # (A Ctrl-C mid-exchange: the connection's state is unknown, say an
            # answer left unread, behind which the next request would go out
            # and then fail. Never reused.)
            _drop(conn, response)
            raise
        return response.status, response.headers, raw

    def _is_closed(self) -> bool:
        with self._lock:
            return self._closed

    def _set_timeout(
        self, conn: http.client.HTTPConnection, deadline: float, *, connecting: bool = False
    ) -> None:
        left = deadline - time.monotonic()
        if left <= 0.0:
            raise TimeoutError("deadline passed")
        if connecting:
            conn.timeout = unlimited_past_max(min(left, self._connect_timeout))
        elif conn.sock is not None:
            conn.sock.settimeout(unlimited_past_max(left))

    def _interpret(
        self, method: str, status: int, headers: http.client.HTTPMessage, raw: bytes
    ) -> SendResult:
        # (An answer may quote the request's path, the token in it: a proxy's or a
        # self-hosted Bot API server's "Not Found: /bot<token>/sendMessage".)
        raw = self._mask.data(raw)
        payload: dict[str, Any] | None
        try:
            decoded = json.loads(raw) if raw else None
            payload = decoded if isinstance(decoded, dict) else None
            # The token written with escapes, or in UTF-16 or UTF-32: either puts a
            # backslash or a NUL in the bytes (the token is ASCII). Otherwise every
            # decoded string is a slice of the bytes, where it is masked already.
            if payload is not None and (b"\\" in raw or b"\0" in raw):
                text = json.dumps(payload)
                if self._mask.found(text):  # (only inside a string: it holds no quote)
                    payload = json.loads(self._mask.text(text))
        except (ValueError, RecursionError):  # (nested too deep to decode)
            payload = None
        if status == 200 and payload is not None and payload.get("ok") is True:
            result = payload.get("result")
            message_id = result.get("message_id") if isinstance(result, dict) else None
            return SendResult(message_id=message_id, raw=payload)
        description = ""
        parameters: Mapping[str, Any] = {}
        if payload is not None:
            description = str(payload.get("description") or "")
            params = payload.get("parameters")
            if isinstance(params, dict):
                parameters = params
        if not description:
            description = "not a Bot API answer" if payload is None else "no description"
        error = TelegramError(status, description, parameters, payload)
        logger.debug("telegram: %s answered HTTP %d: %s", method, status, description)
        if status == 429:
            stated = parameters.get("scope") in ("global", "chat", "group")
            scope: Literal["chat", "global"] = (
                "global" if parameters.get("scope") == "global" else "chat"
            )
            retry_after = _retry_after(
                parameters.get("retry_after"), headers.get("Retry-After"), description
            )
            raise RateLimited(
                retry_after, scope, f"{method}: {description}", stated=stated
            ) from error
        # (408: the server gave up waiting for the request, which it did not act on.)
        if status >= 500 or status == 408 or (status == 200 and payload is None):
            # A 200 that is not a Bot API answer may not come from the platform (a
            # proxy's page): sent again, at least once rather than maybe never.
            raise TransientSendError(f"{method}: {error}") from error
        raise PermanentSendError(f"{method}: {error}") from error

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close every connection this sender opened; later sends raise ``RuntimeError``.

        Idempotent; never blocks on a send. A send running in another thread
        at that moment fails with a :class:`~outbound.errors.TransientSendError`
        (its connection, or its connect, is shut down, and closed by that
        thread as the send ends), and none goes out once ``close()`` returned. In a forked child
        it closes only the child's copies of the parent's connections (the
        parent's sends go on).
        """
        with self._lock:
            self._closed = True
            slots = list(self._connections)
        pid = os.getpid()
        for slot in slots:
            if slot.pid != pid:
                slot.shut()  # (this process's copy of a parent's: its descriptors only)
            else:
                with slot.lock:
                    if slot.busy:
                        slot.end()  # in use: its thread closes it as the send ends
                    else:
                        slot.shut()  # idle: no thread uses it now, nor will (_closed)
            # Forgotten once done: a close() cut short (a Ctrl-C), or one running
            # beside this one, finds what is left and does it (again).
            with self._lock:
                self._connections.discard(slot)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        with self._lock:
            state = "closed" if self._closed else f"connections={len(self._connections)}"
        return f"<TelegramSender {self._host}{self._path} {state}>"


def chat_key(chat_id: ChatId) -> Hashable:
    """A Telegram chat as the platform knows it: an ``"@username"`` in lower case
    (usernames are case-blind: ``"@Name"`` and ``"@name"`` are one chat, so one
    lane and one rate budget), an int as it is; anything else as it is (it
    does not name a chat; ``validate`` refuses it). Pure; never raises."""
    if isinstance(chat_id, str) and str.startswith(chat_id, "@"):
        return str.lower(chat_id)  # (str's own: a subclass's may do anything)
    return chat_id


_RETRY_AFTER_TEXT = re.compile(r"retry after (\d+(?:\.\d+)?)", re.IGNORECASE)


def _retry_after(value: object, header: str | None, description: str = "") -> float:
    """The wait a 429 asks for: ``parameters.retry_after``, else the ``Retry-After``
    header (seconds or an HTTP date), else the "retry after N" of the
    description, else 1 second; at most a day."""
    match = _RETRY_AFTER_TEXT.search(description)
    for candidate in (value, header, match.group(1) if match else None):
        seconds = parse_retry_after(candidate)
        if seconds is not None:
            return seconds
    return 1.0


def _is_dropped(sock: socket.socket) -> bool:
    """True if an idle keep-alive socket was closed (or is readable) on the server's side."""
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)
    except (OSError, ValueError):
        return True


def check_sender_settings(max_text_length: object, **seconds: object) -> None:
    """Raise ``TypeError``/``ValueError`` naming the setting unless ``max_text_length``
    is an int >= 1 and each of ``seconds`` a finite number of seconds > 0: the
    constructor checks of every platform sender. Pure."""
    for name, value in seconds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of seconds, not {shown_number(value)}")
        if not 0 < value < math.inf or (isinstance(value, int) and value.bit_length() > 1000):
            raise ValueError(
                f"{name} must be a finite number of seconds > 0, not {shown_number(value)}"
            )
    if isinstance(max_text_length, bool) or not isinstance(max_text_length, int):
        raise TypeError(f"max_text_length must be an int, not {shown_number(max_text_length)}")
    if max_text_length < 1:
        raise ValueError(f"max_text_length must be >= 1, not {shown_number(max_text_length)}")


def check_request(
    request: SendRequest, max_text_length: int, *, reserved: frozenset[str] = frozenset()
) -> None:
    """Raise ``TypeError``/``ValueError`` unless Telegram can take ``request``.

    The chat id is an ``int`` (signed 64-bit) or a public ``"@channelname"``;
    a text (of a ``TextMessage``, or the ``text`` of ``sendMessage`` or
    ``editMessageText``, in any case) is non-empty and at most
    ``max_text_length`` long, its ``parse_mode`` one of the Bot API's; a method is a Bot API
    method name and uses none of the ``reserved`` parameter names (those a
    client library keeps for itself). Shared by the Telegram senders.
    """
    if not isinstance(request, SendRequest):
        raise TypeError(f"expected a SendRequest, not {type(request).__name__}")
    chat_id = request.chat_id
    if isinstance(chat_id, bool) or not isinstance(chat_id, (int, str)):
        raise TypeError(
            f"a Telegram chat id is an int or an '@channelname' str, not {type(chat_id).__name__}"
        )
    if isinstance(chat_id, str) and not _USERNAME.fullmatch(chat_id):
        raise ValueError(
            "a Telegram chat id given as a str must be a public '@channelname'; "
            "pass numeric ids as int"
        )
    if isinstance(chat_id, int) and not -(2**63) <= chat_id < 2**63:
        # Telegram's ids have at most 52 significant bits (the value is not shown:
        # str() of an int past 4300 digits raises).
        raise ValueError("a Telegram chat id is a signed 64-bit integer; this one is out of range")
    message = request.message
    if isinstance(message, TextMessage):
        check_text(message.text, max_text_length)
        _check_parse_mode(message.parse_mode)
    elif isinstance(message, MethodMessage):
        if not _METHOD.fullmatch(message.method):
            raise ValueError(f"not a Bot API method name: {message.method!r}")
        taken = reserved.intersection(message.params)
        if taken:
            raise ValueError(
                f"parameter {sorted(taken)[0]!r} cannot be sent through this sender: "
                "its client library keeps it for itself"
            )
        # Bot API method names are case-insensitive.
        if message.method.lower() in _TEXT_METHODS:
            check_text(message.params.get("text"), max_text_length)
            _check_parse_mode(message.params.get("parse_mode"))
    else:
        raise TypeError(f"unsupported message type {type(message).__name__}")


def _check_parse_mode(parse_mode: object) -> None:
    """Raise ``ValueError`` unless ``parse_mode`` is None or one of the Bot API's."""
    if parse_mode is None:
        return
    if not isinstance(parse_mode, str) or parse_mode.lower() not in _PARSE_MODES:
        raise ValueError(
            "a Telegram parse_mode is 'HTML', 'MarkdownV2' or 'Markdown' (in any case), "
            f"not {parse_mode!r}"[:200]
        )
