"""A Ctrl-C landing at every point of ``pause`` and ``close`` where one can: as each
call the library makes begins or returns (a C function's return), one point per run.

Whatever the point, nothing is left waiting for good: a task queued before an
interrupted pause runs once the pause (if it was set) ends, and after an
interrupted close the next ``shutdown`` (which closes again) ends the pool,
also with threads that never time out (``idle_timeout=math.inf``), which
nothing but the close wakes.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from dispatch_helpers import TIMEOUT, until

import outbound
from outbound import Dispatcher, State
from outbound._handoff import Handoff

#: More points than pause or close has on any path (the sweep stops at the
#: first point past the last; this bounds it should that never come).
MOST_POINTS = 400


_PACKAGE = os.path.dirname(outbound.__file__) + os.sep


#: Between taking an idle worker and waking it: the README's "Not guaranteed"
#: (a thread that never times out is lost there).
#: And while force_close moves queued tasks out, one it took may be left
#: unresolved (the same row).
_DOCUMENTED = {
    Handoff.wake_all.__code__,
    Handoff.wake_one.__code__,
    Dispatcher._drop_queued_locked.__code__,
}


def _ours(frame: FrameType | None) -> bool:
    return frame is not None and frame.f_code.co_filename.startswith(_PACKAGE)


def _interrupted(call: Callable[[], object], n: int) -> list[str]:
    """Run ``call`` with a KeyboardInterrupt at its ``n``-th profile event (a
    call beginning or returning); the list names where it landed (empty: ``call``
    has fewer points)."""
    points = [0]
    fired: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if fired or event == "c_call":
            # (Python checks for a signal once a C function returned, not
            # before it runs: a lock's release is never skipped.)
            return
        if event == "c_return" and frame.f_code in _DOCUMENTED:
            return
        if not _ours(frame) and not (event in ("call", "return") and _ours(frame.f_back)):
            # Inside the standard library (threading's own state is not
            # safe from a signal): its calls' beginnings and returns to us
            # are points, not what they do.
            return
        points[0] += 1
        if points[0] == n:
            name = getattr(arg, "__name__", "") if event.startswith("c_") else frame.f_code.co_name
            fired.append(f"{event} {name}")
            raise KeyboardInterrupt

    gc.disable()  # no collector's callback in between: the same points every run
    sys.setprofile(profile)
    try:
        call()
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)
        gc.enable()
    return fired


def _sweep(run: Callable[[int], bool]) -> int:
    for n in range(1, MOST_POINTS):
        if not run(n):
            return n - 1
    pytest.fail(f"more than {MOST_POINTS} points")


def _holding(d: Dispatcher) -> tuple[threading.Event, Any]:
    started, release = threading.Event(), threading.Event()

    def hold() -> str:
        started.set()
        release.wait(TIMEOUT)
        return "held"

    busy = d.submit("busy", hold)
    assert started.wait(TIMEOUT)
    return release, busy


def test_a_task_queued_before_an_interrupted_pause_runs_when_it_ends() -> None:
    # The pause was set, then the Ctrl-C came before its end was put on the
    # timer: the idle worker slept past it for good, the task never ran.
    def run(n: int) -> bool:
        d = Dispatcher(max_inflight=1, idle_timeout=math.inf)
        try:
            release, busy = _holding(d)
            queued = d.submit("k", lambda: "ran")
            fired = _interrupted(lambda: d.pause(0.05), n)
            release.set()
            assert busy.result(TIMEOUT) == "held"
            assert queued.result(TIMEOUT) == "ran", fired
            assert d.drain(TIMEOUT), fired
            assert d.submit("k", lambda: "later").result(TIMEOUT) == "later"
            assert d.shutdown(TIMEOUT), fired
        finally:
            d.force_close()
        return bool(fired)

    assert _sweep(run) > 5


def test_a_pause_extended_by_an_interrupted_pause_still_ends() -> None:
    def run(n: int) -> bool:
        d = Dispatcher(max_inflight=1, idle_timeout=math.inf)
        try:
            release, busy = _holding(d)
            queued = d.submit("k", lambda: "ran")
            d.pause(0.02)
            fired = _interrupted(lambda: d.pause(0.05), n)
            release.set()
            assert busy.result(TIMEOUT) == "held"
            assert queued.result(TIMEOUT) == "ran", fired
            assert d.shutdown(TIMEOUT), fired
        finally:
            d.force_close()
        return bool(fired)

    assert _sweep(run) > 5


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_shutdown_ends_a_pool_whose_close_was_interrupted(busy: bool) -> None:
    # The state moved to closing, then the Ctrl-C came before the drained
    # check: no later close ran it again, and the idle threads (which never
    # time out) were never woken: shutdown() waited for good.
    def run(n: int) -> bool:
        d = Dispatcher(max_inflight=2, idle_timeout=math.inf)
        try:
            assert d.submit("w", lambda: "warm").result(TIMEOUT) == "warm"
            assert until(lambda: d.stats().idle_threads == 1)
            release, held = _holding(d) if busy else (threading.Event(), None)
            fired = _interrupted(d.close, n)
            release.set()
            if held is not None:
                assert held.result(TIMEOUT) == "held"
            assert d.shutdown(TIMEOUT), fired
            assert d.stats().state is State.CLOSED, fired
            assert d.stats().threads == 0, fired
        finally:
            d.force_close()
        return bool(fired)

    assert _sweep(run) > 3


@pytest.mark.parametrize("how", ["force_close", "cancel_futures"])
def test_a_pool_whose_force_close_was_interrupted_still_ends(how: str) -> None:
    # A Ctrl-C at the call that resolves what was taken out left those futures
    # unresolved and counted for good: this thread's next force_close took it
    # for a resolver at work, and shutdown() never returned.
    def run(n: int) -> bool:
        d = Dispatcher(max_inflight=1, idle_timeout=math.inf)
        try:
            release, busy = _holding(d)
            queued = [d.submit("k", lambda: "ran") for _ in range(3)]
            if how == "force_close":
                fired = _interrupted(d.force_close, n)
            else:
                fired = _interrupted(d._cancel_queued, n)
            release.set()
            assert busy.result(TIMEOUT) == "held"
            d.force_close()
            for future in queued:
                assert future.done(), fired
            assert d.shutdown(TIMEOUT), fired
            assert d.stats().state is State.CLOSED, fired
        finally:
            d.force_close()
        return bool(fired)

    assert _sweep(run) > 5
