"""``OutboxRow``: the outbox table as Django sees it, for the admin. Unmanaged, read-only.

The table belongs to the store (:mod:`outbound.outbox`): Django never
creates, alters, flushes or writes it. Rows change only through the store's
own fenced operations (``retry_dead``, ``cancel``, ``dead_letter``; see
:mod:`outbound.contrib.django.admin`), never through ``save()``, which
raises. Its table is ``OUTBOUND["table"]`` on ``OUTBOUND["using"]``; the
two stores keep times differently (Unix seconds on SQLite, ``timestamptz``
on PostgreSQL), and :class:`TimestampField` reads both.
"""

from __future__ import annotations

import datetime as _dt
import json
from decimal import Decimal
from typing import Any, ClassVar

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db import models

__all__ = ["STATUS_CHOICES", "OutboxRow", "PayloadField", "TimestampField", "outbox_table"]

STATUS_CHOICES = [
    ("pending", "pending"),
    ("processing", "processing"),
    ("sent", "sent"),
    ("dead", "dead"),
    ("cancelled", "cancelled"),
]


def outbox_table() -> str:
    """The outbox table name from ``OUTBOUND["table"]`` (``"outbox"`` if the settings are bad:
    ``manage.py check`` reports those)."""
    from .conf import get_settings  # noqa: PLC0415 - settings are read when asked

    try:
        return get_settings().table
    except (ImproperlyConfigured, TypeError, ValueError):
        return "outbox"


class TimestampField(models.Field):  # type: ignore[misc]
    """A moment stored as Unix seconds (SQLite) or ``timestamptz`` (PostgreSQL), read as
    an aware UTC ``datetime``. Only read: the model is never saved."""

    def get_internal_type(self) -> str:
        # No backend converter for this name: from_db_value sees the raw value.
        return "OutboundTimestampField"

    def db_type(self, connection: Any) -> str | None:
        return None  # the store owns the column

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return self.to_python(value)

    def to_python(self, value: Any) -> Any:
        if value is None or isinstance(value, _dt.datetime):
            return value
        if isinstance(value, (int, float, Decimal)):
            return _dt.datetime.fromtimestamp(float(value), tz=_dt.timezone.utc)
        if isinstance(value, str):  # SQLite hands text for a REAL column given text
            try:
                return _dt.datetime.fromtimestamp(float(value), tz=_dt.timezone.utc)
            except ValueError:
                return _dt.datetime.fromisoformat(value)
        return value


class PayloadField(models.TextField):  # type: ignore[misc]
    """The JSON payload as its text (``json`` on PostgreSQL, ``jsonb`` before schema
    version 3; text on SQLite)."""

    def get_internal_type(self) -> str:
        return "OutboundPayloadField"

    def db_type(self, connection: Any) -> str | None:
        return None  # the store owns the column

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        # A driver that decoded the JSON already.
        return json.dumps(value, ensure_ascii=False)


class OutboxRow(models.Model):  # type: ignore[misc]
    """One outbox row (unmanaged: the store owns the table). See :mod:`outbound.outbox`."""

    id = models.BigIntegerField(primary_key=True)
    key = models.TextField()
    type = models.TextField()
    payload = PayloadField()
    dedupe_key = models.TextField(null=True)
    status = models.TextField(choices=STATUS_CHOICES)
    head = models.BooleanField()
    seq = models.BigIntegerField(null=True)
    attempts = models.IntegerField()
    available_at = TimestampField()
    lease_owner = models.TextField(null=True)
    lease_token = models.BigIntegerField(null=True)
    lease_expires_at = TimestampField(null=True)
    last_error = models.TextField(null=True)
    created_at = TimestampField()
    updated_at = TimestampField()

    class Meta:
        managed = False
        db_table = outbox_table()
        ordering: ClassVar[list[str]] = ["-id"]
        default_permissions = ("view", "change")
        verbose_name = "outbox row"
        verbose_name_plural = "outbox rows"

    def __str__(self) -> str:
        return f"row {self.id} ({self.status}, key {self.key})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "outbox rows are changed only by the store's own operations "
            "(get_store().retry_dead(), cancel(), dead_letter()), never saved"
        )

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("outbox rows are deleted only by the store's purge(), never one by one")


def _follow_settings(*, setting: str, **kwargs: Any) -> None:
    """``override_settings(OUTBOUND=...)`` may name another table."""
    if setting == "OUTBOUND":
        OutboxRow._meta.db_table = outbox_table()


setting_changed.connect(_follow_settings, dispatch_uid="outbound.contrib.django.models")
