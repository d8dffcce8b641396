"""The admin's view of the outbox table: an unmanaged model, so nothing runs in the database.

Its table follows ``OUTBOUND["table"]``, as the model's does, so that a
changed table needs no new migration.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations, models

import outbound.contrib.django.models as outbox_models


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies: ClassVar[list[tuple[str, str]]] = [("outbound", "0002_outbox_schema_2")]
    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="OutboxRow",
            fields=[
                ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                ("key", models.TextField()),
                ("type", models.TextField()),
                ("payload", outbox_models.PayloadField()),
                ("dedupe_key", models.TextField(null=True)),
                ("status", models.TextField(choices=outbox_models.STATUS_CHOICES)),
                ("head", models.BooleanField()),
                ("seq", models.BigIntegerField(null=True)),
                ("attempts", models.IntegerField()),
                ("available_at", outbox_models.TimestampField()),
                ("lease_owner", models.TextField(null=True)),
                ("lease_token", models.BigIntegerField(null=True)),
                ("lease_expires_at", outbox_models.TimestampField(null=True)),
                ("last_error", models.TextField(null=True)),
                ("created_at", outbox_models.TimestampField()),
                ("updated_at", outbox_models.TimestampField()),
            ],
            options={
                "verbose_name": "outbox row",
                "verbose_name_plural": "outbox rows",
                "db_table": outbox_models.outbox_table(),
                "ordering": ["-id"],
                "default_permissions": ("view", "change"),
                "managed": False,
            },
        ),
    ]
