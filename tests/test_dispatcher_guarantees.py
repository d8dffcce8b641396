"""Guarantees that misbehaving callbacks, odd timing and extreme values once broke.

Each test pins one way to break a README guarantee: a task runs exactly once
and in order; a worker survives whatever a callback raises; every future is
resolved; ``shutdown()`` is True only when everything is resolved; values at
and past ``threading.TIMEOUT_MAX`` neither crash a thread nor raise late;
hooks are checked when they are built.
"""

from __future__ import annotations

import _thread
import functools
import math
import subprocess
import sys
import textwrap
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, wait
from typing import Any, cast

import pytest
from dispatch_helpers import blocker as _blocker

import outbound._lane as lane_module
from outbound import Defer, Dispatcher, DispatcherClosed, Hooks, KeyedExecutor, current_context

TIMEOUT = 10.0


# ------------------------------------------------------- the lane refill race


class _OwnerTakesItFirst(deque):  # type: ignore[type-arg]
    """A lane's queue whose armed ``append`` lets the lane's owner pop the new task
    before the submitting thread goes on (it waits for that pop, the lane lock held)."""

    armed: threading.Thread | None = None
    release_owner: threading.Event | None = None
    popped = threading.Event()

    def append(self, item: Any) -> None:
        super().append(item)
        cls = type(self)
        if cls.armed is threading.current_thread():
            cls.armed = None
            assert cls.release_owner is not None
            cls.release_owner.set()
            assert cls.popped.wait(TIMEOUT), "the owner never took the task"

    def popleft(self) -> Any:
        item = super().popleft()
        type(self).popped.set()
        return item


def _fresh_queue_class() -> type[_OwnerTakesItFirst]:
    """A subclass of its own per test: the class attributes are the test's state."""
    return cast(
        "type[_OwnerTakesItFirst]", type("Q", (_OwnerTakesItFirst,), {"popped": threading.Event()})
    )


def test_a_task_the_owner_takes_at_once_is_accepted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The running lane's owner takes a task in the instant after submit appended it:
    submit must neither queue it again, nor make a second lane, nor refuse it."""
    queue_cls = _fresh_queue_class()
    monkeypatch.setattr(lane_module, "deque", queue_cls)
    runs: list[str] = []
    started, release = threading.Event(), threading.Event()
    queue_cls.release_owner = release
    d = Dispatcher(max_inflight=4)
    try:
        first = d.submit("k", _blocker(started, release, "first"))
        assert started.wait(TIMEOUT)
        queue_cls.popped.clear()
        queue_cls.armed = threading.current_thread()

        def second_task() -> int:
            runs.append("second")
            return current_context().attempt

        second = d.submit("k", second_task)
        assert first.result(timeout=TIMEOUT) == "first"
        assert second.result(timeout=TIMEOUT) == 1  # its first and only run
        assert d.drain(TIMEOUT)
        assert d.stats().lanes == 0
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert runs == ["second"]


def test_close_in_the_refill_window_does_not_refuse_a_queued_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() lands while the owner takes the just-appended task: submit must not
    raise DispatcherClosed for a task that is queued and runs."""
    queue_cls = _fresh_queue_class()
    monkeypatch.setattr(lane_module, "deque", queue_cls)
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=2)

    class CloseThenRelease(threading.Event):
        def set(self) -> None:
            d.close()
            release.set()

    queue_cls.release_owner = CloseThenRelease()
    ran: list[int] = []
    try:
        d.submit("k", _blocker(started, release))
        assert started.wait(TIMEOUT)
        queue_cls.popped.clear()
        queue_cls.armed = threading.current_thread()
        fut = d.submit("k", ran.append, 2)  # accepted: it must not raise
        assert fut.result(timeout=TIMEOUT) is None
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert ran == [2]


# ------------------------------------------------- callbacks that raise anything


class _Fatal(BaseException):
    pass


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt, _Fatal])
def test_a_done_callback_raising_base_exception_spares_the_worker(
    exc_type: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    started, release = threading.Event(), threading.Event()
    seen: list[str] = []
    d = Dispatcher(max_inflight=1)
    try:
        first = d.submit("k", _blocker(started, release, 1))

        def bad(_f: Future[Any]) -> None:
            raise exc_type("from a callback")

        first.add_done_callback(bad)
        first.add_done_callback(lambda f: seen.append("second callback"))
        later = [d.submit("k", int, i) for i in range(2, 6)]
        other = d.submit("other", lambda: "other")
        release.set()
        assert first.result(timeout=TIMEOUT) == 1
        assert [f.result(timeout=TIMEOUT) for f in later] == [2, 3, 4, 5]
        assert other.result(timeout=TIMEOUT) == "other"
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert seen == ["second callback"]  # the callbacks after it still ran
    assert "from a callback" in caplog.text


@pytest.mark.parametrize("exc_type", [SystemExit, _Fatal])
def test_force_close_resolves_every_future_when_a_callback_raises(
    exc_type: type[BaseException],
) -> None:
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=1, queue_size=100)
    try:
        d.submit("busy", _blocker(started, release))
        assert started.wait(TIMEOUT)
        queued = [d.submit(f"k{i % 3}", lambda: None) for i in range(60)]
        for f in queued[::7]:
            f.add_done_callback(lambda f: (_ for _ in ()).throw(exc_type("callback")))
        d.force_close()  # what a callback raises is logged, not raised here
        assert all(f.cancelled() for f in queued)
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


def test_force_close_interrupted_by_ctrl_c_still_resolves_every_future() -> None:
    """A KeyboardInterrupt in force_close's loop (a callback's, or a real Ctrl-C
    landing anywhere in it) reaches the caller only after every future is resolved."""
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=1, queue_size=500)
    try:
        d.submit("busy", _blocker(started, release))
        assert started.wait(TIMEOUT)
        queued = [d.submit(i % 10, lambda: None) for i in range(400)]
        queued[3].add_done_callback(lambda f: _thread.interrupt_main())  # lands a bit later
        queued[50].add_done_callback(lambda f: (_ for _ in ()).throw(KeyboardInterrupt()))

        def close_and_let_a_late_interrupt_land() -> None:
            d.force_close()
            for _ in range(1000):  # a pending interrupt_main() lands here at worst
                pass

        with pytest.raises(KeyboardInterrupt):
            close_and_let_a_late_interrupt_land()
        assert all(f.cancelled() for f in queued)
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


def test_shutdown_is_not_true_while_force_close_is_still_resolving() -> None:
    started, release = threading.Event(), threading.Event()
    in_callback, go_on = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=1, queue_size=100)
    closer: threading.Thread | None = None
    try:
        d.submit("busy", _blocker(started, release))
        assert started.wait(TIMEOUT)
        queued = [d.submit("k", lambda: None) for _ in range(50)]

        def slow(_f: Future[Any]) -> None:
            in_callback.set()
            assert go_on.wait(TIMEOUT)

        queued[0].add_done_callback(slow)
        closer = threading.Thread(target=d.force_close)
        closer.start()
        assert in_callback.wait(TIMEOUT)
        # force_close is resolving (held in the first callback): not all done yet
        assert not all(f.done() for f in queued)
        assert d.shutdown(timeout=0.2) is False
        assert d.drain(timeout=0) is False
        release.set()
        go_on.set()
        assert d.shutdown(TIMEOUT) is True
        assert all(f.done() for f in queued)
    finally:
        release.set()
        go_on.set()
        if closer is not None:
            closer.join(TIMEOUT)
        assert d.shutdown(TIMEOUT)


def _busy_executor(keys: list[str]) -> tuple[KeyedExecutor, threading.Event, list[Future[Any]]]:
    """A one-worker executor whose worker a running task holds until the event is set,
    and a no-op task queued for each of ``keys``."""
    ex = KeyedExecutor(max_workers=1)
    started, release = threading.Event(), threading.Event()
    ex.submit_keyed("busy", _blocker(started, release))
    assert started.wait(TIMEOUT)
    return ex, release, [ex.submit_keyed(k, lambda: None) for k in keys]


@pytest.mark.parametrize("second", ["force_close", "cancel_futures", "from a callback"])
def test_a_second_force_close_returns_once_every_future_is_resolved(second: str) -> None:
    """force_close in one thread is held in the first cancelled future's callback.
    A second call (force_close, or KeyedExecutor.shutdown(wait=False,
    cancel_futures=True)) finds nothing left to take: it must still return only
    once every queued future is resolved, resolving those the first has not
    reached in its own thread, without waiting for the first's callback. Before
    the fix it returned at once, with 49 futures pending. A callback that calls
    force_close itself leaves the rest to the call it runs in."""
    in_callback, go_on = threading.Event(), threading.Event()
    ex, release, queued = _busy_executor(["k"] * 50)
    d = ex._dispatcher
    closer: threading.Thread | None = None
    seen: list[bool] = []
    threads: list[str] = []
    try:

        def slow(_f: Future[Any]) -> None:
            in_callback.set()
            if second == "from a callback":
                d.force_close()  # returns at once, resolving nothing more
                seen.append(all(f.done() for f in queued))
            assert go_on.wait(TIMEOUT)

        def where(_f: Future[Any]) -> None:
            threads.append(threading.current_thread().name)

        queued[0].add_done_callback(slow)
        queued[-1].add_done_callback(where)
        closer = threading.Thread(target=d.force_close, name="first")
        closer.start()
        assert in_callback.wait(TIMEOUT)
        if second == "from a callback":
            assert seen == [False]  # the outer call resolves the rest
        elif second == "force_close":
            d.force_close()  # the first is still held in its callback
            assert all(f.cancelled() for f in queued)
            assert threads == [threading.current_thread().name]
        else:
            ex.shutdown(wait=False, cancel_futures=True)
            assert all(f.cancelled() for f in queued)
        go_on.set()
        closer.join(TIMEOUT)
        assert not closer.is_alive()
        assert all(f.cancelled() for f in queued)
        assert len(threads) == 1  # each callback ran once
    finally:
        release.set()
        go_on.set()
        if closer is not None:
            closer.join(TIMEOUT)
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("inner", ["force_close", "cancel_futures", "shutdown"])
def test_callbacks_a_helping_force_close_runs_do_not_help_again(inner: str) -> None:
    """A first force_close is held in its first callback; a second one resolves the
    other 300 futures. Their callbacks call back in: a force_close or cancel_futures
    there must not resolve the next futures inside the callback (each callback
    would nest in the one before: past the recursion limit, futures were cancelled
    and their callbacks never ran), and shutdown() there raises, as from any
    callback of the dispatcher, instead of waiting for the held first call."""
    n = 300
    ex, block, futures = _busy_executor([f"k{i}" for i in range(n)])
    d = ex._dispatcher
    calls = [0] * n
    depth, deepest = [0], [0]
    errors: list[BaseException] = []
    first_in, release_first = threading.Event(), threading.Event()
    first = threading.Thread(target=d.force_close)

    def callback(f: Future[Any]) -> None:
        calls[futures.index(f)] += 1
        if threading.current_thread() is first:
            if not first_in.is_set():
                first_in.set()
                assert release_first.wait(TIMEOUT)
            return
        depth[0] += 1
        deepest[0] = max(deepest[0], depth[0])
        try:
            if inner == "force_close":
                d.force_close()
            elif inner == "cancel_futures":
                ex.shutdown(wait=False, cancel_futures=True)
            else:
                d.shutdown(TIMEOUT)
        except RuntimeError as exc:
            errors.append(exc)
        finally:
            depth[0] -= 1

    for f in futures:
        f.add_done_callback(callback)
    first.start()
    try:
        assert first_in.wait(TIMEOUT)
        d.force_close()  # helps: resolves the rest in this thread
        assert all(f.cancelled() for f in futures)
    finally:
        release_first.set()
        first.join(TIMEOUT)
        block.set()
    assert d.shutdown(TIMEOUT)
    assert calls == [1] * n
    assert deepest[0] == 1
    assert len(errors) == (n - 1 if inner == "shutdown" else 0)


def test_a_second_force_close_under_a_lock_a_callback_takes_does_not_deadlock() -> None:
    """A watchdog's force_close is in a cancelled future's callback, which takes an
    application lock; the service's stop() holds that lock and calls force_close.
    The second call must not wait for the first (which waits for it)."""
    d = Dispatcher(max_inflight=1)
    release, running = threading.Event(), threading.Event()
    d.submit("k", _blocker(running, release))
    queued = d.submit("k", lambda: None)
    assert running.wait(TIMEOUT)
    app_lock = threading.Lock()
    in_callback, holder_in = threading.Event(), threading.Event()

    def on_done(_f: Future[Any]) -> None:
        in_callback.set()
        assert holder_in.wait(TIMEOUT)
        with app_lock:
            pass

    queued.add_done_callback(on_done)
    watchdog = threading.Thread(target=d.force_close)
    watchdog.start()
    try:
        assert in_callback.wait(TIMEOUT)
        with app_lock:
            holder_in.set()
            d.force_close()
        watchdog.join(TIMEOUT)
        assert not watchdog.is_alive()
        assert queued.cancelled()
    finally:
        holder_in.set()
        release.set()
        watchdog.join(TIMEOUT)
        assert d.shutdown(TIMEOUT)


def test_two_dispatchers_force_closing_each_other_from_callbacks_do_not_deadlock() -> None:
    """A pipeline torn down from both ends at once: the cancelled future's callback
    of each dispatcher force-closes the other."""
    ds = [Dispatcher(max_inflight=1), Dispatcher(max_inflight=1)]
    release = threading.Event()
    queued: list[Future[Any]] = []
    for d in ds:
        started = threading.Event()
        d.submit("k", _blocker(started, release))
        queued.append(d.submit("k", lambda: None))
        assert started.wait(TIMEOUT)
    both = threading.Barrier(2, timeout=TIMEOUT)

    def closes(other: Dispatcher) -> Callable[[Future[Any]], None]:
        def callback(_f: Future[Any]) -> None:
            both.wait()
            other.force_close()

        return callback

    queued[0].add_done_callback(closes(ds[1]))
    queued[1].add_done_callback(closes(ds[0]))
    closers = [threading.Thread(target=d.force_close) for d in ds]
    try:
        for t in closers:
            t.start()
        for t in closers:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in closers)
        assert all(f.cancelled() for f in queued)
    finally:
        release.set()
        for t in closers:
            t.join(TIMEOUT)
        for d in ds:
            assert d.shutdown(TIMEOUT)


def test_shutdown_true_means_every_future_is_done_under_force_close() -> None:
    """force_close in one thread, shutdown in another an instant later, many queued."""
    n = 20_000
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=1, queue_size=n)
    d.submit("busy", _blocker(started, release))
    assert started.wait(TIMEOUT)
    queued = [d.submit(i % 100, lambda: None) for i in range(n)]
    go = threading.Barrier(2, timeout=TIMEOUT)

    def closer() -> None:
        go.wait()
        d.force_close()

    t = threading.Thread(target=closer)
    t.start()
    go.wait()
    release.set()
    if d.shutdown(TIMEOUT):
        assert all(f.done() for f in queued)
    t.join(TIMEOUT)
    assert d.shutdown(TIMEOUT)
    assert all(f.done() for f in queued)


# ------------------------------------------------------------- uniform cancel


def test_a_parked_task_cancelled_by_force_close_looks_like_one_never_started() -> None:
    deferred = threading.Event()

    def parks() -> None:
        deferred.set()
        raise Defer(60.0)

    d = Dispatcher(max_inflight=2)
    started, release = threading.Event(), threading.Event()
    try:
        parked = d.submit("p", parks)
        assert deferred.wait(TIMEOUT)
        d.submit("busy", _blocker(started, release))
        assert started.wait(TIMEOUT)
        never = d.submit("busy", lambda: None)
        assert not parked.done()
        waiter = threading.Thread(target=wait, args=([parked], TIMEOUT))
        waiter.start()
        called: list[Future[None]] = []
        parked.add_done_callback(called.append)
        d.force_close()
        waiter.join(TIMEOUT)
        assert not waiter.is_alive()
        for f in (parked, never):
            assert f.done()
            assert f.cancelled()
            assert not f.running()
            with pytest.raises(CancelledError):
                f.result(timeout=0)
            with pytest.raises(CancelledError):
                f.exception(timeout=0)
        assert called == [parked]
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


# ----------------------------------------------------- values at and past limits


@pytest.mark.parametrize("delay", [threading.TIMEOUT_MAX, 1e10, 1e300])
def test_a_huge_defer_parks_its_lane_only(delay: float) -> None:
    """A lane parked for longer than threading.TIMEOUT_MAX leaves the timer working
    for every other lane."""
    d = Dispatcher()
    try:
        far = d.submit("far", lambda: (_ for _ in ()).throw(Defer(delay)))

        def soon() -> int:
            if current_context().attempt == 1:
                raise Defer(0.01)
            return current_context().attempt

        assert d.submit("near", soon).result(timeout=TIMEOUT) == 2
        assert d.stats().parked == 1
        assert not far.done()
    finally:
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert far.cancelled()


@pytest.mark.parametrize("delay", [threading.TIMEOUT_MAX, 1e10])
def test_a_huge_pause_can_be_force_closed(delay: float) -> None:
    d = Dispatcher()
    try:
        d.pause(delay)
        fut = d.submit("k", lambda: None)
        assert d.stats().paused_for > 1e6
        assert not fut.done()
    finally:
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert fut.cancelled()


@pytest.mark.parametrize("idle_timeout", [threading.TIMEOUT_MAX, 1e10, math.inf])
def test_a_huge_idle_timeout_keeps_idle_workers_usable(idle_timeout: float) -> None:
    d = Dispatcher(max_inflight=1, idle_timeout=idle_timeout)
    try:
        assert d.submit("a", lambda: 1).result(timeout=TIMEOUT) == 1
        assert d.drain(TIMEOUT)
        for _ in range(3):  # the worker goes idle in between
            assert d.submit("b", lambda: 2).result(timeout=TIMEOUT) == 2
    finally:
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("timeout", [threading.TIMEOUT_MAX, 1e10, math.inf])
def test_shutdown_and_drain_accept_any_non_negative_timeout(timeout: float) -> None:
    d = Dispatcher()
    assert d.submit("k", lambda: 1).result(timeout=TIMEOUT) == 1
    assert d.drain(timeout) is True
    assert d.shutdown(timeout) is True
    ex = KeyedExecutor(max_workers=2)
    ex.submit(lambda: None).result(timeout=TIMEOUT)
    ex.shutdown()


@pytest.mark.parametrize("timeout", [threading.TIMEOUT_MAX, 1e10, math.inf])
def test_wait_cancelled_accepts_huge_timeouts(timeout: float) -> None:
    started = threading.Event()

    def task() -> bool:
        started.set()
        return current_context().wait_cancelled(timeout)

    d = Dispatcher()
    try:
        fut = d.submit("k", task)
        assert started.wait(TIMEOUT)
        d.force_close()
        assert fut.result(timeout=TIMEOUT) is True
    finally:
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("timeout", [-1.0, math.nan, -math.inf])
def test_bad_timeouts_are_refused_before_anything_changes(timeout: float) -> None:
    d = Dispatcher()
    try:
        with pytest.raises(ValueError, match="timeout"):
            d.shutdown(timeout)
        assert d.state.value == "open"  # refused before closing
        with pytest.raises(ValueError, match="timeout"):
            d.drain(timeout)
    finally:
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("exit_timeout", [1e10, threading.TIMEOUT_MAX])
def test_a_huge_exit_timeout_exits_cleanly(exit_timeout: float) -> None:
    script = textwrap.dedent(
        f"""
        import logging, sys
        from outbound import Dispatcher
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
        d = Dispatcher(exit_timeout={exit_timeout!r})
        d.submit("k", print, "ran", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "ran" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "ERROR" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------ hooks


@pytest.mark.parametrize("field", ["on_queued", "on_start", "on_done", "on_rejected"])
def test_hooks_must_be_callable(field: str) -> None:
    with pytest.raises(TypeError, match=f"Hooks.{field} must be callable"):
        Hooks(**{field: 3})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "hook", "expected"),
    [
        ("on_queued", lambda key: None, r"on_queued\(key, queue_len\)"),
        ("on_start", lambda: None, r"on_start\(key\)"),
        ("on_start", lambda key, extra: None, r"on_start\(key\)"),
        ("on_done", lambda key, info: None, r"on_done\(info\)"),
        ("on_rejected", lambda *, key, error: None, r"on_rejected\(key, error\)"),
    ],
)
def test_hooks_with_the_wrong_arity_are_refused(field: str, hook: Any, expected: str) -> None:
    with pytest.raises(TypeError, match=expected):
        Hooks(**{field: hook})


def test_hooks_accept_every_callable_that_fits() -> None:
    class Counter:
        def __call__(self, key: object, queue_len: int, extra: int = 0) -> None:
            pass

    def variadic(*args: object) -> None:
        pass

    Hooks(
        on_queued=Counter(),
        on_start=functools.partial(lambda prefix, key: None, "p"),
        on_done=variadic,
        on_rejected=lambda key, error, *rest: None,
    )
    Hooks(on_start=print, on_done=repr)  # builtins: checked where a signature is known


def test_dispatcher_closed_still_raised_for_a_closed_dispatcher() -> None:
    d = Dispatcher()
    d.close()
    with pytest.raises(DispatcherClosed):
        d.submit("k", lambda: None)
    assert d.shutdown(TIMEOUT)
