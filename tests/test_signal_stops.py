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
from types import FrameType
from typing import Any

import pytest

from outbound._signal_flag import SignalFlag
from outbound.contrib._worker import Signals
from outbound.outbox.web.cli import sigterm_stops

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


# ------------------------------------------------------------- second signals


@pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="CPython 3.10 runs a signal handler unprofiled: no call in it to land on",
)
def test_a_second_signal_landing_anywhere_in_the_first_ones_handler_forces() -> None:
    # The handler looked at `stop`, then set it: a second signal whose handler
    # ran between the two counted as a first, and the stop was never forced
    # (the worker drained to its deadline). Swept over every call the first
    # handler makes.
    n = 1
    while True:
        signals = Signals()
        signals.install()
        calls = [0]
        fired: list[bool] = []

        def profile(frame: FrameType, event: str, arg: Any, n: int = n) -> None:
            if fired or event not in ("return", "c_return"):
                return
            caller = frame if event == "c_return" else frame.f_back
            if caller is None or caller.f_code.co_name != "_on_signal":
                return
            calls[0] += 1
            if calls[0] == n:
                fired.append(True)
                os.kill(os.getpid(), signal.SIGINT)  # its handler runs as this returns

        sys.setprofile(profile)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            sys.setprofile(None)
            forced = signals.forced.wait(5.0)
            signals.restore()
        if not fired:
            break
        assert forced, f"two signals, and no force (the second at call {n} of the first's)"
        n += 1
    assert n > 1, "the handler made no call to land on"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_signal_to_a_process_forked_from_a_worker_does_what_it_would_have_done() -> None:
    # A handler's multiprocessing helper (forked) inherited the worker's
    # handlers: terminate() only set the child's copy of the flag (it never
    # ended), and the byte it wrote to the shared socket pair woke the
    # parent's waits at once, for good: the idle worker spun at full CPU.
    signals = Signals()
    signals.install()
    try:
        pid = os.fork()
        if pid == 0:  # the child: waits to be told to stop
            try:
                signals.stop.wait(20.0)
            finally:
                os._exit(3)
        ready = time.monotonic() + 0.2
        while time.monotonic() < ready:  # (the child reaches its wait)
            signals.stop.wait(0.05)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), f"the child went on to exit {os.WEXITSTATUS(status)}"
        assert os.WTERMSIG(status) == signal.SIGTERM
        assert not signals.stop.is_set()
        began = time.thread_time()
        assert signals.stop.wait(0.3) is False
        assert time.thread_time() - began < 0.15, "the parent's wait spun"
    finally:
        signals.restore()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_flag_set_in_a_forked_process_wakes_no_wait_of_its_parent() -> None:
    flag = SignalFlag()
    try:
        pid = os.fork()
        if pid == 0:
            flag.set()
            os._exit(0)
        os.waitpid(pid, 0)
        began = time.thread_time()
        assert flag.wait(0.3) is False
        assert time.thread_time() - began < 0.15, "the wait spun on the child's byte"
    finally:
        flag.close()


def test_sigterm_stops_raises_once_whatever_follows() -> None:
    # A second signal raised while the first's KeyboardInterrupt unwound a
    # lock's wait (RuntimeError: release unlocked lock, a traceback and
    # status 1), or inside the bounded stop the first started (the demo's
    # relay left running, its rows 'processing').
    sigint = signal.getsignal(signal.SIGINT)
    with sigterm_stops():
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGHUP)
        if sigint is signal.default_int_handler:
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is sigint


def test_every_waiter_of_a_set_flag_returns_at_once() -> None:
    # wait() read the wake byte out: one waiter took it and the other slept
    # out its timeout on a flag that was set.
    flag = SignalFlag()
    took: dict[str, float] = {}

    def waiter(name: str) -> None:
        began = time.monotonic()
        flag.wait(30.0)
        took[name] = time.monotonic() - began

    threads = [threading.Thread(target=waiter, args=(name,)) for name in "AB"]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.05)  # (both in their select, most likely; either way they must end)
        flag.set()
        for thread in threads:
            thread.join(10.0)
        assert not any(thread.is_alive() for thread in threads), "a waiter missed the set"
        assert sorted(took) == ["A", "B"]
    finally:
        flag.set()
        flag.close()


_RESTORE_CUT = r"""
import os, signal, sys, time
from outbound.outbox.web.cli import sigterm_stops

N = int(sys.argv[1])
calls = []
def profile(frame, event, arg):
    if (event == "return" and frame.f_code.co_name == "signal"
            and frame.f_back is not None and frame.f_back.f_code.co_name == "sigterm_stops"):
        calls.append(1)
        if len(calls) == N:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGINT)
sys.setprofile(profile)
try:
    with sigterm_stops():
        pass
except KeyboardInterrupt:
    pass
sys.setprofile(None)
if len(calls) < N:
    print("past")
    sys.exit(0)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    print("interrupted")
    sys.exit(0)
print("ignored")
"""


def test_a_ctrl_c_as_sigterm_stops_puts_its_handlers_back_leaves_ctrl_c_working() -> None:
    # A Ctrl-C landing in the loop that put the handlers back cut it short:
    # SIGINT kept the spent handler, and every later Ctrl-C did nothing.
    # Swept over each handler installed and put back.
    n = 1
    while True:
        out = subprocess.run(
            [sys.executable, "-c", _RESTORE_CUT, str(n)],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
        assert out.returncode == 0, out.stderr
        if out.stdout.strip() == "past":
            break
        assert out.stdout.strip() == "interrupted", f"a later Ctrl-C was ignored (at call {n})"
        n += 1
    assert n > 4
