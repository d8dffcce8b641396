"""Which databases the Django outbox takes: ``manage.py check`` and ``migrate`` refuse,
before any migration runs, every one the worker would refuse; an SQLite ``NAME``
given as a ``file:`` URI (Django opens every ``NAME`` with ``uri=True``) is the
file it names.

Each case is a project of its own in a temporary directory, run as real
``manage.py``-style subprocesses.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "django", reason="Django is not installed: pip install 'outbound-dispatcher[django]'"
)

TIMEOUT = 60.0


def project(tmp_path: Path, databases: str) -> Path:
    """A settings module with ``databases`` (Python source of the DATABASES dict)."""
    (tmp_path / "dbs_settings.py").write_text(
        "SECRET_KEY = 'x'\n"
        "USE_TZ = True\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'outbound.contrib.django']\n"
        f"DATABASES = {databases}\n"
        "OUTBOUND = {}\n",
        encoding="utf-8",
    )
    # A backend Django can load that is neither PostgreSQL nor SQLite.
    backend = tmp_path / "otherdb"
    backend.mkdir(exist_ok=True)
    (backend / "__init__.py").write_text("", encoding="utf-8")
    (backend / "base.py").write_text(
        "from django.db.backends.sqlite3.base import DatabaseWrapper as _Base\n"
        "class DatabaseWrapper(_Base):\n"
        "    vendor = 'otherdb'\n",
        encoding="utf-8",
    )
    return tmp_path


def django(cwd: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env.update(DJANGO_SETTINGS_MODULE="dbs_settings", PYTHONPATH=str(cwd))
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()\n" + code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def manage(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return django(
        cwd,
        "from django.core.management import execute_from_command_line\n"
        f"execute_from_command_line(['manage.py', *{list(argv)!r}])\n",
    )


def uri(path: Path, query: str = "") -> str:
    return "file:" + urllib.parse.quote(str(path)) + (f"?{query}" if query else "")


@pytest.mark.parametrize("query", ["", "mode=rwc&cache=private"])
def test_an_sqlite_uri_name_holds_the_outbox_in_the_file_it_names(
    tmp_path: Path, query: str
) -> None:
    db = tmp_path / "my data.db"  # a space: percent-encoded in the URI
    cwd = project(
        tmp_path,
        f"{{'default': {{'ENGINE': 'django.db.backends.sqlite3', 'NAME': {uri(db, query)!r}}}}}",
    )
    checked = manage(cwd, "check")
    assert checked.returncode == 0, checked.stderr
    migrated = manage(cwd, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    written = django(
        cwd,
        "from django.db import transaction\n"
        "from outbound.contrib.django import enqueue_on_commit, get_store\n"
        "with transaction.atomic():\n"
        "    enqueue_on_commit(key='k', type='t', payload={'n': 1})\n"
        "print(get_store().path)\n",
    )
    assert written.returncode == 0, written.stderr
    assert written.stdout.strip() == str(db)
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT key, type, status FROM outbox").fetchall()
    assert rows == [("k", "t", "pending")]


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("file://db.example/var/app.db", "with a host ('db.example')"),
        ("{uri}?mode=ro", "read-only"),
        ("{uri}?immutable=1", "read-only"),
        # SQLite takes the first of two: it was read-only, and the last said not.
        ("{uri}?immutable=1&immutable=0", "read-only"),
        ("{uri}?nolock=1", "without locking"),
        # Django's connection wrote to SQLite's in-memory VFS, the worker to the file.
        ("{uri}?vfs=memdb", "another VFS"),
        ("{uri}?vfs=unix-dotfile", "another VFS"),
    ],
)
def test_an_sqlite_uri_the_relays_cannot_write_is_refused_before_migrating(
    tmp_path: Path, name: str, says: str
) -> None:
    db = tmp_path / "app.db"
    sqlite3.connect(db).close()  # there, so that a read-only open would succeed
    name = name.replace("{uri}", uri(db))
    cwd = project(
        tmp_path, f"{{'default': {{'ENGINE': 'django.db.backends.sqlite3', 'NAME': {name!r}}}}}"
    )
    for command in ("check", "migrate"):
        done = manage(cwd, command)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "(outbound.E006)" in done.stderr
        assert says in done.stderr
        assert "Traceback" not in done.stderr
        assert "Applying" not in done.stdout  # no migration ran


def test_a_database_neither_postgresql_nor_sqlite_is_refused_before_migrating(
    tmp_path: Path,
) -> None:
    db = tmp_path / "other.db"
    cwd = project(tmp_path, f"{{'default': {{'ENGINE': 'otherdb', 'NAME': {str(db)!r}}}}}")
    done = manage(cwd, "migrate")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "(outbound.E006)" in done.stderr
    assert "database 'default' is otherdb" in done.stderr
    assert "Applying" not in done.stdout


def test_an_in_memory_database_passes_the_checks_and_the_outbox_says_why_it_cannot_run(
    tmp_path: Path,
) -> None:
    """Django's test databases are in memory by default: checks pass, migrate makes no
    outbox, and a write to it names the problem."""
    cwd = project(
        tmp_path, "{'default': {'ENGINE': 'django.db.backends.sqlite3', 'NAME': ':memory:'}}"
    )
    assert manage(cwd, "check").returncode == 0
    done = django(
        cwd,
        "from django.core.management import call_command\n"
        "from django.core.exceptions import ImproperlyConfigured\n"
        "from outbound.contrib.django import enqueue_on_commit\n"
        "call_command('migrate', verbosity=0)\n"
        "try:\n"
        "    enqueue_on_commit(key='k', type='t', payload={})\n"
        "except ImproperlyConfigured as exc:\n"
        "    print('refused:', exc)\n",
    )
    assert done.returncode == 0, done.stderr
    assert "refused: " in done.stdout
    assert "is in memory, which no relay can read" in done.stdout


@pytest.fixture
def role_database() -> Iterator[tuple[str, str]]:
    """A database of its own and a role without login that may create tables in it:
    ``(database, role)``; both dropped after."""
    url = os.environ.get("OUTBOUND_TEST_POSTGRES")
    if not url:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    psycopg = pytest.importorskip("psycopg")
    suffix = uuid.uuid4().hex[:10]
    database, role = f"outbound_role_{suffix}", f"Outbound Role {suffix}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" NOLOGIN')
        admin.execute(f'CREATE DATABASE "{database}"')
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
        with psycopg.connect(**{**info, "dbname": database}, autocommit=True) as conn:
            conn.execute(f'GRANT USAGE, CREATE ON SCHEMA public TO "{role}"')
        yield database, role
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_the_outbox_takes_the_role_django_assumes(
    tmp_path: Path, role_database: tuple[str, str]
) -> None:
    """With ``OPTIONS["assume_role"]`` Django works as that role (``SET ROLE``); the
    outbox did its work as the login user, so the table ``migrate`` made was the
    login user's and a request's write into it, as the role, was refused. The
    store takes the role too (a role name with spaces in it, libpq-escaped)."""
    import psycopg  # noqa: PLC0415

    database, role = role_database
    info = psycopg.conninfo.conninfo_to_dict(os.environ["OUTBOUND_TEST_POSTGRES"])
    settings = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": database,
        "USER": info.get("user", "postgres"),
        "HOST": info.get("host", "127.0.0.1"),
        "PORT": str(info.get("port", "5432")),
        "OPTIONS": {"assume_role": role},
    }
    cwd = project(tmp_path, repr({"default": settings}))
    assert manage(cwd, "migrate", "--verbosity", "0").returncode == 0
    done = django(
        cwd,
        "from django.db import connection, transaction\n"
        "from outbound.contrib.django import enqueue, get_store\n"
        "with transaction.atomic():\n"
        "    enqueue(key='k', type='t', payload={'n': 1})\n"
        "with connection.cursor() as cursor:\n"
        "    cursor.execute('SELECT current_user')\n"
        "    print('django as', cursor.fetchone()[0])\n"
        "print('outbox', get_store().table)\n",
    )
    assert done.returncode == 0, done.stderr
    assert f"django as {role}" in done.stdout
    table = done.stdout.split("outbox ", 1)[1].strip()
    url = psycopg.conninfo.make_conninfo(os.environ["OUTBOUND_TEST_POSTGRES"], dbname=database)
    with psycopg.connect(url) as conn:
        owner = conn.execute(
            "SELECT tableowner FROM pg_tables WHERE tablename = %s", (table,)
        ).fetchone()
        assert owner == (role,)
        assert conn.execute(f'SELECT count(*) FROM "{table}"').fetchone() == (1,)
