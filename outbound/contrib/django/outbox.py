"""The durable outbox on Django's own database connection.

::

    from django.db import transaction
    from outbound.contrib.django import enqueue_on_commit

    with transaction.atomic():
        order = Order.objects.create(...)
        enqueue_on_commit(key=order.customer_id, type="order.placed", payload={"id": order.id})

The row is written on ``django.db.connections[using]`` inside the current
transaction: it commits with the order, and a rolled-back ``atomic()``
leaves nothing to send. ``manage.py outbound_worker`` (or a relay from
:func:`build_relay`) delivers committed rows to the handlers of
``OUTBOUND["handlers"]``.

Databases: PostgreSQL (psycopg 3; relays in every process are woken by
``NOTIFY`` at commit) and SQLite files (relays poll every
``poll_interval``; :func:`enqueue_on_commit` also wakes the relays of the
calling process at once). An in-memory SQLite database cannot hold an
outbox: no other connection or process can see it.

Schema: the app's migrations (``outbound.0001_outbox``, and
``outbound.0002_outbox_schema_2`` for an outbox made by an earlier
version) create or upgrade the table on the ``using`` database
(``manage.py migrate``, and so Django's test runner) by the store's own
idempotent ``create_schema``, so the SQL stays in one place.
``outbound_worker`` does it too if needed (a changed ``table`` needs no
new migration).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db import close_old_connections, connections, transaction
from django.utils.connection import ConnectionDoesNotExist
from django.utils.module_loading import import_string

from outbound.errors import StoreError
from outbound.outbox import (
    DEFAULT_RETRY,
    EventBus,
    OutboxMessage,
    PostgresStore,
    Relay,
    RetryPolicy,
    SQLiteStore,
    Store,
)

from .conf import Settings, _import_failed, get_settings

__all__ = [
    "build_bus",
    "build_relay",
    "close_stores",
    "create_schema",
    "enqueue",
    "enqueue_on_commit",
    "get_store",
]

logger = logging.getLogger("outbound")

# ------------------------------------------------------------ in-process wake-up

# Guards _waiters: wake callbacks of the relays running in this process,
# by (database alias, table). Held only to add, remove or copy a set.
_waiters_lock = threading.Lock()
_waiters: dict[tuple[str, str], set[Callable[[], object]]] = {}


class _LocalListener:
    """Registers a relay's wake-up for :func:`enqueue_on_commit` in this process."""

    def __init__(self, where: tuple[str, str], wake: Callable[[], object], inner: Any) -> None:
        self._where = where
        self._wake = wake
        self._inner = inner

    def start(self) -> None:
        if self._inner is not None:
            self._inner.start()
        with _waiters_lock:
            _waiters.setdefault(self._where, set()).add(self._wake)

    def stop(self, timeout: float | None = None) -> None:
        with _waiters_lock:
            waiting = _waiters.get(self._where)
            if waiting is not None:
                waiting.discard(self._wake)
                if not waiting:
                    del _waiters[self._where]
        if self._inner is not None:
            self._inner.stop(timeout)


def _wake_local(where: tuple[str, str]) -> None:
    with _waiters_lock:
        wakes = list(_waiters.get(where, ()))
    for wake in wakes:
        try:
            wake()
        except Exception:
            logger.exception("outbound: waking a relay failed")


class _DjangoPostgresStore(PostgresStore):
    """A :class:`PostgresStore` whose relays are also woken by :func:`enqueue_on_commit`."""

    def __init__(self, conninfo: str, *, alias: str, **options: Any) -> None:
        self.alias = alias
        super().__init__(conninfo, **options)

    def listener(self, wake: Callable[[], object]) -> _LocalListener:  # type: ignore[override]
        return _LocalListener((self.alias, self.table), wake, super().listener(wake))


class _DjangoSQLiteStore(SQLiteStore):
    """A :class:`SQLiteStore` whose relays are woken by :func:`enqueue_on_commit`."""

    def __init__(self, path: str, *, alias: str, **options: Any) -> None:
        self.alias = alias
        super().__init__(path, **options)

    def listener(self, wake: Callable[[], object]) -> _LocalListener:
        return _LocalListener((self.alias, self.table), wake, None)


# ------------------------------------------------------------------------ stores

# Guards _stores: the stores built in this process, by alias and location.
# Held only to look up or replace the dict, never while a store is closed.
_stores_lock = threading.Lock()
_stores: dict[tuple[str, str, str], Store] = {}
# The keys of a database's settings that say where it is (the test runner
# changes NAME in place).
_WHERE = ("NAME", "USER", "PASSWORD", "HOST", "PORT", "OPTIONS")


def _conninfo(connection: Any) -> str:
    """A libpq connection string for the database of a Django PostgreSQL connection.

    With ``OPTIONS["assume_role"]`` (which Django sets with ``SET ROLE`` on each of
    its connections) the store's connections take that role too, as a ``-c role=``
    startup option: the outbox is created, written and relayed as Django's
    tables are, under the role, not the login user.
    """
    import psycopg  # noqa: PLC0415 - the PostgreSQL backend has it imported already

    keywords = {option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()}
    params = {
        name: str(value)
        for name, value in connection.get_connection_params().items()
        if name in keywords and isinstance(value, (str, int, float)) and value != ""
    }
    role = connection.settings_dict.get("OPTIONS", {}).get("assume_role")
    if role:
        # (libpq's options: a backslash escapes the next character, spaces included.)
        escaped = re.sub(r"([\\\s])", r"\\\1", f"role={role}")
        params["options"] = " ".join(filter(None, (params.get("options", ""), "-c", escaped)))
    conninfo: str = psycopg.conninfo.make_conninfo(**params)
    return conninfo


class _InMemory(ImproperlyConfigured):  # type: ignore[misc]
    """The outbox's database is in memory (Django's test databases are, by default):
    no relay can read it. ``migrate`` then creates no outbox; the worker refuses it."""

    def __init__(self, alias: str, where: str) -> None:
        super().__init__(
            f"the outbox needs an SQLite database file or PostgreSQL; database {alias!r}"
            f"{where} is in memory, which no relay can read"
        )


def _location(connection: Any) -> str:
    """Where the store of ``connection``'s database is: a libpq string, or an SQLite file.

    Raises :class:`_InMemory` for a database no other connection can see, and
    ``ImproperlyConfigured`` for one the outbox cannot use.
    """
    vendor = connection.vendor
    if vendor == "postgresql":
        return _conninfo(connection)
    if vendor == "sqlite":
        name = connection.settings_dict["NAME"]
        alias = connection.alias
        if not name or connection.is_in_memory_db():
            raise _InMemory(alias, "")
        return _sqlite_file(os.fspath(name), alias)
    raise ImproperlyConfigured(
        f"the outbox supports PostgreSQL and SQLite; database {connection.alias!r} is {vendor}"
    )


def _sqlite_file(name: str, alias: str) -> str:
    """The file an SQLite ``NAME`` opens: a path, or the path of a ``file:`` URI (Django
    opens every ``NAME`` with ``uri=True``). The relays open that path with SQLite's
    defaults, so a URI whose parameters would make Django's connection see another
    database, or the same file another way, is refused: ``mode=memory``, a ``vfs``
    other than ``unix``, read-only (``mode=ro``, ``immutable``), no locking
    (``nolock``), a host."""
    if not name.startswith("file:"):
        return name
    uri = urllib.parse.urlsplit(name)
    path = urllib.parse.unquote(uri.path)
    params = urllib.parse.parse_qs(uri.query, keep_blank_values=True)

    def says(key: str, *values: str) -> bool:  # SQLite reads the first; look at each
        return any(v.lower() in values for v in params.get(key, ()))

    def on(key: str) -> bool:
        return any(v.lower() not in ("0", "no", "false", "off") for v in params.get(key, ()))

    if not path or path == ":memory:" or says("mode", "memory"):
        raise _InMemory(alias, f" ({name!r})")
    if uri.netloc.lower() not in ("", "localhost"):
        raise ImproperlyConfigured(
            f"database {alias!r} is an SQLite URI with a host ({uri.netloc!r}); "
            "the outbox needs a local file"
        )
    if any(v != "unix" for v in params.get("vfs", ())):
        raise ImproperlyConfigured(
            f"database {alias!r} opens its SQLite file through another VFS ({name!r}); "
            "the outbox's relays open it with SQLite's default and must see the same database"
        )
    if says("mode", "ro") or on("immutable") or on("nolock"):
        raise ImproperlyConfigured(
            f"database {alias!r} opens its SQLite file read-only or without locking "
            f"({name!r}); the outbox writes its rows there, beside relays in other processes"
        )
    return path


def _store(connection: Any, conf: Settings) -> Store:
    alias = connection.alias
    sd = connection.settings_dict
    key = (alias, connection.vendor, repr([sd.get(k) for k in _WHERE]))
    with _stores_lock:
        store = _stores.get(key)
        if store is not None:
            return store
    location = _location(connection)
    options: dict[str, Any] = {
        "table": conf.table,
        "max_pending": conf.max_pending,
        "ordering": conf.ordering,
        "create": False,
    }
    if connection.vendor == "postgresql":
        store = _DjangoPostgresStore(location, alias=alias, notify=conf.notify, **options)
    else:
        store = _DjangoSQLiteStore(location, alias=alias, **options)
    with _stores_lock:
        return _stores.setdefault(key, store)


def get_store(using: str | None = None) -> Store:
    """The outbox store of database ``using`` (default ``OUTBOUND["using"]``), for this process.

    For relays and inspection (``status()``, ``rows()``, ``retry_dead()``,
    ``purge()``): those open connections of the store's own. Cached;
    thread-safe; does not connect. Raises ``ImproperlyConfigured`` for a
    database that cannot hold an outbox.
    """
    conf = get_settings()
    alias = using or conf.using
    try:
        connection = connections[alias]
    except ConnectionDoesNotExist:
        raise ImproperlyConfigured(
            f"{alias!r} is not a database alias of settings.DATABASES"
        ) from None
    return _store(connection, conf)


def create_schema(using: str | None = None) -> None:
    """Create the outbox table of ``using`` if missing. Idempotent; blocks on the database."""
    get_store(using).create_schema()


def _migrate(connection: Any) -> None:
    """The migration's step: create the outbox on the ``using`` database, skip the others."""
    conf = get_settings()
    if connection.alias != conf.using:
        return
    try:
        store = _store(connection, conf)
    except _InMemory as exc:  # a test database; the worker says why it cannot run
        logger.info("outbound: no outbox created: %s", exc)
        return
    store.create_schema()


# ----------------------------------------------------------------------- enqueue


def enqueue(
    *,
    key: str | int,
    type: str,
    payload: Any,
    dedupe_key: str | None = None,
    delay: float | None = None,
    using: str | None = None,
) -> int:
    """Write one outbox row on Django's connection ``using``, in its current transaction.

    Inside ``transaction.atomic(using=...)`` the row commits or rolls back
    with the block; outside one (autocommit) it is committed at once.
    Returns the row's id. Raises what the store's ``enqueue`` raises:
    ``TypeError``/``ValueError`` for bad arguments (nothing written),
    :class:`~outbound.errors.OutboxFull`, :class:`~outbound.errors.DuplicateMessage`
    (the transaction stays usable), :class:`~outbound.errors.StoreError`
    (the enclosing ``atomic()`` is then marked for rollback, since the
    database may have aborted the transaction). Blocks on the database;
    uses the calling thread's connection, like any ORM call.
    """
    conf = get_settings()
    alias = using or conf.using
    connection = connections[alias]
    store = _store(connection, conf)
    connection.validate_no_broken_transaction()
    connection.ensure_connection()
    raw = connection.connection
    try:
        return store.enqueue(
            raw, key=key, type=type, payload=payload, dedupe_key=dedupe_key, delay=delay
        )
    except StoreError:
        if connection.in_atomic_block:
            transaction.set_rollback(True, using=alias)
        raise
    except TypeError as exc:
        if connection.vendor == "postgresql" and "psycopg.Connection" in str(exc):
            raise ImproperlyConfigured(
                "the outbox on PostgreSQL needs Django to use psycopg 3, not psycopg2"
            ) from exc
        raise


def enqueue_on_commit(
    *,
    key: str | int,
    type: str,
    payload: Any,
    dedupe_key: str | None = None,
    delay: float | None = None,
    using: str | None = None,
) -> int:
    """:func:`enqueue`, then wake this process's relays when the transaction commits.

    The wake-up is a ``transaction.on_commit`` callback: nothing happens
    if the block rolls back. On PostgreSQL, ``NOTIFY`` already wakes the
    relays of every process at commit; on SQLite, relays in other
    processes still find the row at their next poll. Same errors and
    blocking as :func:`enqueue`.
    """
    conf = get_settings()
    alias = using or conf.using
    row_id = enqueue(
        key=key, type=type, payload=payload, dedupe_key=dedupe_key, delay=delay, using=alias
    )
    transaction.on_commit(functools.partial(_wake_local, (alias, conf.table)), using=alias)
    return row_id


# ------------------------------------------------------------------------ relays


def _in_django(handler: Callable[[OutboxMessage], object]) -> Callable[[OutboxMessage], object]:
    """Run ``handler`` like a request: stale database connections closed before and after."""

    @functools.wraps(handler)
    def run(message: OutboxMessage) -> object:
        close_old_connections()
        try:
            return handler(message)
        finally:
            close_old_connections()

    return run


def build_bus() -> EventBus:
    """An :class:`EventBus` with the handlers of ``OUTBOUND["handlers"]`` subscribed.

    Each handler is imported now, and runs with Django's stale database
    connections closed before and after it (as around a request). Raises
    ``ImportError`` for a handler that cannot be imported, or whose module
    raised anything else as it was imported.
    """
    bus = EventBus()
    for type_, path in get_settings().handlers.items():
        try:
            handler = import_string(path)
        except ImportError:
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the module's own code failed (or exited) as it was imported
            raise ImportError(_import_failed(path, exc)) from exc
        bus.subscribe(type_, _in_django(handler))
    return bus


def build_relay(
    bus: EventBus | None = None, *, using: str | None = None, **overrides: Any
) -> Relay:
    """A :class:`~outbound.outbox.Relay` (not started) on the outbox of ``using``.

    Options come from ``OUTBOUND["relay"]``; ``overrides`` replace any of
    them (``batch_size``, ``max_inflight``, ``max_concurrency``, ``lease``,
    ``poll_interval``, ``listen``, ``retry``, ``name``). ``bus`` defaults
    to :func:`build_bus`. Start it with ``start()``, stop it with
    ``stop(timeout)``; :func:`enqueue_on_commit` wakes it at each commit.
    Does not block.
    """
    relay_conf = get_settings().relay
    options: dict[str, Any] = {
        "batch_size": relay_conf.batch_size,
        "max_inflight": relay_conf.max_inflight,
        "max_concurrency": relay_conf.max_concurrency,
        "lease": relay_conf.lease,
        "poll_interval": relay_conf.poll_interval,
        "listen": relay_conf.listen,
        "retry": RetryPolicy(
            max_attempts=relay_conf.max_attempts,
            base_delay=relay_conf.backoff,
            max_delay=relay_conf.backoff_max,
            max_total=DEFAULT_RETRY.max_total,
        ),
    }
    options.update(overrides)
    return Relay(get_store(using), bus if bus is not None else build_bus(), **options)


def close_stores() -> None:
    """Close the stores :func:`get_store` built (their connection pools) and forget them.

    Stop the relays that use them first. The next call builds new ones.
    Thread-safe; blocks while the pools close.
    """
    with _stores_lock:
        stores = list(_stores.values())
        _stores.clear()
    for store in stores:
        store.close()


def close_stores_before_test_databases_drop() -> None:
    """Have Django's test runner close the stores before it drops a test database.

    A PostgreSQL store keeps a pool of connections to its database; one to a
    test database the runner is about to drop would make the drop fail ("being
    accessed by other users") and leave the database on the server. Wraps
    ``BaseDatabaseCreation.destroy_test_db`` once (the runner's way to drop
    one); called by the app's ``ready()``. Idempotent."""
    from django.db.backends.base.creation import BaseDatabaseCreation  # noqa: PLC0415

    original = BaseDatabaseCreation.destroy_test_db
    if getattr(original, "_outbound_closes_stores", False):
        return

    @functools.wraps(original)
    def destroy_test_db(self: Any, *args: Any, **kwargs: Any) -> Any:
        close_stores()
        return original(self, *args, **kwargs)

    destroy_test_db._outbound_closes_stores = True  # type: ignore[attr-defined]
    BaseDatabaseCreation.destroy_test_db = destroy_test_db


def _forget(*, setting: str, **kwargs: Any) -> None:
    if setting == "OUTBOUND":
        close_stores()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's relays or pool threads: start empty."""
    global _stores_lock, _waiters_lock
    _stores_lock = threading.Lock()
    _waiters_lock = threading.Lock()
    _stores.clear()
    _waiters.clear()


setting_changed.connect(_forget, dispatch_uid="outbound.contrib.django.outbox")
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
