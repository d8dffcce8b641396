"""Narrow windows and odd callers, each once a defect: pinned by forcing the window open."""

from __future__ import annotations

import gc
import math
import threading
import weakref
from typing import Any

import pytest

from outbound import Defer, Dispatcher, Hooks, KeyedExecutor, QueueFull, State

WAIT = 10.0


class _SlowDiscard(set[Any]):
    """The pool's worker set: a worker thread's leaving is slow (0.3 s).

    That widens the moment a retiring worker leaves the pool: a submit made
    then must still get a worker (the room it leaves is the cap's room).
    """

    def __init__(self, items: Any) -> None:
        super().__init__(items)
        self.in_window = threading.Event()

    def discard(self, item: Any) -> None:
        if threading.current_thread().name.startswith("outbound-worker"):
            self.in_window.set()
            threading.Event().wait(0.3)  # widen the window, not to synchronize
        super().discard(item)


def test_submit_while_the_last_worker_retires_is_not_stranded() -> None:
    """A worker retiring on idle_timeout leaves room where schedulers see it."""
    d = Dispatcher(max_inflight=1, idle_timeout=0.05)
    slow = _SlowDiscard(d._workers)
    d._workers = slow
    try:
        assert d.submit("a", lambda: 1).result(WAIT) == 1
        assert slow.in_window.wait(WAIT)  # the worker is retiring
        late = d.submit("b", lambda: "ran")
        assert late.result(WAIT) == "ran"
    finally:
        assert d.shutdown(WAIT)


def test_a_pending_pause_does_not_hold_up_shutdown() -> None:
    d = Dispatcher()
    assert d.submit(1, lambda: None).result(WAIT) is None
    d.pause(60.0)
    assert d.shutdown(timeout=5.0)
    assert d.state is State.CLOSED


def test_pause_after_close_starts_no_thread_left_behind() -> None:
    d = Dispatcher()
    assert d.shutdown(WAIT)
    d.pause(60.0)
    assert d.shutdown(timeout=5.0)  # the conftest fixture checks no thread is left


def test_workers_started_at_once_are_all_joined_by_shutdown() -> None:
    d = Dispatcher(max_inflight=64)
    barrier = threading.Barrier(16)

    def burst(base: int) -> None:
        barrier.wait(WAIT)
        for i in range(8):
            d.submit(base * 100 + i, lambda: None)

    threads = [threading.Thread(target=burst, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert d.shutdown(WAIT)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("outbound-worker")]
    assert alive == []


def test_drain_from_a_task_is_refused_on_every_worker() -> None:
    d = Dispatcher(max_inflight=4)
    gate = threading.Event()
    try:
        blockers = [d.submit(n, gate.wait, WAIT) for n in range(3)]
        outcome = d.submit("x", d.drain, 1.0).exception(WAIT)
        assert isinstance(outcome, RuntimeError)
        gate.set()
        assert all(b.result(WAIT) for b in blockers)
    finally:
        gate.set()
        assert d.shutdown(WAIT)


@pytest.mark.parametrize("hook", ["on_queued", "on_rejected"])
@pytest.mark.parametrize("wait", ["drain", "shutdown"])
def test_drain_and_shutdown_from_a_hook_of_the_submitting_thread_are_refused(
    hook: str, wait: str
) -> None:
    # on_queued and on_rejected run in submit's thread: a drain there made
    # submit (which never blocks) wait for every task of the dispatcher.
    seen: list[BaseException | bool] = []
    d: Dispatcher

    def call(*_: object) -> None:
        try:
            seen.append(getattr(d, wait)(WAIT))
        except BaseException as exc:
            seen.append(exc)

    d = Dispatcher(max_inflight=1, queue_size=1, hooks=Hooks(**{hook: call}))
    gate = threading.Event()
    try:
        first = d.submit("k", gate.wait, WAIT)
        if hook == "on_rejected":
            d.submit("k", lambda: None)  # queued: the queue is full
            with pytest.raises(QueueFull):
                d.submit("k", lambda: None)
        assert len(seen) == 1
        assert isinstance(seen[0], RuntimeError)
        assert wait in str(seen[0])
        # Refused in the hook only: the same thread may wait once it returned.
        gate.set()
        assert first.result(WAIT) is True
        assert d.drain(WAIT)
    finally:
        gate.set()
        d.close()
        assert d.shutdown(WAIT)


class _Payload:
    pass


def test_a_failed_task_keeps_neither_its_key_nor_its_arguments() -> None:
    key, payload = _Payload(), _Payload()
    key_ref, payload_ref = weakref.ref(key), weakref.ref(payload)

    with Dispatcher(max_inflight=1) as d:
        # A C callable, so that no frame of the task itself holds the argument
        # (a Python function's frame would, in the traceback, as with the stdlib).
        future = d.submit(key, int, payload=payload)  # type: ignore[arg-type]
        assert isinstance(future.exception(WAIT), TypeError)
        assert d.drain(WAIT)
        del key, payload
        gc.collect()
        assert key_ref() is None
        assert payload_ref() is None
    del future


def test_a_failed_keyless_task_keeps_no_arguments() -> None:
    payload = _Payload()
    ref = weakref.ref(payload)
    with KeyedExecutor(1) as ex:
        future = ex.submit(int, payload=payload)  # type: ignore[arg-type]
        assert isinstance(future.exception(WAIT), TypeError)
        del payload
        gc.collect()
        assert ref() is None


def test_a_future_the_caller_resolved_while_queued_does_not_stall_the_lane() -> None:
    gate = threading.Event()
    with Dispatcher() as d:
        d.submit("k", gate.wait, WAIT)
        second = d.submit("k", lambda: "two")
        third = d.submit("k", lambda: "three")
        second.set_result("resolved by the caller")
        gate.set()
        assert third.result(WAIT) == "three"
        assert second.result(WAIT) == "resolved by the caller"


def test_force_close_copes_with_futures_the_caller_resolved() -> None:
    gate = threading.Event()
    d = Dispatcher()
    try:
        d.submit("k", gate.wait, WAIT)
        a = d.submit("k", int)
        b = d.submit("k", int)
        a.set_result(0)
        d.force_close()
        assert b.cancelled()
    finally:
        gate.set()
        assert d.shutdown(WAIT)


def test_the_end_of_a_pause_does_not_grow_the_pool_past_its_jobs() -> None:
    with Dispatcher(max_inflight=64) as d:
        gate = threading.Event()
        first = [d.submit(i, gate.wait, WAIT) for i in range(8)]
        gate.set()
        assert all(f.result(WAIT) for f in first)
        assert d.drain(WAIT)
        before = d.stats().threads
        d.pause(0.2)
        second = [d.submit(i, lambda: None) for i in range(8)]
        for f in second:
            f.result(WAIT)
        assert d.stats().threads <= max(before, 8)


def test_a_timeout_or_delay_too_large_for_a_float_means_never() -> None:
    # Any number >= 0 is taken; an int past what a float holds is past
    # threading.TIMEOUT_MAX: no limit (float() of it raised OverflowError).
    huge = 10**400
    assert Defer(huge).delay == math.inf
    d = Dispatcher(send_timeout=huge)
    try:
        assert d.submit("k", lambda: "ran").result(WAIT) == "ran"
        assert d.drain(huge)
        d.pause(huge)
        assert d.stats().paused_for == math.inf
    finally:
        assert d.shutdown(huge)


def test_on_queued_may_run_after_shutdown_returned() -> None:
    """on_queued runs in the submitting thread once the task is queued: the task
    can finish, and shutdown() return True, before it does (as documented); it
    still runs once, with the lane's length, and the task's result stands."""
    entered, release, seen = threading.Event(), threading.Event(), []

    def on_queued(key: object, queue_len: int) -> None:
        entered.set()
        assert release.wait(10.0)
        seen.append((key, queue_len))

    d = Dispatcher(2, hooks=Hooks(on_queued=on_queued))
    futures: list[Any] = []
    submitter = threading.Thread(target=lambda: futures.append(d.submit("k", lambda: 7)))
    submitter.start()
    try:
        assert entered.wait(10.0)
        assert d.shutdown(10.0) is True
        assert not seen  # the hook still runs
    finally:
        release.set()
        submitter.join(10.0)
    assert not submitter.is_alive()
    assert seen == [("k", 1)]
    assert futures[0].result(0) == 7


@pytest.mark.parametrize("resolve", ["set_exception", "set_result"])
def test_a_task_whose_future_was_resolved_while_deferred_does_not_run_again(
    resolve: str,
) -> None:
    # Its future is running (cancel() says False): resolving it is how a caller
    # gives up on a message waiting out a long 429. It ran again all the same,
    # after its caller was told it was withdrawn, its lane held behind it.
    runs: list[str] = []
    started = threading.Event()

    def deferred() -> str:
        runs.append("deferred")
        started.set()
        if runs.count("deferred") == 1:
            raise Defer(0.2)
        return "sent"

    with Dispatcher() as d:
        first = d.submit("chat", deferred)
        second = d.submit("chat", lambda: runs.append("next"))
        assert started.wait(WAIT)
        assert not first.cancel()
        if resolve == "set_exception":
            first.set_exception(LookupError("withdrawn by its caller"))
        else:
            first.set_result("withdrawn")
        second.result(WAIT)
    assert runs == ["deferred", "next"]
    if resolve == "set_exception":
        assert isinstance(first.exception(0), LookupError)
    else:
        assert first.result(0) == "withdrawn"
