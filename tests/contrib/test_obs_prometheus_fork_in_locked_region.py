"""A fork made while the forking thread itself holds prometheus_client's
multiprocess value lock (a signal handler that forks, running while the main
thread is inside ``Counter.inc``) returns in the parent, and the child can
update its metrics: the lock is freed in the child, not held across the fork."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

SCRIPT = textwrap.dedent(
    r"""
    import os, signal, sys
    import prometheus_client
    import prometheus_client.values as values
    from outbound.contrib.prometheus import PrometheusMetrics, _multiprocess_lock

    PrometheusMetrics(prometheus_client.CollectorRegistry())
    lock = _multiprocess_lock()
    assert lock is not None, "not in multiprocess mode"
    counter = prometheus_client.Counter("c", "c", registry=None)

    def on_signal(signum, frame):
        # e.g. a pre-fork master that spawns a worker from a signal handler
        pid = os.fork()
        if pid == 0:
            counter.inc()      # the child can update its metrics
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("forked, child status", status, flush=True)

    signal.signal(signal.SIGUSR1, on_signal)

    fired = []
    def tracer(frame, event, arg):
        if frame.f_code.co_filename == values.__file__ and frame.f_code.co_name == "inc":
            def local(frame, event, arg):
                if event == "line" and lock.locked() and not fired:
                    fired.append(1)
                    signal.raise_signal(signal.SIGUSR1)   # handler runs here, lock held
                return local
            return local
        return None

    sys.settrace(tracer)
    counter.inc()
    sys.settrace(None)
    assert fired
    print("parent done", flush=True)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_from_handler_while_lock_held_does_not_hang(tmp_path: Path) -> None:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process hung at the fork (output so far: {exc.stdout!r})")
    assert proc.returncode == 0, proc.stderr
    assert "forked, child status 0" in proc.stdout
    assert "parent done" in proc.stdout
