"""The commands' stops by signal: a SIGTERM whose handler runs inside the main thread's
own wait for it (the simulator's and the workers' loops) must end that wait.

A ``threading.Event`` set from such a handler waited for the lock its own wait held:
the process hung for good, deaf to every later signal but SIGKILL. Each test lands the
signal deterministically there (a profile function sends it as the wait calls into C)
in a process of its own, so that the old hang fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from outbound._signal_flag import SignalFlag

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="POSIX signals")

# Sends SIGTERM to this process once, from inside a wait called by a function named
# CALLER of a file ending in FILE (the wait's own frame or the one below it: an
# Event's Condition.wait): as it calls a lock's acquire or select.select.
_LANDER = """
import os, signal, sys

def land(caller, file):
    fired = []

    def profile(frame, event, arg):
        if fired or event != "c_call" or getattr(arg, "__name__", "") not in ("acquire", "select"):
            return
        if frame.f_code.co_name != "wait":
            return
        up = frame.f_back
        for _ in range(2):
            if up is None:
                return
            if up.f_code.co_name == caller and up.f_code.co_filename.endswith(file):
                fired.append(True)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            up = up.f_back

    sys.setprofile(profile)
    return fired
"""


def _run_child(body: str, timeout: float = 30.0) -> str:
    """Run ``body`` (after _LANDER) in a child process; its standard output. Fails,
    killing it, if it has not ended within ``timeout`` seconds."""
    code = _LANDER + textwrap.dedent(body)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        pytest.fail(
            "the process did not stop: the signal's handler, run inside the wait for it, "
            f"hung\nstdout: {out}\nstderr: {err}"
        )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {out}\nstderr: {err}"
    return out


def test_worker_signals_stop_ends_when_the_handler_runs_inside_its_wait() -> None:
    out = _run_child(
        """
        import time
        from outbound.contrib._worker import Signals

        signals = Signals()
        signals.install()
        fired = land("<module>", "<string>")
        began = time.monotonic()
        stopped = signals.stop.wait(20.0)
        sys.setprofile(None)
        signals.restore()
        print(bool(fired), stopped, round(time.monotonic() - began, 1))
        """
    )
    fired, stopped, took = out.split()
    assert fired == "True", "the signal did not land inside the wait"
    assert stopped == "True"
    assert float(took) < 10.0, f"the wait went on for {took}s after the signal"


def test_worker_second_signal_inside_the_wait_sets_forced() -> None:
    out = _run_child(
        """
        from outbound.contrib._worker import Signals

        signals = Signals()
        signals.install()
        signals._on_signal(signal.SIGTERM, None)  # the first: stop
        fired = land("<module>", "<string>")
        forced = signals.forced.wait(20.0)
        sys.setprofile(None)
        signals.restore()
        print(bool(fired), forced)
        """
    )
    assert out.split() == ["True", "True"]


def test_simulator_command_stops_when_sigterm_lands_inside_its_wait() -> None:
    out = _run_child(
        """
        from outbound.simulator import main

        fired = land("run", "simulator.py")
        status = main(["--port", "0"])
        sys.setprofile(None)
        print("status", status, bool(fired))
        """
    )
    assert out.splitlines()[-1] == "status 0 True", out
    assert "stopped: 0 requests" in out


# ------------------------------------------------------------------- the flag


def test_wait_times_out_false_and_set_is_for_good() -> None:
    flag = SignalFlag()
    try:
        assert not flag.is_set()
        began = time.monotonic()
        assert flag.wait(0.05) is False
        assert time.monotonic() - began >= 0.04
        assert flag.wait(0) is False
        assert flag.wait(-1.0) is False
        flag.set()
        flag.set()
        assert flag.is_set()
        assert flag.wait(None) is True
        assert flag.wait(threading.TIMEOUT_MAX) is True
    finally:
        flag.close()
        flag.close()


def test_set_from_another_thread_wakes_a_long_wait() -> None:
    flag = SignalFlag()
    try:
        setter = threading.Timer(0.05, flag.set)
        setter.start()
        began = time.monotonic()
        assert flag.wait(threading.TIMEOUT_MAX) is True
        assert time.monotonic() - began < 10.0
        setter.join(10)
    finally:
        flag.close()


def test_many_sets_never_block_once_the_socket_is_full() -> None:
    flag = SignalFlag()
    try:
        for _ in range(200_000):  # far past a socket pair's buffer
            flag.set()
        assert flag.wait(0) is True
    finally:
        flag.close()


def test_a_closed_flag_still_sets_and_waits_by_its_flag() -> None:
    flag = SignalFlag()
    flag.close()
    began = time.monotonic()
    assert flag.wait(0.1) is False
    assert time.monotonic() - began >= 0.09
    flag.set()
    assert flag.wait(5.0) is True
