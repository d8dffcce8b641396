"""System checks of the ``OUTBOUND`` setting (``manage.py check``; ids ``outbound.E001``-``E005``).

- ``outbound.E001``: ``OUTBOUND`` is not a dict.
- ``outbound.E002``: an unknown key (a typo); the message names it.
- ``outbound.E003``: a bad value: wrong type, out of range, not a choice.
- ``outbound.E004``: ``using`` names no database of ``DATABASES``.
- ``outbound.E005``: a handler or the sender factory cannot be imported,
  or is not callable.

Registered by the app's ``ready()``. Imports the handlers; starts nothing.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from .conf import validate

__all__ = ["check_settings"]


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """One ``checks.Error`` per problem in ``settings.OUTBOUND``. Thread-safe."""
    _, problems = validate(getattr(settings, "OUTBOUND", None), imports=True)
    return [
        checks.Error(
            f"{problem.key}: {problem.message}",
            hint="See outbound.contrib.django.conf for the keys of OUTBOUND.",
            obj="settings.OUTBOUND",
            id=problem.id,
        )
        for problem in problems
    ]
