"""Sending through slack_sdk: :class:`SlackSender` (extra ``slack``).

For apps that already hold a ``slack_sdk.WebClient``::

    client = WebClient(token=os.environ["SLACK_BOT_TOKEN"])
    sender = chain(retry(), rate_limit(SLACK), timeout())(SlackSender(client))

A :class:`~outbound.messages.TextMessage` goes out with
``chat_postMessage``; a :class:`~outbound.messages.MethodMessage` with
``api_call(method, json=params)``, the request's chat as ``channel``. The
message id of the result is the answer's ``ts`` (or ``message_ts``, or
``scheduled_message_id``).

How slack_sdk's errors map (none chained to slack_sdk's error, which holds
the request, the token and the text, and may quote the answer's body; an
error of the network is)::

    HTTP 429, or error "ratelimited"          RateLimited(retry_after, scope)
    HTTP 5xx or 408, errors internal_error,   TransientSendError
      fatal_error, service_unavailable,
      request_timeout, a body that is not
      JSON or cannot be decoded, an interim
      answer ("103 Early Hints", which
      urllib takes for the answer: at
      least once), network errors
    timeouts, deadline passed                 SendTimeout (a TransientSendError)
    other errors (channel_not_found,          PermanentSendError
      invalid_auth, msg_too_long, ...)

Real Slack answers a 429 with a ``Retry-After: N`` header (whole seconds;
an HTTP date is read too, and a wait past a day is cut to a day) and
``{"ok": false, "error": "ratelimited"}``, and does not say whether
the channel's limit (about one post per second) or the workspace-wide one
was hit: the error is then ``RateLimited(N, "chat", stated=False)`` and
the rate limiter of :func:`~outbound.middleware.rate_limit` infers the
scope. The body's ``retry_after`` and ``scope`` (extensions of
:class:`~outbound.simulator.PlatformSimulator`) are used when present.
Slack's limits are per method: a 429 of another method is recorded
against the channel all the same, which is conservative.

Each send runs on a shallow copy of the client, so the client given is
never changed and stays usable elsewhere. On that copy:

- ``timeout`` is the running task's ``current_context().remaining()`` (or
  ``timeout`` outside a task). slack_sdk hands it to ``urllib``, which
  applies it to the connect and to each read, not to the whole exchange:
  a server that trickles its answer (a byte at a time, each read inside
  the timeout) holds a send for as long as it goes on, past the
  deadline. A Slack answer is one small read, where the two agree. An
  answer's body is read up to 64 MiB: one that declares more, or runs
  past it, is a ``TransientSendError`` (through an opener the
  application installed too; a client subclass's own request method
  reads as it reads).
- ``retry_handlers`` is empty. slack_sdk's handlers sleep in the calling
  thread: ``RateLimitErrorRetryHandler`` for as long as ``Retry-After``
  says, the default ``ConnectionErrorRetryHandler`` for its backoff, and
  would hold a worker and its concurrency permit meanwhile. Retries are
  outbound's (:func:`outbound.middleware.retry`), which wait on the
  dispatcher's timer without holding a thread.
- redirects are not followed: urllib follows a 301, 302 or 303 as a GET
  (the message dropped, and the other server's ``"ok": true`` taken for
  its post) and sends the ``Authorization`` header, the token, wherever
  the ``Location`` says. A redirect is a ``PermanentSendError`` naming
  where it pointed: ``base_url`` is wrong (``http://`` for ``https://``,
  say). A client subclass that makes its own requests keeps them, with
  their ``Authorization`` header: the request it is given is refused a
  redirect where it goes on to urllib (to slack_sdk's method, by
  ``super()``); a request of its own making follows what urllib follows.

``TextMessage.parse_mode`` is Slack's ``parse`` (``"full"`` or
``"none"``); ``disable_notification`` has no Slack equivalent and is
ignored. slack_sdk logs request bodies (message text included) at DEBUG
on its ``slack_sdk`` loggers, and at ERROR an answer's body that is not
JSON or a status line it cannot read, either of which may quote the
message's text. The bot token is masked in the records of
``slack_sdk.web.base_client`` and of a logger given to the client
(``WebClient(logger=...)``): a filter on them, given each sender's token
(a gateway's page may echo the request's ``Authorization`` header).
"""

from __future__ import annotations

import copy
import http.client
import io
import logging
import re
import sys
import types
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import IO, Any, Final, Literal
from urllib.error import URLError

try:
    from slack_sdk import WebClient
    from slack_sdk.errors import SlackApiError, SlackRequestError
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "outbound.contrib.slack needs slack_sdk: pip install 'outbound-dispatcher[slack]'"
    ) from exc

from outbound._compat import unlimited_past_max
from outbound._secret import context_dropped, transport_error
from outbound.context import time_allowed
from outbound.contrib._common import TokenFilter, redirect_error
from outbound.errors import PermanentSendError, RateLimited, SendTimeout, TransientSendError
from outbound.messages import (
    MethodMessage,
    SendRequest,
    SendResult,
    TextMessage,
    check_json_params,
    check_text,
)
from outbound.retry import parse_retry_after
from outbound.telegram import check_base_url, check_sender_settings

__all__ = ["SlackSender"]

logger = logging.getLogger("outbound.contrib.slack")

_METHOD = re.compile(r"[a-z][A-Za-z0-9]*(\.[A-Za-z0-9]+)+")
_TRANSIENT = frozenset({"internal_error", "fatal_error", "service_unavailable", "request_timeout"})
_RATE_LIMITED = frozenset({"ratelimited", "rate_limited"})
_PARSE = frozenset({"full", "none"})
_POSTING = frozenset({"chat.postMessage", "chat.postEphemeral", "chat.scheduleMessage"})
_TOKEN_CHARS = re.compile(r"[!-~]+")
# slack_sdk's "error" for an answer that is not JSON, followed by the body.
_NOT_JSON = "Received a response in a non-JSON format"


class SlackSender:
    """A :class:`~outbound.messages.Sender` over a ``slack_sdk.WebClient``.

    - ``client``: a synchronous ``WebClient`` with its token and base URL.
    - ``max_text_length``: the longest text :meth:`validate` lets through
      (Slack refuses more than 40,000 characters with ``msg_too_long``).
    - ``timeout``: the time limit of a send outside a dispatcher task
      (inside one, the task's ``current_context().remaining()``).

    Thread-safe: each send works on its own copy of the client and its own
    HTTP connection. :meth:`send` blocks for one HTTP round trip, each
    socket operation of it bounded by the time left before the deadline,
    not the whole (see the module docstring: a server trickling its answer
    can hold it longer), nor the host's lookup, which the system resolver
    bounds with its own timeout; :meth:`validate` never blocks.
    """

    __slots__ = ("_client", "_max_text_length", "_timeout")

    def __init__(
        self, client: WebClient, *, max_text_length: int = 40_000, timeout: float = 30.0
    ) -> None:
        if not isinstance(client, WebClient):
            raise TypeError(f"client must be a slack_sdk.WebClient, not {type(client).__name__}")
        _check_client(client)
        check_sender_settings(max_text_length, timeout=timeout)
        _mask_token_in_logs(client)
        self._client = client
        self._max_text_length = max_text_length
        self._timeout = float(timeout)

    @property
    def client(self) -> WebClient:
        return self._client

    def __repr__(self) -> str:
        return f"<SlackSender base_url={self._client.base_url!r}>"

    # ------------------------------------------------------------ validation

    def validate(self, request: SendRequest) -> None:
        """Raise ``TypeError``/``ValueError`` if Slack would refuse ``request``. Never blocks.

        Checks the channel (a non-empty ``str``: an id such as ``C0123``
        or a ``#name``), the text (non-empty, at most ``max_text_length``
        characters; a posting method may carry ``blocks`` or
        ``attachments`` instead), ``parse_mode``, the method name, and that
        the parameters encode as JSON.
        """
        self._check(request)
        if isinstance(request.message, MethodMessage):
            check_json_params(request.message)

    def _check(self, request: SendRequest) -> None:
        if not isinstance(request, SendRequest):
            raise TypeError(f"expected a SendRequest, not {type(request).__name__}")
        channel = request.chat_id
        if not isinstance(channel, str):
            raise TypeError(
                f"a Slack channel is a str (an id such as 'C0123' or a '#name'), "
                f"not {type(channel).__name__}"
            )
        if not channel.strip() or channel != channel.strip():
            raise ValueError(f"not a Slack channel: {channel!r}")
        message = request.message
        if isinstance(message, TextMessage):
            check_text(message.text, self._max_text_length)
            if message.parse_mode is not None and message.parse_mode not in _PARSE:
                raise ValueError(
                    f"parse_mode is Slack's 'parse': 'full' or 'none', not {message.parse_mode!r}"
                )
        elif isinstance(message, MethodMessage):
            if not _METHOD.fullmatch(message.method):
                raise ValueError(f"not a Slack Web API method name: {message.method!r}")
            params = message.params
            if message.method in _POSTING and not any(
                params.get(k) for k in ("blocks", "attachments")
            ):
                check_text(params.get("text"), self._max_text_length)
            elif isinstance(params.get("text"), str):
                check_text(params["text"], self._max_text_length)
        else:
            raise TypeError(f"unsupported message type {type(message).__name__}")

    # --------------------------------------------------------------- sending

    def send(self, request: SendRequest) -> SendResult:
        """Send ``request``; return the message's ``ts`` and the answer's body.

        Blocks for one HTTP round trip, each socket operation of it within the
        running task's deadline (or ``timeout`` outside a task). Raises ``TypeError``/``ValueError``
        for bad input (nothing is sent), and otherwise the errors of the
        module docstring.
        """
        self._check(request)
        message = request.message
        if isinstance(message, MethodMessage):
            check_json_params(message)  # (slack_sdk's own error would look like an answer's)
        _check_client(self._client)  # (an application may change its token or URL)
        _mask_token_in_logs(self._client)  # (or its logger)
        method = "chat.postMessage" if isinstance(message, TextMessage) else message.method
        allowed = time_allowed(self._timeout, method)
        client = copy.copy(self._client)
        # (typed int; urllib takes a float, and None, no limit, for one past TIMEOUT_MAX)
        client.timeout = unlimited_past_max(allowed)  # type: ignore[assignment]
        client.retry_handlers = []
        if _own_request(client):
            client._perform_urllib_http_request_internal = types.MethodType(  # type: ignore[method-assign]
                _open_without_redirects, client
            )
        else:  # (a subclass's own: still no redirect where it goes through urllib)
            client._perform_urllib_http_request_internal = _refusing_redirects(  # type: ignore[method-assign,assignment]
                client._perform_urllib_http_request_internal
            )
        # (An error raised from None leaves without the client's, which quotes
        # the answer's body: not its context either.)
        with context_dropped():
            try:
                if isinstance(message, TextMessage):
                    options: dict[str, Any] = {}
                    if message.parse_mode is not None:
                        options["parse"] = message.parse_mode
                    response = client.chat_postMessage(
                        channel=str(request.chat_id), text=message.text, **options
                    )
                else:
                    params = {**message.params, "channel": request.chat_id}
                    response = client.api_call(method, json=params)
            except _Redirected as exc:
                raise redirect_error(method, exc.status, exc.location, "base_url") from None
            except _Unreadable as exc:
                raise TransientSendError(f"{method}: {exc}") from None
            except SlackApiError as exc:
                # (Its response holds the request's arguments, the token and the
                # text; its text the answer's body, which may echo them.)
                raise _api_error(method, exc) from None
            except SlackRequestError as exc:
                raise PermanentSendError(f"{method}: {exc}") from exc
            except TimeoutError as exc:
                raise SendTimeout(f"{method}: no answer within {allowed:.3f}s") from exc
            except URLError as exc:
                if isinstance(exc.reason, TimeoutError):
                    raise SendTimeout(f"{method}: no answer within {allowed:.3f}s") from exc
                raise TransientSendError(f"{method}: {exc.reason}") from exc
            except (OSError, http.client.HTTPException) as exc:
                text, cause = transport_error(exc)
                raise TransientSendError(f"{method}: {text}") from cause
            except (AttributeError, TypeError):
                # slack_sdk reads an answer whose JSON is not an object (a proxy's
                # "[]", a bare number) as if it were one: not Slack's answer.
                raise TransientSendError(f"{method}: the answer is not a JSON object") from None
            except (RecursionError, UnicodeError, LookupError, ValueError) as exc:
                # slack_sdk decodes the body by its charset and its JSON as it
                # comes: a proxy's Latin-1 page, an unknown charset, JSON nested
                # too deep or a number too long make it raise these.
                unread = _unread_answer(exc)
                if unread is None:
                    raise
                status, headers = unread
                if status == 429:
                    seconds = _retry_after({}, headers)
                    raise RateLimited(
                        seconds, "chat", f"{method}: HTTP 429", stated=False
                    ) from None
                raise TransientSendError(
                    f"{method}: HTTP {status}: the answer cannot be read"
                ) from None
        data = response.data
        body: Mapping[str, Any] = data if isinstance(data, Mapping) else {}
        message_id = next(
            (
                body[k]
                for k in ("ts", "message_ts", "scheduled_message_id")
                if isinstance(body.get(k), str)
            ),
            None,
        )
        return SendResult(message_id=message_id, raw=body)


def _check_client(client: WebClient) -> None:
    """Whether ``client``'s token and base URL can go into a request; else ``ValueError``
    naming the setting, never the token. A token with a line break or a space (a
    config file's) failed every send with http.client's bare ``ValueError``
    quoting it; a base URL no request can use, every send, and was retried."""
    token = client.token
    if token is not None and (not isinstance(token, str) or _TOKEN_CHARS.fullmatch(token) is None):
        what = f"a str of {len(token)} characters" if isinstance(token, str) else type(token)
        raise ValueError(
            "the Slack client's token must be printable ASCII with no space or line break, "
            f"not {what}"
        )
    check_base_url(client.base_url, "the Slack client's base_url")
    headers = client.headers
    if isinstance(headers, Mapping):
        for name, value in headers.items():
            # (http.client refuses them with a bare ValueError before sending.)
            if not isinstance(name, str) or _HEADER_NAME.fullmatch(name) is None:
                raise ValueError(f"the Slack client's header name {name!r} cannot be sent")
            if _header_bytes(value) is None:
                raise ValueError(
                    f"the Slack client's header {name!r} has a value that cannot be sent "
                    "(a line break, a NUL, a character past Latin-1, or not a str, "
                    "bytes or int)"
                )


#: Masks the tokens of the senders made in the records of slack_sdk's logger: it
#: logs at ERROR an answer's body that is not JSON, and a status line it cannot
#: read, either of which may quote the request's ``Authorization`` header (a
#: gateway's page echoing the request).
_TOKEN_LOG_MASK: Final = TokenFilter()
# (A filter applies to its own logger's records only, not to its children's.)
logging.getLogger("slack_sdk.web.base_client").addFilter(_TOKEN_LOG_MASK)


def _mask_token_in_logs(client: WebClient) -> None:
    """Mask ``client``'s token in the records of slack_sdk's logger, and of the
    logger the client was given (``WebClient(logger=...)``) if it has one."""
    if isinstance(client.token, str) and client.token:
        _TOKEN_LOG_MASK.add(client.token)
    own = getattr(client, "logger", None)
    if isinstance(own, logging.Logger) and _TOKEN_LOG_MASK not in own.filters:
        own.addFilter(_TOKEN_LOG_MASK)


def _header_bytes(value: object) -> bytes | None:
    """A header's value as http.client sends it (a str in Latin-1, bytes as they
    are, an int as its digits); None if it cannot go out whole on one line. Pure."""
    if isinstance(value, str):
        try:
            data = value.encode("latin-1")
        except UnicodeEncodeError:
            return None
    elif isinstance(value, bytes):
        data = value
    elif isinstance(value, int) and not isinstance(value, bool):
        data = int.__repr__(value).encode()
    else:
        return None
    return None if any(c in data for c in b"\r\n\0") else data


#: A header name http.client sends (RFC 9110's token).
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _unread_answer(exc: BaseException) -> tuple[int, Any] | None:
    """The status and headers of the answer slack_sdk failed to read when it raised
    ``exc``, from its own frames; None if ``exc`` came before any answer."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        if not str(frame.f_globals.get("__name__", "")).startswith("slack_sdk"):
            continue
        for name in ("resp", "response"):
            found = frame.f_locals.get(name)
            if isinstance(found, dict):
                status, headers = found.get("status"), found.get("headers")
            else:  # urllib's answer
                status, headers = getattr(found, "code", None), getattr(found, "headers", None)
            if isinstance(status, int) and not isinstance(status, bool) and headers is not None:
                return status, headers
    return None


def _retry_after(body: Mapping[str, Any], headers: Mapping[str, Any]) -> float:
    header = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if isinstance(header, list):
        header = header[0] if header else None
    for value in (body.get("retry_after"), header):
        seconds = parse_retry_after(value)
        if seconds is not None:
            return seconds
    return 1.0


def _not_json(exc: SlackApiError) -> bool:
    data = exc.response.data
    error = data.get("error") if isinstance(data, Mapping) else None
    return isinstance(error, str) and error.startswith(_NOT_JSON)


def _own_request(client: WebClient) -> bool:
    """Whether ``client`` makes its requests with slack_sdk's own method (one this
    sender can replace by :func:`_open_without_redirects`): not a subclass's."""
    own = getattr(WebClient, "_perform_urllib_http_request_internal", None)
    return own is not None and getattr(type(client), own.__name__, None) is own


class _Redirected(Exception):
    """A redirect answered to a request (see :func:`_open_without_redirects`)."""

    def __init__(self, status: int, location: str) -> None:
        super().__init__(f"HTTP {status}: a redirect, not followed")
        self.status = status
        self.location = location


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Follows no redirect, nor reads its ``Location`` (one that is not a URL raised
    ``ValueError``): urllib then raises the 3xx as an ``HTTPError``."""

    def http_error_302(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: Any
    ) -> None:
        return None  # (not handled here: the next handler raises it)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


class _NoRoom(dict[str, int]):
    """A request's record of the redirects it followed, as full as any limit: urllib's
    redirect handler (the standard one, or a subclass that keeps its loop check)
    then raises the 3xx as an ``HTTPError`` instead of following it."""

    def __len__(self) -> int:
        return sys.maxsize


class _Unreadable(Exception):
    """urllib failed on an answer with a ``ValueError`` (a redirect's ``Location``
    that is not a URL, say): no answer to read."""


def _open_without_redirects(
    client: WebClient, url: str, req: urllib.request.Request
) -> dict[str, Any]:
    """slack_sdk's ``_perform_urllib_http_request_internal`` (one request, its answer
    as a dict of ``status``, ``headers`` and ``body``), following no redirect
    (:class:`_Redirected`, its body unread), and with no DEBUG log of the
    answer's body. As ``urlopen`` does, through the opener an application
    installed (``urllib.request.install_opener``) when the client names no
    proxy and no TLS context. Blocks for the round trip."""
    if not url.lower().startswith("http"):  # (urllib opens file:// and ftp:// too)
        raise SlackRequestError(f"Invalid URL detected: {url}")
    if client.proxy is not None and not isinstance(client.proxy, str):
        raise SlackRequestError(f"Invalid proxy detected: {client.proxy} must be a str value")
    req.redirect_dict = _NoRoom()  # type: ignore[attr-defined]
    # Sent with this request (and a proxy's, and an auth handler's retry of it),
    # never with a redirect's, whatever a redirect handler of the application's
    # installed opener does (one that follows regardless of the loop check).
    authorization = req.headers.pop("Authorization", None)
    if authorization is not None:
        req.add_unredirected_header("Authorization", authorization)
    installed = getattr(urllib.request, "_opener", None)  # (what urlopen uses)
    if client.proxy is None and client.ssl is None and installed is not None:
        opener: Any = installed
    else:
        handlers: list[urllib.request.BaseHandler] = [
            urllib.request.HTTPSHandler(context=client.ssl),
            _NoRedirects(),
        ]
        if client.proxy is not None:
            handlers.append(
                urllib.request.ProxyHandler({"http": client.proxy, "https": client.proxy})
            )
        opener = urllib.request.build_opener(*handlers)
    try:
        answer = opener.open(req, timeout=client.timeout)
    except urllib.error.HTTPError as exc:
        _raise_redirected(exc)
        # slack_sdk reads an error's body whole (e.read()): read here, capped,
        # and handed on in memory (a 502 declaring gigabytes was a MemoryError).
        with exc:
            body = _read_capped(exc, exc.code)
        raise urllib.error.HTTPError(
            exc.url, exc.code, exc.msg, exc.headers, io.BytesIO(body)
        ) from None
    except ValueError as exc:  # (UnicodeError too: a host IDNA cannot encode)
        raise _Unreadable(f"the answer could not be read ({type(exc).__name__})") from None
    if answer.geturl() != req.full_url:  # (followed all the same: not the API's answer)
        location = answer.geturl()
        answer.close()
        raise _Redirected(0, location)
    with answer:
        status, headers = answer.code, answer.headers
        body = _read_capped(answer, status)
    if headers.get_content_type() == "application/gzip":  # (admin.analytics.getFile)
        return {"status": status, "headers": headers, "body": body}
    charset = headers.get_content_charset() or "utf-8"
    try:
        text = body.decode(charset)
    except (UnicodeError, LookupError) as exc:  # (a proxy's Latin-1 page; a charset unknown)
        raise _Unreadable(
            f"HTTP {status}: the answer could not be read ({type(exc).__name__})"
        ) from None
    return {"status": status, "headers": headers, "body": text}


#: The longest answer body read (a Slack answer is a few KB; admin.analytics.getFile's
#: gzip file is the largest): one that declares more, or runs past it, is a
#: transport error, not a ``MemoryError`` (``http.client`` allocates a declared
#: length at once), as :class:`~outbound.telegram.TelegramSender` has it.
_MAX_ANSWER: Final = 64 * 1024 * 1024
#: The most read at once.
_READ_SIZE: Final = 64 * 1024


def _read_capped(answer: Any, status: int) -> bytes:
    """The body of ``answer`` (urllib's), read in pieces, at most ``_MAX_ANSWER``
    bytes; past that, :class:`_Unreadable`. Blocks for the reads."""
    declared = getattr(answer, "length", None)  # (http.client's, of Content-Length)
    if isinstance(declared, int) and declared > _MAX_ANSWER:
        raise _Unreadable(
            f"HTTP {status}: the answer declares {declared} bytes, "
            f"past the most read of one ({_MAX_ANSWER})"
        )
    pieces: list[bytes] = []
    size = 0
    while True:
        piece: bytes = answer.read(_READ_SIZE)
        if not piece:
            return b"".join(pieces)
        size += len(piece)
        if size > _MAX_ANSWER:
            raise _Unreadable(
                f"HTTP {status}: the answer runs past the most read of one ({_MAX_ANSWER} bytes)"
            )
        pieces.append(piece)


def _refusing_redirects(
    perform: Callable[[str, urllib.request.Request], dict[str, Any]],
) -> Callable[[str, urllib.request.Request], dict[str, Any]]:
    """A client subclass's own request method (``perform``), its requests marked
    as having no room for a redirect: urllib's redirect handler raises the 3xx
    (:class:`_Redirected`) instead of following it, where ``perform`` goes through
    urllib (slack_sdk's method, by ``super()``) with the request it was given. A
    request of its own making is not marked, and the ``Authorization`` header is
    left where ``perform`` may read it (a redirect handler that follows
    regardless would send it on)."""

    def perform_refusing(url: str, req: urllib.request.Request) -> dict[str, Any]:
        req.redirect_dict = _NoRoom()  # type: ignore[attr-defined]
        try:
            return perform(url, req)
        except urllib.error.HTTPError as exc:
            _raise_redirected(exc)
            raise
        except ValueError as exc:  # (a Location that is not a URL, read before the check)
            raise _Unreadable(f"the answer could not be read ({type(exc).__name__})") from None

    return perform_refusing


def _raise_redirected(exc: urllib.error.HTTPError) -> None:
    """Raise :class:`_Redirected` (its body unread) if ``exc`` is a redirect's."""
    if 300 <= exc.code < 400:
        location = str(exc.headers.get("Location") or "") if exc.headers else ""
        exc.close()
        raise _Redirected(exc.code, location) from None


#: What a Slack error code looks like: "channel_not_found".
_ERROR_CODE: Final = re.compile(r"[a-z0-9_]{1,100}")


def _api_error(method: str, exc: SlackApiError) -> Exception:
    response = exc.response
    status = int(response.status_code)
    if 300 <= status < 400:
        headers = response.headers if isinstance(response.headers, Mapping) else {}
        where = next((str(v) for k, v in headers.items() if str(k).lower() == "location"), "")
        logger.debug("slack: %s answered HTTP %d, a redirect", method, status)
        return redirect_error(method, status, where, "base_url")
    data = response.data
    body: Mapping[str, Any] = data if isinstance(data, Mapping) else {}
    error = body.get("error")
    if not isinstance(error, str):
        error = f"HTTP {status}"
    elif not _ERROR_CODE.fullmatch(error):
        # (Slack's are codes, "channel_not_found": anything else, a gateway's
        # echo of the request say, may quote the token or the text.)
        error = f"HTTP {status}: an error that is not a Slack error code"
    not_json = _not_json(exc)
    if not_json:  # (then the body: never said)
        error = "the answer is not JSON"
    logger.debug("slack: %s answered HTTP %d: %s", method, status, error)
    if status == 429 or error in _RATE_LIMITED:
        headers = response.headers if isinstance(response.headers, Mapping) else {}
        stated = body.get("scope") in ("global", "chat", "group")
        scope: Literal["chat", "global"] = "global" if body.get("scope") == "global" else "chat"
        return RateLimited(_retry_after(body, headers), scope, f"{method}: {error}", stated=stated)
    if status >= 500 or status == 408 or error in _TRANSIENT or not body or not_json:
        return TransientSendError(f"{method}: HTTP {status}: {error}")
    return PermanentSendError(f"{method}: HTTP {status}: {error}")
