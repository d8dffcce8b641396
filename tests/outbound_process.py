"""Run ``python -m outbound ...`` as a real process, with a timeout: the demo and the
simulator as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

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
    threads of its own); it must exit 0 having printed ``ok``."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok", done.stdout + done.stderr
