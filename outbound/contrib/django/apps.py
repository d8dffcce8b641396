"""The Django app: ``INSTALLED_APPS += ["outbound.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class OutboundConfig(AppConfig):  # type: ignore[misc]
    """Registers the system checks, and has Django's test runner close the outbox's
    connection pools before it drops a test database; starts nothing.

    ``ready()`` runs for every management command and twice under the
    autoreloader, so no thread, connection or dispatcher is made here:
    :func:`~outbound.contrib.django.reply` builds the dispatcher on first
    use, in the process that uses it.
    """

    name = "outbound.contrib.django"
    label = "outbound"
    verbose_name = "outbound"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from .checks import check_settings  # noqa: PLC0415 - needs the app registry ready
        from .outbox import close_stores_before_test_databases_drop  # noqa: PLC0415

        checks.register(check_settings, "outbound")
        close_stores_before_test_databases_drop()
