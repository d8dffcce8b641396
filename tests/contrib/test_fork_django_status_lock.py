"""Django status view: the lock that guards the per-store monitors (views._lock) is not
made new in a forked child, unlike every other lock of the Django integration.

The integration renews its module locks at a fork for exactly this reason
(sending.py, outbox.py and conf.py each register an ``after_in_child`` hook: "Another
thread may have held the lock at the fork"), and its stores are rebuilt per process
(outbox._after_fork_in_child); outbound/contrib/django/views.py:48 ``_lock`` is left as
the fork found it. A parent thread serving a status request (``monitor()``, under that
lock) when the process forks leaves the child's first status request waiting on it for
good. README "Pre-fork servers": "one a parent thread held at the fork would otherwise
stay held there for good ... So gunicorn --preload is safe and post_fork needs nothing".

The case holds the lock in another parent thread (as a thread inside ``monitor()`` does),
forks, and has the child ask for the monitor, every wait bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("django")
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    r"""
    import json, os, select, sys, threading
    import django
    from django.conf import settings
    settings.configure(
        SECRET_KEY="x", USE_TZ=True,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth",
                        "outbound.contrib.django"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                               "NAME": os.path.join(sys.argv[1], "db.sqlite3")}},
        OUTBOUND={},
    )
    django.setup()
    from outbound.contrib.django import views
    from outbound.contrib.django.outbox import create_schema

    create_schema()
    views.monitor().snapshot()          # the status page, used in the parent

    holding, done = threading.Event(), threading.Event()
    def hold():
        with views._lock:               # a parent thread inside monitor()
            holding.set()
            done.wait(30)
    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result = []
            def ask():
                try:
                    result.append(views.monitor().snapshot().counts.get("pending", 0))
                except BaseException as exc:
                    result.append(repr(exc))
            t = threading.Thread(target=ask, daemon=True)
            t.start()
            t.join(10)
            word = result[0] if result else "monitor() still blocked after 10 s"
            os.write(w, json.dumps(word).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    done.set()
    holder.join(10)
    ready, _, _ = select.select([r], [], [], 30)
    child = json.loads(os.read(r, 4096) or b"null") if ready else "no word from the child"
    os.waitpid(pid, 0)
    parent = views.monitor().snapshot().counts.get("pending", 0)
    print(json.dumps({"child": child, "parent": parent}))
    """
)


def test_a_child_reads_the_status_though_a_parent_thread_was_in_monitor(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is checked below
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["parent"] == 0, out
    assert out["child"] == 0, f"the child's status request did not complete: {out}"
