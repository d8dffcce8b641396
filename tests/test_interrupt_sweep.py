"""A Ctrl-C landing at every point of ``submit`` where one can: the entry of each
Python function it calls (a signal handler runs there), one point per run.

Whatever the point: the interrupted submit either returned a future that
resolves, or raised and its task never runs; the key goes on working (a
later task of it runs), no thread or room in the pool is lost, and
``drain`` and ``shutdown`` finish. Each scenario is swept until the point
counter passes the last call submit makes.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from types import FrameType
from typing import Any, TypeVar

import pytest
from dispatch_helpers import TIMEOUT, until
from interrupts import interrupt_after_call

import outbound
from outbound import Defer, Dispatcher, KeyedExecutor, current_context
from outbound._lane import Task

T = TypeVar("T")

#: More calls than submit makes on any path (the sweep stops at the first
#: point past the last call; this bounds it should that never come).
MOST_CALLS = 200


def _stdlib_defect(frame: FrameType) -> bool:
    """Python 3.13's ``Thread.start`` reads ``self.daemon`` (a property) after listing
    the thread and inside a ``try`` that unlists it only for an ``Exception``:
    a Ctrl-C landing there leaves a thread that never starts listed by
    ``threading.enumerate()`` for good, whoever starts it. Not counted."""
    code = frame.f_code
    return code.co_name == "daemon" and code.co_filename == threading.__file__


def _interrupt_at(n: int) -> tuple[Callable[[FrameType, str, Any], Any], list[str]]:
    """A trace function raising KeyboardInterrupt at the entry of the ``n``-th call
    made in this thread; the list gets the name of the function it landed in."""
    calls = [0]
    fired: list[str] = []

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if _stdlib_defect(frame):
            return None
        if event == "call" and not fired:
            calls[0] += 1
            if calls[0] == n:
                fired.append(frame.f_code.co_name)
                raise KeyboardInterrupt
        return None

    return trace, fired


def _submit_interrupted(
    d: Dispatcher, key: str, n: int, ran: list[str]
) -> tuple[Future[None] | None, list[str]]:
    trace, fired = _interrupt_at(n)
    future = None
    gc.disable()  # no collector's callback in between: the same points every run
    sys.settrace(trace)
    try:
        future = d.submit(key, ran.append, "interrupted")
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
        gc.enable()
    return future, fired


def _check(d: Dispatcher, future: Future[None] | None, ran: list[str], keys: list[str]) -> None:
    if future is not None:
        try:
            future.result(TIMEOUT)
        except CancelledError:
            pass
    later = [d.submit(key, ran.append, key) for key in keys]
    for f in later:
        assert f.result(TIMEOUT) is None
    assert d.drain(TIMEOUT)
    if future is None:
        assert "interrupted" not in ran  # submit raised: the task never runs
    stats = d.stats()
    assert stats.threads <= stats.max_inflight
    assert stats.lanes == 0


def _sweep(run: Callable[[int], bool]) -> int:
    """Run the scenario with the Ctrl-C at call 1, 2, ... until one lands nowhere."""
    for n in range(1, MOST_CALLS):
        if not run(n):
            return n - 1
    pytest.fail(f"submit made more than {MOST_CALLS} calls")


@pytest.mark.parametrize(("max_inflight", "idle_worker"), [(1, False), (2, False), (2, True)])
def test_a_ctrl_c_anywhere_in_submitting_to_a_new_key(max_inflight: int, idle_worker: bool) -> None:
    def run(n: int) -> bool:
        d = Dispatcher(max_inflight=max_inflight, idle_timeout=30.0)
        ran: list[str] = []
        try:
            if idle_worker:
                assert d.submit("w", ran.append, "w").result(TIMEOUT) is None
                assert until(lambda: d.stats().idle_threads == 1)
            future, fired = _submit_interrupted(d, "k", n, ran)
            _check(d, future, ran, ["k", "z"])
        finally:
            assert d.shutdown(TIMEOUT)
        return bool(fired)

    assert _sweep(run) > 5


def test_a_ctrl_c_anywhere_in_submitting_to_a_busy_key_or_a_full_pool() -> None:
    def run(n: int) -> bool:
        d = Dispatcher(max_inflight=2, idle_timeout=30.0)
        ran: list[str] = []
        release = threading.Event()
        started = threading.Barrier(3)

        def hold() -> None:
            started.wait(TIMEOUT)
            release.wait(TIMEOUT)

        try:
            busy = [d.submit("k", hold), d.submit("other", hold)]
            started.wait(TIMEOUT)
            future, fired = _submit_interrupted(d, "k", n, ran)
            also, fired_too = _submit_interrupted(d, "third", n, ran)
            release.set()
            for f in busy:
                assert f.result(TIMEOUT) is None
            _check(d, future, ran, ["k", "third"])
            if also is not None:
                try:
                    also.result(TIMEOUT)
                except CancelledError:
                    pass
        finally:
            release.set()
            assert d.shutdown(TIMEOUT)
        return bool(fired or fired_too)

    assert _sweep(run) > 1


def test_a_ctrl_c_anywhere_in_an_executors_unkeyed_submit() -> None:
    # KeyedExecutor.submit: a task of no lane, counted until resolved. One
    # left counted (never queued) kept drain() from ever finishing.
    def run(n: int) -> bool:
        ex = KeyedExecutor(max_workers=2)
        ran: list[str] = []
        trace, fired = _interrupt_at(n)
        future = None
        gc.disable()
        sys.settrace(trace)
        try:
            future = ex.submit(ran.append, "interrupted")
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
            gc.enable()
        try:
            if future is not None:
                try:
                    future.result(TIMEOUT)
                except CancelledError:
                    pass
            assert ex.submit(ran.append, "later").result(TIMEOUT) is None
            assert ex._dispatcher.drain(TIMEOUT)
            if future is None:
                assert "interrupted" not in ran
        finally:
            ex._dispatcher.force_close()
            ex._dispatcher.shutdown(TIMEOUT)  # bounded: a count left over would hang shutdown()
        return bool(fired)

    assert _sweep(run) > 5


def test_a_ctrl_c_as_any_call_of_growing_the_pool_returns_gives_every_job_back() -> None:
    # _grow_locked takes ready lanes (any key's, with their accepted tasks)
    # for new workers. A Ctrl-C as its take() returned (right after the
    # popleft) lost the lane: its futures never resolved and no shutdown
    # ever ended. Swept over every call it makes, as each returns.
    code = Dispatcher._grow_locked.__code__

    def run(n: int) -> bool:
        d = Dispatcher(max_inflight=4, idle_timeout=30.0)
        try:
            d.pause(10 * TIMEOUT)  # lanes queue; no thread starts for them
            order: list[str] = []
            futures = [d.submit(key, order.append, f"{key}{i}") for i, key in enumerate("aabbc")]
            profile, fired = interrupt_after_call(code, n)
            made = None
            with d._lock:
                ready = list(d._handoff.ready)
                assert len(ready) == 3
                assert not d._workers
                gc.disable()
                sys.setprofile(profile)
                try:
                    made = d._grow_locked()
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.setprofile(None)
                    gc.enable()
                if fired:
                    assert made is None
                    assert list(d._handoff.ready) == ready  # every job back, in order
                    assert not d._workers  # and no worker that never starts listed
                d._paused_until = 0.0  # the pause over: the next submit grows the pool
            if made:
                d._give_up(made)
            assert d.submit("z", order.append, "z").result(TIMEOUT) is None
            for f in futures:
                assert f.result(TIMEOUT) is None
            assert [x for x in order if x[0] == "a"] == ["a0", "a1"]
            assert [x for x in order if x[0] == "b"] == ["b2", "b3"]
            assert d.drain(TIMEOUT)
            assert d.stats().lanes == 0
        finally:
            assert d.shutdown(TIMEOUT)
        return bool(fired)

    assert _sweep(run) >= 6


_PACKAGE = os.path.dirname(outbound.__file__) + os.sep


def _interrupted_at_return(n: int, call: Callable[[], T]) -> tuple[T | None, list[str]]:
    """Run ``call`` with a KeyboardInterrupt as the ``n``-th call made in the library
    returns (a signal handler's, where CPython checks for one); its result (None
    if interrupted) and the list naming where it landed (empty: fewer points)."""
    points = [0]
    fired: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if fired or event not in ("return", "c_return"):
            return
        caller = frame if event == "c_return" else frame.f_back
        if caller is None or not caller.f_code.co_filename.startswith(_PACKAGE):
            return
        points[0] += 1
        if points[0] == n:
            fired.append(frame.f_code.co_name)
            raise KeyboardInterrupt

    result = None
    gc.disable()  # no collector's callback in between: the same points every run
    sys.setprofile(profile)
    try:
        result = call()
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)
        gc.enable()
    return result, fired


@pytest.mark.parametrize("then", ["drain", "submit"])
def test_a_ctrl_c_as_any_call_returns_in_a_submit_that_grows_the_pool_loses_no_lane(
    then: str,
) -> None:
    # The pool grew for other keys' ready lanes, and the Ctrl-C came as
    # _grow_locked (or its callers) returned, before submit had the new
    # workers to start: they stayed listed, never started, their lanes
    # with them; those keys' futures never resolved, no later submit ran,
    # and no shutdown ended. Swept over every return in the library during
    # the submit; then the interrupted submit's own handler, a drain() or a
    # later submit starts what was left.
    def run(n: int) -> bool:
        d = Dispatcher(max_inflight=4, idle_timeout=30.0)
        try:
            d.pause(10 * TIMEOUT)
            futures = [d.submit(key, str, key) for key in "abc"]
            with d._lock:
                assert len(d._handoff.ready) == 3
                assert not d._workers
                # The pause over, as its timer leaves it when it cannot start
                # a thread: the next submit or drain() grows the pool.
                d._paused_until = 0.0
                d._stranded = True
            _, fired = _interrupted_at_return(n, lambda: d.submit("z", str, "z"))
            if then == "drain":
                assert d.drain(TIMEOUT)
            else:
                assert d.submit("later", str, "later").result(TIMEOUT) == "later"
            assert [f.result(TIMEOUT) for f in futures] == ["a", "b", "c"]
            assert d.drain(TIMEOUT)
            stats = d.stats()
            assert stats.lanes == 0
            assert stats.threads <= stats.max_inflight
            with d._lock:
                assert not d._unstarted
        finally:
            assert d.shutdown(TIMEOUT)
        return bool(fired)

    assert _sweep(run) > 20


def test_a_ctrl_c_as_any_call_returns_in_a_drain_that_restarts_the_pool_strands_nothing() -> None:
    # drain() grows the pool for lanes queued with no thread (a start that
    # failed). It cleared the mark of that before growing: a Ctrl-C landing
    # before the growing took a lane left them queued with no thread and no
    # mark, and no later drain() ever ended.
    def run(n: int) -> bool:
        d = Dispatcher(max_inflight=2, idle_timeout=30.0)
        try:
            d.pause(10 * TIMEOUT)
            futures = [d.submit(key, str, key) for key in "abcd"]
            with d._lock:
                # The pause over, as its timer leaves it when it cannot start
                # a thread: the next submit or drain() grows the pool.
                d._paused_until = 0.0
                d._stranded = True
            _, fired = _interrupted_at_return(n, lambda: d.drain(TIMEOUT))
            assert d.drain(TIMEOUT)
            assert [f.result(TIMEOUT) for f in futures] == list("abcd")
            stats = d.stats()
            assert stats.lanes == 0
            assert stats.threads <= stats.max_inflight
        finally:
            assert d.shutdown(TIMEOUT)
        return bool(fired)

    assert _sweep(run) > 10


def test_a_ctrl_c_as_any_call_returns_in_an_executors_unkeyed_submit_that_grows_the_pool() -> None:
    # KeyedExecutor.submit grew the pool for its task; a Ctrl-C as the
    # growing returned left the new worker listed and never started: with
    # max_workers=1 every later unkeyed submit's future never resolved.
    def run(n: int) -> bool:
        ex = KeyedExecutor(max_workers=1)
        try:
            future, fired = _interrupted_at_return(n, lambda: ex.submit(str, "interrupted"))
            if future is not None:
                try:
                    future.result(TIMEOUT)
                except CancelledError:
                    pass
            assert ex.submit(str, "later").result(TIMEOUT) == "later"
            stats = ex.stats()
            assert stats.threads <= stats.max_inflight
            # (Pushed by a call whose return a Ctrl-C could land on, a task
            # was queued and not counted: it counted out one too many.)
            assert ex._dispatcher.drain(TIMEOUT)
        finally:
            assert ex._dispatcher.shutdown(TIMEOUT)
        return bool(fired)

    assert _sweep(run) > 10


@contextlib.contextmanager
def _pool_and_gate(workers: int) -> Iterator[tuple[KeyedExecutor, threading.Event]]:
    """A KeyedExecutor and the gate its blocked tasks wait on; on the way out the
    gate opens and the pool is shut down, its queue cancelled."""
    executor = KeyedExecutor(max_workers=workers)
    gate = threading.Event()
    try:
        yield executor, gate
    finally:
        gate.set()
        executor.shutdown(wait=False, cancel_futures=True)


def _defer_for_good() -> None:
    raise Defer(math.inf)


def test_a_ctrl_c_as_any_call_returns_in_force_close_loses_no_queued_task() -> None:
    # force_close() moved each keyed task with `dropped.append(tasks.pop())`,
    # each waiting keyless one with `handoff.take()` and the deferred ones
    # with a loop over what the timer gave back when emptied: a Ctrl-C right
    # after a pop (or the clear) returned left tasks in no place at all. The keyed one's
    # future never resolved while drain() and shutdown() said True; the
    # keyless one stayed counted, and no shutdown ever ended. Swept over
    # every return in the library during the force_close; the call made
    # again (or a shutdown) resolves everything it had not reached.
    def run(n: int) -> bool:
        with _pool_and_gate(1) as (executor, gate):
            d = executor._dispatcher
            # Two deferred for good, in the timer only (and a parked lane).
            deferred = [executor.submit(_defer_for_good) for _ in range(2)]
            deferred.append(executor.submit_keyed("parked", _defer_for_good))
            assert until(lambda: len(d._timer.items()) == 3)
            busy = executor.submit_keyed("busy", gate.wait, TIMEOUT)
            assert until(busy.running)
            keyed = [executor.submit_keyed("k", str, i) for i in range(3)]
            keyless = [executor.submit(str, i) for i in range(3)]
            with d._lock:
                waiting = list(d._handoff.ready)
            assert sum(type(job) is Task for job in waiting) == 3  # the keyless ones
            _, fired = _interrupted_at_return(n, d.force_close)
            d.force_close()
            # The busy task still runs: nothing is drained (a lane retired as
            # the Ctrl-C came was counted an orphan, its entry gone: the table
            # looked empty, and drain() said True).
            assert not d.drain(0), f"drained with a task running (Ctrl-C at {fired})"
            gate.set()
            for f in keyed + keyless + deferred:
                assert f.done(), f"a queued future was lost (Ctrl-C at {fired})"
                assert f.cancelled()
            assert busy.result(TIMEOUT) is True
            assert d.shutdown(TIMEOUT), f"the pool never emptied (Ctrl-C at {fired})"
            assert d._keyless == 0
            return bool(fired)

    assert _sweep(run) > 10


def test_a_ctrl_c_as_any_call_returns_in_force_close_then_a_shutdown_ends_it() -> None:
    # What a user does next may be a shutdown(), not force_close() again. A
    # Ctrl-C while a lane was emptied skipped to the next lane; the ready
    # queue was then cleared with that lane in it, its tasks left with no
    # owner: shutdown() never ended.
    def run(n: int) -> bool:
        with _pool_and_gate(1) as (executor, gate):
            d = executor._dispatcher
            busy = executor.submit_keyed("busy", gate.wait, TIMEOUT)
            assert until(busy.running)
            keyed = [executor.submit_keyed(key, str, i) for i in range(2) for key in "kl"]
            keyless = [executor.submit(str, i) for i in range(2)]
            _, fired = _interrupted_at_return(n, d.force_close)
            gate.set()
            assert d.shutdown(TIMEOUT), f"the pool never emptied (Ctrl-C at {fired})"
            assert all(f.done() for f in keyed + keyless), f"Ctrl-C at {fired}"
            assert d._keyless == 0
            return bool(fired)

    assert _sweep(run) > 10


def _defer_once_after(gate: threading.Event) -> str:
    gate.wait(TIMEOUT)
    if current_context().attempt == 1:
        raise Defer(0.01)  # a running task deferred once (a 429, say)
    return "ok"


def test_a_ctrl_c_as_any_call_returns_in_cancel_futures_keeps_the_pause_end() -> None:
    # The pause's end left the timer with every other item, and was armed
    # again at the very end of the move: a Ctrl-C as the move returned left
    # it marked armed, with no item. A running task that then deferred
    # waited past the pause for a worker's idle timeout (30 s).
    def run(n: int) -> bool:
        with _pool_and_gate(2) as (executor, gate):
            d = executor._dispatcher
            running = executor.submit(_defer_once_after, gate)
            assert until(running.running)
            executor.submit_keyed("k", str, 1)
            d.pause(0.2)
            _, fired = _interrupted_at_return(
                n, lambda: executor.shutdown(wait=False, cancel_futures=True)
            )
            gate.set()
            assert d.shutdown(TIMEOUT), f"the pause never ended (Ctrl-C at {fired})"
            assert running.result(0) == "ok"
            return bool(fired)

    assert _sweep(run) > 10
