"""Flask integration: :class:`FlaskOutbound` (also exported as ``Outbound``), extra ``flask``.

::

    from flask import Flask, request
    from outbound.contrib.flask import Outbound

    outbound = Outbound()

    def create_app():
        app = Flask(__name__)
        app.config["OUTBOUND_TELEGRAM_TOKEN"] = "123456:ABC..."
        outbound.init_app(app)

        @app.post("/hook")
        def hook():
            update = request.get_json()
            outbound.reply_text(update["chat_id"], "got it")   # a Future, at once
            return {"ok": True}

        return app

State lives in ``app.extensions["outbound"]``, so one extension object
serves several apps in one process (the app-factory pattern), each with
its own configuration and its own :class:`~outbound.Dispatcher`.

Configuration (read once, in :meth:`FlaskOutbound.init_app`; a bad value or
an unknown ``OUTBOUND_*`` key raises ``ValueError`` or ``TypeError`` there):

- ``OUTBOUND_PLATFORM`` (``"telegram"``): the platform of the default sender.
- ``OUTBOUND_TELEGRAM_TOKEN`` (``None``): the bot token; replies through the
  default sender need it (without it they fail, inside their future, with
  a ``ValueError`` that says so); an app that only uses the outbox, or
  passes a ``sender_factory``, does not.
- ``OUTBOUND_TELEGRAM_URL`` (``"https://api.telegram.org"``): the Bot API
  root; a stand-in platform's URL in tests.
- ``OUTBOUND_RATE_LIMITS`` (``"telegram"``): ``"telegram"``, ``"slack"``,
  ``"none"``, an :class:`~outbound.ratelimit.RateLimits` or ``None``; per
  process, so divide it by the number of workers if they share a bot.
- ``OUTBOUND_MAX_ATTEMPTS`` (``5``): sends tried per message (retry).
- ``OUTBOUND_MAX_INFLIGHT`` (``32``): sends running at once, per process.
- ``OUTBOUND_QUEUE_SIZE`` (``64``): messages waiting per chat before
  ``QueueFull``.
- ``OUTBOUND_SEND_TIMEOUT`` (``30.0``): seconds one send may take.
- ``OUTBOUND_SHUTDOWN_TIMEOUT`` (``10.0``): seconds queued sends get at
  interpreter exit (``None``: as long as they take).
- ``OUTBOUND_OUTBOX_TABLE`` (``"outbox"``): the table of
  :meth:`FlaskOutbound.enqueue`, which writes in Flask-SQLAlchemy's
  transaction (extra ``flask-sqlalchemy``: ``pip install
  'outbound-dispatcher[flask-sqlalchemy]'``).
- ``OUTBOUND_OUTBOX_MAX_PENDING`` (``None``): unfinished outbox rows before
  ``OutboxFull``.
- ``OUTBOUND_HANDLERS`` (``None``): outbox type -> the handler that
  delivers a row of that type (a callable, or a ``"module:function"`` or
  ``"module.function"`` path), for ``flask outbound worker``.

``flask --app APP outbound worker`` runs a relay on the app's outbox until
SIGTERM or Ctrl-C, as Django's ``manage.py outbound_worker`` does, with the
same options (``--batch-size``, ``--max-inflight``, ``--max-concurrency``,
``--poll-interval``, ``--lease``, ``--drain-timeout``, ``--name``): each
handler gets one :class:`~outbound.outbox.OutboxMessage` under the app's
context; returning marks the row sent, raising retries it later (dead
after the relay's attempts, or at once for ``PermanentSendError``). One
line on standard error per failed delivery (unless logging is configured
for ``outbound``). On a signal it stops claiming and lets the claimed rows
finish within ``--drain-timeout`` seconds (default 30), then exits (status
1 if rows were left to their lease, which another worker delivers).

The default sender is :class:`~outbound.telegram.TelegramSender` behind the
``retry``, ``rate_limit`` and ``timeout`` middleware;
``FlaskOutbound(sender_factory=f)`` replaces it with ``f(app)``.

Threads and processes. Nothing starts a thread at import or in
``init_app``: each app builds its dispatcher and sender on first use, once
per process, so a pre-fork server that imported the app in its master
(``gunicorn --preload``) gives every worker its own, and the master none.
A worker never inherits the master's queued messages.

- gunicorn: ``--preload`` is safe. ``post_fork`` needs nothing (the pid is
  checked on every use); in ``worker_exit`` call :func:`shutdown_all` with
  a timeout below ``graceful_timeout``, so that what the worker accepted
  is sent before the master's SIGKILL. With the ``gthread`` worker,
  ``--threads`` request threads share the process's dispatcher.
- uWSGI: ``enable-threads = true`` (or the dispatcher's threads never run),
  and ``lazy-apps = true`` to load the app in each worker; without it,
  ``py-call-osafterfork = true`` runs Python's fork hooks. uWSGI may skip
  Python's exit hooks: set ``uwsgi.atexit`` to call :func:`shutdown_all`.
- Interpreter exit: each dispatcher gets ``OUTBOUND_SHUTDOWN_TIMEOUT``
  seconds to finish (registered like ``concurrent.futures``). What must
  survive a crash or a SIGKILL belongs in the outbox
  (:meth:`FlaskOutbound.enqueue`), delivered by a relay in its own process.

Per-chat order holds within one process. Under several workers, two
updates of one chat may reach two workers; when their replies must keep
their order, enqueue them in the outbox (one relay sends each key in
order) or wait on the reply's future before answering the platform.

Code that needs the app in a worker thread runs under ``app.app_context()``
pushed in that thread (:meth:`FlaskOutbound.submit`,
:meth:`FlaskOutbound.with_app_context`), never under a copy of the request
that submitted it: the request is over by then.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import importlib
import importlib.util
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Protocol, TypeVar

from typing_extensions import ParamSpec

try:
    import click
    from flask import Flask, current_app, has_app_context
    from flask import globals as _flask_globals
    from flask.cli import AppGroup
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "outbound.contrib.flask needs Flask: pip install 'outbound-dispatcher[flask]'"
    ) from exc

from outbound import middleware
from outbound._exit import forget as forget_at_exit
from outbound._future import failed_future
from outbound.dispatcher import Dispatcher
from outbound.errors import DispatcherClosed, OutboxError
from outbound.hooks import Hooks
from outbound.messages import ChatId, Message, Sender, SendResult
from outbound.outbox import EventBus, PostgresStore, Relay, RelayState, SQLiteStore, Store
from outbound.outbox._base import check_max_pending, check_seconds, check_table
from outbound.outbox.relay import check_option
from outbound.ratelimit import SLACK, TELEGRAM, RateLimits
from outbound.reply import Outbound as _ReplyOutbound
from outbound.retry import shown_number
from outbound.telegram import TelegramSender, check_base_url, check_token

__all__ = ["CONFIG_DEFAULTS", "FlaskOutbound", "Outbound", "SenderFactory", "shutdown_all"]

logger = logging.getLogger("outbound.contrib.flask")

P = ParamSpec("P")
T = TypeVar("T")

#: Builds the sender of an app in a process: ``sender_factory(app) -> Sender``.
SenderFactory = Callable[[Flask], Sender]

#: Every configuration key the extension reads, with its default.
CONFIG_DEFAULTS: Final[Mapping[str, object]] = MappingProxyType(
    {
        "OUTBOUND_PLATFORM": "telegram",
        "OUTBOUND_TELEGRAM_TOKEN": None,
        "OUTBOUND_TELEGRAM_URL": "https://api.telegram.org",
        "OUTBOUND_RATE_LIMITS": "telegram",
        "OUTBOUND_MAX_ATTEMPTS": 5,
        "OUTBOUND_MAX_INFLIGHT": 32,
        "OUTBOUND_QUEUE_SIZE": 64,
        "OUTBOUND_SEND_TIMEOUT": 30.0,
        "OUTBOUND_SHUTDOWN_TIMEOUT": 10.0,
        "OUTBOUND_OUTBOX_TABLE": "outbox",
        "OUTBOUND_OUTBOX_MAX_PENDING": None,
        "OUTBOUND_HANDLERS": None,
    }
)

_PLATFORMS: Final = ("telegram",)
_RATE_PRESETS: Final[Mapping[str, RateLimits | None]] = MappingProxyType(
    {"telegram": TELEGRAM, "slack": SLACK, "none": None}
)

# Flask's application and request contexts, kept out of the contexts that
# worker threads run in (see _clean_context).
_FLASK_VARS: Final[frozenset[contextvars.ContextVar[Any]]] = frozenset(
    var
    for var in (
        getattr(_flask_globals, "_cv_app", None),
        getattr(_flask_globals, "_cv_request", None),
    )
    if isinstance(var, contextvars.ContextVar)
)


# ------------------------------------------------------------------ settings


@dataclass(frozen=True, slots=True)
class _Settings:
    """One app's ``OUTBOUND_*`` configuration, checked. Immutable."""

    platform: str
    telegram_token: str | None
    telegram_url: str
    rate_limits: RateLimits | None
    max_attempts: int
    max_inflight: int
    queue_size: int
    send_timeout: float
    shutdown_timeout: float | None
    outbox_table: str
    outbox_max_pending: int | None
    handlers: tuple[tuple[str, Callable[..., object] | str], ...] = ()


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be an int, not {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{key} must be >= 1, not {value!r}")
    return value


def _seconds(config: Mapping[str, Any], key: str, *, allow_inf: bool = False) -> float:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{key} must be a number of seconds, not {type(value).__name__} {value!r}")
    huge = isinstance(value, int) and value.bit_length() > 1000  # past a float
    if huge and allow_inf and value > 0:
        return math.inf
    if huge or not (value > 0 and (allow_inf or math.isfinite(value))):
        raise ValueError(f"{key} must be a finite number of seconds > 0, not {shown_number(value)}")
    return float(value)


def _read_settings(config: Mapping[str, Any]) -> _Settings:
    """Check the ``OUTBOUND_*`` keys of ``config`` (defaults already set)."""
    unknown = sorted(k for k in config if k.startswith("OUTBOUND_") and k not in CONFIG_DEFAULTS)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, CONFIG_DEFAULTS, n=1)
            hints.append(f"{key} (did you mean {close[0]}?)" if close else key)
        raise ValueError(
            f"unknown outbound config key(s): {', '.join(hints)}; "
            f"known keys: {', '.join(CONFIG_DEFAULTS)}"
        )

    platform = config["OUTBOUND_PLATFORM"]
    if platform not in _PLATFORMS:
        raise ValueError(
            f"OUTBOUND_PLATFORM must be one of {', '.join(map(repr, _PLATFORMS))}, "
            f"not {platform!r}; for another platform pass sender_factory="
        )

    # No token is fine for an app that only uses the outbox or passes its
    # own sender_factory; the default sender asks for it when first built.
    token = config["OUTBOUND_TELEGRAM_TOKEN"]
    if token is not None:
        check_token(token, "OUTBOUND_TELEGRAM_TOKEN")

    url = config["OUTBOUND_TELEGRAM_URL"]
    check_base_url(url, "OUTBOUND_TELEGRAM_URL")

    limits = config["OUTBOUND_RATE_LIMITS"]
    if isinstance(limits, str):
        if limits.lower() not in _RATE_PRESETS:
            raise ValueError(
                f"OUTBOUND_RATE_LIMITS must be one of {', '.join(map(repr, _RATE_PRESETS))}, "
                f"a RateLimits or None, not {limits!r}"
            )
        limits = _RATE_PRESETS[limits.lower()]
    elif limits is not None and not isinstance(limits, RateLimits):
        raise TypeError(
            "OUTBOUND_RATE_LIMITS must be a preset name, an outbound.ratelimit.RateLimits "
            f"or None, not {type(limits).__name__}"
        )

    shutdown_timeout: float | None = None
    if config["OUTBOUND_SHUTDOWN_TIMEOUT"] is not None:
        shutdown_timeout = _seconds(config, "OUTBOUND_SHUTDOWN_TIMEOUT")

    try:
        table = check_table(config["OUTBOUND_OUTBOX_TABLE"])
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"OUTBOUND_OUTBOX_TABLE: {exc}") from None
    try:
        max_pending = check_max_pending(config["OUTBOUND_OUTBOX_MAX_PENDING"])
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"OUTBOUND_OUTBOX_MAX_PENDING: {exc}") from None

    handlers = config["OUTBOUND_HANDLERS"]
    if handlers is None:
        handlers = {}
    if not isinstance(handlers, Mapping):
        raise TypeError(
            "OUTBOUND_HANDLERS must be a dict of outbox type -> handler, "
            f"not {type(handlers).__name__}"
        )
    for type_, handler in handlers.items():
        if not isinstance(type_, str) or not type_:
            raise TypeError(f"OUTBOUND_HANDLERS: an outbox type must be a non-empty str: {type_!r}")
        if not callable(handler) and not (isinstance(handler, str) and handler.strip()):
            raise TypeError(
                f"OUTBOUND_HANDLERS[{type_!r}] must be a callable or a 'module:function' path, "
                f"not {type(handler).__name__} {handler!r}"
            )
        if isinstance(handler, str) and _split_path(handler) is None:
            # Imported by the worker only: the module may import the app.
            raise ValueError(
                f"OUTBOUND_HANDLERS[{type_!r}] must be a 'module:function' or "
                f"'module.function' path of Python names, not {handler!r}"
            )

    return _Settings(
        platform=platform,
        telegram_token=token,
        telegram_url=url,
        rate_limits=limits,
        max_attempts=_int(config, "OUTBOUND_MAX_ATTEMPTS"),
        max_inflight=_int(config, "OUTBOUND_MAX_INFLIGHT"),
        queue_size=_int(config, "OUTBOUND_QUEUE_SIZE"),
        send_timeout=_seconds(config, "OUTBOUND_SEND_TIMEOUT", allow_inf=True),
        shutdown_timeout=shutdown_timeout,
        outbox_table=table,
        outbox_max_pending=max_pending,
        handlers=tuple(handlers.items()),
    )


def _default_sender(settings: _Settings) -> Sender:
    """Telegram behind retry → rate limit → timeout; ``ValueError`` without a token."""
    if settings.telegram_token is None:
        raise ValueError(
            "OUTBOUND_TELEGRAM_TOKEN is not set: replies need the bot's token, or a "
            "sender_factory= on the extension (the outbox works without either)"
        )
    platform = TelegramSender(settings.telegram_token, base_url=settings.telegram_url)
    decorators: list[middleware.SenderDecorator] = [
        middleware.retry(max_attempts=settings.max_attempts)
    ]
    if settings.rate_limits is not None:
        decorators.append(middleware.rate_limit(settings.rate_limits))
    decorators.append(middleware.timeout())
    return middleware.chain(*decorators)(platform)


# ------------------------------------------------------------- app contexts


def _clean_context() -> contextvars.Context:
    """A copy of the current ``contextvars`` context without Flask's app and request.

    Work submitted from a request keeps the caller's other context
    variables (tracing ids and the like) but not the request, which is
    over by the time a worker runs it.
    """
    current = contextvars.copy_context()
    if not any(var in current for var in _FLASK_VARS):
        return current
    clean = contextvars.Context()
    clean.run(_set_vars, [(var, value) for var, value in current.items() if var not in _FLASK_VARS])
    return clean


def _set_vars(items: list[tuple[contextvars.ContextVar[Any], Any]]) -> None:
    for var, value in items:
        var.set(value)


def _call_in_app_context(app: Flask, call: Callable[[], T]) -> T:
    with app.app_context():
        return call()


def _failed(error: BaseException) -> Future[SendResult]:
    failed: Future[SendResult] = failed_future(error)
    return failed


def _close_quietly(obj: object) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            logger.exception("outbound: error while closing %r", obj)


# ------------------------------------------------------------- per-app state


class _Session(Protocol):
    """What :meth:`FlaskOutbound.enqueue` needs of a SQLAlchemy session."""

    def connection(self) -> Any: ...

    def get_bind(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class _Runtime:
    """What one app runs in one process; replaced, never changed. ``sender`` and
    ``outbound`` are None until the first reply (submit needs no sender)."""

    pid: int
    dispatcher: Dispatcher
    outbound: _ReplyOutbound | None
    sender: Sender | None


class _AppState:
    """One app's extension state: its settings, and what it runs in this process.

    Thread-safe. Stored in ``app.extensions["outbound"]``.
    """

    def __init__(self, ext: FlaskOutbound, app: Flask, settings: _Settings) -> None:
        self.ext: Final = ext
        self.settings: Final = settings
        self.app_name: Final = app.name
        # (Weak: a state holds its app alive no longer than the app's users do.)
        self._app: Final = weakref.ref(app)
        self._new_lock()
        # guarded: the dispatcher and sender of the process _runtime.pid;
        # one of another pid is a forked parent's, never used here.
        self._runtime: _Runtime | None = None
        # guarded: True once shutdown() ran; no dispatcher is built after.
        self._closed = False
        # guarded: outbox stores by engine URL, built in the process _stores_pid.
        self._stores: dict[str, Store] = {}
        self._stores_pid = os.getpid()

    def _new_lock(self) -> None:
        # Guards the fields marked "guarded"; held for bookkeeping only,
        # never while user code (the sender factory) runs. Nobody waits on
        # it but other threads taking it.
        self._lock = threading.Lock()

    def after_fork(self) -> None:
        """In a forked child: a parent's thread may have held the lock; the app's
        database connections are the parent's (see :func:`_new_pools`)."""
        self._new_lock()
        app = self._app()
        if app is not None:
            _new_pools(app)

    def built_dispatcher(self) -> Dispatcher | None:
        """This process's dispatcher if one was built (nothing is built here)."""
        with self._lock:
            runtime = self._runtime
        if runtime is None or not self._serves(runtime, os.getpid(), False):
            return None
        return runtime.dispatcher

    @staticmethod
    def _serves(runtime: _Runtime | None, pid: int, sender: bool) -> bool:
        """Whether ``runtime`` is this process's, with a sender if one is wanted."""
        return (
            runtime is not None
            and runtime.pid == pid
            and (runtime.sender is not None or not sender)
        )

    def runtime(self, app: Flask, *, sender: bool = True) -> _Runtime:
        """This process's dispatcher, and its sender if ``sender``, built on first use.

        Raises :class:`~outbound.errors.DispatcherClosed` after shutdown, and
        whatever the sender factory raises (with ``sender`` only: a submit
        needs no sender, nor a token). The sender factory runs without the
        lock; threads that race on the first use may each build a sender,
        and all but one are closed.
        """
        pid = os.getpid()
        runtime = self._runtime
        if self._serves(runtime, pid, sender):
            assert runtime is not None
            return runtime
        with self._lock:
            runtime = self._runtime
            if self._serves(runtime, pid, sender):
                assert runtime is not None
                return runtime
            if self._closed:
                raise DispatcherClosed(f"outbound was shut down for the app {self.app_name!r}")
        made: Sender | None = None
        if sender:
            factory = self.ext.sender_factory
            made = factory(app) if factory is not None else _default_sender(self.settings)
            if not callable(getattr(made, "send", None)):
                raise TypeError(f"sender_factory must return a Sender, not {made!r}")
        built: _Runtime | None = None
        started = False
        with self._lock:
            runtime = self._runtime
            ours = runtime is not None and runtime.pid == pid
            if not self._closed and not ours:
                settings = self.settings
                dispatcher = Dispatcher(
                    settings.max_inflight,
                    settings.queue_size,
                    settings.send_timeout,
                    hooks=self.ext.hooks,
                    thread_name_prefix=f"outbound-{self.app_name}",
                    exit_timeout=settings.shutdown_timeout,
                )
                started = True
                outbound = _ReplyOutbound(dispatcher, made) if made is not None else None
                built = runtime = _Runtime(pid, dispatcher, outbound, made)
                self._runtime = built
            elif (
                not self._closed
                and made is not None
                and runtime is not None
                and ours
                and runtime.sender is None
            ):
                # The dispatcher a submit started, given its sender.
                dispatcher = runtime.dispatcher
                built = runtime = _Runtime(pid, dispatcher, _ReplyOutbound(dispatcher, made), made)
                self._runtime = built
            closed = self._closed
        if started:
            _keep_running(self)
        if made is not None and (runtime is None or runtime.sender is not made):
            # Another thread's won, or shut down meanwhile; not the one kept (a
            # factory may return one sender it made once, to every caller).
            _close_quietly(made)
        if built is None and (runtime is None or runtime.pid != pid or closed):
            raise DispatcherClosed(f"outbound was shut down for the app {self.app_name!r}")
        assert runtime is not None
        return runtime

    def started(self) -> bool:
        """True if this process built its dispatcher."""
        runtime = self._runtime
        return runtime is not None and runtime.pid == os.getpid()

    def shutdown(self, timeout: float | None, *, give_up: bool = False) -> bool:
        """Refuse new sends, wait up to ``timeout`` for the queued ones; True if all ended.

        ``give_up`` (the process is exiting): past ``timeout``, what is left is
        cancelled and interpreter exit does not wait for it again."""
        pid = os.getpid()
        with self._lock:
            self._closed = True
            runtime = self._runtime if self._runtime and self._runtime.pid == pid else None
            stores = list(self._stores.values()) if self._stores_pid == pid else []
            self._stores = {}
        done = True
        if runtime is not None:
            done = runtime.dispatcher.shutdown(timeout)
            if done and runtime.sender is not None:
                _close_quietly(runtime.sender)
            elif give_up:
                runtime.dispatcher.force_close()
                forget_at_exit(runtime.dispatcher)
        for store in stores:
            _close_quietly(store)
        if done:  # (otherwise shutdown_all() still reaches it)
            with _registry_lock:
                _running.discard(self)
        return done

    def store(self, bind: Any) -> Store:
        """The outbox store for the database of ``bind`` (an Engine or a Connection).

        The first for a database may connect (outside the lock) to read how the
        engine's connections connect."""
        engine = getattr(bind, "engine", bind)
        key = str(engine.url)
        with self._lock:
            store = self._stores_here_locked().get(key)
        if store is not None:
            return store
        made = _make_store(bind, self.settings)
        with self._lock:
            store = self._stores_here_locked().setdefault(key, made)
        if store is not made:  # (another thread's came first)
            _close_quietly(made)
        return store

    def _stores_here_locked(self) -> dict[str, Store]:
        """The stores this process made (a forked child's own, none of its
        parent's). _lock held."""
        pid = os.getpid()
        if self._stores_pid != pid:
            self._stores = {}
            self._stores_pid = pid
        return self._stores


def _new_pools(app: Flask) -> None:
    """In a forked child: new connection pools for the app's Flask-SQLAlchemy engines,
    the parent's connections left as they are (``dispose(close=False)``, as
    SQLAlchemy advises for a fork). A connection the parent opened before the fork
    (``db.create_all()`` in ``create_app``, run in gunicorn's master with
    ``--preload``) was otherwise every worker's, their statements and
    transactions (the outbox rows in them) mixed on one socket. Never raises."""
    db = app.extensions.get("sqlalchemy")
    engines = getattr(db, "_app_engines", None)  # (Flask-SQLAlchemy 3: app -> engines)
    try:
        found = list(engines.get(app, {}).values()) if engines is not None else []
        for engine in found:
            # (Not a pool of one connection that is the database itself: SQLite
            # in memory. A new pool would be a new, empty database.)
            if type(engine.pool).__name__ not in ("StaticPool", "SingletonThreadPool"):
                engine.dispose(close=False)
    except Exception:  # (an engine of an unknown kind: left as it was)
        pass


def _make_store(bind: Any, settings: _Settings) -> Store:
    """A store on the database of ``bind`` (an Engine or a Connection); its schema is
    not created here."""
    engine = getattr(bind, "engine", bind)
    dialect = engine.dialect
    options: dict[str, Any] = {
        "table": settings.outbox_table,
        "max_pending": settings.outbox_max_pending,
        "create": False,
    }
    if dialect.name == "sqlite" and dialect.driver == "pysqlite":
        path = engine.url.database
        if not path or path == ":memory:" or path.startswith("file:"):
            raise ValueError(
                "the outbox needs a SQLite database file that its relay can open, "
                f"not {engine.url!s}"
            )
        return SQLiteStore(path, **options)
    if dialect.name == "postgresql" and dialect.driver == "psycopg":
        return PostgresStore(_postgres_conninfo(bind), **options)
    raise TypeError(
        "the outbox works on SQLite (sqlite:///file.db) and on PostgreSQL through psycopg 3 "
        f"(postgresql+psycopg://...), not {dialect.name}+{dialect.driver}"
    )


def _postgres_conninfo(bind: Any) -> str:
    """The libpq string of the database of ``bind`` (an Engine or a Connection on
    psycopg 3), as the engine connects: read from one of its connections
    (``bind``'s, or one checked out of the engine), so that what its
    ``connect_args`` (or a ``creator`` or ``do_connect`` hook) set wins over
    the URL, as it does for the engine: the database, the user, ``options``
    (a ``search_path``), ``sslmode``, a password. Not the address the host
    was resolved to (a failover may change it), nor, for a URL naming several
    hosts, the one this connection took. Blocks while that connects."""
    import psycopg  # noqa: PLC0415 - the dialect has it imported already

    engine = getattr(bind, "engine", bind)
    conninfo: str = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    if bind is engine:
        with engine.connect() as connection:
            info = connection.connection.driver_connection.info
    else:
        info = bind.connection.driver_connection.info
    given = psycopg.conninfo.conninfo_to_dict(conninfo)
    used = {name: value for name, value in info.get_parameters().items() if name != "hostaddr"}
    if "," in str(given.get("host", "")):
        used.pop("host", None)
        used.pop("port", None)
    params = {**given, **used}
    if info.password:
        params["password"] = info.password
    return psycopg.conninfo.make_conninfo(**params)


# ------------------------------------------------------------------ registry

# Guards _states (every _AppState of the process) and _running; held only to
# add to, take from or copy them.
_registry_lock = threading.Lock()
_states: weakref.WeakSet[_AppState] = weakref.WeakSet()
# The states that built a dispatcher, held until shutdown_all: an app dropped
# and collected (one a test's factory made) leaves its dispatcher running,
# which shutdown_all must still reach. A state holds no reference to its app.
_running: set[_AppState] = set()


def _keep_running(state: _AppState) -> None:
    with _registry_lock:
        _running.add(state)


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    for state in list(_states):
        state.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def shutdown_all(timeout: float | None = None) -> bool:
    """Shut down outbound for every Flask app of this process, within ``timeout`` in all.

    For gunicorn's ``worker_exit`` hook (and uWSGI's ``uwsgi.atexit``): new
    replies are refused, queued ones get what is left of ``timeout``
    seconds (``None``: as long as they take). Returns True if every queued
    send ended. Otherwise what is left is given up: queued replies are
    cancelled (their futures say so) and interpreter exit does not wait for
    them again (its ``exit_timeout`` would come on top of ``timeout``, past
    gunicorn's graceful timeout); a send under way is abandoned with the
    process. Thread-safe; blocks up to ``timeout``.
    """
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 or None, not {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    with _registry_lock:
        states = list(_states)
        states += [state for state in _running if state not in states]
        _running.clear()
    done = True
    for state in states:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done = state.shutdown(left, give_up=True) and done
    return done


# ----------------------------------------------------------------- extension


class FlaskOutbound:
    """The Flask extension: per-chat ordered replies from request handlers.

    ``FlaskOutbound(app=None, *, sender_factory=None, hooks=None)``: with
    ``app``, :meth:`init_app` is called at once. ``sender_factory(app)``
    builds the app's :class:`~outbound.messages.Sender` instead of the
    default Telegram sender, on the app's first use in each process (if
    threads race on that first use, each may call it; one sender is kept
    and the others are closed). ``hooks`` are :class:`~outbound.Hooks`
    for every app's dispatcher.

    Every method is thread-safe. :meth:`reply`, :meth:`reply_text`,
    :meth:`submit` and :meth:`with_app_context` never block; the methods
    that act on "the app" use ``flask.current_app`` (or ``app=`` where
    offered) and raise ``RuntimeError`` outside an application context.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        sender_factory: SenderFactory | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        if sender_factory is not None and not callable(sender_factory):
            raise TypeError("sender_factory must be callable: sender_factory(app) -> Sender")
        if hooks is not None and not isinstance(hooks, Hooks):
            raise TypeError(
                f"hooks must be an outbound.Hooks or None, not {type(hooks).__name__}"
                + (" (call it: hooks=metrics.hooks())" if callable(hooks) else "")
            )
        self.sender_factory: Final = sender_factory
        self.hooks: Final = hooks
        if app is not None:
            self.init_app(app)

    # ----------------------------------------------------------- registration

    def init_app(self, app: Flask) -> None:
        """Register on ``app``: set the ``OUTBOUND_*`` defaults and check the configuration.

        Raises ``ValueError``/``TypeError`` naming the bad key, and
        ``RuntimeError`` if outbound is already registered on ``app``.
        Starts no thread and opens no connection. Configuration changed
        after this call is not seen. Not thread-safe for one app (call it
        while building the app).
        """
        if "outbound" in app.extensions:
            raise RuntimeError(f"outbound is already registered on the app {app.name!r}")
        for key, value in CONFIG_DEFAULTS.items():
            app.config.setdefault(key, value)
        settings = _read_settings(app.config)
        state = _AppState(self, app, settings)
        app.extensions["outbound"] = state
        app.cli.add_command(_cli)
        with _registry_lock:
            _states.add(state)

    def _app(self, app: Flask | None = None) -> Flask:
        if app is not None:
            return app
        if not has_app_context():
            raise RuntimeError(
                "outbound needs an application context (a request, a CLI command, "
                "or 'with app.app_context():'), or app= where it is accepted"
            )
        real: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
        return real

    def _state(self, app: Flask) -> _AppState:
        state = app.extensions.get("outbound")
        if not isinstance(state, _AppState):
            raise RuntimeError(
                f"outbound is not registered on the app {app.name!r}: call init_app(app) first"
            )
        if state.ext is not self:
            raise RuntimeError(
                f"the app {app.name!r} was registered with another outbound extension object"
            )
        return state

    # ------------------------------------------------------------------ sends

    def _outbound_or_error(self) -> _ReplyOutbound | BaseException:
        """The current app's reply sender, built on first use; or why it cannot be built.

        Raises only outside an application context.
        """
        app = self._app()
        state = self._state(app)
        try:
            outbound = state.runtime(app).outbound
        except Exception as error:
            if not isinstance(error, DispatcherClosed):
                logger.exception("outbound: cannot build the sender of %r", state.app_name)
            return error
        assert outbound is not None  # (built with its sender)
        return outbound

    def reply(
        self, chat_id: ChatId, message: Message, *, idempotency_key: str | None = None
    ) -> Future[SendResult]:
        """Queue ``message`` for ``chat_id`` on the current app; return its future.

        As :meth:`outbound.Outbound.reply`: never blocks, and any refusal
        (``QueueFull``, ``DispatcherClosed``, a bad message, a sender
        factory that failed) comes back inside the future. Only a call
        outside an application context raises (``RuntimeError``). The
        first call in a process starts the app's dispatcher.
        """
        outbound = self._outbound_or_error()
        if isinstance(outbound, BaseException):
            return _failed(outbound)
        return _clean_context().run(
            outbound.reply, chat_id, message, idempotency_key=idempotency_key
        )

    def reply_text(
        self,
        chat_id: ChatId,
        text: str,
        *,
        parse_mode: str | None = None,
        disable_notification: bool = False,
        idempotency_key: str | None = None,
    ) -> Future[SendResult]:
        """:meth:`reply` with a text message. Never blocks; raises only outside an app context."""
        outbound = self._outbound_or_error()
        if isinstance(outbound, BaseException):
            return _failed(outbound)
        return _clean_context().run(
            outbound.reply_text,
            chat_id,
            text,
            parse_mode=parse_mode,
            disable_notification=disable_notification,
            idempotency_key=idempotency_key,
        )

    def submit(
        self, key: Hashable, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the lane of ``key`` under the current app's context.

        The call runs in a worker thread with ``app.app_context()`` pushed
        there (``current_app``, ``g`` and Flask-SQLAlchemy's session work;
        ``request`` does not: the request is over), after the tasks of
        ``key`` queued before it, replies included when ``key`` is their
        chat id. It sees a copy of the caller's other context variables.
        Raises :class:`~outbound.errors.QueueFull` and
        :class:`~outbound.errors.DispatcherClosed` like
        :meth:`outbound.Dispatcher.submit`. Never blocks.
        """
        app = self._app()
        runtime = self._state(app).runtime(app, sender=False)
        call = functools.partial(fn, *args, **kwargs)
        return _clean_context().run(runtime.dispatcher.submit, key, _call_in_app_context, app, call)

    def with_app_context(self, fn: Callable[P, T], *, app: Flask | None = None) -> Callable[P, T]:
        """Wrap ``fn`` so that it runs under ``app.app_context()`` (default: the current app).

        For callbacks that run in a worker thread, such as
        ``future.add_done_callback(outbound.with_app_context(record))``.
        The app is taken now; the wrapper may be called from any thread.
        """
        target = self._app(app)
        self._state(target)

        @functools.wraps(fn)
        def in_app_context(*args: P.args, **kwargs: P.kwargs) -> T:
            with target.app_context():
                return fn(*args, **kwargs)

        return in_app_context

    # ---------------------------------------------------------------- outbox

    def enqueue(
        self,
        *,
        key: str | int,
        type: str,
        payload: Any,
        dedupe_key: str | None = None,
        delay: float | None = None,
        session: _Session | None = None,
    ) -> int:
        """Write an outbox row inside the current transaction of ``session``; return its id.

        ``session`` defaults to Flask-SQLAlchemy's ``db.session`` of the
        current app. The row is written on that session's own connection,
        so it commits with ``session.commit()`` and disappears with
        ``session.rollback()``, together with the app's data. The store is
        :class:`~outbound.outbox.SQLiteStore` for ``sqlite:///file``
        databases and :class:`~outbound.outbox.PostgresStore` for
        ``postgresql+psycopg://``; the table is ``OUTBOUND_OUTBOX_TABLE``
        and must exist (:meth:`create_outbox`). Raises what the store's
        ``enqueue`` raises (``OutboxFull``, ``DuplicateMessage``,
        ``StoreError``, ``TypeError``/``ValueError`` for bad arguments).
        Blocks on the database.
        """
        app = self._app()
        state = self._state(app)
        if session is None:
            session = self._session(app)
        connection = session.connection()
        store = state.store(connection)
        raw = connection.connection.driver_connection
        return store.enqueue(
            raw, key=key, type=type, payload=payload, dedupe_key=dedupe_key, delay=delay
        )

    def outbox_store(self, *, session: _Session | None = None) -> Store:
        """The outbox store of the current app's database, for a relay or the status.

        Run relays in their own process (``python -m outbound outbox`` to
        inspect), not in a pre-fork server's master. Does not block.
        """
        app = self._app()
        state = self._state(app)
        if session is None:
            session = self._session(app)
        return state.store(session.get_bind())

    def status_blueprint(
        self,
        *,
        authorize: Callable[[], Any] | None,
        name: str = "outbound_status",
        refresh: float = 2.0,
    ) -> Any:
        """A blueprint with the outbox's status page (``/``) and its JSON (``/status.json``).

        The store is :meth:`outbox_store` of the app serving the request.
        ``authorize`` runs before each of its requests and returns True,
        False (403) or a response to send instead; it is required, so that
        the page is never public by mistake (``None``: the app guards the
        prefix itself). See :mod:`outbound.contrib.flask_status`.
        """
        from .flask_status import status_blueprint  # noqa: PLC0415 - only this needs it

        return status_blueprint(self.outbox_store, authorize=authorize, name=name, refresh=refresh)

    def create_outbox(self, *, session: _Session | None = None) -> None:
        """Create the outbox table if missing, on a connection of its own. Idempotent.

        Call it where the app creates its tables (next to ``db.create_all()``),
        not inside a transaction that has written to the same SQLite file.
        Blocks on the database.
        """
        self.outbox_store(session=session).create_schema()

    @staticmethod
    def _session(app: Flask) -> _Session:
        db = app.extensions.get("sqlalchemy")
        session = getattr(db, "session", None)
        if session is not None:
            return session  # type: ignore[no-any-return]
        if importlib.util.find_spec("flask_sqlalchemy") is None:
            raise RuntimeError(
                "the outbox writes in Flask-SQLAlchemy's transaction, and Flask-SQLAlchemy "
                "is not installed: pip install 'outbound-dispatcher[flask-sqlalchemy]' "
                "(or pass a SQLAlchemy session as session=)"
            )
        raise RuntimeError(
            f"the outbox needs Flask-SQLAlchemy registered on the app {app.name!r} "
            "(db = SQLAlchemy(app), or db.init_app(app)), or a SQLAlchemy session "
            "passed as session="
        )

    # -------------------------------------------------------------- lifecycle

    @property
    def dispatcher(self) -> Dispatcher:
        """The current app's dispatcher in this process, started if it was not."""
        app = self._app()
        return self._state(app).runtime(app, sender=False).dispatcher

    def started(self, app: Flask | None = None) -> bool:
        """True if the app's dispatcher exists in this process. Never starts it."""
        return self._state(self._app(app)).started()

    def shutdown(self, timeout: float | None = None, *, app: Flask | None = None) -> bool:
        """Refuse new replies for the app and wait up to ``timeout`` for the queued ones.

        Returns True if every queued send ended (then the sender is
        closed). Later replies resolve with
        :class:`~outbound.errors.DispatcherClosed`. Idempotent; blocks up
        to ``timeout`` (``None``: until done). See also :func:`shutdown_all`.
        """
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be >= 0 or None, not {timeout!r}")
        return self._state(self._app(app)).shutdown(timeout)

    def __repr__(self) -> str:
        factory = "default" if self.sender_factory is None else repr(self.sender_factory)
        return f"<FlaskOutbound sender_factory={factory}>"


#: The extension under the name the documentation uses.
Outbound = FlaskOutbound


# ---------------------------------------------------------------- command line

_cli = AppGroup("outbound", help="outbound: run the outbox worker of this app.")


class _Checked(click.ParamType):  # type: ignore[type-arg]  # generic in click 8.3+
    """A worker option read as ``kind`` and checked as the relay checks it (NaN,
    infinity and values out of range refused at parsing, naming the option)."""

    def __init__(self, option: str, kind: Callable[[str], float]) -> None:
        self.option = option
        self.kind = kind
        self.name = "integer" if kind is int else "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            try:
                value = self.kind(value)
            except ValueError:
                self.fail(f"{value!r} is not a valid {self.name}", param, ctx)
        try:
            if self.option == "drain_timeout":
                return check_seconds("--drain-timeout", value, zero=True)
            return check_option(self.option, value)
        except (TypeError, ValueError) as exc:
            self.fail(str(exc), param, ctx)


@_cli.command("worker")
@click.option(
    "--batch-size",
    type=_Checked("batch_size", int),
    default=100,
    show_default=True,
    help="rows claimed at once",
)
@click.option(
    "--max-inflight",
    type=_Checked("max_inflight", int),
    default=64,
    show_default=True,
    help="handlers running at once in this worker",
)
@click.option(
    "--max-concurrency",
    type=_Checked("max_concurrency", int),
    default=None,
    help="rows being delivered at once across every worker (default: no limit)",
)
@click.option(
    "--poll-interval",
    type=_Checked("poll_interval", float),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="seconds between looks for new rows",
)
@click.option(
    "--lease",
    type=_Checked("lease", float),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="how long a claimed row is this worker's before another may take it",
)
@click.option(
    "--drain-timeout",
    type=_Checked("drain_timeout", float),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="on SIGTERM or Ctrl-C, how long the claimed rows get to finish",
)
@click.option("--name", default=None, help="a label added to the lease owner id")
def _worker_command(**options: Any) -> None:
    """Deliver the outbox to OUTBOUND_HANDLERS until SIGTERM or Ctrl-C.

    Run as many as you like, on any hosts: per-key order and
    --max-concurrency hold across all of them.
    """
    _run_worker(**options)


def _split_path(path: str) -> tuple[str, str] | None:
    """``(module, attribute)`` of a ``"module:function"`` or ``"module.function"``
    path (each a dotted run of Python names), None if it is not one."""
    module, sep, attr = path.strip().partition(":")
    if not sep:
        module, _, attr = module.rpartition(".")
    names = [*module.split("."), *attr.split(".")]
    return (module, attr) if all(name.isidentifier() for name in names) else None


def _resolve(type_: str, handler: Callable[..., object] | str) -> Callable[..., object]:
    """A handler, imported if given as a path; ``click.UsageError`` naming what is wrong."""
    if callable(handler):
        return handler
    split = _split_path(handler)
    if split is None:
        raise click.UsageError(f"OUTBOUND_HANDLERS[{type_!r}]: {handler!r} is not a path")
    module, attr = split
    try:
        target: Any = importlib.import_module(module)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise click.UsageError(
            f"OUTBOUND_HANDLERS[{type_!r}]: cannot import {handler!r}: {exc}"
        ) from None
    if not callable(target):
        raise click.UsageError(f"OUTBOUND_HANDLERS[{type_!r}]: {handler!r} is not callable")
    return target  # type: ignore[no-any-return]


def _run_worker(
    *,
    batch_size: int,
    max_inflight: int,
    max_concurrency: int | None,
    poll_interval: float,
    lease: float,
    drain_timeout: float,
    name: str | None,
) -> None:
    """``flask outbound worker``: runs under the app's context, in the main thread. Blocks."""
    from . import _worker as worker  # noqa: PLC0415

    app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
    state: _AppState = app.extensions["outbound"]
    ext = state.ext
    if not state.settings.handlers:
        raise click.UsageError("OUTBOUND_HANDLERS is empty: no outbox type to deliver")
    bus = EventBus()
    for type_, handler in state.settings.handlers:
        bus.subscribe(type_, ext.with_app_context(_resolve(type_, handler), app=app))
    try:
        store = ext.outbox_store()
        store.create_schema()
        relay = Relay(
            store,
            bus,
            batch_size=batch_size,
            max_inflight=max_inflight,
            max_concurrency=max_concurrency,
            poll_interval=poll_interval,
            lease=lease,
            name=name,
        )
    except (RuntimeError, OutboxError, TypeError, ValueError) as exc:
        raise click.ClickException(f"cannot start the outbox relay: {exc}") from exc
    signals = worker.Signals()
    signals.install()
    deadline: float | None = None
    drained = False
    # Set when something runs on that the exit hooks would wait for: a handler
    # that did not return, a reply still being sent. The process then ends at once.
    abandoned = False
    try:
        try:
            with worker.log_failures("outbound worker"):
                try:
                    relay.start()
                except OutboxError as exc:
                    raise click.ClickException(f"cannot start the outbox relay: {exc}") from exc
                click.echo(
                    f"outbound worker: relaying table {store.table!r} of {_where(store)} as "
                    f"{relay.owner} (types: {', '.join(sorted(bus.types()))})"
                )
                if ext.sender_factory is None and state.settings.telegram_token is None:
                    click.echo(
                        "outbound worker: warning: no sender: OUTBOUND_TELEGRAM_TOKEN is not "
                        "set (is the environment variable it is read from?), nor a "
                        "sender_factory; a handler's reply fails, and its row with it",
                        err=True,
                    )
                while not signals.stop.wait(worker.TICK):
                    if relay.state is RelayState.STOPPED:
                        raise click.ClickException(
                            "the outbox relay stopped on an error (see above)"
                        )
                deadline = time.monotonic() + drain_timeout
                _say(f"stopping, draining claimed rows (at most {drain_timeout:g}s)")
                drained = worker.drain_relay(relay, deadline, signals.forced)
        finally:
            if deadline is None:  # (an error: the relay stopped on its own, or never ran)
                abandoned = not relay.force_stop(worker.FORCE_TIMEOUT)
            # The replies the handlers queued: what is left of the drain, until a
            # second signal; what is left then is given up as a row is.
            until = deadline if deadline is not None and drained else time.monotonic()
            replied = worker.wait_replies(
                state.built_dispatcher(),
                until,
                signals.forced,
                _say,
            )
            state.shutdown(0.0, give_up=True)  # (and the app's outbox stores)
            drained = drained and replied
            abandoned = abandoned or not replied
            signals.restore()
    except click.ClickException as exc:
        if abandoned:
            exc.show()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.exit_code)
        raise
    stats = relay.stats()
    summary = (
        f"outbound worker: stopped; sent {stats.sent}, retried {stats.retried}, dead {stats.dead}"
    )
    if not drained:
        cut = "a second signal cut the drain short" if signals.forced.is_set() else ""
        click.echo(
            f"{summary}; {cut or f'the drain did not finish in {drain_timeout:g}s'}: "
            "unfinished rows return "
            "to pending when their lease expires, replies still being sent are given up",
            err=True,
        )
        # Handlers that did not return hold threads, and the exit hooks of
        # their dispatchers would wait for them: end the process now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _say(summary.removeprefix("outbound worker: "))


def _say(text: str) -> None:
    """``outbound worker: <text>`` on standard output, if it can be written: a reader
    gone (a closed pipe) must not keep the worker from draining."""
    with contextlib.suppress(OSError):
        click.echo(f"outbound worker: {text}")


def _where(store: Store) -> str:
    from outbound.outbox.web import describe_store  # noqa: PLC0415 - only the command needs it

    return describe_store(store)
