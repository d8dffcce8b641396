"""The core dispatcher: order, concurrency, queues, futures, hooks, context, Defer."""

from __future__ import annotations

import contextvars
import dataclasses
import gc
import logging
import math
import threading
import time
import weakref
from collections.abc import Hashable
from concurrent.futures import CancelledError, Future
from typing import Any

import pytest
from dispatch_helpers import blocker as _blocker
from dispatch_helpers import returning

from outbound import (
    Defer,
    Dispatcher,
    DispatcherClosed,
    DispatchInfo,
    Hooks,
    QueueFull,
    State,
    current_context,
)

TIMEOUT = 10.0


class Key:
    """A hashable key that can be weakly referenced."""

    def __repr__(self) -> str:
        return "<Key>"


# --------------------------------------------------------------------- order


def test_per_key_fifo() -> None:
    order: list[int] = []
    with Dispatcher(max_inflight=4, queue_size=500) as d:
        futs = [d.submit("k", order.append, i) for i in range(300)]
        for f in futs:
            assert f.result(timeout=TIMEOUT) is None
    assert order == list(range(300))


def test_tasks_of_one_key_never_overlap() -> None:
    lock = threading.Lock()
    running = {"a": 0, "b": 0}
    overlaps: list[str] = []

    def task(key: str) -> None:
        with lock:
            running[key] += 1
            if running[key] > 1:
                overlaps.append(key)
        with lock:
            running[key] -= 1

    with Dispatcher(max_inflight=4, queue_size=1000) as d:
        futs = [d.submit(k, task, k) for _ in range(300) for k in ("a", "b")]
        for f in futs:
            f.result(timeout=TIMEOUT)
    assert overlaps == []


def test_keys_run_concurrently() -> None:
    """Tasks of n distinct keys all run at once: they meet at a barrier of n."""
    n = 4
    barrier = threading.Barrier(n, timeout=TIMEOUT)
    with Dispatcher(max_inflight=n) as d:
        futs = [d.submit(i, barrier.wait) for i in range(n)]
        results = sorted(f.result(timeout=TIMEOUT) for f in futs)
    assert results == list(range(n))  # Barrier.wait returns each arrival index once


def test_one_blocked_key_does_not_block_others() -> None:
    started, release = threading.Event(), threading.Event()
    with Dispatcher(max_inflight=2) as d:
        try:
            d.submit("slow", _blocker(started, release))
            later = d.submit("slow", lambda: "after")
            assert started.wait(TIMEOUT)
            assert [d.submit("fast", returning(i)).result(timeout=TIMEOUT) for i in range(5)] == [
                0,
                1,
                2,
                3,
                4,
            ]
            assert not later.done()
        finally:
            release.set()
        assert later.result(timeout=TIMEOUT) == "after"


# -------------------------------------------------------------------- queues


def test_queue_full_only_for_the_full_key() -> None:
    """queue_size counts waiting tasks: the running one has left the lane."""
    started, release = threading.Event(), threading.Event()
    rejected: list[tuple[Hashable, BaseException]] = []
    hooks = Hooks(on_rejected=lambda k, e: rejected.append((k, e)))
    with Dispatcher(max_inflight=2, queue_size=2, hooks=hooks) as d:
        try:
            running = d.submit("a", _blocker(started, release, "r"))
            assert started.wait(TIMEOUT)
            waiting = [d.submit("a", returning(i)) for i in range(2)]  # fills the lane
            with pytest.raises(QueueFull) as info:
                d.submit("a", lambda: None)
            assert info.value.key == "a"
            assert info.value.queue_size == 2
            assert "a" in str(info.value)
            assert d.submit("b", lambda: "b").result(timeout=TIMEOUT) == "b"
            assert d.stats().queued == 2
        finally:
            release.set()
        assert running.result(timeout=TIMEOUT) == "r"
        assert [f.result(timeout=TIMEOUT) for f in waiting] == [0, 1]
        # the lane drained: the key is accepted again
        assert d.submit("a", lambda: "again").result(timeout=TIMEOUT) == "again"
    assert len(rejected) == 1
    assert rejected[0][0] == "a"
    assert isinstance(rejected[0][1], QueueFull)


class _Unshown:
    """A hashable key whose repr raises (a lazily loaded ORM row, say), or is huge."""

    def __init__(self, huge: bool, error: type[BaseException] = ValueError) -> None:
        self.huge = huge
        self.error = error

    def __repr__(self) -> str:
        if self.huge:
            return "x" * 100_000
        raise self.error("repr unavailable")


@pytest.mark.parametrize(
    ("huge", "error"),
    [(False, ValueError), (False, SystemExit), (True, ValueError)],
    ids=["raising-repr", "repr-raising-SystemExit", "huge-repr"],
)
def test_queue_full_whatever_the_keys_repr(huge: bool, error: type[BaseException]) -> None:
    """The refusal's message showed repr(key): a repr that raised replaced QueueFull by
    its error, and on_rejected was never called."""
    started, release = threading.Event(), threading.Event()
    rejected: list[BaseException] = []
    key = _Unshown(huge, error)
    hooks = Hooks(on_rejected=lambda k, e: rejected.append(e))
    with Dispatcher(max_inflight=1, queue_size=1, hooks=hooks) as d:
        try:
            d.submit(key, _blocker(started, release))
            assert started.wait(TIMEOUT)
            d.submit(key, lambda: None)  # fills the lane
            refused: BaseException | None = None
            try:
                d.submit(key, lambda: None)
            except BaseException as exc:  # (the SystemExit of a repr, too)
                refused = exc
        finally:
            release.set()
    assert isinstance(refused, QueueFull), repr(refused)
    assert refused.key is key
    assert len(str(refused)) < 300
    assert ("whose repr() raised" in str(refused)) is not huge
    assert rejected == [refused]


def test_queue_size_one() -> None:
    started, release = threading.Event(), threading.Event()
    with Dispatcher(max_inflight=1, queue_size=1) as d:
        try:
            d.submit(1, _blocker(started, release))
            assert started.wait(TIMEOUT)
            second = d.submit(1, lambda: 2)
            with pytest.raises(QueueFull):
                d.submit(1, lambda: 3)
        finally:
            release.set()
        assert second.result(timeout=TIMEOUT) == 2


# ------------------------------------------------------------------- futures


def test_result_and_arguments() -> None:
    def fn(a: int, b: int, *, c: int) -> tuple[int, int, int]:
        return (a, b, c)

    with Dispatcher() as d:
        fut = d.submit("k", fn, 1, 2, c=3)
        assert isinstance(fut, Future)
        assert fut.result(timeout=TIMEOUT) == (1, 2, 3)


def test_keyword_names_key_and_fn_reach_the_task() -> None:
    """key and fn are positional-only, so a task may take kwargs named key or fn."""

    def fn(**kwargs: object) -> dict[str, object]:
        return kwargs

    with Dispatcher() as d:
        assert d.submit("k", fn, key=1, fn=2).result(timeout=TIMEOUT) == {"key": 1, "fn": 2}


class Boom(BaseException):
    """A BaseException that is not an Exception."""


@pytest.mark.parametrize(
    "exc", [ValueError("bad"), SystemExit(3), Boom("boom")], ids=["error", "sysexit", "base"]
)
def test_exception_goes_to_future_and_lane_goes_on(exc: BaseException) -> None:
    threads: list[int] = []

    def fail() -> None:
        threads.append(threading.get_ident())
        raise exc

    def ok(i: int) -> int:
        threads.append(threading.get_ident())
        return i

    with Dispatcher(max_inflight=1) as d:
        futs: list[Future[Any]] = [d.submit("k", ok, 0), d.submit("k", fail), d.submit("k", ok, 2)]
        assert futs[0].result(timeout=TIMEOUT) == 0
        assert futs[1].exception(timeout=TIMEOUT) is exc
        assert futs[2].result(timeout=TIMEOUT) == 2
        # the worker survived: the same thread runs the next task
        assert d.submit("k", ok, 3).result(timeout=TIMEOUT) == 3
        assert d.stats().threads == 1
    assert len(set(threads)) == 1


def test_cancelled_future_is_skipped() -> None:
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []
    with Dispatcher(max_inflight=1) as d:
        try:
            d.submit("k", _blocker(started, release))
            assert started.wait(TIMEOUT)
            f1 = d.submit("k", ran.append, 1)
            f2 = d.submit("k", ran.append, 2)
            assert f1.cancel()
        finally:
            release.set()
        assert f2.result(timeout=TIMEOUT) is None
        assert f1.cancelled()
    assert ran == [2]


# --------------------------------------------------------------------- hooks


def test_hooks_values() -> None:
    lock = threading.Lock()
    queued: list[tuple[Hashable, int]] = []
    starts: list[Hashable] = []
    done: list[DispatchInfo] = []
    rejected: list[tuple[Hashable, BaseException]] = []

    def record(target: list[Any], value: object) -> None:
        with lock:
            target.append(value)

    hooks = Hooks(
        on_queued=lambda k, n: record(queued, (k, n)),
        on_start=lambda k: record(starts, k),
        on_done=lambda info: record(done, info),
        on_rejected=lambda k, e: record(rejected, (k, e)),
    )
    started, release = threading.Event(), threading.Event()
    error = ValueError("x")

    def fail() -> None:
        raise error

    d = Dispatcher(max_inflight=1, queue_size=2, hooks=hooks)
    try:
        f0 = d.submit("k", _blocker(started, release))
        assert started.wait(TIMEOUT)
        f1 = d.submit("k", fail)
        f2 = d.submit("k", lambda: None)
        with pytest.raises(QueueFull):
            d.submit("k", lambda: None)
        release.set()
        for f in (f0, f1, f2):
            f.exception(timeout=TIMEOUT)
        assert d.drain(TIMEOUT)
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    with pytest.raises(DispatcherClosed):
        d.submit("z", lambda: None)

    assert queued == [("k", 1), ("k", 1), ("k", 2)]
    assert starts == ["k", "k", "k"]
    assert [i.key for i in done] == ["k", "k", "k"]
    # queue_len: tasks still waiting in the lane when each one started
    assert [i.queue_len for i in done] == [0, 1, 0]
    assert [i.error for i in done] == [None, error, None]
    for info in done:
        assert info.queue_latency >= 0.0
        assert info.run_latency >= 0.0
    assert [k for k, _ in rejected] == ["k", "z"]
    assert isinstance(rejected[0][1], QueueFull)
    assert isinstance(rejected[1][1], DispatcherClosed)


def test_dispatch_info_latencies() -> None:
    """queue_latency covers the wait behind a blocked task; run_latency the run."""
    started, release = threading.Event(), threading.Event()
    infos: list[DispatchInfo] = []
    with Dispatcher(max_inflight=1, hooks=Hooks(on_done=infos.append)) as d:
        try:
            d.submit("k", _blocker(started, release))
            assert started.wait(TIMEOUT)
            t0 = time.monotonic()
            fut = d.submit("k", lambda: None)
            assert not release.wait(0.05)  # keep it waiting a measurable time
        finally:
            release.set()
        fut.result(timeout=TIMEOUT)
        assert d.drain(TIMEOUT)
        elapsed = time.monotonic() - t0
    assert len(infos) == 2
    assert 0.04 <= infos[1].queue_latency <= elapsed
    assert infos[0].run_latency >= 0.04


def test_raising_hooks_are_logged_and_change_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def bad(*args: object) -> None:
        raise RuntimeError("hook failed")

    hooks = Hooks(on_queued=bad, on_start=bad, on_done=bad, on_rejected=bad)
    started, release = threading.Event(), threading.Event()
    caplog.set_level(logging.ERROR, logger="outbound")
    d = Dispatcher(max_inflight=1, queue_size=1, hooks=hooks)
    try:
        first = d.submit("k", _blocker(started, release, 1))
        assert started.wait(TIMEOUT)
        second = d.submit("k", lambda: 2)
        with pytest.raises(QueueFull):  # not the hook's RuntimeError
            d.submit("k", lambda: 3)
        release.set()
        assert first.result(timeout=TIMEOUT) == 1
        assert second.result(timeout=TIMEOUT) == 2
        assert d.submit("k", lambda: 4).result(timeout=TIMEOUT) == 4
        assert d.drain(TIMEOUT)
        assert d.stats().threads == 1
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    with pytest.raises(DispatcherClosed):
        d.submit("k", lambda: 5)
    records = [r for r in caplog.records if r.name == "outbound"]
    messages = " ".join(r.getMessage() for r in records)
    for name in ("on_queued", "on_start", "on_done", "on_rejected"):
        assert name in messages
    assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in records)
    # on_queued x3, on_start x3, on_done x3, on_rejected x2
    assert len(records) == 11


def test_hook_raising_base_exception_does_not_stall_the_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hook raising SystemExit on a worker thread is logged; the worker and lane go on."""
    died = threading.Event()
    thread_errors: list[BaseException | None] = []

    def excepthook(args: threading.ExceptHookArgs) -> None:
        thread_errors.append(args.exc_value)
        died.set()

    monkeypatch.setattr(threading, "excepthook", excepthook)
    calls: list[int] = []

    def on_done(info: DispatchInfo) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise SystemExit("from a hook")

    d = Dispatcher(max_inflight=1, hooks=Hooks(on_done=on_done), exit_timeout=0.1)
    try:
        first = d.submit("k", lambda: 1)
        second = d.submit("k", lambda: 2)
        second.add_done_callback(lambda f: died.set())
        assert first.result(timeout=TIMEOUT) == 1
        assert died.wait(TIMEOUT)  # the second task finished, or the worker died
        assert thread_errors == []
        assert second.result(timeout=0) == 2
    finally:
        d.force_close()
        d.shutdown(0.1)


def test_hooks_type_checked() -> None:
    with pytest.raises(TypeError, match="hooks"):
        Dispatcher(hooks={"on_done": print})  # type: ignore[arg-type]


def test_hooks_and_dispatch_info_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Hooks().on_start = print  # type: ignore[misc]
    info = DispatchInfo("k", 0, 0.0, 0.0)
    assert info.error is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.key = "x"  # type: ignore[misc]


# ------------------------------------------------------------------- context


def test_current_context_inside_task() -> None:
    def task() -> tuple[float, float, float, object, bool, int, float]:
        t0 = time.monotonic()
        ctx = current_context()
        return (
            t0,
            ctx.deadline,
            ctx.remaining(),
            ctx.key,
            ctx.cancelled,
            ctx.attempt,
            ctx.submitted_at,
        )

    before = time.monotonic()
    with Dispatcher(send_timeout=5.0) as d:
        t_in, deadline, remaining, key, cancelled, attempt, submitted = d.submit(
            ("chat", 1), task
        ).result(timeout=TIMEOUT)
    after = time.monotonic()
    # deadline = start of the run + send_timeout
    assert before + 5.0 <= deadline <= t_in + 5.0
    assert 0.0 < remaining <= 5.0
    assert key == ("chat", 1)
    assert cancelled is False
    assert attempt == 1
    assert before <= submitted <= after


def test_current_context_remaining_reaches_zero() -> None:
    def task() -> tuple[float, float]:
        ctx = current_context()
        assert not threading.Event().wait(0.06)
        return ctx.remaining(), ctx.deadline

    with Dispatcher(send_timeout=0.05) as d:
        remaining, deadline = d.submit("k", task).result(timeout=TIMEOUT)
    assert remaining == 0.0
    assert deadline <= time.monotonic()


def test_current_context_infinite_send_timeout() -> None:
    with Dispatcher(send_timeout=math.inf) as d:
        assert d.submit("k", lambda: current_context().remaining()).result(TIMEOUT) == math.inf


def test_current_context_is_per_thread() -> None:
    """Two tasks running at once each see their own key."""
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def task() -> Hashable:
        barrier.wait()
        return current_context().key

    with Dispatcher(max_inflight=2) as d:
        futs = [d.submit(k, task) for k in ("x", "y")]
        assert [f.result(timeout=TIMEOUT) for f in futs] == ["x", "y"]


def test_current_context_outside_task() -> None:
    with pytest.raises(RuntimeError, match="outside a task"):
        current_context()
    with Dispatcher() as d:
        d.submit("k", lambda: None).result(timeout=TIMEOUT)
        with pytest.raises(RuntimeError):  # still not inside a task
            current_context()


def test_task_context_repr() -> None:
    with Dispatcher() as d:
        text = d.submit("k", lambda: repr(current_context())).result(timeout=TIMEOUT)
    assert "key='k'" in text
    assert "attempt=1" in text


# --------------------------------------------------------------------- Defer


def test_defer_reruns_at_lane_head() -> None:
    order: list[tuple[str, int]] = []

    def first() -> str:
        ctx = current_context()
        order.append(("first", ctx.attempt))
        if ctx.attempt == 1:
            raise Defer(0.01)
        return "first"

    def later(name: str) -> str:
        order.append((name, current_context().attempt))
        return name

    with Dispatcher(max_inflight=2) as d:
        futs = [d.submit("k", first), d.submit("k", later, "b"), d.submit("k", later, "c")]
        assert [f.result(timeout=TIMEOUT) for f in futs] == ["first", "b", "c"]
    assert order == [("first", 1), ("first", 2), ("b", 1), ("c", 1)]


def test_defer_holds_no_thread_or_permit() -> None:
    """max_inflight=1: while one lane is parked, another key runs on the freed permit."""
    parked_submitted = threading.Event()
    attempts: list[int] = []

    def deferring() -> str:
        attempts.append(current_context().attempt)
        if current_context().attempt == 1:
            assert parked_submitted.wait(TIMEOUT)
            raise Defer(60.0)  # parked far longer than the test
        return "never"

    d = Dispatcher(max_inflight=1)
    try:
        parked = d.submit("parked", deferring)
        other = d.submit("other", lambda: "ran")
        parked_submitted.set()
        assert other.result(timeout=TIMEOUT) == "ran"
        assert d.submit("third", lambda: 3).result(timeout=TIMEOUT) == 3
        # a task submitted to the parked key waits behind the deferred one
        behind = d.submit("parked", lambda: "behind")
        s = d.stats()
        assert (s.parked, s.lanes, s.queued, s.running) == (1, 1, 2, 0)
        assert not parked.done()
        assert not behind.done()
        assert not parked.cancel()  # it already ran once: it is running
    finally:
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert attempts == [1]
    with pytest.raises(CancelledError):
        parked.result(timeout=TIMEOUT)
    assert behind.cancelled()


def test_defer_many_lanes_with_one_permit() -> None:
    """Many lanes deferring at once on max_inflight=1 all finish, each in order."""
    results: dict[int, list[int]] = {k: [] for k in range(20)}

    def task(k: int, i: int) -> None:
        if current_context().attempt < 3 and i % 2 == 0:
            raise Defer(0.0)
        results[k].append(i)

    with Dispatcher(max_inflight=1, queue_size=10) as d:
        futs = [d.submit(k, task, k, i) for i in range(6) for k in range(20)]
        for f in futs:
            assert f.result(timeout=TIMEOUT) is None
    assert all(v == list(range(6)) for v in results.values())


def test_defer_scope_all_pauses_every_lane() -> None:
    gate = threading.Event()
    t_defer: list[float] = []
    starts: dict[str, float] = {}

    def pauser() -> str:
        if current_context().attempt == 1:
            assert gate.wait(TIMEOUT)
            t_defer.append(time.monotonic())
            raise Defer(0.2, scope="all")
        starts["pauser"] = time.monotonic()
        return "p"

    def other() -> str:
        starts["other"] = time.monotonic()
        return "o"

    with Dispatcher(max_inflight=2) as d:
        fp = d.submit("p", pauser)
        release = threading.Event()
        try:
            # submitted before the pause, but the pauser holds the other slot until it defers
            blocker_started = threading.Event()
            d.submit("b", _blocker(blocker_started, release))
            assert blocker_started.wait(TIMEOUT)
            fo = d.submit("o", other)
            gate.set()
            assert fp.result(timeout=TIMEOUT) == "p"
            assert fo.result(timeout=TIMEOUT) == "o"
        finally:
            gate.set()
            release.set()
    # no lane started a task during the pause, not even one that was ready
    assert starts["pauser"] >= t_defer[0] + 0.2
    assert starts["other"] >= starts["pauser"]  # the deferred lane kept its place


def test_defer_validation() -> None:
    with pytest.raises(ValueError):
        Defer(-1)
    with pytest.raises(ValueError):
        Defer(math.nan)
    with pytest.raises(ValueError):
        Defer(1, scope="chat")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        Defer(True)
    with pytest.raises(TypeError, match="str"):
        Defer("1")  # type: ignore[arg-type]
    assert Defer(math.inf).delay == math.inf  # until force_close, as the README says
    assert Defer(1.5).delay == 1.5
    assert Defer(0, scope="all").scope == "all"


# --------------------------------------------------------------------- pause


def test_pause_delays_new_starts() -> None:
    with Dispatcher(max_inflight=2) as d:
        t0 = time.monotonic()
        d.pause(0.15)
        assert d.stats().paused_for > 0.0
        fut = d.submit("k", time.monotonic)
        started_at = fut.result(timeout=TIMEOUT)
    assert started_at >= t0 + 0.15


def test_pause_lets_running_tasks_finish() -> None:
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=2)
    try:
        running = d.submit("a", _blocker(started, release, "done"))
        assert started.wait(TIMEOUT)
        d.pause(60.0)
        later = d.submit("b", lambda: "later")
        release.set()
        assert running.result(timeout=TIMEOUT) == "done"
        s = d.stats()
        assert s.paused_for > 0.0
        assert (s.running, s.queued) == (0, 1)
        assert not later.done()
    finally:
        release.set()
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert later.cancelled()


@pytest.mark.parametrize("delay", [-1.0, math.nan])
def test_pause_rejects_bad_delay(delay: float) -> None:
    d = Dispatcher()
    try:
        with pytest.raises(ValueError):
            d.pause(delay)
        assert d.stats().paused_for == 0.0
    finally:
        assert d.shutdown(TIMEOUT)


# ---------------------------------------------------------------- contextvars

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")


def test_contextvars_copied_from_submitter() -> None:
    def task() -> str:
        seen = request_id.get()
        request_id.set("changed-in-task")
        return seen

    def submit_from_thread(d: Dispatcher, value: str, out: list[Future[str]]) -> None:
        request_id.set(value)
        out.append(d.submit("k", task))

    with Dispatcher() as d:
        token = request_id.set("main")
        try:
            fut = d.submit("k", task)
            request_id.set("after-submit")  # the copy was taken at submit
            assert fut.result(timeout=TIMEOUT) == "main"
            assert request_id.get() == "after-submit"  # the task's change stays in the task
        finally:
            request_id.reset(token)
        out: list[Future[str]] = []
        t = threading.Thread(target=submit_from_thread, args=(d, "thread", out))
        t.start()
        t.join(TIMEOUT)
        assert out[0].result(timeout=TIMEOUT) == "thread"
        # a later task of the same lane does not inherit a previous task's context
        assert d.submit("k", task).result(timeout=TIMEOUT) == "none"


# --------------------------------------------------------------- observation


def test_stats_and_repr() -> None:
    d = Dispatcher(max_inflight=2, queue_size=8)
    s = d.stats()
    assert (s.state, s.lanes, s.queued, s.running, s.threads) == (State.OPEN, 0, 0, 0, 0)
    assert (s.max_inflight, s.cancelled, s.parked) == (2, False, 0)
    assert "state=open" in repr(d)
    assert (d.max_inflight, d.queue_size, d.send_timeout) == (2, 8, 30.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.lanes = 3  # type: ignore[misc]
    barrier = threading.Barrier(3, timeout=TIMEOUT)
    release = threading.Event()

    def hold() -> None:
        barrier.wait()
        assert release.wait(TIMEOUT)

    try:
        futs = [d.submit("a", hold), d.submit("b", hold)]
        futs += [d.submit("a", lambda: None) for _ in range(3)]
        futs.append(d.submit("c", lambda: None))
        barrier.wait()  # both holders are running
        s = d.stats()
        assert (s.lanes, s.running, s.queued, s.threads) == (3, 2, 4, 2)
        assert s.state is State.OPEN
        text = repr(d)
        assert "lanes=3" in text
        assert "queued=4" in text
        assert "running=2" in text
        assert "threads=2/2" in text
    finally:
        release.set()
        for f in futs:
            f.result(timeout=TIMEOUT)
        assert d.shutdown(TIMEOUT)
    s = d.stats()
    assert (s.state, s.lanes, s.queued, s.running, s.threads) == (State.CLOSED, 0, 0, 0, 0)
    assert "state=closed" in repr(d)


def test_no_thread_before_first_submit() -> None:
    before = threading.active_count()
    d = Dispatcher()
    try:
        assert threading.active_count() == before
        assert d.stats().threads == 0
    finally:
        assert d.shutdown(TIMEOUT)


def test_thread_count_bounded_by_max_inflight() -> None:
    idents: set[int] = set()
    peak_threads = 0
    lock = threading.Lock()

    def task() -> None:
        nonlocal peak_threads
        with lock:
            idents.add(threading.get_ident())
            peak_threads = max(peak_threads, d.stats().threads)

    with Dispatcher(max_inflight=3, queue_size=10) as d:
        base = threading.active_count()
        futs = [d.submit(k, task) for k in range(500)]
        for f in futs:
            f.result(timeout=TIMEOUT)
        assert threading.active_count() <= base + 3
    assert 1 <= len(idents) <= 3
    assert peak_threads <= 3


def test_threads_are_reused() -> None:
    """One task after another on 100 distinct keys: not a thread per key or per task."""
    idents: set[int] = set()
    with Dispatcher(max_inflight=4) as d:
        for k in range(100):
            d.submit(k, lambda: idents.add(threading.get_ident())).result(timeout=TIMEOUT)
        assert d.stats().threads <= 4
    assert len(idents) <= 4


def _freed_event(obj: object) -> threading.Event:
    """An Event set when ``obj`` is garbage."""
    freed = threading.Event()
    weakref.finalize(obj, freed.set)
    return freed


def test_lane_removed_after_it_empties() -> None:
    with Dispatcher(max_inflight=2) as d:
        futs = [d.submit(k, lambda: None) for k in range(20) for _ in range(3)]
        for f in futs:
            f.result(timeout=TIMEOUT)
        assert d.drain(TIMEOUT)
        assert d.stats().lanes == 0
        assert d._lanes == {}  # white box: nothing keeps the keys in the lane table


def test_key_released_after_lane_drains() -> None:
    key = Key()
    freed = _freed_event(key)
    with Dispatcher(max_inflight=1) as d:
        futs = [d.submit(key, returning(i)) for i in range(5)]
        assert [f.result(timeout=TIMEOUT) for f in futs] == list(range(5))
        assert d.drain(TIMEOUT)
        assert d.stats().lanes == 0
        del key
        gc.collect()
        # the worker lets go of the lane right after its last task; 2 s is generous
        assert freed.wait(2.0), "the dispatcher keeps an idle lane's key alive"


def test_key_released_after_deferred_lane_drains() -> None:
    """A lane that was parked once and then drained does not keep its key alive."""
    key = Key()
    freed = _freed_event(key)

    def task() -> int:
        if current_context().attempt == 1:
            raise Defer(0.0)
        return current_context().attempt

    with Dispatcher(max_inflight=1) as d:
        assert d.submit(key, task).result(timeout=TIMEOUT) == 2
        d.submit("flush", lambda: None).result(timeout=TIMEOUT)  # the worker moved on
        del key
        gc.collect()
        assert freed.wait(2.0), "the dispatcher keeps a drained lane's key alive"


def test_task_args_and_result_not_kept_once_worker_moves_on() -> None:
    class Obj:
        pass

    def make(a: Obj) -> Obj:
        return Obj()

    with Dispatcher(max_inflight=1) as d:
        arg = Obj()
        arg_freed = _freed_event(arg)
        fut = d.submit("k", make, arg)
        result_freed = _freed_event(fut.result(timeout=TIMEOUT))
        d.submit("flush", lambda: None).result(timeout=TIMEOUT)
        del arg, fut
        gc.collect()
        assert arg_freed.wait(TIMEOUT)
        assert result_freed.wait(TIMEOUT)


def test_task_args_and_result_not_kept_by_idle_worker() -> None:
    class Obj:
        pass

    def make(a: Obj) -> Obj:
        return Obj()

    with Dispatcher(max_inflight=1) as d:
        arg = Obj()
        arg_freed = _freed_event(arg)
        fut = d.submit("k", make, arg)
        result_freed = _freed_event(fut.result(timeout=TIMEOUT))
        del arg, fut
        gc.collect()
        assert arg_freed.wait(2.0), "an idle worker keeps its last task's arguments"
        assert result_freed.wait(2.0), "an idle worker keeps its last task's result"


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_inflight": 0}, ValueError),
        ({"max_inflight": -1}, ValueError),
        ({"max_inflight": 2.0}, TypeError),
        ({"max_inflight": "4"}, TypeError),
        ({"max_inflight": True}, TypeError),
        ({"queue_size": 0}, ValueError),
        ({"queue_size": None}, TypeError),
        ({"quantum": 0}, ValueError),
        ({"quantum": 1.5}, TypeError),
        ({"send_timeout": 0}, ValueError),
        ({"send_timeout": -1.0}, ValueError),
        ({"send_timeout": math.nan}, ValueError),
        ({"send_timeout": "30"}, TypeError),
        ({"send_timeout": None}, TypeError),
        ({"idle_timeout": 0}, ValueError),
        ({"idle_timeout": math.nan}, ValueError),
        ({"exit_timeout": math.nan}, ValueError),
        ({"exit_timeout": -1}, ValueError),
        ({"initializer": 42}, TypeError),
        ({"thread_name_prefix": 3}, TypeError),
    ],
)
def test_constructor_rejects_bad_input(kwargs: dict[str, object], error: type) -> None:
    before = threading.active_count()
    with pytest.raises(error) as info:
        Dispatcher(**kwargs)  # type: ignore[arg-type]
    name = next(iter(kwargs))
    assert name in str(info.value)
    assert threading.active_count() == before


@pytest.mark.parametrize("timeout", [-1, -0.001, math.nan])
def test_negative_timeouts_rejected(timeout: float) -> None:
    d = Dispatcher()
    try:
        with pytest.raises(ValueError, match="timeout"):
            d.drain(timeout)
        with pytest.raises(ValueError, match="timeout"):
            d.shutdown(timeout)
        assert d.state is State.OPEN  # a refused shutdown did not close anything
        assert d.submit("k", lambda: 1).result(timeout=TIMEOUT) == 1
    finally:
        assert d.shutdown(TIMEOUT)


def test_submit_rejects_bad_input() -> None:
    queued: list[object] = []
    with Dispatcher(hooks=Hooks(on_queued=lambda k, n: queued.append(k))) as d:
        with pytest.raises(TypeError, match="callable"):
            d.submit("k", 42)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="hashable"):
            d.submit(["unhashable"], lambda: None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="hashable"):
            d.submit({"a": 1}, lambda: None)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            d.submit("k")  # type: ignore[call-arg]
        s = d.stats()
        assert (s.lanes, s.queued, s.threads) == (0, 0, 0)
        assert queued == []
        # still fully usable
        assert d.submit("k", lambda: "ok").result(timeout=TIMEOUT) == "ok"
