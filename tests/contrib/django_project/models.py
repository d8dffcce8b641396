"""The application's own data, written in the same transaction as the outbox row."""

from __future__ import annotations

from django.db import models


class Order(models.Model):  # type: ignore[misc]  # Django has no type information here
    chat_id = models.BigIntegerField()
    text = models.TextField()

    class Meta:
        app_label = "django_project"
