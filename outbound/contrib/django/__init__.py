"""Django integration (extra ``django``): ``INSTALLED_APPS += ["outbound.contrib.django"]``.

One settings dict, ``OUTBOUND`` (see :mod:`outbound.contrib.django.conf`),
checked by ``manage.py check`` (and so before ``migrate``, which creates
the outbox table). Nothing starts in ``AppConfig.ready()``. The README's
"Django quickstart" goes from ``startproject`` to a delivered message.

- :func:`reply`, :func:`reply_text`: send through this process's
  dispatcher, built on first use (:func:`get_outbound`, :func:`shutdown`).
- :func:`enqueue`, :func:`enqueue_on_commit`: write a durable outbox row on
  Django's own connection, inside the current ``transaction.atomic()``.
- ``manage.py outbound_worker``: deliver the outbox to
  ``OUTBOUND["handlers"]`` in a process of its own (:func:`build_relay`
  for a relay in this one).
- With ``django.contrib.admin``: the outbox rows in the admin
  (:mod:`outbound.contrib.django.admin`); the status page at
  ``include("outbound.contrib.django.urls")`` and in the admin
  (:mod:`outbound.contrib.django.views`).
"""

from __future__ import annotations

try:
    import django as _django
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "outbound.contrib.django needs Django: pip install 'outbound-dispatcher[django]'"
    ) from exc

from .outbox import (
    build_bus,
    build_relay,
    close_stores,
    create_schema,
    enqueue,
    enqueue_on_commit,
    get_store,
)
from .sending import get_outbound, reply, reply_text, shutdown

__all__ = [
    "build_bus",
    "build_relay",
    "close_stores",
    "create_schema",
    "enqueue",
    "enqueue_on_commit",
    "get_outbound",
    "get_store",
    "reply",
    "reply_text",
    "shutdown",
]

del _django
