"""System checks of the ``OUTBOUND`` setting (``manage.py check``; ids ``outbound.E001``-``E006``).

- ``outbound.E001``: ``OUTBOUND`` is not a dict.
- ``outbound.E002``: an unknown key (a typo); the message names it.
- ``outbound.E003``: a bad value: wrong type, out of range, not a choice.
- ``outbound.E004``: ``using`` names no database of ``DATABASES``.
- ``outbound.E005``: a handler or the sender factory cannot be imported,
  or is not callable.
- ``outbound.E006``: the ``using`` database cannot hold the outbox: it is
  PostgreSQL, but Django talks to it through psycopg2, or psycopg_pool is
  missing (the outbox writes its rows on Django's own connection, which
  must be psycopg 3); it is neither PostgreSQL nor SQLite; or it is an
  SQLite URI the relays cannot share (a host, read-only, no locking,
  another VFS). An in-memory SQLite database passes (Django's test
  databases are in memory unless ``TEST["NAME"]`` names a file):
  ``migrate`` then makes no outbox, and the worker and
  ``enqueue_on_commit`` refuse it, saying why.

``manage.py migrate`` runs these checks first, so a setup that the outbox
cannot work with stops there, before any migration runs.

Registered by the app's ``ready()``. Imports the handlers and the
database backend's driver; starts nothing and opens no connection.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from .conf import E_BAD_VALUE, Problem, validate

__all__ = ["E_DRIVER", "check_settings"]

#: The ``using`` database's driver cannot carry the outbox.
E_DRIVER = "outbound.E006"

_DATABASE_HINT = (
    "Point OUTBOUND['using'] at a PostgreSQL database or an SQLite file that every "
    "worker process can open for writing."
)
_POSTGRES_HINT = (
    "pip install 'outbound-dispatcher[postgres]' (psycopg 3 and psycopg-pool); "
    "Django 4.2+ then uses psycopg 3 by itself, and psycopg2 may stay installed."
)


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """One ``checks.Error`` per problem in ``settings.OUTBOUND``. Thread-safe."""
    conf, problems = validate(getattr(settings, "OUTBOUND", None), imports=True)
    errors = [
        checks.Error(
            f"{problem.key}: {problem.message}",
            hint="See outbound.contrib.django.conf for the keys of OUTBOUND.",
            obj="settings.OUTBOUND",
            id=problem.id,
        )
        for problem in problems
    ]
    if conf is not None:
        found = _driver_problem(conf.using, conf.table)
        if found is not None:
            driver, hint = found
            errors.append(
                checks.Error(
                    f"{driver.key}: {driver.message}",
                    hint=hint,
                    obj="settings.OUTBOUND",
                    id=driver.id,
                )
            )
    return errors


def _driver_problem(using: str, table: str) -> tuple[Problem, str] | None:
    """Why the database ``using`` cannot hold the outbox through Django's connection, if so,
    with a hint."""
    from django.db import connections  # noqa: PLC0415 - after settings are configured

    from .outbox import _InMemory, _location  # noqa: PLC0415 - imports django.db

    where = "OUTBOUND['using']"
    try:
        connection = connections[using]
        vendor = connection.vendor
    except ImproperlyConfigured as exc:  # the backend's driver cannot be imported
        return Problem(where, f"database {using!r}: {exc}", E_DRIVER), _POSTGRES_HINT
    if vendor != "postgresql":
        try:
            _location(connection)
        except _InMemory:
            return None
        except ImproperlyConfigured as exc:
            return Problem(where, str(exc), E_DRIVER), _DATABASE_HINT
        if table.startswith("sqlite_"):
            message = (
                "must not begin with 'sqlite_' in SQLite, which keeps those names for "
                f"itself, not {table!r}"
            )
            return Problem("OUTBOUND['table']", message, E_BAD_VALUE), "Name the table otherwise."
        return None
    from django.db.backends.postgresql.psycopg_any import is_psycopg3  # noqa: PLC0415

    if not is_psycopg3:
        return Problem(
            where,
            f"database {using!r} is PostgreSQL through psycopg2; the outbox writes its rows "
            "on Django's connection, inside your transaction, and needs psycopg 3",
            E_DRIVER,
        ), _POSTGRES_HINT
    if importlib.util.find_spec("psycopg_pool") is None:
        return Problem(
            where,
            f"database {using!r} is PostgreSQL; the outbox's relay needs psycopg_pool, "
            "which is not installed",
            E_DRIVER,
        ), _POSTGRES_HINT
    return None
