"""What only a whole Django project shows: `manage.py check` reports a seconds setting
too large for a float as outbound.E003 (no traceback), refuses a table name SQLite keeps
for itself before `migrate` runs, and the test runner on PostgreSQL drops its test
database after a test looked at the outbox (the store's pool is closed first)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from django_scratch import make_project, manage

POSTGRES_URL = os.environ.get("OUTBOUND_TEST_POSTGRES")


@pytest.mark.parametrize(
    "extra",
    [
        'OUTBOUND["send_timeout"] = 10**400',
        'OUTBOUND["relay"] = {"backoff": 10**400}',
        'OUTBOUND["relay"] = {"drain_timeout": 10**400}',
    ],
)
def test_check_reports_a_seconds_setting_too_large_for_a_float(tmp_path: Path, extra: str) -> None:
    done = manage(make_project(tmp_path, extra), "check")
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-1500:]
    assert done.returncode == 1, output[-1500:]
    assert "outbound.E003" in output, output[-1500:]
    assert "must be a finite number of seconds" in output


def test_check_refuses_a_table_sqlite_keeps_for_itself(tmp_path: Path) -> None:
    root = make_project(tmp_path, 'OUTBOUND["table"] = "sqlite_outbox"')
    checked = manage(root, "check")
    output = checked.stdout + checked.stderr
    assert checked.returncode == 1, output[-1500:]
    assert "outbound.E003" in output
    assert "sqlite_" in output
    migrated = manage(root, "migrate", "-v0")
    assert migrated.returncode != 0  # migrate runs the same checks first
    assert "Traceback" not in migrated.stdout + migrated.stderr


TESTS = """
from django.contrib.auth.models import User
from django.test import TestCase


class StatusPageTest(TestCase):
    def test_staff_sees_the_status_json(self):
        staff = User.objects.create_user("ops", is_staff=True)
        self.client.force_login(staff)
        self.assertEqual(self.client.get("/ops/outbox/status.json").status_code, 200)
"""


@pytest.mark.skipif(not POSTGRES_URL, reason="OUTBOUND_TEST_POSTGRES is not set")
def test_the_test_runner_drops_its_postgres_database_after_the_outbox_was_read(
    tmp_path: Path,
) -> None:
    import psycopg  # noqa: PLC0415

    assert POSTGRES_URL is not None
    params = psycopg.conninfo.conninfo_to_dict(POSTGRES_URL)
    test_db = f"outbound_scratch_{uuid.uuid4().hex[:10]}"
    settings = f"""
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql", "NAME": {params.get("dbname", "postgres")!r},
    "USER": {params.get("user", "postgres")!r}, "PASSWORD": {params.get("password", "")!r},
    "HOST": {params.get("host", "127.0.0.1")!r}, "PORT": {str(params.get("port", "5432"))!r},
    "TEST": {{"NAME": {test_db!r}}},
}}}}
"""
    root = make_project(tmp_path, settings, TESTS)
    try:
        done = manage(root, "test", "scratchapp", "--noinput")
        output = done.stdout + done.stderr
        assert "is being accessed by other users" not in output, output[-1500:]
        assert done.returncode == 0, output[-1500:]
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            left = conn.execute(
                "SELECT datname FROM pg_database WHERE datname = %s", (test_db,)
            ).fetchall()
        assert left == [], f"the test database {test_db} was left behind"
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{test_db}" WITH (FORCE)')
