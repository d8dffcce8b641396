"""A stand-in chat platform on loopback: :class:`PlatformSimulator`.

A real HTTP server (stdlib ``http.server``) that answers like the
Telegram Bot API and, in a small way, like Slack's Web API, so that tests,
the demo and the benchmarks can send over real sockets without a network.

Telegram shape: ``POST`` (or ``GET``) ``/bot<token>/<method>`` with a JSON,
form or query body.

- ``sendMessage`` needs ``chat_id`` and a non-empty ``text`` of at most
  ``max_text_length`` characters; any other method with a ``chat_id`` is
  accepted as is; ``getMe`` answers the bot; other methods without a chat
  answer ``true``.
- Success: ``{"ok": true, "result": {"message_id": N, "chat": {"id": ...}, ...}}``
  (message ids count from 1 per chat).
- Rate limited: HTTP 429 ``{"ok": false, "error_code": 429, "description":
  "Too Many Requests: retry after X", "parameters": {"retry_after": X,
  "scope": S}}``. ``scope`` is an extension real Telegram does not send:
  ``"global"`` (the bot's overall limit), ``"chat"`` or ``"group"``.
  :class:`~outbound.telegram.TelegramSender` maps ``"global"`` to
  ``RateLimited(scope="global")`` and anything else, or nothing, to
  ``"chat"``. With ``real_429s`` the answer is real Telegram's: no
  ``scope``, ``retry_after`` in whole seconds.
- Bad request: HTTP 400 ``{"ok": false, "error_code": 400, "description":
  "Bad Request: ..."}``; a wrong token: HTTP 401.

Slack shape: ``POST /api/chat.postMessage`` with ``channel`` and ``text``
(or ``blocks``/``attachments``), the token as ``Authorization: Bearer``.
Success ``{"ok": true, "channel": ..., "ts": ...}``; errors HTTP 200
``{"ok": false, "error": "..."}``; rate limited HTTP 429 with a
``Retry-After`` header (whole seconds, as Slack) and the precise delay and
scope in the body (with ``real_429s``, real Slack's ``{"ok": false,
"error": "ratelimited"}`` and the header only).

Limits are token buckets (see :class:`SimulatorConfig`): a client that
keeps to the configured rate and burst never gets a 429, one that goes
faster does. Faults (5xx, slow answers, dropped connections, scripted
429s) come at random with configured probabilities or from a schedule
given to :meth:`PlatformSimulator.inject`.

Run it from a shell with ``python -m outbound.simulator --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import math
import random
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from types import FrameType, TracebackType
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

from typing_extensions import Self

from outbound._compat import TIMEOUT_MAX, unlimited_past_max
from outbound._http import ConnectionThreadsServer, join_until
from outbound._signal_flag import SignalFlag
from outbound.context import _seconds
from outbound.telegram import check_token

__all__ = [
    "DEFAULT_TOKEN",
    "Fault",
    "PlatformSimulator",
    "SimulatorConfig",
    "SimulatorStats",
    "add_parser",
    "config_from_args",
    "main",
    "run",
]

logger = logging.getLogger("outbound.simulator")

#: The bot token a simulator accepts unless told otherwise.
DEFAULT_TOKEN = "123456:simulator-token"

_MAX_BODY = 1 << 20
_SLACK_MAX_TEXT = 40_000
_NUMERIC = re.compile(r"-?[0-9]{1,30}")  # (a chat id is a 64-bit number: no huge int)
_USERNAME = re.compile(r"@[A-Za-z][A-Za-z0-9_]{3,31}")
_TELEGRAM_PATH = re.compile(r"/bot([^/]+)/([A-Za-z][A-Za-z0-9_.]*)")
_SLACK_PATH = re.compile(r"/api/([A-Za-z][A-Za-z0-9_.]*)")

FaultKind = Literal["error", "slow", "drop", "rate_limit"]
LimitScope = Literal["global", "chat", "group"]
ChatKey = int | str


@dataclass(frozen=True, slots=True)
class Fault:
    """One scripted fault, for :meth:`PlatformSimulator.inject`.

    - ``"error"``: answer HTTP ``status`` (a 5xx) without delivering.
    - ``"slow"``: deliver, then answer after ``delay`` seconds
      (``None``: the config's ``slow_delay``), past a client's timeout.
    - ``"drop"``: close the connection without answering or delivering.
    - ``"rate_limit"``: answer 429 with ``retry_after`` and ``scope``.

    ``chat_id`` restricts the fault to requests for that chat (``None``:
    the next request for any chat).
    """

    kind: FaultKind
    chat_id: int | str | None = None
    status: int = 502
    delay: float | None = None
    retry_after: float = 1.0
    scope: LimitScope = "chat"

    def __post_init__(self) -> None:
        if self.kind not in ("error", "slow", "drop", "rate_limit"):
            raise ValueError(f"unknown fault kind {self.kind!r}")
        _check_status("status", self.status)
        if self.delay is not None:
            _check_seconds("delay", self.delay)
        _check_seconds("retry_after", self.retry_after)
        if self.scope not in ("global", "chat", "group"):
            raise ValueError(f"scope must be 'global', 'chat' or 'group', not {self.scope!r}")


@dataclass(frozen=True, slots=True)
class SimulatorConfig:
    """How a :class:`PlatformSimulator` behaves. Immutable; every limit is optional.

    Limits (``None``: no limit), each a token bucket refilled at its rate
    that holds at most its burst (``None``: one second's worth of the
    rate, at least 1):

    - ``global_rate``/``global_burst``: messages per second for the whole bot.
    - ``chat_rate``/``chat_burst``: messages per second for one chat.
    - ``group_rate``/``group_burst``: messages *per minute* for one group
      (a Telegram chat with a negative id); groups obey ``chat_rate`` too.
    - ``tolerance``: seconds of arrival jitter forgiven: a request is let
      through if its bucket would hold a whole token that much later.
    - ``whole_second_retry_after``: round ``retry_after`` up to whole
      seconds, as real Telegram does (otherwise milliseconds).
    - ``real_429s``: answer 429s exactly in the real platforms' shapes,
      which say nothing of whose limit was hit: Telegram's body without
      ``parameters.scope`` and with ``retry_after`` in whole seconds
      (rounded up); Slack's ``{"ok": false, "error": "ratelimited"}`` with
      only a ``Retry-After`` header (whole seconds).

    Timing and faults (probabilities are per request, in ``[0, 1]``):
    ``latency`` seconds before each answer plus up to ``jitter`` more;
    ``error_rate`` of answers are ``error_status``; ``slow_rate`` are
    delivered but answered after ``slow_delay`` more seconds;
    ``drop_rate`` lose their connection unanswered; ``seed`` makes the
    draws repeatable. ``max_text_length`` bounds Telegram's text;
    ``idle_timeout`` closes a keep-alive connection idle that long.
    """

    global_rate: float | None = None
    global_burst: float | None = None
    chat_rate: float | None = None
    chat_burst: float | None = None
    group_rate: float | None = None
    group_burst: float | None = None
    tolerance: float = 0.02
    whole_second_retry_after: bool = False
    real_429s: bool = False
    latency: float = 0.0
    jitter: float = 0.0
    error_rate: float = 0.0
    error_status: int = 502
    slow_rate: float = 0.0
    slow_delay: float = 5.0
    drop_rate: float = 0.0
    seed: int | None = None
    max_text_length: int = 4096
    idle_timeout: float = 60.0

    def __post_init__(self) -> None:
        for name in ("global_rate", "global_burst", "chat_rate", "chat_burst"):
            _check_positive(name, getattr(self, name))
        _check_positive("group_rate", self.group_rate)
        _check_positive("group_burst", self.group_burst)
        _check_seconds("tolerance", self.tolerance)
        for kind in ("global", "chat", "group"):
            _check_bucket(
                kind, getattr(self, f"{kind}_rate"), getattr(self, f"{kind}_burst"), self.tolerance
            )
        for name in ("tolerance", "latency", "jitter", "slow_delay"):
            _check_seconds(name, getattr(self, name))
        for name in ("error_rate", "slow_rate", "drop_rate"):
            value = getattr(self, name)
            _check_number(name, value)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be a probability in [0, 1], not {value!r}")
        _check_status("error_status", self.error_status)
        for name in ("whole_second_retry_after", "real_429s"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, not {type(getattr(self, name)).__name__}")
        if isinstance(self.max_text_length, bool) or not isinstance(self.max_text_length, int):
            raise TypeError(
                f"max_text_length must be an int, not {type(self.max_text_length).__name__}"
            )
        if self.max_text_length < 1:
            raise ValueError("max_text_length must be >= 1")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise TypeError(f"seed must be an int or None, not {type(self.seed).__name__}")
        _check_number("idle_timeout", self.idle_timeout)
        if not self.idle_timeout > 0:
            raise ValueError("idle_timeout must be > 0")

    @classmethod
    def telegram(cls, **changes: Any) -> SimulatorConfig:
        """Telegram's published limits: 30/s overall, 1/s per chat, 20/min per group.

        Telegram states the group limit as a count per minute, which lets a
        few messages go close together: the group bucket holds 5, as
        :data:`outbound.ratelimit.TELEGRAM`'s group rate allows.
        """
        defaults = {"global_rate": 30.0, "chat_rate": 1.0, "group_rate": 20.0, "group_burst": 5.0}
        return cls(**{**defaults, **changes})

    @classmethod
    def slack(cls, **changes: Any) -> SimulatorConfig:
        """Slack's posting limit: about 1 message per second per channel."""
        return cls(**{"chat_rate": 1.0, **changes})


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")


def _check_seconds(name: str, value: object) -> None:
    """A finite number of seconds >= 0 (a wait, or a number said to a client)."""
    _check_number(name, value)
    assert isinstance(value, (int, float))
    if not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")


def _check_status(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 500 <= value <= 599:
        raise ValueError(f"{name} must be a 5xx status, not {value!r}")


def _check_bucket(kind: str, rate: float | None, burst: float | None, tolerance: float) -> None:
    """A burst of at least one message (below, no request ever found a whole one:
    429s for good), and a rate at which its time is a number (5e-324 a second:
    an infinite wait, and every limited request's answer failed)."""
    if burst is not None and burst < 1:
        raise ValueError(f"{kind}_burst must be >= 1 (one message), not {burst!r}")
    # (The longest wait, one message's time and the tolerance, in milliseconds as a
    # retry_after is rounded; a group's rate is per minute.)
    period = 60.0 if kind == "group" else 1.0
    if rate is not None and not math.isfinite((period / rate + tolerance) * 1000.0):
        raise ValueError(f"{kind}_rate {rate!r} is too small: a message would wait forever")


def _check_positive(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or None, not {type(value).__name__}")
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, not {value!r}")


@dataclass(frozen=True, slots=True)
class SimulatorStats:
    """A snapshot of a simulator's counters since it started (or since ``reset``).

    ``requests`` every request answered or dropped; ``delivered`` messages
    recorded; ``rate_limited`` 429s, split into ``global_limited``,
    ``chat_limited`` and ``group_limited`` (scripted 429s count by their
    scope); ``rejected`` other 4xx and Slack's ``ok: false``;
    ``server_errors`` injected 5xx; ``slow`` slow answers; ``dropped``
    dropped connections; ``connections`` TCP connections accepted;
    ``open_connections`` those open now.
    """

    requests: int = 0
    delivered: int = 0
    rate_limited: int = 0
    global_limited: int = 0
    chat_limited: int = 0
    group_limited: int = 0
    rejected: int = 0
    server_errors: int = 0
    slow: int = 0
    dropped: int = 0
    connections: int = 0
    open_connections: int = 0


class _Bucket:
    """A token bucket. Guarded by the simulator's lock."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def wait(self, now: float, tolerance: float) -> float:
        """Seconds until a whole token is here; 0.0 if it is, within ``tolerance``."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        missing = 1.0 - self.tokens
        if missing <= self.rate * tolerance:
            return 0.0
        return missing / self.rate


@dataclass(slots=True)
class _Reply:
    """What a handler must do with one request, decided under the lock."""

    status: int = 200
    body: Mapping[str, Any] | None = None
    headers: tuple[tuple[str, str], ...] = ()
    delay: float = 0.0
    drop: bool = False


class _BadRequest(Exception):
    pass


def _phrase(status: int) -> str:
    """The reason phrase of ``status``; a generic one for a 5xx ``http`` does not name."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Server Error"


def _chat_key(value: object) -> ChatKey | None:
    """A Telegram chat id as recorded: an int, or an ``@username``; None if invalid."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        value = value.strip()
        if _NUMERIC.fullmatch(value):
            return int(value)
        if _USERNAME.fullmatch(value):
            return value.lower()  # (usernames are case-blind, as on Telegram)
    return None


def _record_key(chat_id: int | str) -> ChatKey:
    if isinstance(chat_id, bool) or not isinstance(chat_id, (int, str)):
        raise TypeError(f"chat_id must be an int or a str, not {type(chat_id).__name__}")
    if isinstance(chat_id, str) and _NUMERIC.fullmatch(chat_id.strip()):
        return int(chat_id)
    if isinstance(chat_id, str) and _USERNAME.fullmatch(chat_id.strip()):
        return chat_id.strip().lower()
    return chat_id


class _State(enum.Enum):
    """Lifecycle of a :class:`PlatformSimulator`; it only moves down this list."""

    #: Built, not listening yet.
    NEW = "new"
    #: Listening and answering on its background threads.
    RUNNING = "running"
    #: Stopped: port closed, threads joined; it cannot start again.
    STOPPED = "stopped"


class PlatformSimulator:
    """A stand-in chat platform over HTTP on loopback.

    ``PlatformSimulator(config, *, host="127.0.0.1", port=0, token=DEFAULT_TOKEN,
    **changes)``: ``changes`` are :class:`SimulatorConfig` fields applied on
    top of ``config``. ``port=0`` takes a free port; ``url`` tells which
    once started. Use as a context manager, or call :meth:`start` and
    :meth:`stop`.

    Every method is thread-safe. :meth:`start` and :meth:`stop` block
    until the server is up or its threads have ended; :meth:`wait_received`
    blocks up to its timeout; the others return at once. Requests are
    served on one thread per connection; the latency and slow faults wait
    on those threads, and :meth:`stop` cuts such waits short.
    """

    def __init__(
        self,
        config: SimulatorConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = DEFAULT_TOKEN,
        **changes: Any,
    ) -> None:
        config = config if config is not None else SimulatorConfig()
        if changes:
            config = dataclasses.replace(config, **changes)
        check_token(token)
        if not isinstance(host, str):
            raise TypeError(f"host must be a str ('': every interface), not {host!r}")
        try:
            host.encode("idna")  # (what the bind does: its error was a bare TypeError)
        except UnicodeError:
            raise ValueError(f"host {host!r} is not a host name or an address") from None
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"port must be an int, not {type(port).__name__}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0: any free port), not {port!r}")
        self._host = host
        self._requested_port = port
        self._token = token

        # Guards every field below up to _stopping. Waiters on _arrived (same
        # lock): wait_received(), woken when a message is recorded.
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._config = config
        self._rng = random.Random(config.seed)
        self._state = _State.NEW
        self._server: _Server | None = None
        self._serve_thread: threading.Thread | None = None
        self._global_bucket: _Bucket | None = None
        self._chat_buckets: dict[ChatKey, _Bucket] = {}
        self._group_buckets: dict[ChatKey, _Bucket] = {}
        # Scripted faults, consumed first-match in order by arriving requests.
        self._faults: deque[Fault] = deque()
        # Delivered messages: per chat and overall, each in arrival order.
        self._by_chat: dict[ChatKey, list[dict[str, Any]]] = {}
        self._all: list[dict[str, Any]] = []
        self._message_ids: dict[ChatKey, int] = {}
        self._slack_seq = 0
        self._counts: dict[str, int] = dict.fromkeys(
            (f.name for f in dataclasses.fields(SimulatorStats) if f.name != "open_connections"),
            0,
        )
        # Set once by stop(): wakes handlers waiting out latency or a slow fault.
        self._stopping = threading.Event()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Bind and serve on a background thread; return self. Idempotent while running.

        Raises ``RuntimeError`` once stopped (a simulator starts once).
        """
        with self._lock:
            if self._state is _State.RUNNING:
                return self
            if self._state is _State.STOPPED:
                raise RuntimeError("a stopped PlatformSimulator cannot be started again")
            server = _Server((self._host, self._requested_port), self)
            self._server = server
            self._state = _State.RUNNING
            thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"outbound-simulator:{server.server_address[1]}",
                daemon=True,
            )
            self._serve_thread = thread
            thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, close every connection and join every thread. Idempotent.

        Blocks up to about ``timeout`` seconds for the threads to end
        (``math.inf``, or past ``threading.TIMEOUT_MAX``: as long as they
        take); the connections and the listening socket are closed
        whatever the wait. A ``timeout`` that is not a number of seconds
        ``>= 0`` raises ``TypeError`` or ``ValueError`` before anything stops.
        """
        deadline = time.monotonic() + _seconds("timeout", timeout)
        with self._lock:
            if self._state is not _State.RUNNING:
                self._state = _State.STOPPED
                return
            self._state = _State.STOPPED
            server, thread = self._server, self._serve_thread
        assert server is not None
        assert thread is not None
        self._stopping.set()
        try:
            server.shutdown()
            join_until(thread, deadline)
            server.close_connections()
            server.join_threads(deadline)
        finally:
            server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        """The base URL, ``http://host:port`` (a Telegram ``base_url``). Needs :meth:`start`."""
        with self._lock:
            server = self._server
        if server is None:
            raise RuntimeError("the simulator has not been started")
        host, port = server.server_address[:2]
        if isinstance(host, bytes):
            host = host.decode()
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"

    @property
    def token(self) -> str:
        """The bot token the simulator accepts."""
        return self._token

    @property
    def config(self) -> SimulatorConfig:
        """The configuration in force."""
        with self._lock:
            return self._config

    def configure(self, **changes: Any) -> SimulatorConfig:
        """Replace configuration fields from now on; the rate limits start afresh."""
        with self._lock:
            self._config = dataclasses.replace(self._config, **changes)
            self._reset_limits_locked()
            return self._config

    # -------------------------------------------------------- faults, records

    def inject(self, *faults: Fault) -> None:
        """Schedule faults: each hits the next request that matches its ``chat_id``."""
        for fault in faults:
            if not isinstance(fault, Fault):
                raise TypeError(f"expected a Fault, not {type(fault).__name__}")
        with self._lock:
            self._faults.extend(faults)

    def received(self, chat_id: int | str) -> list[dict[str, Any]]:
        """Copies of the messages delivered to ``chat_id``, in arrival order.

        Each is a dict: ``platform`` (``"telegram"`` or ``"slack"``),
        ``method``, ``chat_id``, ``message_id``, ``text`` (or None),
        ``params`` (everything the client sent) and ``time`` (monotonic).
        A numeric string and the int name the same chat.
        """
        key = _record_key(chat_id)
        with self._lock:
            return [dict(m) for m in self._by_chat.get(key, ())]

    def all_received(self) -> list[dict[str, Any]]:
        """Copies of every delivered message, in arrival order."""
        with self._lock:
            return [dict(m) for m in self._all]

    def wait_received(
        self, count: int, *, chat_id: int | str | None = None, timeout: float | None
    ) -> bool:
        """Block until ``count`` messages were delivered (to ``chat_id``, or in all).

        Returns False if ``timeout`` seconds pass first (``None``, ``math.inf``,
        or past ``threading.TIMEOUT_MAX``: no limit).
        """
        seconds = math.inf if timeout is None else _seconds("timeout", timeout)
        deadline = time.monotonic() + seconds
        key = None if chat_id is None else _record_key(chat_id)

        def enough() -> bool:
            got = self._all if key is None else self._by_chat.get(key, ())
            return len(got) >= count

        with self._arrived:
            while not enough():
                left = deadline - time.monotonic()
                if not left > 0:
                    return False
                self._arrived.wait(min(left, TIMEOUT_MAX))
            return True

    def stats(self) -> SimulatorStats:
        """A snapshot of the counters."""
        with self._lock:
            counts = dict(self._counts)
            server = self._server if self._state is _State.RUNNING else None
        open_connections = server.open_connections() if server is not None else 0
        return SimulatorStats(**counts, open_connections=open_connections)

    def reset(self) -> None:
        """Forget records, counters, rate-limit state and scheduled faults."""
        with self._lock:
            self._by_chat.clear()
            self._all.clear()
            self._message_ids.clear()
            self._faults.clear()
            for name in self._counts:
                self._counts[name] = 0
            self._reset_limits_locked()

    def __repr__(self) -> str:
        with self._lock:
            state, server = self._state.value, self._server
            delivered = self._counts["delivered"]
        where = f" port={server.server_address[1]}" if server else ""
        return f"<PlatformSimulator {state}{where} delivered={delivered}>"

    # ------------------------------------------------------------- internals

    def _reset_limits_locked(self) -> None:
        self._global_bucket = None
        self._chat_buckets.clear()
        self._group_buckets.clear()

    def _count_connection(self) -> None:
        with self._lock:
            self._counts["connections"] += 1

    def _pick_fault_locked(self, chat: ChatKey | None) -> Fault | None:
        for i, fault in enumerate(self._faults):
            if fault.chat_id is None or _record_key(fault.chat_id) == chat:
                del self._faults[i]
                return fault
        cfg = self._config
        if cfg.drop_rate and self._rng.random() < cfg.drop_rate:
            return Fault("drop")
        if cfg.error_rate and self._rng.random() < cfg.error_rate:
            return Fault("error", status=cfg.error_status)
        if cfg.slow_rate and self._rng.random() < cfg.slow_rate:
            return Fault("slow")
        return None

    def _delay_locked(self, fault: Fault | None) -> float:
        cfg = self._config
        delay = cfg.latency
        if cfg.jitter:
            delay += cfg.jitter * self._rng.random()
        if fault is not None and fault.kind == "slow":
            delay += cfg.slow_delay if fault.delay is None else fault.delay
        return delay

    def _limit_wait_locked(self, chat: ChatKey, *, group: bool) -> tuple[float, LimitScope]:
        """The longest wait any limit asks for (0.0: none), and whose it is."""
        cfg = self._config
        now = time.monotonic()
        waits: list[tuple[float, LimitScope]] = []
        if cfg.global_rate is not None:
            if self._global_bucket is None:
                self._global_bucket = _bucket(cfg.global_rate, cfg.global_burst, now)
            waits.append((self._global_bucket.wait(now, cfg.tolerance), "global"))
        if cfg.chat_rate is not None:
            bucket = self._chat_buckets.get(chat)
            if bucket is None:
                bucket = self._chat_buckets[chat] = _bucket(cfg.chat_rate, cfg.chat_burst, now)
            waits.append((bucket.wait(now, cfg.tolerance), "chat"))
        if group and cfg.group_rate is not None:
            bucket = self._group_buckets.get(chat)
            if bucket is None:
                bucket = _bucket(cfg.group_rate / 60.0, cfg.group_burst, now)
                self._group_buckets[chat] = bucket
            waits.append((bucket.wait(now, cfg.tolerance), "group"))
        wait, scope = max(waits, default=(0.0, "chat"), key=lambda w: w[0])
        return wait, scope

    def _take_tokens_locked(self, chat: ChatKey, *, group: bool) -> None:
        if self._global_bucket is not None:
            self._global_bucket.tokens -= 1.0
        bucket = self._chat_buckets.get(chat)
        if bucket is not None:
            bucket.tokens -= 1.0
        if group:
            bucket = self._group_buckets.get(chat)
            if bucket is not None:
                bucket.tokens -= 1.0

    def _retry_after(self, wait: float) -> float:
        if self._config.whole_second_retry_after:
            return max(1, math.ceil(wait))  # (an int, as Telegram says it)
        return math.ceil(wait * 1000.0) / 1000.0

    def _count_limited_locked(self, scope: LimitScope) -> None:
        self._counts["rate_limited"] += 1
        self._counts[f"{scope}_limited"] += 1

    def _deliver_locked(
        self, platform: str, method: str, chat: ChatKey, text: str | None, params: dict[str, Any]
    ) -> int:
        message_id = self._message_ids.get(chat, 0) + 1
        self._message_ids[chat] = message_id
        record = {
            "platform": platform,
            "method": method,
            "chat_id": chat,
            "message_id": message_id,
            "text": text,
            "params": params,
            "time": time.monotonic(),
        }
        self._by_chat.setdefault(chat, []).append(record)
        self._all.append(record)
        self._counts["delivered"] += 1
        self._arrived.notify_all()
        return message_id

    def _telegram(self, token: str, method: str, params: dict[str, Any]) -> _Reply:
        with self._lock:
            self._counts["requests"] += 1
            if token != self._token:
                self._counts["rejected"] += 1
                return _telegram_error(401, "Unauthorized")
            if method == "getMe":
                return _Reply(
                    body={"ok": True, "result": {"id": 1, "is_bot": True, "username": "sim_bot"}}
                )
            has_chat = "chat_id" in params
            chat = _chat_key(params.get("chat_id"))
            fault = self._pick_fault_locked(chat)
            delay = self._delay_locked(fault)
            if fault is not None and fault.kind == "drop":
                self._counts["dropped"] += 1
                return _Reply(drop=True, delay=delay)
            if fault is not None and fault.kind == "error":
                self._counts["server_errors"] += 1
                reply = _telegram_error(fault.status, _phrase(fault.status))
                reply.delay = delay
                return reply
            if fault is not None and fault.kind == "rate_limit":
                self._count_limited_locked(fault.scope)
                return _telegram_429(fault.retry_after, fault.scope, delay, self._config)
            text = params.get("text")
            problem = None
            if method == "sendMessage" or has_chat:
                if not has_chat or params.get("chat_id") in ("", None):
                    problem = "Bad Request: chat_id is empty"
                elif chat is None:
                    problem = "Bad Request: chat not found"
            if problem is None and method == "sendMessage":
                if not isinstance(text, str) or not text.strip():
                    problem = "Bad Request: message text is empty"
                elif len(text) > self._config.max_text_length:
                    problem = "Bad Request: message is too long"
            if problem is not None:
                self._counts["rejected"] += 1
                reply = _telegram_error(400, problem)
                reply.delay = delay
                return reply
            if chat is None:
                return _Reply(body={"ok": True, "result": True}, delay=delay)
            is_group = isinstance(chat, int) and chat < 0
            wait, scope = self._limit_wait_locked(chat, group=is_group)
            if wait > 0.0:
                self._count_limited_locked(scope)
                return _telegram_429(self._retry_after(wait), scope, delay, self._config)
            self._take_tokens_locked(chat, group=is_group)
            message_id = self._deliver_locked(
                "telegram", method, chat, text if isinstance(text, str) else None, params
            )
            if fault is not None and fault.kind == "slow":
                self._counts["slow"] += 1
            chat_type = "group" if is_group else ("channel" if isinstance(chat, str) else "private")
            result: dict[str, Any] = {
                "message_id": message_id,
                "date": int(time.time()),
                "chat": {"id": chat, "type": chat_type},
            }
            if isinstance(text, str):
                result["text"] = text
            return _Reply(body={"ok": True, "result": result}, delay=delay)

    def _slack(self, auth: str | None, method: str, params: dict[str, Any]) -> _Reply:
        with self._lock:
            self._counts["requests"] += 1
            token = params.get("token")
            if auth is not None and auth.startswith("Bearer "):
                token = auth[len("Bearer ") :]
            if token != self._token:
                self._counts["rejected"] += 1
                return _slack_error("not_authed" if token is None else "invalid_auth")
            if method != "chat.postMessage":
                self._counts["rejected"] += 1
                return _slack_error("unknown_method")
            channel = params.get("channel")
            chat: ChatKey | None = None
            if isinstance(channel, str) and channel.strip():
                chat = _record_key(channel.strip())
            fault = self._pick_fault_locked(chat)
            delay = self._delay_locked(fault)
            if fault is not None and fault.kind == "drop":
                self._counts["dropped"] += 1
                return _Reply(drop=True, delay=delay)
            if fault is not None and fault.kind == "error":
                self._counts["server_errors"] += 1
                return _Reply(fault.status, {"ok": False, "error": "internal_error"}, delay=delay)
            if fault is not None and fault.kind == "rate_limit":
                self._count_limited_locked(fault.scope)
                return _slack_429(fault.retry_after, fault.scope, delay, self._config)
            text = params.get("text")
            has_body = any(params.get(k) for k in ("blocks", "attachments"))
            error = None
            if chat is None:
                error = "channel_not_found"
            elif not has_body and (not isinstance(text, str) or not text.strip()):
                error = "no_text"
            elif isinstance(text, str) and len(text) > _SLACK_MAX_TEXT:
                error = "msg_too_long"
            if error is not None or chat is None:
                self._counts["rejected"] += 1
                reply = _slack_error(error or "channel_not_found")
                reply.delay = delay
                return reply
            wait, scope = self._limit_wait_locked(chat, group=False)
            if wait > 0.0:
                self._count_limited_locked(scope)
                return _slack_429(self._retry_after(wait), scope, delay, self._config)
            self._take_tokens_locked(chat, group=False)
            self._deliver_locked(
                "slack", method, chat, text if isinstance(text, str) else None, params
            )
            if fault is not None and fault.kind == "slow":
                self._counts["slow"] += 1
            self._slack_seq += 1
            ts = f"{int(time.time())}.{self._slack_seq % 1_000_000:06d}"
            body = {
                "ok": True,
                "channel": chat,
                "ts": ts,
                "message": {"type": "message", "text": text, "ts": ts},
            }
            return _Reply(body=body, delay=delay)


def _bucket(rate: float, burst: float | None, now: float) -> _Bucket:
    return _Bucket(rate, burst if burst is not None else max(1.0, rate), now)


def _telegram_error(status: int, description: str) -> _Reply:
    return _Reply(status, {"ok": False, "error_code": status, "description": description})


def _telegram_429(
    retry_after: float, scope: LimitScope, delay: float, config: SimulatorConfig
) -> _Reply:
    if config.real_429s:
        # Real Telegram: whole seconds, no scope, no header.
        seconds = max(1, math.ceil(retry_after))
        real = {
            "ok": False,
            "error_code": 429,
            "description": f"Too Many Requests: retry after {seconds}",
            "parameters": {"retry_after": seconds},
        }
        return _Reply(429, real, delay=delay)
    body = {
        "ok": False,
        "error_code": 429,
        "description": f"Too Many Requests: retry after {retry_after:g}",
        "parameters": {"retry_after": retry_after, "scope": scope},
    }
    return _Reply(429, body, delay=delay)


def _slack_error(error: str) -> _Reply:
    return _Reply(200, {"ok": False, "error": error})


def _slack_429(
    retry_after: float, scope: LimitScope, delay: float, config: SimulatorConfig
) -> _Reply:
    if config.real_429s:
        # Real Slack: the wait in a Retry-After header only, whole seconds.
        header = (("Retry-After", str(max(1, math.ceil(retry_after)))),)
        return _Reply(429, {"ok": False, "error": "ratelimited"}, header, delay=delay)
    body = {"ok": False, "error": "ratelimited", "retry_after": retry_after, "scope": scope}
    headers = (("Retry-After", str(max(1, math.ceil(retry_after)))),)
    return _Reply(429, body, headers, delay=delay)


# ------------------------------------------------------------------ HTTP layer


class _Server(ConnectionThreadsServer):
    """One thread per connection; tracks them so that ``stop`` can end and join them."""

    thread_name = "outbound-simulator-conn"

    def __init__(self, address: tuple[str, int], simulator: PlatformSimulator) -> None:
        self.simulator = simulator
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.simulator._count_connection()
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug(
            "simulator: connection from %s ended with an error", client_address, exc_info=True
        )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server_version = "outbound-simulator"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(unlimited_past_max(self.server.simulator.config.idle_timeout))

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("simulator: " + format, *args)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        sim = self.server.simulator
        parts = urlsplit(self.path)
        telegram = _TELEGRAM_PATH.fullmatch(parts.path)
        slack = _SLACK_PATH.fullmatch(parts.path)
        try:
            params = self._read_params(parts.query)
        except _BadRequest as exc:
            if slack:
                self._answer(_slack_error("invalid_form_data"))
            else:
                self._answer(_telegram_error(400, f"Bad Request: {exc}"))
            return
        if telegram:
            reply = sim._telegram(telegram.group(1), telegram.group(2), params)
        elif slack:
            reply = sim._slack(self.headers.get("Authorization"), slack.group(1), params)
        else:
            reply = _telegram_error(404, "Not Found")
        if reply.delay > 0.0:  # (past TIMEOUT_MAX: until the simulator stops)
            sim._stopping.wait(unlimited_past_max(reply.delay))
        if reply.drop:
            self.close_connection = True
            return
        self._answer(reply)

    def _read_params(self, query: str) -> dict[str, Any]:
        params: dict[str, Any] = dict(parse_qsl(query, keep_blank_values=True))
        length_header = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise _BadRequest("chunked bodies are not supported")
        try:
            length = int(length_header) if length_header else 0
        except ValueError:
            self.close_connection = True
            raise _BadRequest("bad Content-Length") from None
        if not 0 <= length <= _MAX_BODY:
            self.close_connection = True
            raise _BadRequest("request body too large")
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return params
        ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype == "application/json" or (not ctype and raw.lstrip().startswith(b"{")):
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):  # (nested too deep to parse)
                raise _BadRequest("can't parse JSON body") from None
            if not isinstance(body, dict):
                raise _BadRequest("the JSON body must be an object")
            params.update(body)
        elif ctype in ("application/x-www-form-urlencoded", ""):
            try:
                params.update(parse_qsl(raw.decode("utf-8"), keep_blank_values=True))
            except UnicodeDecodeError:
                raise _BadRequest("the form body is not UTF-8") from None
        else:
            raise _BadRequest(f"unsupported Content-Type {ctype!r}")
        return params

    def _answer(self, reply: _Reply) -> None:
        body = json.dumps(reply.body if reply.body is not None else {}).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in reply.headers:
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


# ---------------------------------------------------------------- command line


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    net.add_argument("--port", type=_port, default=0, help="port to bind (default: a free one)")
    net.add_argument("--token", default=DEFAULT_TOKEN, help="bot token (default: %(default)s)")
    lim = parser.add_argument_group("limits (default: none)")
    preset = lim.add_mutually_exclusive_group()
    preset.add_argument(
        "--telegram-limits",
        action="store_true",
        help="Telegram's published limits: 30/s overall, 1/s per chat, 20/min per group",
    )
    preset.add_argument(
        "--slack-limits", action="store_true", help="Slack's limit: 1/s per channel"
    )
    lim.add_argument("--global-rate", type=float, help="messages per second for the whole bot")
    lim.add_argument("--global-burst", type=float, help="burst of the global limit")
    lim.add_argument("--chat-rate", type=float, help="messages per second per chat")
    lim.add_argument("--chat-burst", type=float, help="burst of the per-chat limit")
    lim.add_argument("--group-rate", type=float, help="messages per minute per group")
    lim.add_argument("--group-burst", type=float, help="burst of the per-group limit")
    lim.add_argument("--tolerance", type=float, help="seconds of arrival jitter forgiven")
    lim.add_argument(
        "--whole-seconds",
        action="store_true",
        help="round retry_after up to whole seconds, as real Telegram does",
    )
    lim.add_argument(
        "--real-429s",
        action="store_true",
        help="answer 429s in the real platforms' shapes (no scope, whole seconds)",
    )
    flt = parser.add_argument_group("latency and faults")
    flt.add_argument("--latency", type=float, help="seconds before each answer")
    flt.add_argument("--jitter", type=float, help="up to this many more seconds, at random")
    flt.add_argument("--error-rate", type=float, help="probability of a 5xx answer")
    flt.add_argument("--error-status", type=int, help="the 5xx status to answer (default 502)")
    flt.add_argument("--slow-rate", type=float, help="probability of a slow answer")
    flt.add_argument("--slow-delay", type=float, help="extra seconds of a slow answer")
    flt.add_argument("--drop-rate", type=float, help="probability of a dropped connection")
    flt.add_argument("--seed", type=int, help="seed for the random faults and jitter")
    flt.add_argument("--max-text-length", type=int, help="longest text accepted (default 4096)")


def _port(text: str) -> int:
    digits = text.strip()
    port = int(digits) if digits.isascii() and digits.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, not {text!r}")
    return port


_CONFIG_OPTIONS = (
    "global_rate",
    "global_burst",
    "chat_rate",
    "chat_burst",
    "group_rate",
    "group_burst",
    "tolerance",
    "latency",
    "jitter",
    "error_rate",
    "error_status",
    "slow_rate",
    "slow_delay",
    "drop_rate",
    "seed",
    "max_text_length",
)


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    """The :class:`SimulatorConfig` that parsed command-line options describe."""
    changes: dict[str, Any] = {
        name: getattr(args, name) for name in _CONFIG_OPTIONS if getattr(args, name) is not None
    }
    if args.whole_seconds:
        changes["whole_second_retry_after"] = True
    if args.real_429s:
        changes["real_429s"] = True
    if args.telegram_limits:
        return SimulatorConfig.telegram(**changes)
    if args.slack_limits:
        return SimulatorConfig.slack(**changes)
    return SimulatorConfig(**changes)


def _say(line: str) -> None:
    """Print ``line`` to standard output; once its reader has gone (a script that read
    the URL and closed the pipe), the rest goes nowhere: serving goes on, and its end
    is still the normal one (main thread only)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        from outbound.outbox.cli import quiet_broken_pipe  # noqa: PLC0415

        quiet_broken_pipe()


def run(args: argparse.Namespace) -> int:
    """Run a simulator in the foreground until SIGINT or SIGTERM; return the exit status.

    Prints the base URL as the first line of standard output.
    """
    try:
        config = config_from_args(args)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        simulator = PlatformSimulator(config, host=args.host, port=args.port, token=args.token)
    except (TypeError, ValueError) as exc:  # a bad --token, --host or --port
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # (Not an Event: setting one in a handler that interrupted the wait on it hung.)
    stop = SignalFlag()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, on_signal)
    try:
        try:
            simulator.start()
        except OSError as exc:  # the port is taken, the host is not this machine's, ...
            reason = exc.strerror or str(exc)
            where = f"{args.host}:{args.port}"
            print(f"simulator: cannot listen on {where}: {reason}", file=sys.stderr)
            return 1
        with simulator as sim:
            _say(sim.url)
            _say(f"  telegram: base_url={sim.url} token={sim.token}")
            _say(f"  slack:    {sim.url}/api/chat.postMessage")
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
            s = sim.stats()
        _say(
            f"stopped: {s.requests} requests, {s.delivered} delivered, "
            f"{s.rate_limited} rate limited, {s.server_errors + s.dropped + s.slow} faults"
        )
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop.close()
    return 0


def _describe() -> str:
    return (
        "Run a stand-in chat platform (Telegram Bot API and Slack chat.postMessage) "
        "on a local port, with optional rate limits, latency and faults."
    )


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``simulator`` command to ``subparsers``; its ``func`` default is :func:`run`."""
    parser = subparsers.add_parser(
        "simulator", help="run the stand-in chat platform", description=_describe()
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python -m outbound.simulator [options]``."""
    parser = argparse.ArgumentParser(prog="python -m outbound.simulator", description=_describe())
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
