"""The PostgreSQL store's watchdog on its own: no database needed.

It shuts down the socket of a call that outlives its deadline; a socket
pair stands in for a connection whose peer stopped answering.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator

import pytest

from outbound.outbox.postgres import _WATCHDOG, _WATCHDOG_IDLE, _Watchdog

from .conftest import wait_for

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.fixture
def idle_watchdog() -> None:
    """The watchdog's thread, if a test before left one, has ended."""
    wait_for(lambda: _WATCHDOG._thread is None, timeout=10)


def _blocked_read_is_cut(deadline: float = 0.2) -> bool:
    """A read on a silent socket, bounded by the watchdog: cut (True) or not."""
    mine, peer = socket.socketpair()
    try:
        mine.settimeout(10.0)  # only if the watchdog fails
        with _WATCHDOG.bound(mine, deadline) as dropped:
            try:
                data = mine.recv(1)
            except TimeoutError:
                return False
        return data == b"" and dropped()
    finally:
        mine.close()
        peer.close()


@contextlib.contextmanager
def held_elsewhere(wd: _Watchdog = _WATCHDOG, seconds: float = 60.0) -> Iterator[None]:
    """Another thread holds a block bounded by ``seconds`` for the block's
    length; it must not have been dropped."""
    holding = threading.Event()
    release = threading.Event()
    mine, peer = socket.socketpair()
    outcome: list[bool] = []

    def hold() -> None:
        with wd.bound(mine, seconds) as dropped:
            holding.set()
            release.wait(30.0)
        outcome.append(dropped())

    holder = threading.Thread(target=hold, name="holder")
    holder.start()
    try:
        assert holding.wait(10.0)
        yield
    finally:
        release.set()
        holder.join(10.0)
        mine.close()
        peer.close()
    assert outcome == [False]


def test_a_silent_read_is_cut_at_its_deadline(idle_watchdog: None) -> None:
    assert _blocked_read_is_cut()


def test_a_forked_child_has_a_watchdog_of_its_own(idle_watchdog: None) -> None:
    # The parent's thread is running (a statement just ran) when it forks:
    # the child inherits its object, not the thread, and maybe a held lock.
    with held_elsewhere():
        assert _WATCHDOG._thread is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded fork"
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            try:
                os._exit(0 if _blocked_read_is_cut() else 1)
            finally:
                os._exit(2)
        deadline = time.monotonic() + 20.0
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the child's silent read was never cut")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0


def test_a_thread_that_cannot_start_is_started_by_the_next_call(
    idle_watchdog: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_start = threading.Thread.start

    def no_threads_left(thread: threading.Thread) -> None:
        if thread.name == "outbound-pg-watchdog":
            monkeypatch.setattr(threading.Thread, "start", real_start)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", no_threads_left)
    caplog.set_level(logging.WARNING, logger="outbound")
    mine, peer = socket.socketpair()
    try:
        with _WATCHDOG.bound(mine, 60.0):  # runs unbounded, and says so
            pass
    finally:
        mine.close()
        peer.close()
    assert "cannot start the outbox connection watchdog" in caplog.text
    assert _WATCHDOG._armed == {}
    assert _blocked_read_is_cut()


def test_ctrl_c_while_the_thread_starts_leaves_nothing_armed(
    idle_watchdog: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_start = threading.Thread.start

    def interrupted(thread: threading.Thread) -> None:
        if thread.name == "outbound-pg-watchdog":
            monkeypatch.setattr(threading.Thread, "start", real_start)
            raise KeyboardInterrupt
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    mine, peer = socket.socketpair()
    try:
        with pytest.raises(KeyboardInterrupt), _WATCHDOG.bound(mine, 60.0):
            pytest.fail("the call runs after an interrupted start")  # pragma: no cover
    finally:
        mine.close()
        peer.close()
    assert _WATCHDOG._armed == {}
    assert _blocked_read_is_cut()


def _counting_notify(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the wake-ups of the watchdog's thread from now on."""
    calls = [0]
    cond = _WATCHDOG._cond
    real = cond.notify

    def notify(n: int = 1) -> None:
        calls[0] += 1
        real(n)

    monkeypatch.setattr(cond, "notify", notify)
    return calls


def test_statements_bounded_far_ahead_do_not_wake_the_thread(
    idle_watchdog: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A relay bounds every statement by many seconds: waking the thread for
    # each (to re-arm, then to idle) made it compete with the relay's loop
    # for the GIL twice per statement.
    mine, peer = socket.socketpair()
    try:
        with _WATCHDOG.bound(mine, 60.0):
            pass
        wait_for(lambda: _WATCHDOG._next < math.inf, timeout=10)  # the thread waits
        thread = _WATCHDOG._thread
        calls = _counting_notify(monkeypatch)
        for _ in range(1000):
            with _WATCHDOG.bound(mine, 60.0) as dropped:
                assert not dropped()
        assert calls[0] == 0
        assert _WATCHDOG._thread is thread
        assert _WATCHDOG._armed == {}
    finally:
        mine.close()
        peer.close()


def test_a_short_deadline_wakes_a_thread_waiting_on_a_long_one(
    idle_watchdog: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with held_elsewhere():
        wait_for(lambda: _WATCHDOG._next < math.inf, timeout=10)
        calls = _counting_notify(monkeypatch)
        started = time.monotonic()
        assert _blocked_read_is_cut(0.05)
        # Cut near its deadline, not at the thread's next periodic look.
        assert time.monotonic() - started < _WATCHDOG_IDLE
        assert calls[0] == 1


def test_the_thread_stays_while_statements_run_and_ends_once_idle(idle_watchdog: None) -> None:
    # Statements that come and go between two of its looks keep it (no
    # thread per burst); with none for _WATCHDOG_IDLE it ends.
    mine, peer = socket.socketpair()
    threads: set[threading.Thread | None] = set()
    try:
        until = time.monotonic() + 2.5 * _WATCHDOG_IDLE
        while time.monotonic() < until:
            with _WATCHDOG.bound(mine, 60.0):
                threads.add(_WATCHDOG._thread)
            time.sleep(0.01)  # a statement every 10 ms, none in between
    finally:
        mine.close()
        peer.close()
    assert len(threads) == 1
    (thread,) = threads
    assert thread is not None
    thread.join(3 * _WATCHDOG_IDLE + 10.0)
    assert not thread.is_alive()
    assert _WATCHDOG._thread is None
