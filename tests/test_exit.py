"""Interpreter exit: queued work gets exit_timeout to finish, then the process ends."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent(
    """
    import logging, sys, threading
    from outbound import Dispatcher

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    done = []
    d = Dispatcher(max_inflight=2, exit_timeout={exit_timeout})
    d.submit("quick", done.append, "quick")
    forever = threading.Event()
    d.submit("stuck", forever.wait)             # never finishes on its own
    d.submit("stuck", done.append, "behind")    # queued behind it
    d.submit("later", done.append, "later")
    print("main returns", flush=True)
    import atexit
    atexit.register(lambda: print("done at exit:", sorted(done), flush=True))
    """
)


def run_script(exit_timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(exit_timeout=exit_timeout)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc, time.monotonic() - start


def test_exit_with_stuck_work_ends_within_its_bound() -> None:
    proc, elapsed = run_script(exit_timeout=1.0)
    assert proc.returncode == 0, proc.stderr
    assert "main returns" in proc.stdout
    # The quick tasks finished; the one stuck behind the hung task did not,
    # and the process still ended, about exit_timeout after main returned.
    assert "done at exit: ['later', 'quick']" in proc.stdout
    assert "did not finish within exit_timeout=1.0" in proc.stderr
    assert elapsed < 20.0


def test_exit_lets_queued_work_finish() -> None:
    script = textwrap.dedent(
        """
        from outbound import Dispatcher
        results = []
        d = Dispatcher(max_inflight=1, exit_timeout=30.0)
        for i in range(50):
            d.submit("chat", results.append, i)
        import atexit
        atexit.register(lambda: print("count", len(results), flush=True))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "count 50" in proc.stdout
