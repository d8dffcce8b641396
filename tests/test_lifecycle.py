"""Lifecycle of the dispatcher: close, drain, shutdown, force_close, context manager."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ALL_COMPLETED, CancelledError, Future, wait

import pytest
from dispatch_helpers import blocker as _blocker
from dispatch_helpers import returning

from outbound import (
    Defer,
    Dispatcher,
    DispatcherClosed,
    Hooks,
    OutboundError,
    State,
    current_context,
)

TIMEOUT = 10.0


# --------------------------------------------------------------------- close


def test_close_refuses_new_work_and_runs_queued() -> None:
    started, release = threading.Event(), threading.Event()
    rejected: list[BaseException] = []
    d = Dispatcher(max_inflight=1, hooks=Hooks(on_rejected=lambda k, e: rejected.append(e)))
    try:
        first = d.submit("k", _blocker(started, release, 1))
        queued = [d.submit("k", returning(i)) for i in range(2, 5)]
        assert started.wait(TIMEOUT)
        d.close()
        assert d.state is State.CLOSING
        with pytest.raises(DispatcherClosed, match="closed"):
            d.submit("other", lambda: None)
        d.close()  # idempotent
        release.set()
        assert first.result(timeout=TIMEOUT) == 1
        assert [f.result(timeout=TIMEOUT) for f in queued] == [2, 3, 4]
        assert d.drain(TIMEOUT)
        assert d.stats().state is State.CLOSED
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert len(rejected) == 1
    assert isinstance(rejected[0], DispatcherClosed)
    assert isinstance(rejected[0], RuntimeError)
    assert isinstance(rejected[0], OutboundError)


def test_close_unused_dispatcher() -> None:
    d = Dispatcher()
    d.close()
    assert d.state is State.CLOSED
    assert d.drain(0)
    assert d.shutdown(0)
    assert d.stats().threads == 0


# --------------------------------------------------------------------- drain


def test_drain_with_timeout_returns_false_while_busy() -> None:
    started, release = threading.Event(), threading.Event()
    d = Dispatcher()
    try:
        fut = d.submit("k", _blocker(started, release, "v"))
        assert started.wait(TIMEOUT)
        assert d.drain(0) is False
        t0 = time.monotonic()
        assert d.drain(0.05) is False
        assert time.monotonic() - t0 >= 0.04
        release.set()
        assert d.drain(TIMEOUT) is True
        assert fut.result(timeout=0) == "v"
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


def test_drain_without_timeout_waits_for_everything() -> None:
    started, release = threading.Event(), threading.Event()
    returned = threading.Event()
    d = Dispatcher(max_inflight=2)
    try:
        futs = [d.submit("a", _blocker(started, release, "a"))]
        futs += [d.submit(k, returning(k)) for k in "bcd"]
        assert started.wait(TIMEOUT)

        def drainer() -> None:
            assert d.drain() is True
            returned.set()

        t = threading.Thread(target=drainer)
        t.start()
        assert not returned.wait(0.05)  # the blocker still runs
        release.set()
        assert returned.wait(TIMEOUT)
        t.join(TIMEOUT)
        assert all(f.done() for f in futs)
        assert d.state is State.OPEN  # drain does not close
        assert d.submit("e", lambda: "e").result(timeout=TIMEOUT) == "e"
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


def test_drain_idle_dispatcher() -> None:
    with Dispatcher() as d:
        assert d.drain() is True
        assert d.drain(0) is True


# ------------------------------------------------------------------ shutdown


def test_shutdown_waits_for_queued_work() -> None:
    results: list[int] = []
    d = Dispatcher(max_inflight=2)
    futs = [d.submit(i % 3, results.append, i) for i in range(60)]
    assert d.shutdown() is True
    assert all(f.done() for f in futs)
    assert sorted(results) == list(range(60))
    assert d.state is State.CLOSED
    assert d.stats().threads == 0
    assert d.shutdown() is True  # idempotent
    assert d.shutdown(0) is True
    with pytest.raises(DispatcherClosed):
        d.submit("k", lambda: None)


def test_shutdown_is_true_once_the_work_is_done_while_idle_threads_still_leave() -> None:
    # Its result is whether every accepted future is done (close + drain): idle
    # threads on their way out run nothing more, and shutdown(0) does not wait for them.
    d = Dispatcher(max_inflight=8)
    futures = [d.submit(i % 4, returning(i)) for i in range(40)]
    assert [f.result(timeout=TIMEOUT) for f in futures] == list(range(40))
    assert d.drain(TIMEOUT)
    assert d.stats().threads > 0  # idle, not retired (idle_timeout is long)
    assert d.shutdown(0) is True
    assert d.shutdown(TIMEOUT) is True
    assert d.stats().threads == 0  # a wait with time left waits for them


@pytest.mark.parametrize("where", ["on_done", "callback"])
@pytest.mark.parametrize("keyed", [True, False])
def test_shutdown_is_false_while_a_hook_or_callback_of_a_finished_task_runs(
    where: str, keyed: bool
) -> None:
    entered, release, gate = threading.Event(), threading.Event(), threading.Event()

    def hold(*_: object) -> None:
        entered.set()
        assert release.wait(TIMEOUT)

    d = Dispatcher(max_inflight=2, hooks=Hooks(on_done=hold) if where == "on_done" else None)
    try:
        if keyed:
            future = d.submit("k", gate.wait, TIMEOUT)
        else:  # as KeyedExecutor.submit does
            future = d._submit_keyless(gate.wait, (TIMEOUT,), {})
        if where == "callback":
            future.add_done_callback(hold)  # runs in the worker, as the task ends
        gate.set()
        assert entered.wait(TIMEOUT)
        assert future.done()
        assert d.shutdown(0.05) is False  # the task is done; its hook or callback is not
        release.set()
        assert d.shutdown(TIMEOUT) is True
    finally:
        gate.set()
        release.set()
        d.shutdown(TIMEOUT)


def test_shutdown_with_timeout_returns_false_then_true() -> None:
    started, release = threading.Event(), threading.Event()
    d = Dispatcher()
    try:
        fut = d.submit("k", _blocker(started, release))
        queued = d.submit("k", lambda: "queued")
        assert started.wait(TIMEOUT)
        assert d.shutdown(0.05) is False
        assert d.state is State.CLOSING
        with pytest.raises(DispatcherClosed):
            d.submit("k", lambda: None)
        release.set()
        assert d.shutdown(TIMEOUT) is True
        assert fut.done()
        assert queued.result(timeout=0) == "queued"
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


def test_shutdown_with_parked_lane_waits_for_its_rerun() -> None:
    def task() -> int:
        if current_context().attempt == 1:
            raise Defer(0.05)
        return current_context().attempt

    d = Dispatcher()
    fut = d.submit("k", task)
    assert d.shutdown(TIMEOUT) is True
    assert fut.result(timeout=0) == 2


def test_shutdown_from_inside_a_task_raises() -> None:
    d = Dispatcher()
    try:

        def task() -> BaseException | None:
            try:
                d.shutdown(1.0)
            except RuntimeError as exc:
                return exc
            return None

        error = d.submit("k", task).result(timeout=TIMEOUT)
        assert isinstance(error, RuntimeError)
        assert "task" in str(error)
        # the refused call changed nothing
        assert d.state is State.OPEN
        assert d.submit("k", lambda: 1).result(timeout=TIMEOUT) == 1
    finally:
        assert d.shutdown(TIMEOUT)


def test_shutdown_from_a_task_of_another_dispatcher() -> None:
    inner = Dispatcher()
    inner_fut = inner.submit("k", lambda: "inner")
    with Dispatcher() as outer:
        assert outer.submit("k", inner.shutdown, TIMEOUT).result(timeout=TIMEOUT) is True
    assert inner_fut.result(timeout=0) == "inner"
    assert inner.state is State.CLOSED


def test_shutdown_from_a_hook_raises() -> None:
    """A hook runs on a worker thread: shutdown() there must be refused like in a task."""
    seen: list[object] = []

    def on_done(info: object) -> None:
        try:
            seen.append(d.shutdown(0.2))
        except RuntimeError as exc:
            seen.append(exc)

    d = Dispatcher(hooks=Hooks(on_done=on_done))
    try:
        d.submit("k", lambda: None).result(timeout=TIMEOUT)
        assert d.drain(TIMEOUT)
    finally:
        assert d.shutdown(TIMEOUT)
    assert len(seen) == 1
    assert isinstance(seen[0], RuntimeError)


def test_no_thread_left_after_shutdown() -> None:
    # Thread objects, not idents (reused); and a subset: a thread of an
    # earlier test (the PostgreSQL statement watchdog) may end meanwhile.
    base = set(threading.enumerate())
    d = Dispatcher(max_inflight=4)
    futs = [d.submit(k, lambda: None) for k in range(50)]

    def deferring() -> None:
        if current_context().attempt == 1:
            raise Defer(0.0)  # starts the timer thread too

    futs.append(d.submit("defer", deferring))
    assert d.shutdown(TIMEOUT) is True
    assert all(f.done() for f in futs)
    assert set(threading.enumerate()) <= base
    assert d.stats().threads == 0


# --------------------------------------------------------------- force_close


def test_force_close_resolves_everything_at_once() -> None:
    """Queued, ready-for-a-thread and parked tasks are cancelled at once; running ones
    see cancelled; nothing is left pending."""
    running_started = threading.Event()
    defer_ready = threading.Event()
    seen_cancel: list[bool] = []

    def running() -> str:
        running_started.set()
        # cooperative: returns as soon as force_close flags the context
        seen_cancel.append(current_context().wait_cancelled(TIMEOUT))
        return "finished"

    def deferring() -> None:
        defer_ready.set()
        raise Defer(60.0)

    ran: list[str] = []
    d = Dispatcher(max_inflight=2, queue_size=100)
    try:
        parked = d.submit("parked", deferring)
        assert defer_ready.wait(TIMEOUT)
        behind_parked = d.submit("parked", ran.append, "behind-parked")
        run_fut = d.submit("busy", running)
        assert running_started.wait(TIMEOUT)
        queued_same_lane = [d.submit("busy", ran.append, f"busy-{i}") for i in range(5)]
        # the second slot is taken by a task blocked on an event, so these lanes
        # wait for a thread
        hold_started, hold = threading.Event(), threading.Event()
        held = d.submit("hold", _blocker(hold_started, hold, "held"))
        assert hold_started.wait(TIMEOUT)
        waiting_for_thread = [d.submit(f"w{i}", ran.append, f"w{i}") for i in range(10)]
        s = d.stats()
        assert (s.running, s.parked) == (2, 1)

        d.force_close()

        # at once, before any running task finished:
        for f in [*queued_same_lane, *waiting_for_thread, behind_parked]:
            assert f.done()
            assert f.cancelled()
        assert parked.done()
        assert parked.cancelled()  # ran once and deferred: cancelled too
        with pytest.raises(CancelledError):
            parked.result(timeout=0)
        assert not held.done()
        assert d.state is State.CLOSING
        assert d.stats().cancelled is True
        with pytest.raises(DispatcherClosed):
            d.submit("new", lambda: None)
        assert run_fut.result(timeout=TIMEOUT) == "finished"
        hold.set()
        assert held.result(timeout=TIMEOUT) == "held"
        assert d.drain(TIMEOUT)
        assert d.stats().state is State.CLOSED
    finally:
        hold.set()
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert seen_cancel == [True]
    assert ran == []
    s = d.stats()
    assert (s.lanes, s.queued, s.running, s.parked, s.threads) == (0, 0, 0, 0, 0)


def test_force_close_wakes_waiters() -> None:
    """concurrent.futures.wait() on queued futures returns when force_close cancels them."""
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=1)
    try:
        d.submit("a", _blocker(started, release))
        assert started.wait(TIMEOUT)
        futs = [d.submit(k, lambda: None) for k in "bcd"]
        result: list[set[Future[None]]] = []

        def waiter() -> None:
            done, _ = wait(futs, timeout=TIMEOUT, return_when=ALL_COMPLETED)
            result.append(done)

        t = threading.Thread(target=waiter)
        t.start()
        d.force_close()
        t.join(TIMEOUT)
        assert not t.is_alive()
        assert result[0] == set(futs)
        for f in futs:
            with pytest.raises(CancelledError):
                f.result(timeout=0)
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


def test_force_close_then_running_task_defers() -> None:
    """A running task that defers after force_close is resolved as cancelled, not re-run."""
    started, go = threading.Event(), threading.Event()
    attempts: list[int] = []

    def task() -> None:
        attempts.append(current_context().attempt)
        started.set()
        assert go.wait(TIMEOUT)
        raise Defer(60.0)

    d = Dispatcher()
    try:
        fut = d.submit("k", task)
        assert started.wait(TIMEOUT)
        d.force_close()
        go.set()
        with pytest.raises(CancelledError):
            fut.result(timeout=TIMEOUT)
        assert fut.cancelled()  # like a task that never started
        assert d.shutdown(TIMEOUT)
    finally:
        go.set()
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert attempts == [1]


def test_force_close_idempotent_and_after_close() -> None:
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=1)
    try:
        d.submit("a", _blocker(started, release))
        assert started.wait(TIMEOUT)
        queued = d.submit("a", lambda: None)
        d.close()
        d.force_close()  # after close: still cancels what waits
        assert queued.cancelled()
        d.force_close()
        d.force_close()
        release.set()
        assert d.shutdown(TIMEOUT)
        d.force_close()  # after shutdown
        assert d.state is State.CLOSED
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


def test_force_close_from_inside_a_task() -> None:
    submitted = threading.Event()

    def task() -> tuple[bool, bool]:
        assert submitted.wait(TIMEOUT)
        before = current_context().cancelled
        d.force_close()
        return before, current_context().cancelled

    d = Dispatcher(max_inflight=1)
    try:
        first = d.submit("k", task)
        rest = [d.submit("k", lambda: None) for _ in range(3)]
        submitted.set()
        assert first.result(timeout=TIMEOUT) == (False, True)
        for f in rest:
            assert f.cancelled()
    finally:
        assert d.shutdown(TIMEOUT)


def test_force_close_unused_dispatcher() -> None:
    d = Dispatcher()
    d.force_close()
    assert d.state is State.CLOSED
    assert d.shutdown(0) is True


# ------------------------------------------------------ from many threads


@pytest.mark.parametrize("method", ["close", "drain", "shutdown", "force_close", "mixed"])
def test_lifecycle_from_many_threads(method: str) -> None:
    n = 6
    barrier = threading.Barrier(n + 1, timeout=TIMEOUT)
    started, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    results: list[tuple[str, object]] = []
    lock = threading.Lock()
    d = Dispatcher(max_inflight=2, queue_size=100)
    names = ["close", "drain", "shutdown", "force_close"] * 2

    def caller(i: int) -> None:
        name = names[i] if method == "mixed" else method
        try:
            barrier.wait()
            fn = getattr(d, name)
            out = fn(TIMEOUT) if name in ("drain", "shutdown") else fn()
            with lock:
                results.append((name, out))
        except BaseException as exc:  # reported below
            with lock:
                errors.append(exc)

    try:
        futs = [d.submit("a", _blocker(started, release))]
        futs += [d.submit(k % 7, returning(k)) for k in range(50)]
        assert started.wait(TIMEOUT)
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        release.set()
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive()
        assert errors == []
        assert len(results) == n
        for name, out in results:
            if name in ("drain", "shutdown"):
                assert out is True
            else:
                assert out is None
        _, not_done = wait(futs, timeout=TIMEOUT)
        assert not not_done
        if method in ("close", "shutdown"):
            assert [f.result() for f in futs[1:]] == list(range(50))
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert d.state is State.CLOSED


def test_concurrent_submit_and_shutdown() -> None:
    """Submits racing with shutdown: each is either refused or run; none is left pending."""
    for _ in range(20):
        d = Dispatcher(max_inflight=2, queue_size=1000)
        barrier = threading.Barrier(3, timeout=TIMEOUT)
        accepted: list[Future[int]] = []
        refused: list[int] = []

        def submitter(base: int) -> None:
            barrier.wait()
            for i in range(200):
                try:
                    accepted.append(d.submit((base, i % 5), returning(i)))
                except DispatcherClosed:
                    refused.append(i)

        threads = [threading.Thread(target=submitter, args=(b,)) for b in range(2)]
        for t in threads:
            t.start()
        barrier.wait()
        assert d.shutdown(TIMEOUT)
        for t in threads:
            t.join(TIMEOUT)
        assert d.shutdown(TIMEOUT)
        assert len(accepted) + len(refused) == 400
        assert all(f.done() and not f.cancelled() for f in accepted)


def test_concurrent_submit_and_force_close() -> None:
    for _ in range(20):
        d = Dispatcher(max_inflight=2, queue_size=1000)
        barrier = threading.Barrier(3, timeout=TIMEOUT)
        accepted: list[Future[int]] = []

        def submitter(base: int) -> None:
            barrier.wait()
            for i in range(200):
                try:
                    accepted.append(d.submit((base, i % 5), returning(i)))
                except DispatcherClosed:
                    pass

        threads = [threading.Thread(target=submitter, args=(b,)) for b in range(2)]
        for t in threads:
            t.start()
        barrier.wait()
        d.force_close()
        for t in threads:
            t.join(TIMEOUT)
        assert d.shutdown(TIMEOUT)
        _, not_done = wait(accepted, timeout=TIMEOUT)
        assert not not_done
        for f in accepted:
            assert f.cancelled() or f.result(timeout=0) is not None


# ----------------------------------------------------------- context manager


def test_context_manager_shuts_down() -> None:
    with Dispatcher(max_inflight=2) as d:
        futs = [d.submit(i % 2, returning(i)) for i in range(20)]
    assert d.state is State.CLOSED
    assert [f.result(timeout=0) for f in futs] == list(range(20))
    assert d.stats().threads == 0
    with pytest.raises(DispatcherClosed):
        d.submit("k", lambda: None)


def test_context_manager_on_exception() -> None:
    futs: list[Future[str]] = []

    def body(d: Dispatcher) -> None:
        with d:
            futs.append(d.submit("k", lambda: "done"))
            raise KeyError("boom")

    d = Dispatcher()
    with pytest.raises(KeyError):
        body(d)
    assert futs[0].result(timeout=0) == "done"
    assert d.state is State.CLOSED


def test_with_returns_the_dispatcher() -> None:
    d = Dispatcher()
    with d as entered:
        assert entered is d
