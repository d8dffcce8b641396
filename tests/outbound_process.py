"""Run ``python -m outbound ...`` as a real process, with a timeout: the demo and the
simulator as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

FAST = ["--global-rate", "1000", "--chat-rate", "1000", "--latency", "0"]


def outbound(  # type: ignore[no-untyped-def]
    *args: str, timeout: float = 60, env: dict[str, str] | None = None, **kw
):
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbound", *args],
        stdout=kw.pop("stdout", subprocess.PIPE),
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        **kw,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout}s; stderr: {err[-2000:]}")
    return proc.returncode, out or "", err or ""


def run_script_ok(script: str, *args: str, timeout: float = 120) -> None:
    """Run ``script`` in a fresh interpreter (for forks: the test process has
    threads of its own); it must exit 0 having printed ``ok``. The script can
    import this module (``from outbound_process import ...``)."""
    env = dict(os.environ)
    tests = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok", done.stdout + done.stderr


def wait_until_reading_a_body(thread: threading.Thread, timeout: float = 20) -> None:
    """Return once ``thread`` is blocked reading an answer (a ``readinto`` on its
    stack); the test's server sends the head at once and holds the body back.
    Polls every 10 ms; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        frame = sys._current_frames().get(thread.ident or 0)
        while frame is not None:
            if frame.f_code.co_name == "readinto":
                return
            frame = frame.f_back
        assert time.monotonic() < deadline, "the send never read its answer's body"
        time.sleep(0.01)
