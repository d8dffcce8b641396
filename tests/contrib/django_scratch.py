"""A throwaway Django project in a temporary folder, run with `python -m django` in real
subprocesses: for what only a whole project shows (system checks, migrate, the test runner)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PYTHON = sys.executable

SETTINGS = """
import os
SECRET_KEY = "scratch"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
    "django.contrib.sessions", "django.contrib.messages", "outbound.contrib.django", "scratchapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
              "OPTIONS": {"context_processors": ["django.template.context_processors.request",
                  "django.contrib.auth.context_processors.auth",
                  "django.contrib.messages.context_processors.messages"]}}]
ROOT_URLCONF = "scratchapp.urls"
ALLOWED_HOSTS = ["testserver", "127.0.0.1"]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": os.path.join(os.path.dirname(__file__), "db.sqlite3")}}
OUTBOUND = {"handlers": {"greet": "scratchapp.handlers.greet"}}
"""

URLS = """
from django.contrib import admin
from django.urls import include, path
urlpatterns = [
    path("admin/", admin.site.urls),
    path("ops/outbox/", include("outbound.contrib.django.urls")),
]
"""

HANDLERS = """
def greet(message):
    pass
"""


def make_project(root: Path, extra_settings: str = "", tests: str = "") -> Path:
    app = root / "scratchapp"
    app.mkdir(parents=True)
    (app / "__init__.py").write_text("")
    (app / "settings.py").write_text(SETTINGS + "\n" + textwrap.dedent(extra_settings))
    (app / "urls.py").write_text(URLS)
    (app / "handlers.py").write_text(HANDLERS)
    if tests:
        (app / "tests.py").write_text(textwrap.dedent(tests))
    return root


def manage(root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "DJANGO_SETTINGS_MODULE": "scratchapp.settings",
    }
    return subprocess.run(
        [PYTHON, "-m", "django", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
