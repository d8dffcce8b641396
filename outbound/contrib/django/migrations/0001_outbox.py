"""Create the outbox table on the ``OUTBOUND["using"]`` database (the store's own schema)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations


def create_outbox(apps: Any, schema_editor: Any) -> None:
    from outbound.contrib.django.outbox import _migrate  # noqa: PLC0415

    _migrate(schema_editor.connection)


class Migration(migrations.Migration):  # type: ignore[misc]
    # The store creates its tables on a connection of its own; nothing to
    # wrap in this connection's transaction.
    atomic = False
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(create_outbox, migrations.RunPython.noop, elidable=False)
    ]
