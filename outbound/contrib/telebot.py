"""Sending through pyTelegramBotAPI: :class:`TeleBotSender` (extra ``telegram``).

For bots that already hold a ``telebot.TeleBot``::

    bot = telebot.TeleBot(token, threaded=False)   # threaded=False: no polling pool
    sender = chain(retry(), rate_limit(TELEGRAM), timeout())(TeleBotSender(bot))

A :class:`~outbound.messages.TextMessage` goes out with ``bot.send_message``
(so the bot's defaults, such as its ``parse_mode``, apply); a
:class:`~outbound.messages.MethodMessage` goes out as the raw Bot API call
it names, its parameters passed as the Bot API spells them.

How pyTelegramBotAPI's errors map (none chained to the original, which holds
the request, the token and the text in its URL; an error the answer decided
has a :class:`~outbound.telegram.TelegramError` for its cause, as
:class:`~outbound.telegram.TelegramSender`'s has, with the answer's
``parameters``: ``migrate_to_chat_id`` for a group that became a
supergroup)::

    ApiTelegramException, error_code 429    RateLimited(retry_after, scope)
    error_code or HTTP status 5xx or 408,   TransientSendError
      invalid JSON, requests' network errors
    requests' timeouts, deadline passed     SendTimeout (a TransientSendError)
    other error codes (400, 403, ...)       PermanentSendError

``retry_after`` is the answer's ``parameters.retry_after``, else its
``Retry-After`` header (seconds, or an HTTP date), else the description's
"retry after N", else 1 second; a wait past a day is cut to a day.

An answer pyTelegramBotAPI cannot read (an error body without
``error_code`` or ``description``, a body that is not a JSON object: a
proxy's or a load balancer's page, JSON nested too deep to decode) makes
it raise ``KeyError``, ``TypeError`` or ``RecursionError`` from inside its
own code; the sender maps those by the answer's HTTP status as above (a
429 still honours its ``Retry-After``), and a 200 that is not a Bot API
answer is a ``TransientSendError``. A call that succeeded but whose
returned message pyTelegramBotAPI cannot read (a 200 that says
``"ok": true``, whatever its ``result``) was sent: it returns a
``SendResult`` without a ``message_id`` (and logs a warning), so it is
not sent twice. An interim answer ("103 Early Hints"), which requests
takes for the answer, is a ``TransientSendError``: whether the call was
made cannot be told (tried again: at least once).

Real Telegram never says whose limit a 429 was: the error is then
``RateLimited(..., "chat", stated=False)`` and the rate limiter of
:func:`~outbound.middleware.rate_limit` infers the scope;
``parameters.scope`` (an extension of
:class:`~outbound.simulator.PlatformSimulator`) is taken as stated.

Timeouts. ``telebot.apihelper.READ_TIMEOUT`` and ``CONNECT_TIMEOUT`` are
process-wide; this sender does not touch them. Each call instead passes
pyTelegramBotAPI's per-request ``timeout``, which becomes that request's
connect and read timeouts: the running task's
``current_context().remaining()``, or ``timeout`` outside a task. As with
any ``requests`` timeout it bounds each socket operation, not the whole
exchange, so a server that trickles its answer byte by byte can outlast
it; a Bot API answer is one small read, where the two agree. Nor does it
bound the host's lookup: a resolver that does not answer holds a send for
the system resolver's own timeout (``resolv.conf``). For the same reason a
:class:`MethodMessage` may not carry a ``timeout`` parameter.

Redirects are not followed: requests follows a 301, 302 or 303 as a GET
without the parameters (the message dropped, and the other server's
``"ok": true`` taken for the send's) and a 307 or 308 with the token in the
URL, wherever the ``Location`` says. A redirect is a ``PermanentSendError``
naming the host it pointed to: ``apihelper.API_URL`` is wrong. During a send
the sending thread's session (pyTelegramBotAPI's, or the one set in
``apihelper.session``) is called with ``allow_redirects=False``, the session
itself unchanged and in this thread only (with a ``SESSION_TIME_TO_LIVE``, not
renewed during the send); with ``apihelper.SESSION_TIME_TO_LIVE = 0`` (a new
session for each request) or a ``CUSTOM_REQUEST_SENDER``, requests go out as
pyTelegramBotAPI makes them, following what they follow.

Retries are outbound's (:func:`outbound.middleware.retry`), which wait
without holding a thread. ``telebot.apihelper.RETRY_ON_ERROR`` makes
pyTelegramBotAPI sleep and retry inside the sending thread, holding a
worker and its permit; the sender refuses to work while it is set.

pyTelegramBotAPI logs every request with its parameters (message text
included) and every answer at DEBUG on its ``TeleBot`` logger, and
urllib3 each request's URL, parameters and text in it, at DEBUG on
``urllib3.connectionpool`` (and ``urllib3.util.retry`` when a session
retries); keep both above DEBUG where message text must not be logged.
The bot token is masked in the records of those loggers (a filter on
them, given each sender's token: an answer's body may quote the
request's path too). The errors the sender raises carry neither the
token nor the text: an answer's description that quotes the request's
path is cut from its query on, and the client's error is neither their
cause nor their context. Uploads (files
as ``InputFile``) are not supported: pass a ``file_id`` or a URL.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Hashable, Iterator, Mapping
from types import FrameType, TracebackType
from typing import Any, Final, Literal, cast

try:
    import requests
    import telebot
    from telebot import apihelper
    from telebot import util as telebot_util
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "outbound.contrib.telebot needs pyTelegramBotAPI: "
        "pip install 'outbound-dispatcher[telegram]'"
    ) from exc

from outbound._compat import TIMEOUT_MAX
from outbound._secret import TokenMask, transport_error, wrapped
from outbound.context import time_allowed
from outbound.contrib._common import TokenFilter, redirect_error
from outbound.errors import PermanentSendError, RateLimited, SendTimeout, TransientSendError
from outbound.messages import (
    ChatId,
    MethodMessage,
    SendRequest,
    SendResult,
    TextMessage,
    check_json_params,
)
from outbound.retry import parse_retry_after
from outbound.telegram import TelegramError, chat_key, check_request, check_sender_settings

__all__ = ["TeleBotSender"]

logger = logging.getLogger("outbound.contrib.telebot")

# Parameters pyTelegramBotAPI consumes itself instead of sending them.
_RESERVED = frozenset({"timeout", "long_polling_timeout"})


class TeleBotSender:
    """A :class:`~outbound.messages.Sender` over a ``telebot.TeleBot``.

    - ``bot``: the client; only its token, its defaults and
      ``send_message`` are used. Build it with ``threaded=False`` if it
      only sends (``threaded=True`` starts a thread pool for polling).
    - ``max_text_length``: the longest text :meth:`validate` lets through.
    - ``timeout``: the time limit of a send outside a dispatcher task
      (inside one, the task's ``current_context().remaining()``).

    Raises ``ValueError`` if ``telebot.apihelper.RETRY_ON_ERROR`` is set
    (see the module docstring). Thread-safe: pyTelegramBotAPI keeps one
    ``requests`` session per thread. :meth:`send` blocks for one HTTP round
    trip, each socket operation of it within the deadline, not the whole
    (see the module docstring); :meth:`validate` never blocks.
    """

    __slots__ = ("_bot", "_max_text_length", "_timeout")

    def __init__(
        self, bot: telebot.TeleBot, *, max_text_length: int = 4096, timeout: float = 30.0
    ) -> None:
        if not isinstance(bot, telebot.TeleBot):
            raise TypeError(f"bot must be a telebot.TeleBot, not {type(bot).__name__}")
        check_sender_settings(max_text_length, timeout=timeout)
        _check_no_retry()
        if isinstance(bot.token, str) and bot.token:
            _URL_LOG_MASK.add(bot.token)
        self._bot = bot
        self._max_text_length = max_text_length
        self._timeout = float(timeout)

    @property
    def bot(self) -> telebot.TeleBot:
        return self._bot

    def __repr__(self) -> str:
        return f"<TeleBotSender max_text_length={self._max_text_length}>"

    def chat_key(self, chat_id: ChatId) -> Hashable:
        """The chat as Telegram knows it (see :func:`outbound.telegram.chat_key`). Pure."""
        return chat_key(chat_id)

    # ------------------------------------------------------------ validation

    def validate(self, request: SendRequest) -> None:
        """Raise ``TypeError``/``ValueError`` if Telegram would refuse ``request``. Never blocks.

        Checks the chat id (an ``int``, or an ``"@channelname"`` ``str``),
        the text (non-empty, at most ``max_text_length`` characters), the
        method name, and that the parameters encode as JSON.
        """
        check_request(request, self._max_text_length, reserved=_RESERVED)
        if isinstance(request.message, MethodMessage):
            check_json_params(request.message)

    # --------------------------------------------------------------- sending

    def send(self, request: SendRequest) -> SendResult:
        """Send ``request``; return the new message's id and ``{"ok": True, "result": ...}``.

        Blocks for one HTTP round trip, each socket operation of it within the
        running task's deadline (or ``timeout`` outside a task). Raises ``TypeError``/``ValueError``
        for bad input (nothing is sent), and otherwise the errors of the
        module docstring.
        """
        check_request(request, self._max_text_length, reserved=_RESERVED)
        if isinstance(request.message, MethodMessage):
            check_json_params(request.message)  # (requests' own error is no answer's)
        _check_no_retry()
        message = request.message
        method = "sendMessage" if isinstance(message, TextMessage) else message.method
        # (past TIMEOUT_MAX, which sockets cannot take: as good as forever)
        allowed = min(time_allowed(self._timeout, method), TIMEOUT_MAX)
        # The error a failure maps to, raised past the except clauses: the error
        # it maps then stays out of its context too (``from None`` only hides it
        # from a traceback). pyTelegramBotAPI puts the token and every parameter
        # (the text too) in the URL, which requests quotes in its errors; its
        # own errors quote the answer's body, which may echo both.
        failure: Exception | None = None
        try:
            with _no_redirects():
                result = self._call(request, method, allowed)
        except _Redirected as exc:
            failure = redirect_error(method, exc.status, exc.location, "apihelper.API_URL")
        except apihelper.ApiTelegramException as exc:
            failure = _api_error(method, exc, TokenMask(self._bot.token))
        except apihelper.ApiHTTPException as exc:
            failure = _http_error(method, exc)
        except apihelper.ApiInvalidJSONException:
            failure = TransientSendError(f"{method}: the answer is not JSON")
        except requests.exceptions.Timeout:
            failure = SendTimeout(f"{method}: no answer within {allowed:.3f}s")
        except requests.exceptions.RequestException as exc:
            text, quoted = transport_error(exc)
            if quoted is not None:  # (None: an answer it quotes, described by its types)
                text = _failure(exc)
            failure = TransientSendError(f"{method}: {text}")
        except (KeyError, TypeError, AttributeError, IndexError, ValueError, RecursionError) as exc:
            frames = _telebot_frames(exc.__traceback__)
            if frames is None:
                raise  # not an answer pyTelegramBotAPI choked on: a bug to surface
            # The call succeeded if it failed reading the message returned
            # (telebot.types), or the answer is a 200 that says "ok": true.
            made = any(f.f_globals.get("__name__") == "telebot.types" for f in frames)
            response = None if made else _unread_answer(frames)
            if made or (response is not None and _succeeded(response)):
                logger.warning(
                    "telebot: %s succeeded but its answer could not be read (%s: %s)",
                    method,
                    type(exc).__name__,
                    exc,
                )
                return SendResult(message_id=None, raw={"ok": True, "result": None})
            if response is not None:
                failure = _answer_error(method, response, TokenMask(self._bot.token))
            elif _in_transport(frames):
                # (requests or urllib3 choked on the answer: a redirect's
                # Location that is not a URL, say. Not chained: it quotes what
                # the answer said.)
                failure = TransientSendError(
                    f"{method}: the HTTP client could not follow the answer ({type(exc).__name__})"
                )
            else:
                raise
        if failure is not None:
            # The raised error's traceback holds this frame: not the client's
            # objects (its error, its answer, its frames hold the thread's
            # session and pooled socket, which a kept error kept open after
            # the thread retired).
            frames = response = quoted = None
            # (The cause is the answer's TelegramError, if one was made: never the
            # client's error, which holds the request.)
            raise failure from failure.__cause__
        message_id = result.get("message_id") if isinstance(result, Mapping) else None
        return SendResult(message_id=message_id, raw={"ok": True, "result": result})

    def _call(self, request: SendRequest, method: str, allowed: float) -> object:
        """Make the Bot API call of ``request``; its ``result``. Raises pyTelegramBotAPI's
        and requests' errors."""
        message = request.message
        if isinstance(message, TextMessage):
            sent = self._bot.send_message(
                request.chat_id,
                message.text,
                parse_mode=message.parse_mode,
                disable_notification=message.disable_notification or None,
                timeout=cast(int, allowed),  # typed int by telebot; requests takes a float
            )
            # (None: the answer's "result" was null; the call succeeded)
            result: object = sent.json if sent is not None else None
        else:
            params = {**message.params, "chat_id": request.chat_id}
            result = _make_request()(
                self._bot.token,
                method,
                method="post",
                params={**_encode(params), "timeout": allowed},
            )
        return result


class _Redirected(Exception):
    """A redirect answered to a request of a send (see :class:`_RefusingSession`)."""

    def __init__(self, status: int, location: str) -> None:
        super().__init__(f"HTTP {status}: a redirect, not followed")
        self.status = status
        self.location = location


class _RefusingSession:
    """The ``requests`` session pyTelegramBotAPI takes in the sending thread during
    a send (:func:`_no_redirects`): the thread's own, each request made with
    ``allow_redirects=False``, a redirect answered raised as :class:`_Redirected`
    (its body unread). requests follows a 301, 302 or 303 as a GET without the
    parameters (the message dropped, and the other server's ``"ok": true``
    taken for the send's), and a 307 or 308 with the token in the URL, to
    wherever the ``Location`` says. The session itself is not changed."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        kwargs["allow_redirects"] = False
        response: requests.Response = self._session.request(method, url, **kwargs)
        if 300 <= response.status_code < 400 and "location" in response.headers:
            location = str(response.headers.get("location") or "")
            response.close()
            raise _Redirected(response.status_code, location)
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


@contextlib.contextmanager
def _no_redirects() -> Iterator[None]:
    """A block in which pyTelegramBotAPI's requests from this thread follow no
    redirect: the thread's session (pyTelegramBotAPI's, or the application's
    ``apihelper.session``) stands behind a :class:`_RefusingSession` for the
    block, in this thread only. With ``apihelper.SESSION_TIME_TO_LIVE = 0``
    (a new session for each request) or a ``CUSTOM_REQUEST_SENDER``, requests
    go out as pyTelegramBotAPI makes them."""
    if apihelper.SESSION_TIME_TO_LIVE == 0:
        yield
        return
    session = apihelper._get_req_session()  # type: ignore[no-untyped-call]
    local = telebot_util.thread_local
    if getattr(local, "req_session", None) is not session:
        yield
        return
    refusing = _RefusingSession(session)
    # With a SESSION_TIME_TO_LIVE, the session is not renewed within the block
    # (a renewed one, its expiry falling in the send, followed redirects): its
    # time is set a day ahead for the block, then put back.
    made = getattr(local, "req_session_time", None)
    if apihelper.SESSION_TIME_TO_LIVE and made is not None:
        local.req_session_time = _dt.datetime.now() + _dt.timedelta(days=1)
    local.req_session = refusing
    try:
        yield
    finally:
        if getattr(local, "req_session", None) is refusing:  # (not one made anew within)
            local.req_session = session
        if made is not None:
            local.req_session_time = made


#: The request's path quoted with its query: ``/bot<token>/sendMessage?chat_id=1&text=...``
#: (``/test/`` between, any part percent-encoded, the token masked or not, or
#: only its secret part). The Bot API's path only, ``bot`` then the token or a
#: bot id's digits: a description may quote a URL of the text's own,
#: ``t.me/botanicbot/shop?startapp=1``.
_QUERY: Final = re.compile(r"((?:/|%2[Ff])bot(?:<token>|\d)[^\s?#]*?)(?:\?|%3[Ff]).*", re.DOTALL)


#: Masks the tokens of the senders made in the records of the loggers below
#: (urllib3's ``connectionpool`` logs each request's URL at DEBUG, the token in
#: its path); above DEBUG a quoted request path's query, the message's text,
#: is cut too (urllib3's "Failed to parse headers (url=...)").
_URL_LOG_MASK: Final = TokenFilter(cut=_QUERY)
# (A filter applies to its own logger's records only, not to its children's.)
# (TeleBot: pyTelegramBotAPI's own, which logs each answer's body at DEBUG, a
# proxy's page quoting the request's path, the token in it. urllib3.connection:
# "Failed to parse headers (url=...)" at WARNING.)
for _name in (
    "urllib3.connectionpool",
    "urllib3.connection",
    "urllib3.util.retry",
    "urllib3.poolmanager",
    "TeleBot",
):
    logging.getLogger(_name).addFilter(_URL_LOG_MASK)


def _fresh_session_after_fork() -> None:
    """In a forked child: give the forking thread a new requests session.

    pyTelegramBotAPI keeps one ``requests.Session`` per thread, with its
    keep-alive connections; the forking thread's went to the child as it
    was, sockets shared with the parent: the two would read each other's
    answers. The parent's session is left alone (closing it here would
    close nothing of the parent's, but is not needed). A session the
    application set (``apihelper.session``) is its own to handle.
    """
    if apihelper.session is None and hasattr(telebot_util.thread_local, "req_session"):
        apihelper._get_req_session(reset=True)  # type: ignore[no-untyped-call]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_session_after_fork)


def _failure(exc: BaseException) -> str:
    """What failed in a request, without its text (see :meth:`TeleBotSender.send`): the
    types of the error and of what it wraps, and the system's reason if there is one
    ("Connection refused")."""
    errors = list(itertools.islice(wrapped(exc, reasons=True), 6))
    reason = next(
        (e.strerror for e in errors if isinstance(e, OSError) and isinstance(e.strerror, str)),
        "",
    )
    described = " <- ".join(dict.fromkeys(type(e).__name__ for e in errors))
    return f"{described}: {reason}" if reason else described


def _check_no_retry() -> None:
    if apihelper.RETRY_ON_ERROR:
        raise ValueError(
            "telebot.apihelper.RETRY_ON_ERROR is set: pyTelegramBotAPI would sleep and retry "
            "inside the sending thread. Unset it and retry with outbound.middleware.retry()"
        )


def _make_request() -> Callable[..., Any]:
    """pyTelegramBotAPI's raw Bot API call (untyped: cast here once)."""
    return cast(Callable[..., Any], apihelper._make_request)


def _encode(params: Mapping[str, Any]) -> dict[str, Any]:
    """Bot API parameters as query values: objects and arrays as JSON, booleans lowercase."""
    encoded: dict[str, Any] = {}
    for name, value in params.items():
        if value is None:
            continue
        if isinstance(value, bool):
            encoded[name] = "true" if value else "false"
        elif isinstance(value, (Mapping, list, tuple)):
            encoded[name] = json.dumps(value, separators=(",", ":"), allow_nan=False)
        else:
            encoded[name] = value
    return encoded


_RETRY_AFTER_TEXT = re.compile(r"retry after (\d+(?:\.\d+)?)", re.IGNORECASE)


def _retry_after(parameters: Mapping[str, Any], header: object, description: str = "") -> float:
    match = _RETRY_AFTER_TEXT.search(description)
    for value in (parameters.get("retry_after"), header, match.group(1) if match else None):
        seconds = parse_retry_after(value)
        if seconds is not None:
            return seconds
    return 1.0


def _telebot_frames(tb: TracebackType | None) -> list[FrameType] | None:
    """The frames of an error raised inside pyTelegramBotAPI's own code, else None."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    # (The innermost may be json's or requests', called by pyTelegramBotAPI.)
    if not any(str(f.f_globals.get("__name__", "")).startswith("telebot") for f in frames):
        return None
    return frames


#: Modules of the HTTP transport under pyTelegramBotAPI.
_TRANSPORT: Final = ("requests", "urllib3", "urllib", "http", "idna", "encodings")


def _in_transport(frames: list[FrameType]) -> bool:
    """Whether an error rose from the HTTP transport pyTelegramBotAPI called (a frame
    of it below pyTelegramBotAPI's last), not from pyTelegramBotAPI's own code."""
    names = [str(f.f_globals.get("__name__", "")) for f in frames]
    last = max(i for i, name in enumerate(names) if name.startswith("telebot"))
    return any(name.split(".")[0] in _TRANSPORT for name in names[last + 1 :])


def _unread_answer(frames: list[FrameType]) -> requests.Response | None:
    """The HTTP answer pyTelegramBotAPI failed to read.

    Its ``_check_result`` and ``ApiTelegramException`` index the decoded body
    without checking it; the answer is the ``result`` they were given.
    """
    for frame in reversed(frames):
        result = frame.f_locals.get("result")
        if isinstance(result, requests.Response):
            return result
    return None


def _rate_limited(
    method: str, payload: Mapping[str, Any], header: object, description: str
) -> RateLimited:
    """A 429 answer as :class:`RateLimited`: its wait and, if the answer states it, scope.
    The wait is read from ``description`` as the error says it: a quoted path cut
    from its query on (its text, which a "retry after N" in it would set)."""
    raw = payload.get("parameters")
    parameters: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    stated = parameters.get("scope") in ("global", "chat", "group")
    scope: Literal["chat", "global"] = "global" if parameters.get("scope") == "global" else "chat"
    seconds = _retry_after(parameters, header, description)
    return RateLimited(seconds, scope, f"{method}: {description}", stated=stated)


def _succeeded(response: requests.Response) -> bool:
    """True for a 200 whose JSON object says ``"ok": true``: the call was made."""
    return int(response.status_code) == 200 and _payload(response).get("ok") is True


def _payload(response: requests.Response) -> Mapping[str, Any]:
    """The answer's JSON object; empty if it is not one."""
    try:
        decoded = response.json()
    except (ValueError, RecursionError):  # (nested too deep to decode)
        return {}
    return decoded if isinstance(decoded, Mapping) else {}


def _answer_error(method: str, response: requests.Response, mask: TokenMask) -> Exception:
    """The send error for an answer that is not a well-formed Bot API answer."""
    status = int(response.status_code)
    payload = _payload(response)
    said = payload.get("description")
    description = _described(said, mask) if isinstance(said, str) else f"HTTP {status}"
    logger.debug("telebot: %s answered %d with an unreadable body", method, status)
    failure: Exception
    if status == 429:
        failure = _rate_limited(method, payload, response.headers.get("Retry-After"), description)
    elif status >= 500 or status in (200, 408):
        failure = TransientSendError(f"{method}: HTTP {status}: not a Bot API answer")
    else:
        failure = PermanentSendError(f"{method}: HTTP {status}: {description}")
    return _caused(failure, status, description, payload)


def _api_error(method: str, exc: apihelper.ApiTelegramException, mask: TokenMask) -> Exception:
    """The send error for a Bot API answer that says ``"ok": false``: by its
    ``error_code`` or its HTTP status, whichever says more (a gateway's 503
    may carry a code of its own: tried again, not dropped)."""
    payload = exc.result_json if isinstance(exc.result_json, Mapping) else {}
    status = int(exc.result.status_code)
    try:
        code = int(exc.error_code)
    except (TypeError, ValueError, OverflowError):  # (OverflowError: 1e400 reads as inf)
        code = status
    description = _described(str(exc.description), mask)
    logger.debug("telebot: %s answered HTTP %d, error %d: %s", method, status, code, description)
    failure: Exception
    if 429 in (code, status):
        failure = _rate_limited(method, payload, exc.result.headers.get("Retry-After"), description)
    elif code >= 500 or status >= 500 or 408 in (code, status):
        failure = TransientSendError(f"{method}: error {code}: {description}")
    else:
        failure = PermanentSendError(f"{method}: error {code}: {description}")
    return _caused(failure, status, description, payload)


def _caused(
    failure: Exception, status: int, description: str, payload: Mapping[str, Any]
) -> Exception:
    """``failure`` with the answer's :class:`~outbound.telegram.TelegramError` for
    its cause, as :class:`~outbound.telegram.TelegramSender` raises it: its HTTP
    status, ``description`` (as the error's text has it: the token masked, a
    quoted query cut) and the numbers of its ``parameters``
    (``migrate_to_chat_id``, ``retry_after``) with a ``scope`` it states; not
    the decoded body, nor any other text of it, which may quote the request
    (its URL holds the token and the text)."""
    raw = payload.get("parameters")
    parameters: dict[str, Any] = {}
    if isinstance(raw, Mapping):
        for name, value in raw.items():
            if not isinstance(name, str):
                continue
            if isinstance(value, (int, float)) or (
                name == "scope" and value in ("chat", "global", "group")
            ):
                parameters[name] = value
    failure.__cause__ = TelegramError(status, description, parameters)
    return failure


def _described(description: str, mask: TokenMask) -> str:
    """An answer's description for an error's text: the token masked, and from the
    query of a path it quotes on, cut (a proxy's "Not Found:
    /bot<token>/sendMessage?...": pyTelegramBotAPI sends the parameters, the text
    too, in the URL's query, which may be quoted decoded, its spaces too). Pure."""
    return _QUERY.sub(r"\1?...", mask.text(description))


def _http_error(method: str, exc: apihelper.ApiHTTPException) -> Exception:
    status = int(exc.result.status_code)
    if status == 429:
        seconds = _retry_after({}, exc.result.headers.get("Retry-After"))
        return RateLimited(seconds, "chat", f"{method}: HTTP 429", stated=False)
    # A 1xx is an interim answer ("103 Early Hints") requests took for the
    # answer: the call may have been made, or not; tried again (at least once).
    if status >= 500 or status == 408 or status < 200:
        return TransientSendError(f"{method}: HTTP {status}")
    return PermanentSendError(f"{method}: HTTP {status}")
