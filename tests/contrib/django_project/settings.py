"""Settings of the test project, read from the environment.

- ``OUTBOUND_TEST_POSTGRES``: the PostgreSQL server (``default``); without
  it, ``default`` is an SQLite file too.
- ``OUTBOUND_DJANGO_DIR``: where the SQLite files live.
- ``OUTBOUND_DJANGO_DB``: the database name to use as is (a worker
  subprocess pointed at the test database); otherwise the test runner
  creates ``outbound_django_<pid>``.
- ``OUTBOUND_DJANGO_SIM_URL``, ``OUTBOUND_DJANGO_SIM_TOKEN``: the stand-in
  platform the handlers reply to.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any
from urllib.parse import unquote, urlsplit

_dir = os.environ.get("OUTBOUND_DJANGO_DIR") or tempfile.gettempdir()
_pid = os.getpid()
_url = os.environ.get("OUTBOUND_TEST_POSTGRES")
_fixed = os.environ.get("OUTBOUND_DJANGO_DB")


def _sqlite(name: str, fixed: str | None = None) -> dict[str, Any]:
    test = os.path.join(_dir, f"test_{name}_{_pid}.sqlite3")
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": fixed or os.path.join(_dir, f"{name}.sqlite3"),
        "TEST": {"NAME": test},
    }


def _postgres(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _fixed or unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "TEST": {"NAME": f"outbound_django_{_pid}"},
    }


SECRET_KEY = "outbound-tests"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "outbound.contrib.django",
    "django_project",
]
# The admin and the status page (tests/contrib/test_django_admin.py).
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ROOT_URLCONF = "django_project.urls"
STATIC_URL = "/static/"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DATABASES = {
    "default": _postgres(_url) if _url else _sqlite("default", _fixed),
    "lite": _sqlite("lite"),
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
OUTBOUND: dict[str, Any] = {
    "telegram": {
        # (Set empty: no token, as an environment variable not set gives.)
        "token": os.environ.get("OUTBOUND_DJANGO_SIM_TOKEN", "test-token") or None,
        "base_url": os.environ.get("OUTBOUND_DJANGO_SIM_URL", "http://127.0.0.1:9"),
    },
    "rate_limits": None,
    "send_timeout": 10.0,
    "handlers": {
        "greet": "django_project.handlers.greet",
        "stall": "django_project.handlers.stall",
        "stubborn": "django_project.handlers.stubborn",
        "impatient": "django_project.handlers.impatient",
        "fire": "django_project.handlers.fire",
        "flaky": "django_project.handlers.flaky",
        "refused": "django_project.handlers.refused",
    },
    "relay": {"lease": 10.0, "poll_interval": 0.5, "drain_timeout": 10.0},
}
LOGGING_CONFIG = None
