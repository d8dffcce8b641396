"""The ``OUTBOUND`` settings dict: its keys, defaults, and validation.

::

    OUTBOUND = {
        # reply() / reply_text(): the dispatcher and the platform sender
        "max_inflight": 512,          # sends running at once, over every chat
        "queue_size": 64,             # messages waiting per chat
        "send_timeout": 30.0,         # seconds one send may take
        "exit_timeout": 10.0,         # seconds given to queued sends at exit
        "telegram": {"token": "123:abc", "base_url": "https://api.telegram.org"},
        "sender": None,               # or "myapp.senders.build": a factory returning a Sender
        "rate_limits": "telegram",    # "telegram", "slack" or None
        "retry_attempts": 5,          # sends tried per message (429s and transient errors)
        # the outbox, on Django's own connection
        "using": "default",           # database alias (PostgreSQL or an SQLite file)
        "table": "outbox",
        "max_pending": None,          # enqueue() raises OutboxFull beyond this many
        "ordering": "strict",         # or "mutex"
        "notify": True,               # PostgreSQL NOTIFY on enqueue
        # manage.py outbound_worker
        "handlers": {"order.placed": "shop.handlers.order_placed"},
        "relay": {
            "batch_size": 100, "max_inflight": 64, "max_concurrency": None,
            "lease": 30.0, "poll_interval": 1.0, "listen": True,
            "max_attempts": 10, "backoff": 1.0, "backoff_max": 300.0,
            "drain_timeout": 30.0,
        },
    }

Every key is optional. :func:`validate` reports every problem (the system
checks in :mod:`outbound.contrib.django.checks` show them, ids
``outbound.E001``-``E006``); :func:`get_settings` returns the checked,
immutable :class:`Settings`, cached per process until the ``OUTBOUND``
setting changes (``override_settings`` in tests). Thread-safe; nothing
here blocks or imports the handlers, except :func:`validate` with
``imports=True``.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from outbound.dispatcher import _positive_seconds
from outbound.outbox._base import check_max_pending, check_table
from outbound.outbox.relay import check_option
from outbound.retry import shown_number
from outbound.telegram import check_base_url, check_token

__all__ = [
    "Problem",
    "RelaySettings",
    "Settings",
    "check_relay_option",
    "get_settings",
    "load",
    "validate",
]

_DOTTED: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")

#: Problem ids, one per kind of mistake.
E_NOT_A_DICT: Final = "outbound.E001"
E_UNKNOWN_KEY: Final = "outbound.E002"
E_BAD_VALUE: Final = "outbound.E003"
E_NO_DATABASE: Final = "outbound.E004"
E_IMPORT: Final = "outbound.E005"


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """``OUTBOUND["relay"]``: how ``outbound_worker`` runs its relay. Immutable."""

    batch_size: int = 100
    max_inflight: int = 64
    max_concurrency: int | None = None
    lease: float = 30.0
    poll_interval: float = 1.0
    listen: bool = True
    max_attempts: int = 10
    backoff: float = 1.0
    backoff_max: float = 300.0
    drain_timeout: float = 30.0


#: The relay's settings when none is given (a slotted dataclass keeps its
#: defaults in ``__init__`` only).
_RELAY_DEFAULTS: Final = RelaySettings()


def _check_backoffs(relay: Mapping[str, Any], problems: list[Problem]) -> None:
    """Append a problem if ``backoff_max`` is below ``backoff``, either given or
    its default (the worker's retry policy refuses that); called after their own
    checks, which left ``relay`` holding numbers if they found nothing."""
    keys = {_where("relay", "backoff"), _where("relay", "backoff_max")}
    if any(problem.key in keys for problem in problems):
        return  # (a value of the wrong kind: said already)
    backoff = relay.get("backoff", _RELAY_DEFAULTS.backoff)
    backoff_max = relay.get("backoff_max", _RELAY_DEFAULTS.backoff_max)
    if not backoff_max < backoff:
        return
    if "backoff_max" in relay:
        default = "" if "backoff" in relay else f" ({backoff:g}, its default)"
        problems.append(
            Problem(
                _where("relay", "backoff_max"), f"must be >= relay backoff{default}", E_BAD_VALUE
            )
        )
    else:
        problems.append(
            Problem(
                _where("relay", "backoff"),
                f"must be <= relay backoff_max ({backoff_max:g}, its default)",
                E_BAD_VALUE,
            )
        )


@dataclass(frozen=True, slots=True)
class Settings:
    """The checked ``OUTBOUND`` dict, defaults filled in. Immutable."""

    max_inflight: int = 512
    queue_size: int = 64
    send_timeout: float = 30.0
    exit_timeout: float | None = 10.0
    telegram_token: str | None = None
    telegram_base_url: str = "https://api.telegram.org"
    sender: str | None = None
    rate_limits: str | None = "telegram"
    retry_attempts: int = 5
    using: str = "default"
    table: str = "outbox"
    max_pending: int | None = None
    ordering: str = "strict"
    notify: bool = True
    handlers: Mapping[str, str] = field(default_factory=dict)
    relay: RelaySettings = field(default_factory=RelaySettings)


@dataclass(frozen=True, slots=True)
class Problem:
    """One mistake in ``OUTBOUND``: where (``key``, as Python spells it), what, its id."""

    key: str
    message: str
    id: str


# ----------------------------------------------------------------- value checks


def _int(minimum: int, *, optional: bool = False) -> Callable[[object], object]:
    def check(value: object) -> object:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            extra = " or None" if optional else ""
            raise ValueError(f"must be an int >= {minimum}{extra}, not {value!r}")
        return value

    return check


def _seconds(*, optional: bool = False, zero: bool = False) -> Callable[[object], object]:
    def check(value: object) -> object:
        if value is None and optional:
            return None
        ok = (
            not isinstance(value, bool)
            and isinstance(value, (int, float))
            # (an int too large for a float is no finite number of seconds)
            and not (isinstance(value, int) and value.bit_length() > 1000)
            and math.isfinite(value)
            and (value >= 0 if zero else value > 0)
        )
        if not ok:
            bound = ">= 0" if zero else "> 0"
            extra = " or None" if optional else ""
            raise ValueError(
                f"must be a finite number of seconds {bound}{extra}, not {shown_number(value)}"
            )
        return float(value)  # type: ignore[arg-type]

    return check


def _exit_timeout(value: object) -> object:
    """As the dispatcher checks it (> 0, ``math.inf``: wait for everything), or None."""
    if value is None:
        return None
    try:
        return _positive_seconds("exit_timeout", value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            "must be a number of seconds > 0 (math.inf: wait for everything) or None, "
            f"not {shown_number(value)}"
        ) from None


def _bool(value: object) -> object:
    if not isinstance(value, bool):
        raise ValueError(f"must be True or False, not {value!r}")
    return value


def _choice(*choices: str | None) -> Callable[[object], object]:
    def check(value: object) -> object:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(map(repr, choices))}, not {value!r}")
        return value

    return check


def _text(value: object) -> object:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty str, not {value!r}")
    return value


def _dotted(*, optional: bool = False) -> Callable[[object], object]:
    def check(value: object) -> object:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not _DOTTED.fullmatch(value):
            raise ValueError(f"must be a dotted import path like 'app.module.name', not {value!r}")
        return value

    return check


def _token(value: object) -> object:
    if value is None:
        return None
    try:
        return check_token(value, "the bot token")
    except ValueError as exc:
        raise ValueError(f"{exc}, or None") from None


def _url(value: object) -> object:
    try:
        check_base_url(value)
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix("base_url ")) from None
    return value


def _table(value: object) -> object:
    return check_table(value)


_TOP: Final[dict[str, Callable[[object], object]]] = {
    "max_inflight": _int(1),
    "queue_size": _int(1),
    "send_timeout": _seconds(),
    "exit_timeout": _exit_timeout,
    "sender": _dotted(optional=True),
    "rate_limits": _choice("telegram", "slack", None),
    "retry_attempts": _int(1),
    "using": _text,
    "table": _table,
    "max_pending": check_max_pending,
    "ordering": _choice("strict", "mutex"),
    "notify": _bool,
}
_TELEGRAM: Final[dict[str, Callable[[object], object]]] = {"token": _token, "base_url": _url}
# The relay's own checks of the options the worker builds it with.
_RELAY: Final[dict[str, Callable[[object], object]]] = {
    "batch_size": partial(check_option, "batch_size"),
    "max_inflight": partial(check_option, "max_inflight"),
    "max_concurrency": partial(check_option, "max_concurrency"),
    "lease": partial(check_option, "lease"),
    "poll_interval": partial(check_option, "poll_interval"),
    "listen": _bool,
    "max_attempts": _int(1),
    "backoff": _seconds(zero=True),
    "backoff_max": _seconds(zero=True),
    "drain_timeout": _seconds(zero=True),
}
_NESTED: Final = ("telegram", "relay", "handlers")


def check_relay_option(name: str, value: object) -> Any:
    """``value`` checked as ``OUTBOUND["relay"][name]`` is (``outbound_worker``'s options);
    ``TypeError`` or ``ValueError`` saying why. Pure."""
    return _RELAY[name](value)


def _where(*keys: str) -> str:
    return "OUTBOUND" + "".join(f"[{key!r}]" for key in keys)


def _section(
    raw: Mapping[Any, Any],
    specs: Mapping[str, Callable[[object], object]],
    path: tuple[str, ...],
    problems: list[Problem],
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Check the keys of one dict against ``specs``; return the good values."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in extra:
            continue
        spec = specs.get(key) if isinstance(key, str) else None
        if spec is None:
            known = ", ".join(sorted((*specs, *extra)))
            problems.append(
                Problem(
                    _where(*path, str(key)),
                    f"unknown key {key!r} (known keys: {known})",
                    E_UNKNOWN_KEY,
                )
            )
            continue
        try:
            out[key] = spec(value)
        except (TypeError, ValueError, OverflowError) as exc:
            problems.append(Problem(_where(*path, key), str(exc), E_BAD_VALUE))
    return out


def _dict(raw: object, path: tuple[str, ...], problems: list[Problem]) -> Mapping[Any, Any]:
    if isinstance(raw, Mapping):
        return raw
    problems.append(
        Problem(_where(*path), f"must be a dict, not {type(raw).__name__}", E_BAD_VALUE)
    )
    return {}


def _handlers(raw: Mapping[Any, Any], problems: list[Problem], *, imports: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    for type_, path in raw.items():
        where = _where("handlers", str(type_))
        if not isinstance(type_, str) or not type_:
            problems.append(
                Problem(where, f"an event type must be a non-empty str: {type_!r}", E_BAD_VALUE)
            )
            continue
        try:
            _dotted()(path)
        except ValueError as exc:
            problems.append(Problem(where, str(exc), E_BAD_VALUE))
            continue
        if imports and not _importable(where, path, problems):
            continue
        out[type_] = path
    return out


def _importable(where: str, path: str, problems: list[Problem]) -> bool:
    try:
        target = import_string(path)
    except ImportError as exc:
        problems.append(Problem(where, f"cannot import {path!r}: {exc}", E_IMPORT))
        return False
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the module's own code failed (or exited) as it was imported
        problems.append(Problem(where, _import_failed(path, exc), E_IMPORT))
        return False
    if not callable(target):
        problems.append(Problem(where, f"{path!r} is not callable", E_IMPORT))
        return False
    return True


def _import_failed(path: str, exc: BaseException) -> str:
    """Why ``path`` cannot be imported: the exception its import raised."""
    module = path.rpartition(".")[0]
    return f"cannot import {path!r}: importing {module!r} raised {type(exc).__name__}: {exc}"


def validate(raw: object, *, imports: bool = False) -> tuple[Settings | None, list[Problem]]:
    """Check an ``OUTBOUND`` value; return the settings (None if any problem) and the problems.

    With ``imports``, the handlers and the sender factory are imported and
    must be callable, and ``using`` must name a database of ``DATABASES``.
    """
    problems: list[Problem] = []
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problems.append(
            Problem("OUTBOUND", f"must be a dict, not {type(raw).__name__}", E_NOT_A_DICT)
        )
        return None, problems
    values = _section(raw, _TOP, (), problems, extra=_NESTED)
    telegram = _section(
        _dict(raw.get("telegram", {}), ("telegram",), problems), _TELEGRAM, ("telegram",), problems
    )
    relay = _section(
        _dict(raw.get("relay", {}), ("relay",), problems), _RELAY, ("relay",), problems
    )
    handlers = _handlers(
        _dict(raw.get("handlers", {}), ("handlers",), problems), problems, imports=imports
    )
    if imports:
        sender = values.get("sender")
        if sender is not None:
            _importable(_where("sender"), sender, problems)
        using = values.get("using", "default")
        if using not in django_settings.DATABASES:
            problems.append(
                Problem(
                    _where("using"),
                    f"{using!r} is not a database alias of settings.DATABASES",
                    E_NO_DATABASE,
                )
            )
    _check_backoffs(relay, problems)
    if problems:
        return None, problems
    if "token" in telegram:
        values["telegram_token"] = telegram["token"]
    if "base_url" in telegram:
        values["telegram_base_url"] = telegram["base_url"]
    return Settings(**values, handlers=handlers, relay=RelaySettings(**relay)), problems


def load(raw: object) -> Settings:
    """The checked ``OUTBOUND`` value; raises ``ImproperlyConfigured`` naming each problem."""
    checked, problems = validate(raw)
    if checked is None:
        lines = "; ".join(f"{p.key}: {p.message} ({p.id})" for p in problems)
        raise ImproperlyConfigured(f"invalid OUTBOUND setting: {lines}")
    return checked


# Guards _cached; held only to read or replace it (load() is quick and pure).
_lock = threading.Lock()
_cached: Settings | None = None


def get_settings() -> Settings:
    """``settings.OUTBOUND``, checked; cached until the setting changes. Never blocks long."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = load(getattr(django_settings, "OUTBOUND", None))
        return _cached


def _forget(*, setting: str, **kwargs: Any) -> None:
    global _cached
    if setting == "OUTBOUND":
        with _lock:
            _cached = None


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


setting_changed.connect(_forget, dispatch_uid="outbound.contrib.django.conf")
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
