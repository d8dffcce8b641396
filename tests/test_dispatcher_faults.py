"""Faults injected at exact points: Ctrl-C, a thread that cannot start, bad keys.

Each test puts the fault where the dispatcher is between two steps of its
bookkeeping (starting a worker, after queueing, while force_close drops
work) and checks the promise afterwards: every accepted task runs once,
every future is resolved, the ``max_inflight`` cap is exact, and a submit
that raised left nothing that runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from dispatch_helpers import TIMEOUT, blocker, until

from outbound import (
    Defer,
    Dispatcher,
    DispatchInfo,
    Hooks,
    KeyedExecutor,
    QueueFull,
    State,
    current_context,
)
from outbound.errors import BrokenDispatcher, DispatcherClosed

_real_start = threading.Thread.start
_RealThread = threading.Thread


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """What any thread dies of during the test (e.g. a permit released twice).

    Not set with ``monkeypatch``: the tests undo their patches midway.
    """
    errors: list[BaseException] = []

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            errors.append(args.exc_value)

    previous = threading.excepthook
    threading.excepthook = hook
    try:
        yield errors
    finally:
        threading.excepthook = previous


def fail_start_once(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, *, after_start: bool = False
) -> list[int]:
    """Make the next ``Thread.start`` raise ``error`` (after really starting, if asked)."""
    calls: list[int] = []

    def start(self: threading.Thread) -> None:
        calls.append(1)
        if len(calls) == 1:
            if after_start:
                _real_start(self)
            raise error
        _real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return calls


def assert_cap_is_exact(d: Dispatcher, cap: int) -> None:
    """``cap`` tasks run at once on distinct keys, and not one more."""
    release = threading.Event()
    started = [threading.Event() for _ in range(cap + 1)]
    futures = [d.submit(("cap", i), blocker(started[i], release)) for i in range(cap + 1)]
    try:
        for event in started[:cap]:
            assert event.wait(TIMEOUT)
        stats = d.stats()
        assert stats.running == cap
        assert stats.threads == cap
        assert not started[cap].is_set()
    finally:
        release.set()
    for future in futures:
        future.result(TIMEOUT)


# ------------------------------------------------- starting a worker thread


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("can't start new thread")])
def test_start_failing_before_the_thread_runs_refuses_cleanly(
    monkeypatch: pytest.MonkeyPatch, thread_errors: list[BaseException], error: BaseException
) -> None:
    """The first worker cannot start: submit raises, the task never runs, no permit leaks."""
    ran: list[int] = []
    d = Dispatcher(max_inflight=2)
    try:
        fail_start_once(monkeypatch, error)
        with pytest.raises(type(error)):
            d.submit("k", ran.append, 1)
        monkeypatch.undo()
        assert d.state is State.OPEN
        assert d.stats().threads == 0
        assert d.submit("k", ran.append, 2).result(TIMEOUT) is None
        assert d.drain(TIMEOUT)
        assert ran == [2]
        assert_cap_is_exact(d, 2)
    finally:
        assert d.shutdown(TIMEOUT)
    assert thread_errors == []


def test_ctrl_c_in_start_after_the_thread_began_keeps_the_count(
    monkeypatch: pytest.MonkeyPatch, thread_errors: list[BaseException]
) -> None:
    """Ctrl-C lands in Thread.start after the new thread began: it is counted once,
    submit raises and its task does not run."""
    in_init, go = threading.Event(), threading.Event()

    def init() -> None:
        in_init.set()
        assert go.wait(TIMEOUT)

    ran: list[int] = []
    d = Dispatcher(max_inflight=2, initializer=init)
    try:

        def start(self: threading.Thread) -> None:
            monkeypatch.undo()
            _real_start(self)
            assert in_init.wait(TIMEOUT)  # the thread runs and counts as a worker
            raise KeyboardInterrupt

        monkeypatch.setattr(threading.Thread, "start", start)
        with pytest.raises(KeyboardInterrupt):
            d.submit("k", ran.append, 1)
        go.set()
        assert d.drain(TIMEOUT)
        assert ran == []
        assert d.submit("k", ran.append, 2).result(TIMEOUT) is None
        assert ran == [2]
        assert_cap_is_exact(d, 2)
    finally:
        go.set()
        assert d.shutdown(TIMEOUT)
    assert thread_errors == []


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("can't start new thread")])
def test_ctrl_c_in_start_of_a_thread_that_began_without_waiting(
    monkeypatch: pytest.MonkeyPatch, thread_errors: list[BaseException], error: BaseException
) -> None:
    """The thread began, the starter saw an error at once: whichever wins, one owner."""
    results: list[int] = []
    d = Dispatcher(max_inflight=1)
    try:
        fail_start_once(monkeypatch, error, after_start=True)
        try:
            future: Future[None] | None = d.submit("k", results.append, 1)
        except type(error):
            future = None
        monkeypatch.undo()
        assert d.drain(TIMEOUT)
        if future is None:  # refused: it must not have run
            assert results == []
        else:
            assert future.result(TIMEOUT) is None
            assert results == [1]
        assert_cap_is_exact(d, 1)
    finally:
        assert d.shutdown(TIMEOUT)
    assert thread_errors == []


@pytest.mark.parametrize("error", [MemoryError(), KeyboardInterrupt()])
def test_building_the_thread_object_failing_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch, thread_errors: list[BaseException], error: BaseException
) -> None:
    ran: list[int] = []
    d = Dispatcher(max_inflight=2)
    try:
        calls: list[int] = []

        def thread(*args: Any, **kwargs: Any) -> threading.Thread:
            calls.append(1)
            if len(calls) == 1:
                raise error
            return _RealThread(*args, **kwargs)

        monkeypatch.setattr(threading, "Thread", thread)
        with pytest.raises(type(error)):
            d.submit("k", ran.append, 1)
        monkeypatch.undo()
        assert d.stats().threads == 0
        # same key: a lane left behind without an owner would swallow this one
        assert d.submit("k", ran.append, 2).result(TIMEOUT) is None
        assert d.drain(TIMEOUT)
        assert ran == [2]
        assert_cap_is_exact(d, 2)
    finally:
        assert d.shutdown(TIMEOUT)
    assert thread_errors == []


def test_a_task_that_joined_a_stranded_lane_runs_at_the_next_drain(
    thread_errors: list[BaseException],
) -> None:
    """Another submit joins the lane while its worker fails to start (it reads
    _stranded before it is set): the task stays queued, drain() starts a thread."""
    d = Dispatcher(max_inflight=1)
    joined: list[Future[str]] = []
    calls: list[int] = []

    def start(self: threading.Thread) -> None:
        calls.append(1)
        if len(calls) == 1:
            joined.append(d.submit("k", lambda: "joined"))  # fast path, flag not yet set
            raise RuntimeError("can't start new thread")
        _real_start(self)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(threading.Thread, "start", start)
            with pytest.raises(RuntimeError):
                d.submit("k", lambda: "first")
        assert d.stats().threads == 0
        assert not joined[0].done()
        assert d.drain(TIMEOUT)
        assert joined[0].result(0) == "joined"
    finally:
        assert d.shutdown(TIMEOUT)
    assert thread_errors == []


def test_a_later_thread_failing_to_start_leaves_the_work_to_a_live_worker(
    monkeypatch: pytest.MonkeyPatch, thread_errors: list[BaseException]
) -> None:
    """Another worker exists: submit accepts, and that worker runs the task."""
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=2)
    try:
        busy = d.submit("busy", blocker(started, release))
        assert started.wait(TIMEOUT)
        fail_start_once(monkeypatch, RuntimeError("can't start new thread"))
        future = d.submit("other", lambda: "ran")
        monkeypatch.undo()
        assert d.state is State.OPEN
        release.set()
        assert busy.result(TIMEOUT) is None
        assert future.result(TIMEOUT) == "ran"
        assert d.drain(TIMEOUT)
        assert_cap_is_exact(d, 2)
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert thread_errors == []


def test_a_later_thread_failing_to_start_wakes_a_worker_that_went_idle(
    thread_errors: list[BaseException],
) -> None:
    """The pool grows for a new lane because its only worker is busy; that worker
    goes idle while the new thread fails to start: the job given back must wake it
    (it would otherwise sleep for idle_timeout, here for ever)."""
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=2, idle_timeout=math.inf)
    calls: list[int] = []

    def start(self: threading.Thread) -> None:
        calls.append(1)
        if len(calls) == 1:
            release.set()  # the busy worker finishes, finds nothing, sleeps
            assert wait_for(lambda: d.stats().idle_threads == 1)
            raise RuntimeError("can't start new thread")
        _real_start(self)

    try:
        busy = d.submit("busy", blocker(started, release))
        assert started.wait(TIMEOUT)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(threading.Thread, "start", start)
            future = d.submit("other", lambda: "ran")
        assert calls == [1]
        assert busy.result(TIMEOUT) is None
        assert future.result(TIMEOUT) == "ran"
        assert d.stats().threads == 1
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert thread_errors == []


def wait_for(predicate: Callable[[], bool]) -> bool:
    done = threading.Event()
    for _ in range(int(TIMEOUT / 0.01)):
        if predicate():
            return True
        done.wait(0.01)
    return predicate()


# --------------------------------------------------------------- hooks


@pytest.mark.parametrize("lane_exists", [False, True], ids=["new-lane", "fast-path"])
def test_ctrl_c_from_on_queued_refuses_the_task(lane_exists: bool) -> None:
    """on_queued raises KeyboardInterrupt: submit raises, so the task must not run."""
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def on_queued(key: object, queue_len: int) -> None:
        if key == "x" and queue_len == (2 if lane_exists else 1):
            raise KeyboardInterrupt

    d = Dispatcher(max_inflight=1, hooks=Hooks(on_queued=on_queued))
    try:
        d.submit("busy", blocker(started, release))
        assert started.wait(TIMEOUT)
        if lane_exists:
            d.submit("x", ran.append, 0)
        with pytest.raises(KeyboardInterrupt):
            d.submit("x", ran.append, 1)
        after = d.submit("x", ran.append, 2)
        release.set()
        assert after.result(TIMEOUT) is None
        assert d.drain(TIMEOUT)
        assert ran == ([0, 2] if lane_exists else [2])
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


def test_on_done_is_not_called_for_a_task_cancelled_as_it_deferred() -> None:
    """A task cancelled by force_close gets no on_done, whether it was queued,
    parked, or deferring at that very moment."""
    done: list[DispatchInfo] = []
    d = Dispatcher(hooks=Hooks(on_done=done.append))

    def defer_after_force_close() -> None:
        d.force_close()
        raise Defer(0.0)

    try:
        future = d.submit("k", defer_after_force_close)
        assert d.drain(TIMEOUT)
        assert future.cancelled()
        assert done == []
    finally:
        assert d.shutdown(TIMEOUT)


# ------------------------------------------------------------ timer threads


def test_timer_restarts_do_not_pile_up_in_the_thread_list() -> None:
    d = Dispatcher(idle_timeout=0.01)
    try:
        for _ in range(5):
            d.pause(0.0)
            timer = d._timer.thread
            if timer is not None:
                timer.join(TIMEOUT)
                assert not timer.is_alive()
        with d._lock:
            assert len(d._threads) <= 1
    finally:
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("how", ["defer", "defer_keyless", "pause"])
def test_a_log_handler_that_submits_when_the_timer_cannot_start_deadlocks_nothing(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A handler that forwards outbound's errors to an admin chat through the
    dispatcher (a bot's natural choice) was run while the dispatcher's lock was held:
    "cannot start the timer thread" was logged under it, and the handler's submit
    waited for a lock its own thread held, for good."""
    real_start = threading.Thread.start
    failures = [1]  # the timer's first start fails (a transient limit)

    def start(self: threading.Thread) -> None:
        if self.name.endswith("-timer") and failures:
            failures.pop()
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    d = Dispatcher(max_inflight=2)
    forwarded: list[Future[str]] = []

    class ToAdminChat(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            forwarded.append(d.submit("admin-chat", record.getMessage))

    handler = ToAdminChat(logging.ERROR)
    logger = logging.getLogger("outbound")
    logger.addHandler(handler)
    runs: list[int] = []

    def rate_limited() -> str:
        runs.append(1)
        if len(runs) == 1:
            raise Defer(0.01)  # parks on the timer, whose thread must start
        return "sent"

    out: list[object] = []
    try:
        if how == "pause":
            started, release = threading.Event(), threading.Event()
            held = d.submit("busy", blocker(started, release))  # a lane: pause arms the timer
            assert started.wait(TIMEOUT)
            aside = threading.Thread(target=d.pause, args=(0.01,), daemon=True)
            aside.start()
            aside.join(TIMEOUT)
            assert not aside.is_alive(), "pause() waited for its own lock"
            release.set()
            held.result(TIMEOUT)
        else:
            submit = d.submit if how == "defer" else lambda _k, fn: d._submit_keyless(fn, (), {})
            future = submit("chat", rate_limited)
            drained = threading.Thread(target=lambda: out.append(d.drain(TIMEOUT)), daemon=True)
            drained.start()
            drained.join(TIMEOUT + 2)
            assert not drained.is_alive(), "the worker waited for its own lock"
            assert out == [True]
            assert future.result(TIMEOUT) == "sent"
    finally:
        logger.removeHandler(handler)
        monkeypatch.undo()
        release_all = d.shutdown(TIMEOUT)
    assert release_all
    assert [f.result(TIMEOUT) for f in forwarded] == ["outbound: cannot start the timer thread"]


def test_pause_starts_no_thread_before_any_submit() -> None:
    d = Dispatcher()
    try:
        d.pause(10.0)
        assert d._timer.thread is None
        assert d.stats().paused_for > 0
    finally:
        assert d.shutdown(TIMEOUT)


def test_a_submit_during_a_pause_still_starts_when_it_ends() -> None:
    d = Dispatcher()
    try:
        d.pause(0.05)
        assert d.submit("k", lambda: "ran").result(TIMEOUT) == "ran"
    finally:
        assert d.shutdown(TIMEOUT)


# ------------------------------------------------------------------ keys


class MutableKey:
    """A key whose hash the test changes after submission (a user bug)."""

    def __init__(self, h: int) -> None:
        self.h = h
        self.raise_on_hash: BaseException | None = None

    def __hash__(self) -> int:
        if self.raise_on_hash is not None:
            error, self.raise_on_hash = self.raise_on_hash, None
            raise error
        return self.h

    def __eq__(self, other: object) -> bool:
        return self is other


def test_a_key_whose_hash_changes_does_not_wedge_the_dispatcher() -> None:
    started, release = threading.Event(), threading.Event()
    key = MutableKey(1)
    d = Dispatcher(max_inflight=2)
    try:
        first = d.submit(key, blocker(started, release, "first"))
        assert started.wait(TIMEOUT)
        key.h = 2  # the lane is filed under the old hash
        release.set()
        assert first.result(TIMEOUT) == "first"
        assert d.drain(TIMEOUT)
        assert d.stats().lanes == 0
        assert d.submit(key, lambda: "again").result(TIMEOUT) == "again"
        key.h = 1  # back to the first hash: finds the old, dead entry
        assert d.submit(key, lambda: "back").result(TIMEOUT) == "back"
        assert d.drain(TIMEOUT)
        assert d.stats().lanes == 0
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


class _CallingBack(logging.Handler):
    """A logging handler that calls the dispatcher (an admin chat's alert does)."""

    def __init__(self, d: Dispatcher) -> None:
        super().__init__(logging.ERROR)
        self.d = d
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.d.stats()
        with contextlib.suppress(DispatcherClosed):
            self.d.submit("admin", lambda: None)


@pytest.mark.parametrize("how", ["force_close", "retired"])
def test_a_log_handler_calling_back_on_a_changed_hash_deadlocks_nothing(how: str) -> None:
    # The line was logged under the dispatcher's lock (force_close) or a
    # lane's: a handler calling back in waited on its own thread for good.
    started, release = threading.Event(), threading.Event()
    key = MutableKey(1)
    d = Dispatcher(max_inflight=1)
    handler = _CallingBack(d)
    logging.getLogger("outbound").addHandler(handler)
    try:
        d.submit("busy", blocker(started, release))
        assert started.wait(TIMEOUT)
        queued = d.submit(key, lambda: "ran")
        key.h = 2  # the lane is filed under the old hash
        if how == "force_close":
            closer = threading.Thread(target=d.force_close, daemon=True)
            closer.start()
            closer.join(TIMEOUT)
            assert not closer.is_alive(), "force_close() never returned"
            assert queued.cancelled()
        else:
            release.set()
            assert queued.result(TIMEOUT) == "ran"
            assert d.drain(TIMEOUT)
        assert until(lambda: any("hash of a key of type MutableKey" in m for m in handler.lines))
    finally:
        logging.getLogger("outbound").removeHandler(handler)
        release.set()
        assert d.shutdown(TIMEOUT)


def test_a_key_whose_hash_raises_later_does_not_kill_its_worker(
    thread_errors: list[BaseException],
) -> None:
    started, release = threading.Event(), threading.Event()
    key = MutableKey(1)
    d = Dispatcher(max_inflight=1)
    try:
        first = d.submit(key, blocker(started, release))
        assert started.wait(TIMEOUT)
        key.raise_on_hash = ValueError("hash broke")
        release.set()
        assert first.result(TIMEOUT) is None
        assert d.drain(TIMEOUT)
        assert d.submit("next", lambda: "ran").result(TIMEOUT) == "ran"
        assert d.stats().threads == 1
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert thread_errors == []


def test_a_key_whose_hash_raises_at_submit_is_refused_clearly() -> None:
    key = MutableKey(1)
    key.raise_on_hash = ValueError("hash broke")
    d = Dispatcher()
    try:
        with pytest.raises(TypeError, match=r"MutableKey.*hash broke"):
            d.submit(key, lambda: None)
        assert d.stats().queued == 0
        assert d.stats().lanes == 0
    finally:
        assert d.shutdown(TIMEOUT)


def test_ctrl_c_from_a_key_hash_in_force_close_still_resolves_every_future() -> None:
    started, release = threading.Event(), threading.Event()
    bad = MutableKey(7)
    d = Dispatcher(max_inflight=1)
    try:
        d.submit("busy", blocker(started, release))
        assert started.wait(TIMEOUT)
        queued = [d.submit(k, lambda: None) for k in (bad, bad, "a", "b", bad)]
        bad.raise_on_hash = KeyboardInterrupt()  # as force_close retires its lane
        with pytest.raises(KeyboardInterrupt):
            d.force_close()
        assert all(f.cancelled() for f in queued)
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


# ------------------------------------------------------------- exit, init


def test_a_dispatcher_made_during_interpreter_exit_never_drops_work() -> None:
    """Made by an atexit function, after the exit shutdown of dispatchers ran:
    submit refuses, naming the cause, or the task runs; never accepted and lost."""
    script = textwrap.dedent(
        """
        import atexit, threading
        from outbound import Dispatcher, DispatcherClosed

        first = Dispatcher()

        def slow_task():
            threading.Event().wait(0.5)  # a task that takes a while, not a sync
            print("ran", flush=True)

        def late():
            d = Dispatcher(max_inflight=1)
            try:
                d.submit("k", slow_task)
            except DispatcherClosed as exc:
                print("refused:", exc, flush=True)
            else:
                print("accepted", flush=True)

        atexit.register(late)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert ("refused:" in out and "exiting" in out) or ("accepted" in out and "ran" in out), out


_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def test_initializer_runs_in_each_thread_in_the_creators_context() -> None:
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def init() -> None:
        with lock:
            seen.append((threading.current_thread().name, _request_id.get()))
        _request_id.set("set by init")  # stays in the initializer's context

    token = _request_id.set("at construction")
    try:
        ex = KeyedExecutor(max_workers=2, initializer=init)
    finally:
        _request_id.reset(token)
    try:
        started, release = threading.Event(), threading.Event()
        other_started = threading.Event()
        _request_id.set("submitter")
        f1 = ex.submit_keyed("a", blocker(started, release))
        assert started.wait(TIMEOUT)
        f2 = ex.submit_keyed("b", blocker(other_started, release))
        assert other_started.wait(TIMEOUT)
        release.set()
        f1.result(TIMEOUT)
        f2.result(TIMEOUT)
        assert ex.submit(_request_id.get).result(TIMEOUT) == "submitter"
    finally:
        ex.shutdown()
    assert len(seen) == 2
    assert len({name for name, _ in seen}) == 2
    assert all(value == "at construction" for _, value in seen)


# ------------------------------------------------------------ seconds


def test_bool_as_seconds_is_refused() -> None:
    d = Dispatcher()
    try:
        with pytest.raises(TypeError, match="bool"):
            d.pause(True)
        with pytest.raises(TypeError, match="bool"):
            d.drain(timeout=True)
        with pytest.raises(TypeError, match="bool"):
            d.shutdown(timeout=False)
        with pytest.raises(TypeError, match="bool"):
            Defer(True)
    finally:
        assert d.shutdown(TIMEOUT)


def test_infinite_pause_and_defer_last_until_force_close() -> None:
    """README: a delay longer than TIMEOUT_MAX means "until force_close()"."""
    d = Dispatcher()
    try:
        d.pause(math.inf)
        assert d.stats().paused_for == math.inf
        waiting = d.submit("k", lambda: None)
        attempts: list[int] = []

        def defer_forever() -> None:
            attempts.append(1)
            raise Defer(math.inf)

        assert d.drain(0) is False
        d.force_close()
        assert waiting.cancelled()
        assert d.shutdown(TIMEOUT)
        assert d.stats().paused_for == 0
        e = Dispatcher()
        parked = e.submit("k", defer_forever)
        assert wait_for(lambda: e.stats().parked == 1)
        e.force_close()
        assert parked.cancelled()
        assert attempts == [1]
        assert e.shutdown(TIMEOUT)
    finally:
        d.force_close()
        assert d.shutdown(TIMEOUT)


def test_a_deferred_task_keeps_its_turn_and_is_not_counted_as_waiting() -> None:
    """queue_size bounds the tasks waiting behind the lane's current one, also
    while that one is deferred."""
    lens: list[int] = []
    d = Dispatcher(queue_size=2, hooks=Hooks(on_queued=lambda key, n: lens.append(n)))

    def defer_once() -> str:
        if current_context().attempt == 1:
            raise Defer(math.inf)
        return "second run"

    try:
        first = d.submit("k", defer_once)
        assert wait_for(lambda: d.stats().parked == 1)
        d.submit("k", lambda: None)
        d.submit("k", lambda: None)
        with pytest.raises(QueueFull):
            d.submit("k", lambda: None)
        assert lens == [1, 1, 2]
    finally:
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert first.cancelled()


class _HookFailure(BaseException):
    pass


@pytest.mark.usefixtures("broken_log")
@pytest.mark.parametrize("error", [ValueError, _HookFailure])
def test_hooks_that_raise_with_a_log_that_raises_change_nothing(
    error: type[BaseException], thread_errors: list[BaseException]
) -> None:
    # Each hook's error is logged and swallowed. The log raising too must
    # not end a worker thread (its lanes stranded, their tasks never run)
    # nor make a submit raise.
    def hook(*args: object) -> None:
        raise error("hook")

    d = Dispatcher(
        max_inflight=4,
        queue_size=2,
        hooks=Hooks(on_queued=hook, on_start=hook, on_done=hook, on_rejected=hook),
    )
    try:
        order: list[int] = []
        gate = threading.Event()
        first = d.submit("k", gate.wait, TIMEOUT)
        futures = [d.submit("k", order.append, i) for i in range(2)]
        with pytest.raises(QueueFull):
            d.submit("k", order.append, 99)  # on_rejected raises, and its log
        gate.set()
        futures += [d.submit(i, order.append, 100 + i) for i in range(20)]
        assert first.result(TIMEOUT) is True
        for future in futures:
            assert future.result(TIMEOUT) is None
    finally:
        gate.set()
        assert d.shutdown(TIMEOUT) is True
    assert [i for i in order if i < 100] == [0, 1]
    assert sorted(order) == [0, 1, *range(100, 120)]
    assert thread_errors == []


@pytest.mark.usefixtures("broken_log")
def test_an_initializer_that_raises_with_a_log_that_raises_breaks_the_dispatcher(
    thread_errors: list[BaseException],
) -> None:
    def initializer() -> None:
        raise RuntimeError("no init")

    d = Dispatcher(max_inflight=2, initializer=initializer)
    try:
        future = d.submit("k", lambda: 1)
        with pytest.raises(BrokenDispatcher):
            future.result(TIMEOUT)
        with pytest.raises(BrokenDispatcher):
            d.submit("k", lambda: 2)
    finally:
        d.shutdown(TIMEOUT)
    assert thread_errors == []


@pytest.mark.parametrize(
    ("attribute", "value", "error", "says"),
    [
        ("delay", math.nan, ValueError, "Defer delay must be a number of seconds >= 0"),
        ("delay", "soon", TypeError, "Defer delay must be a number of seconds"),
        ("delay", -1.0, ValueError, "Defer delay must be a number of seconds >= 0"),
        ("scope", "sometimes", ValueError, "Defer scope must be 'lane' or 'all'"),
    ],
)
@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
def test_a_defer_changed_after_it_was_made_fails_its_task_by_name(
    attribute: str, value: object, error: type[Exception], says: str, keyed: bool
) -> None:
    """A NaN delay set on a Defer after it was made held the timer's thread in a
    loop (every other parked lane stayed parked); a string ended the worker's
    thread, the keyless task's future pending for good."""

    def task() -> None:
        defer = Defer(0.01)
        setattr(defer, attribute, value)
        raise defer

    ex = KeyedExecutor(max_workers=2)
    try:
        parked = ex.submit_keyed("other", _defer_once) if keyed else ex.submit(_defer_once)
        future = ex.submit_keyed("k", task) if keyed else ex.submit(task)
        with pytest.raises(error, match=says):
            future.result(timeout=TIMEOUT)
        assert isinstance(future.exception(timeout=TIMEOUT).__cause__, Defer)  # type: ignore[union-attr]
        assert parked.result(timeout=TIMEOUT) == 2  # the timer goes on
        assert (ex.submit_keyed("k", abs, -3) if keyed else ex.submit(abs, -3)).result(
            timeout=TIMEOUT
        ) == 3
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    assert ex._dispatcher.shutdown(TIMEOUT)


def _defer_once() -> int:
    if current_context().attempt == 1:
        raise Defer(0.05)
    return current_context().attempt
