"""Bring the outbox table to the store's schema version 4 (PostgreSQL: a new
row is written only when it becomes its key's head; new rows are found by
key).

As in ``0002``, the store migrates its own tables (``create_schema``); on a
database whose outbox is already current this only reads the version. Stop
the ``outbound_worker`` processes of the older version first.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations


def migrate_outbox(apps: Any, schema_editor: Any) -> None:
    from outbound.contrib.django.outbox import _migrate  # noqa: PLC0415

    _migrate(schema_editor.connection)


class Migration(migrations.Migration):  # type: ignore[misc]
    # The store migrates its tables on a connection of its own, in one
    # transaction; nothing to wrap in this connection's transaction.
    atomic = False
    dependencies: ClassVar[list[tuple[str, str]]] = [("outbound", "0004_outbox_schema_3")]
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(migrate_outbox, migrations.RunPython.noop, elidable=False)
    ]
