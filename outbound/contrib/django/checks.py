"""System checks of the ``OUTBOUND`` setting (``manage.py check``; ids ``outbound.E001``-``E006``).

- ``outbound.E001``: ``OUTBOUND`` is not a dict.
- ``outbound.E002``: an unknown key (a typo); the message names it.
- ``outbound.E003``: a bad value: wrong type, out of range, not a choice.
- ``outbound.E004``: ``using`` names no database of ``DATABASES``.
- ``outbound.E005``: a handler or the sender factory cannot be imported,
  or is not callable.
- ``outbound.E006``: the ``using`` database is PostgreSQL, but Django
  talks to it through psycopg2, or psycopg_pool is missing: the outbox
  writes its rows on Django's own connection, which must be psycopg 3.

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

from .conf import Problem, validate

__all__ = ["E_DRIVER", "check_settings"]

#: The ``using`` database's driver cannot carry the outbox.
E_DRIVER = "outbound.E006"

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
        driver = _driver_problem(conf.using)
        if driver is not None:
            errors.append(
                checks.Error(
                    f"{driver.key}: {driver.message}",
                    hint=_POSTGRES_HINT,
                    obj="settings.OUTBOUND",
                    id=driver.id,
                )
            )
    return errors


def _driver_problem(using: str) -> Problem | None:
    """Why the database ``using`` cannot hold the outbox through Django's connection, if so."""
    from django.db import connections  # noqa: PLC0415 - after settings are configured

    where = "OUTBOUND['using']"
    try:
        vendor = connections[using].vendor
    except ImproperlyConfigured as exc:  # the backend's driver cannot be imported
        return Problem(where, f"database {using!r}: {exc}", E_DRIVER)
    if vendor != "postgresql":
        return None
    from django.db.backends.postgresql.psycopg_any import is_psycopg3  # noqa: PLC0415

    if not is_psycopg3:
        return Problem(
            where,
            f"database {using!r} is PostgreSQL through psycopg2; the outbox writes its rows "
            "on Django's connection, inside your transaction, and needs psycopg 3",
            E_DRIVER,
        )
    if importlib.util.find_spec("psycopg_pool") is None:
        return Problem(
            where,
            f"database {using!r} is PostgreSQL; the outbox's relay needs psycopg_pool, "
            "which is not installed",
            E_DRIVER,
        )
    return None
