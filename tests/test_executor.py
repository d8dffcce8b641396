"""KeyedExecutor keeps the ThreadPoolExecutor contract and adds per-key order.

Contract tests run against both ``ThreadPoolExecutor`` and ``KeyedExecutor``, so
that what they check is the stdlib's behaviour, not ours.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import (
    FIRST_COMPLETED,
    CancelledError,
    Executor,
    Future,
    ThreadPoolExecutor,
    as_completed,
    wait,
)
from concurrent.futures import (
    TimeoutError as FuturesTimeout,  # not the builtin before Python 3.11
)
from concurrent.futures.thread import BrokenThreadPool
from typing import Any

import pytest
from dispatch_helpers import blocker as _blocker
from dispatch_helpers import until

from outbound import Defer, KeyedExecutor, current_context

TIMEOUT = 10.0
# freeing happens right after a task returns; generous, and bounds the cost of a failure
FREED_TIMEOUT = 2.0


@pytest.fixture(params=[ThreadPoolExecutor, KeyedExecutor], ids=["stdlib", "keyed"])
def executor_cls(request: pytest.FixtureRequest) -> type[Executor]:
    cls: type[Executor] = request.param
    return cls


@pytest.fixture
def executor(executor_cls: type[Executor]) -> Iterator[Executor]:
    ex = executor_cls(max_workers=2)  # type: ignore[call-arg]
    try:
        yield ex
    finally:
        ex.shutdown(wait=True)


# ------------------------------------------------------------ stdlib contract


def test_is_an_executor() -> None:
    with KeyedExecutor(max_workers=1) as ex:
        assert isinstance(ex, Executor)
        assert "KeyedExecutor" in repr(ex)


def test_submit_result_and_exception(executor: Executor) -> None:
    assert executor.submit(pow, 2, 10).result(timeout=TIMEOUT) == 1024
    assert executor.submit(dict, a=1).result(timeout=TIMEOUT) == {"a": 1}
    fut = executor.submit(int, "not a number")
    assert isinstance(fut, Future)
    assert isinstance(fut.exception(timeout=TIMEOUT), ValueError)


def test_keyless_tasks_run_concurrently(executor: Executor) -> None:
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    futs = [executor.submit(barrier.wait) for _ in range(2)]
    assert sorted(f.result(timeout=TIMEOUT) for f in futs) == [0, 1]


def test_map(executor: Executor) -> None:
    assert list(executor.map(pow, [2, 3, 4], [5, 2, 1])) == [32, 9, 4]
    assert list(executor.map(str, range(50), chunksize=7)) == [str(i) for i in range(50)]
    assert list(executor.map(abs, [], timeout=1)) == []


def test_map_reraises_in_order(executor: Executor) -> None:
    results = executor.map(int, ["1", "x", "3"])
    assert next(results) == 1
    with pytest.raises(ValueError):
        next(results)


def test_map_timeout(executor: Executor) -> None:
    started, release = threading.Event(), threading.Event()
    try:
        results = executor.map(lambda _: _blocker(started, release, "late")(), [0], timeout=0.05)
        assert started.wait(TIMEOUT)
        with pytest.raises(FuturesTimeout):
            next(results)
    finally:
        release.set()


def test_cancel_queued_future(executor_cls: type[Executor]) -> None:
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []
    ex = executor_cls(max_workers=1)  # type: ignore[call-arg]
    try:
        ex.submit(_blocker(started, release))
        assert started.wait(TIMEOUT)
        queued = ex.submit(ran.append, 1)
        assert queued.cancel()
        release.set()
        assert ex.submit(ran.append, 2).result(timeout=TIMEOUT) is None
        assert queued.cancelled()
    finally:
        release.set()
        ex.shutdown(wait=True)
    assert ran == [2]


def test_shutdown_wait_true(executor_cls: type[Executor]) -> None:
    ex = executor_cls(max_workers=2)  # type: ignore[call-arg]
    futs = [ex.submit(pow, 2, i) for i in range(40)]
    ex.shutdown(wait=True)
    assert all(f.done() for f in futs)
    assert [f.result() for f in futs] == [2**i for i in range(40)]
    ex.shutdown()  # idempotent
    ex.shutdown(wait=False)


def test_shutdown_wait_false(executor_cls: type[Executor]) -> None:
    started, release = threading.Event(), threading.Event()
    ex = executor_cls(max_workers=1)  # type: ignore[call-arg]
    try:
        running = ex.submit(_blocker(started, release, "r"))
        queued = ex.submit(lambda: "q")
        assert started.wait(TIMEOUT)
        ex.shutdown(wait=False)  # returns while a task is blocked
        assert not running.done()
        with pytest.raises(RuntimeError):
            ex.submit(lambda: None)
        release.set()
        assert running.result(timeout=TIMEOUT) == "r"
        assert queued.result(timeout=TIMEOUT) == "q"  # queued work still runs
    finally:
        release.set()
        ex.shutdown(wait=True)


def test_shutdown_cancel_futures(executor_cls: type[Executor]) -> None:
    started, release = threading.Event(), threading.Event()
    ex = executor_cls(max_workers=1)  # type: ignore[call-arg]
    try:
        running = ex.submit(_blocker(started, release, "r"))
        assert started.wait(TIMEOUT)
        queued = [ex.submit(pow, 2, i) for i in range(5)]
        ex.shutdown(wait=False, cancel_futures=True)
        for f in queued:
            assert f.cancelled()
            with pytest.raises(CancelledError):
                f.result(timeout=0)
        release.set()
        assert running.result(timeout=TIMEOUT) == "r"
    finally:
        release.set()
        ex.shutdown(wait=True)


def test_runtime_error_after_shutdown(executor_cls: type[Executor]) -> None:
    ex = executor_cls(max_workers=1)  # type: ignore[call-arg]
    ex.shutdown()
    with pytest.raises(RuntimeError):
        ex.submit(pow, 2, 2)
    with pytest.raises(RuntimeError):
        ex.map(abs, [1])


def test_context_manager(executor_cls: type[Executor]) -> None:
    with executor_cls(max_workers=2) as ex:  # type: ignore[call-arg]
        futs = [ex.submit(pow, 3, i) for i in range(20)]
    assert all(f.done() for f in futs)
    with pytest.raises(RuntimeError):
        ex.submit(pow, 2, 2)


def test_failing_initializer_breaks_the_executor(executor_cls: type[Executor]) -> None:
    gate = threading.Event()

    def init() -> None:
        assert gate.wait(TIMEOUT)
        raise ValueError("initializer failed")

    ex = executor_cls(max_workers=2, initializer=init)  # type: ignore[call-arg]
    try:
        futs = [ex.submit(pow, 2, i) for i in range(6)]
        if isinstance(ex, KeyedExecutor):
            futs += [ex.submit_keyed("k", pow, 3, i) for i in range(3)]
        gate.set()
        for f in futs:
            with pytest.raises(BrokenThreadPool):
                f.result(timeout=TIMEOUT)
        with pytest.raises(BrokenThreadPool):
            ex.submit(pow, 2, 2)
    finally:
        gate.set()
        ex.shutdown(wait=True)


def test_initializer_runs_once_per_thread(executor_cls: type[Executor]) -> None:
    local = threading.local()
    lock = threading.Lock()
    init_threads: list[int] = []

    def init(a: int, b: str) -> None:
        local.args = (a, b)
        with lock:
            init_threads.append(threading.get_ident())

    barrier = threading.Barrier(3, timeout=TIMEOUT)

    def task() -> tuple[int, tuple[int, str]]:
        barrier.wait()  # forces three threads
        return threading.get_ident(), local.args

    with executor_cls(
        max_workers=3,
        initializer=init,
        initargs=(7, "x"),  # type: ignore[call-arg]
    ) as ex:
        results = [f.result(timeout=TIMEOUT) for f in [ex.submit(task) for _ in range(3)]]
        # more tasks reuse the threads: no more initializer calls
        for f in [ex.submit(lambda: local.args) for _ in range(20)]:
            assert f.result(timeout=TIMEOUT) == (7, "x")
    assert sorted(init_threads) == sorted(ident for ident, _ in results)
    assert len(set(init_threads)) == 3
    assert all(args == (7, "x") for _, args in results)


def test_no_reference_kept_to_finished_task(executor_cls: type[Executor]) -> None:
    """As CPython's test_no_stale_references: args, fn and result are freed once done."""

    class Obj:
        def method(self) -> None:
            pass

    def make() -> Obj:
        result = Obj()
        weakref.finalize(result, result_freed.set)
        return result

    arg_freed, result_freed, fn_freed = threading.Event(), threading.Event(), threading.Event()
    with executor_cls(max_workers=1) as ex:  # type: ignore[call-arg]
        arg = Obj()
        weakref.finalize(arg, arg_freed.set)
        fut = ex.submit(id, arg)
        assert fut.result(timeout=TIMEOUT) == id(arg)
        del arg, fut
        assert arg_freed.wait(FREED_TIMEOUT), "the executor keeps a finished task's argument"

        fut2 = ex.submit(make)
        assert isinstance(fut2.result(timeout=TIMEOUT), Obj)
        del fut2
        assert result_freed.wait(FREED_TIMEOUT), "the executor keeps a finished task's result"

        owner = Obj()
        weakref.finalize(owner, fn_freed.set)
        ex.submit(owner.method)  # the future is dropped at once
        del owner
        assert fn_freed.wait(FREED_TIMEOUT), "the executor keeps a finished task's callable"


@pytest.mark.parametrize("max_workers", [0, -1])
def test_max_workers_must_be_positive(executor_cls: type[Executor], max_workers: int) -> None:
    with pytest.raises(ValueError, match="max_workers"):
        executor_cls(max_workers=max_workers)  # type: ignore[call-arg]


def test_initializer_must_be_callable(executor_cls: type[Executor]) -> None:
    with pytest.raises(TypeError):
        executor_cls(initializer=42)  # type: ignore[call-arg]


def test_thread_name_prefix(executor_cls: type[Executor]) -> None:
    with executor_cls(max_workers=1, thread_name_prefix="mypool") as ex:  # type: ignore[call-arg]
        name = ex.submit(lambda: threading.current_thread().name).result(timeout=TIMEOUT)
    assert name.startswith("mypool")


def test_wait_and_as_completed(executor: Executor) -> None:
    started, release = threading.Event(), threading.Event()
    try:
        slow = executor.submit(_blocker(started, release, "slow"))
        fast: Future[object] = executor.submit(lambda: "fast")
        done, not_done = wait([slow, fast], timeout=TIMEOUT, return_when=FIRST_COMPLETED)
        assert done == {fast}
        assert not_done == {slow}
        release.set()
        futs: list[Future[Any]] = [slow, fast, *(executor.submit(pow, 2, i) for i in range(10))]
        assert set(as_completed(futs, timeout=TIMEOUT)) == set(futs)
        done, not_done = wait(futs, timeout=TIMEOUT)
        assert done == set(futs)
        assert not not_done
    finally:
        release.set()


def test_as_completed_timeout(executor: Executor) -> None:
    started, release = threading.Event(), threading.Event()
    try:
        fut = executor.submit(_blocker(started, release))
        with pytest.raises(FuturesTimeout):
            list(as_completed([fut], timeout=0.05))
    finally:
        release.set()


def test_done_callbacks(executor: Executor) -> None:
    called = threading.Event()
    seen: list[object] = []

    def callback(f: Future[int]) -> None:
        seen.append(f.result())
        called.set()

    fut = executor.submit(pow, 2, 3)
    fut.add_done_callback(callback)
    assert called.wait(TIMEOUT)
    assert seen == [8]


# ------------------------------------------------------------ keyed extension


def test_default_max_workers_as_stdlib() -> None:
    count = getattr(os, "process_cpu_count", os.cpu_count)() or 1
    ex = KeyedExecutor()
    try:
        assert ex.stats().max_inflight == min(32, count + 4)
    finally:
        ex.shutdown()


def test_submit_keyed_per_key_order() -> None:
    order: dict[str, list[int]] = {"a": [], "b": []}
    with KeyedExecutor(max_workers=4) as ex:
        futs = [ex.submit_keyed(k, order[k].append, i) for i in range(300) for k in ("a", "b")]
        unordered = [ex.submit(pow, 2, i) for i in range(50)]
        for f in futs:
            assert f.result(timeout=TIMEOUT) is None
        assert [f.result(timeout=TIMEOUT) for f in unordered] == [2**i for i in range(50)]
    assert order == {"a": list(range(300)), "b": list(range(300))}


def test_submit_keyed_one_at_a_time_per_key() -> None:
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    first_started, release = threading.Event(), threading.Event()
    with KeyedExecutor(max_workers=3) as ex:
        try:
            a1 = ex.submit_keyed("a", _blocker(first_started, release, 1))
            a2 = ex.submit_keyed("a", lambda: 2)
            assert first_started.wait(TIMEOUT)
            # other keys run meanwhile, concurrently
            others = [ex.submit_keyed(k, barrier.wait) for k in ("b", "c")]
            assert sorted(f.result(timeout=TIMEOUT) for f in others) == [0, 1]
            assert not a2.done()
        finally:
            release.set()
        assert (a1.result(timeout=TIMEOUT), a2.result(timeout=TIMEOUT)) == (1, 2)


def test_submit_keyed_after_shutdown() -> None:
    ex = KeyedExecutor(max_workers=1)
    ex.shutdown()
    with pytest.raises(RuntimeError):
        ex.submit_keyed("k", pow, 2, 2)


def test_keyed_queue_size_unbounded_by_default() -> None:
    started, release = threading.Event(), threading.Event()
    with KeyedExecutor(max_workers=1) as ex:
        try:
            ex.submit_keyed("k", _blocker(started, release))
            assert started.wait(TIMEOUT)
            futs = [ex.submit_keyed("k", abs, -i) for i in range(1000)]
        finally:
            release.set()
        assert [f.result(timeout=TIMEOUT) for f in futs] == list(range(1000))


def test_current_context_in_executor_tasks() -> None:
    def probe() -> tuple[object, float]:
        ctx = current_context()
        return ctx.key, ctx.remaining()

    with KeyedExecutor(max_workers=2) as ex:
        assert ex.submit(probe).result(timeout=TIMEOUT) == (None, math.inf)
        assert ex.submit_keyed("k", probe).result(timeout=TIMEOUT) == ("k", math.inf)


def test_keyless_defer_reruns() -> None:
    def task() -> int:
        if current_context().attempt == 1:
            raise Defer(0.0)
        return current_context().attempt

    with KeyedExecutor(max_workers=1) as ex:
        assert ex.submit(task).result(timeout=TIMEOUT) == 2


def test_shutdown_cancel_futures_keyed_lanes() -> None:
    started, release = threading.Event(), threading.Event()
    ex = KeyedExecutor(max_workers=1)
    try:
        running = ex.submit_keyed("a", _blocker(started, release, "r"))
        assert started.wait(TIMEOUT)
        queued = [ex.submit_keyed(k, abs, -1) for k in ("a", "b", "c")]
        ex.shutdown(wait=False, cancel_futures=True)
        assert all(f.cancelled() for f in queued)
        release.set()
        assert running.result(timeout=TIMEOUT) == "r"
    finally:
        release.set()
        ex.shutdown(wait=True)
    assert ex.stats().threads == 0


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
def test_shutdown_cancel_futures_keeps_a_pause_in_force(keyed: bool) -> None:
    """``shutdown(cancel_futures=True)`` ended a ``pause()``: a running task that
    then deferred ran again at once, inside the pause."""
    starts: list[float] = []
    go = threading.Event()

    def task() -> str:
        starts.append(time.monotonic())
        if current_context().attempt == 1:
            assert go.wait(TIMEOUT)
            raise Defer(0.01)
        return "again"

    ex = KeyedExecutor(max_workers=2)
    d = ex._dispatcher
    try:
        future = ex.submit_keyed("k", task) if keyed else ex.submit(task)
        assert until(lambda: bool(starts))
        paused_until = time.monotonic() + 0.5  # read first: the pause ends no earlier
        d.pause(0.5)
        ex.shutdown(wait=False, cancel_futures=True)
        assert d.stats().paused_for > 0.0
        go.set()
        assert future.result(timeout=TIMEOUT) == "again"
        assert starts[-1] >= paused_until, "re-ran inside the pause"
    finally:
        go.set()
        ex.shutdown(wait=True)


def test_max_workers_of_a_wrong_type_is_refused_by_its_name() -> None:
    with pytest.raises(TypeError, match="max_workers"):
        KeyedExecutor(max_workers="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_workers"):
        KeyedExecutor(max_workers=True)
    for bad in (math.nan, math.inf, 0.0, -1.5):
        with pytest.raises(ValueError, match="max_workers"):
            KeyedExecutor(max_workers=bad)  # type: ignore[arg-type]


def test_max_workers_takes_any_number_as_the_stdlib_does() -> None:
    """``os.cpu_count() / 2`` (a float: rounded up, as the stdlib starts threads while
    it has fewer than it) and integers of other types (``__index__``)."""

    class Count:
        def __index__(self) -> int:
            return 3

    numbers.Integral.register(Count)
    for given, expected in ((1.5, 2), (2.0, 2), (Count(), 3)):
        with KeyedExecutor(max_workers=given) as executor:  # type: ignore[arg-type]
            assert executor._max_workers == expected
            assert list(executor.map(abs, [-1, -2])) == [1, 2]


def test_a_callable_that_is_not_one_is_refused_at_submit() -> None:
    # The documented difference from ThreadPoolExecutor (whose future fails
    # with the TypeError): refused at once, nothing queued.
    with KeyedExecutor(max_workers=1) as ex:
        with pytest.raises(TypeError, match="callable"):
            ex.submit(42)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="callable"):
            ex.submit_keyed("k", 42)  # type: ignore[arg-type]
        assert ex.submit(lambda: 1).result(timeout=TIMEOUT) == 1
