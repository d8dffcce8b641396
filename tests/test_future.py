"""LazyFuture conforms to concurrent.futures.Future: the same checks run on both.

Every test in the first part takes ``make`` (``Future`` or ``LazyFuture``)
and asserts only what the stdlib documents or does; the second part covers
what LazyFuture adds (no condition until needed, callbacks that raise
anything, the dispatcher's cancellation of a running future).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    CancelledError,
    Future,
    InvalidStateError,
    as_completed,
    wait,
)
from concurrent.futures import (
    TimeoutError as FuturesTimeout,  # the builtin TimeoutError from 3.11
)
from typing import Any, cast

import pytest
from dispatch_helpers import raising_log

from outbound._future import LazyFuture, cancel_future, new_future

TIMEOUT = 10.0
Make = Callable[[], "Future[Any]"]


@pytest.fixture(params=[Future, LazyFuture], ids=["Future", "LazyFuture"])
def make(request: pytest.FixtureRequest) -> Make:
    return request.param  # type: ignore[no-any-return]


def _states(f: Future[Any]) -> tuple[bool, bool, bool]:
    return f.done(), f.running(), f.cancelled()


# ---------------------------------------------------------------- states


def test_a_new_future_is_pending(make: Make) -> None:
    f = make()
    assert _states(f) == (False, False, False)
    with pytest.raises(FuturesTimeout):
        f.result(timeout=0)
    with pytest.raises(FuturesTimeout):
        f.exception(timeout=0)
    assert "pending" in repr(f)


def test_running_then_result(make: Make) -> None:
    f = make()
    assert f.set_running_or_notify_cancel() is True
    assert _states(f) == (False, True, False)
    assert f.cancel() is False
    assert "running" in repr(f)
    f.set_result(42)
    assert _states(f) == (True, False, False)
    assert f.result(timeout=0) == 42
    assert f.exception(timeout=0) is None
    assert "finished returned int" in repr(f)


def test_result_without_running(make: Make) -> None:
    f = make()
    f.set_result(None)
    assert f.done()
    assert f.result() is None


def test_exception(make: Make) -> None:
    f = make()
    f.set_running_or_notify_cancel()
    error = ValueError("boom")
    f.set_exception(error)
    assert f.exception() is error
    with pytest.raises(ValueError, match="boom") as info:
        f.result()
    assert info.value is error
    assert "raised ValueError" in repr(f)


def test_cancel_pending(make: Make) -> None:
    f = make()
    assert f.cancel() is True
    assert f.cancel() is True  # again
    assert _states(f) == (True, False, True)
    with pytest.raises(CancelledError):
        f.result()
    with pytest.raises(CancelledError):
        f.exception()
    assert f.set_running_or_notify_cancel() is False
    assert f.cancelled()
    assert f.cancel() is True
    with pytest.raises(RuntimeError):
        f.set_running_or_notify_cancel()


def test_invalid_transitions(make: Make) -> None:
    f = make()
    f.set_result(1)
    with pytest.raises(InvalidStateError):
        f.set_result(2)
    with pytest.raises(InvalidStateError):
        f.set_exception(ValueError())
    assert f.cancel() is False
    with pytest.raises(RuntimeError):
        f.set_running_or_notify_cancel()
    g = make()
    g.cancel()
    with pytest.raises(InvalidStateError):
        g.set_result(1)
    h = make()
    h.set_running_or_notify_cancel()
    with pytest.raises(RuntimeError):
        h.set_running_or_notify_cancel()


# ------------------------------------------------------------- callbacks


def test_callbacks_in_order_once(make: Make) -> None:
    f = make()
    calls: list[tuple[str, Future[Any]]] = []
    f.add_done_callback(lambda x: calls.append(("a", x)))
    f.add_done_callback(lambda x: calls.append(("b", x)))
    assert calls == []
    f.set_result(1)
    assert calls == [("a", f), ("b", f)]
    f.add_done_callback(lambda x: calls.append(("late", x)))  # called at once
    assert calls[-1] == ("late", f)
    assert len(calls) == 3


def test_callbacks_on_cancel_and_exception(make: Make) -> None:
    cancelled, failed = make(), make()
    seen: list[str] = []
    cancelled.add_done_callback(lambda f: seen.append("cancelled"))
    failed.add_done_callback(lambda f: seen.append("failed"))
    cancelled.cancel()
    cancelled.set_running_or_notify_cancel()
    failed.set_exception(KeyError())
    assert seen == ["cancelled", "failed"]


@pytest.mark.parametrize("log", ["working", "error", "exit"])
def test_a_raising_callback_is_logged_and_the_rest_run(
    make: Make, log: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Resolving runs in a dispatcher's worker: a callback's error, logged or
    # not (a log handler that raises), must neither skip the other callbacks nor
    # raise there.
    if make is Future and log == "exit":
        pytest.skip("the stdlib's Future lets what its log raises (not an Exception) go up")
    with contextlib.ExitStack() as stack:
        if log != "working":
            stack.enter_context(raising_log(RuntimeError if log == "error" else SystemExit))
        _a_raising_callback(make, log, caplog)


def _a_raising_callback(make: Make, log: str, caplog: pytest.LogCaptureFixture) -> None:
    f = make()
    seen: list[int] = []

    def bad(_f: Future[Any]) -> None:
        raise ValueError("callback")

    f.add_done_callback(bad)
    f.add_done_callback(lambda _f: seen.append(1))
    with caplog.at_level(logging.ERROR):
        f.set_result(None)
    assert seen == [1]
    assert f.result() is None
    if log == "working":
        assert "callback" in caplog.text


# ------------------------------------------------ wait() and as_completed()


def test_wait_return_when(make: Make) -> None:
    done_ok, done_err, pending = make(), make(), make()
    done_ok.set_result(1)
    done_err.set_exception(ValueError())
    fs = [done_ok, done_err, pending]
    r = wait(fs, timeout=0, return_when=FIRST_COMPLETED)
    assert r.done == {done_ok, done_err}
    assert r.not_done == {pending}
    r = wait(fs, timeout=0, return_when=FIRST_EXCEPTION)
    assert r.done == {done_ok, done_err}
    r = wait(fs, timeout=0.01, return_when=ALL_COMPLETED)
    assert r.not_done == {pending}
    pending.cancel()
    r = wait(fs, timeout=0, return_when=ALL_COMPLETED)
    assert r.not_done == {pending}  # cancelled but not yet notified, as the stdlib says
    pending.set_running_or_notify_cancel()
    r = wait(fs, timeout=0, return_when=ALL_COMPLETED)
    assert r.done == set(fs)


def test_wait_and_as_completed_wake_on_each_kind_of_resolution(make: Make) -> None:
    for how in ("result", "exception", "cancel"):
        fs = [make() for _ in range(3)]
        got: list[object] = []

        def waiter(fs: list[Future[Any]] = fs) -> None:
            got.append(wait(fs, timeout=TIMEOUT, return_when=ALL_COMPLETED))
            got.extend(as_completed(fs, timeout=TIMEOUT))

        t = threading.Thread(target=waiter)
        t.start()
        for f in fs:
            if how == "result":
                f.set_running_or_notify_cancel()
                f.set_result(1)
            elif how == "exception":
                f.set_exception(ValueError())
            else:
                f.cancel()
                f.set_running_or_notify_cancel()
        t.join(TIMEOUT)
        assert not t.is_alive()
        assert got[0].done == set(fs)  # type: ignore[attr-defined]
        assert set(got[1:]) == set(fs)


def test_as_completed_order_and_timeout(make: Make) -> None:
    a, b, c = make(), make(), make()
    b.set_result("b")
    it = as_completed([a, b, c], timeout=0.05)
    assert next(it) is b
    a.set_result("a")
    assert next(it) is a
    with pytest.raises(FuturesTimeout):
        next(it)


def test_result_timeout_then_resolved_from_another_thread(make: Make) -> None:
    f = make()
    with pytest.raises(FuturesTimeout):
        f.result(timeout=0.01)
    threading.Timer(0.01, f.set_result, args=("late",)).start()
    assert f.result(timeout=TIMEOUT) == "late"


@pytest.mark.parametrize("waiter_kind", ["result", "exception", "wait", "as_completed", "callback"])
def test_resolve_races_every_kind_of_waiter(make: Make, waiter_kind: str) -> None:
    """A waiter and a resolver start together, many times: no waiter misses it."""
    rounds = 300
    for i in range(rounds):
        f = make()
        barrier = threading.Barrier(2, timeout=TIMEOUT)
        seen: list[object] = []
        called = threading.Event()

        def waiter(f: Future[Any] = f) -> None:
            barrier.wait()
            if waiter_kind == "result":
                seen.append(f.result(timeout=TIMEOUT))
            elif waiter_kind == "exception":
                seen.append(f.exception(timeout=TIMEOUT))
            elif waiter_kind == "wait":
                seen.append(len(wait([f], timeout=TIMEOUT).done))
            elif waiter_kind == "as_completed":
                seen.extend(1 for _ in as_completed([f], timeout=TIMEOUT))
            else:
                f.add_done_callback(lambda _f: called.set())
                seen.append(called.wait(TIMEOUT))

        t = threading.Thread(target=waiter)
        t.start()
        barrier.wait()
        if i % 3 == 2 and waiter_kind not in ("result", "exception"):
            f.cancel()
            f.set_running_or_notify_cancel()
        else:
            f.set_running_or_notify_cancel()
            f.set_result(1)
        t.join(TIMEOUT)
        assert not t.is_alive()
        assert len(seen) == 1
        if waiter_kind == "exception":
            assert seen == [None]
        else:
            assert seen == [1] or seen == [True]


def test_many_waiters_and_one_cancel(make: Make) -> None:
    f = make()
    out: list[str] = []
    lock = threading.Lock()

    def waiter() -> None:
        try:
            f.result(timeout=TIMEOUT)
        except CancelledError:
            with lock:
                out.append("cancelled")

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    f.cancel()
    for t in threads:
        t.join(TIMEOUT)
    assert out == ["cancelled"] * 8


def test_asyncio_wrap_future(make: Make) -> None:
    f = make()

    async def main() -> object:
        wrapped = asyncio.wrap_future(f)
        asyncio.get_running_loop().call_soon(f.set_result, "async")
        return await asyncio.wait_for(wrapped, TIMEOUT)

    assert asyncio.run(main()) == "async"


def test_no_reference_cycle_keeps_a_failed_future(make: Make) -> None:
    f = make()
    f.set_exception(ValueError("x"))
    with pytest.raises(ValueError):
        f.result()
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None


# ------------------------------------------------------ what LazyFuture adds


def test_the_dispatcher_makes_lazy_futures() -> None:
    assert new_future is LazyFuture


def test_no_condition_unless_someone_waits() -> None:
    f: LazyFuture[int] = LazyFuture()
    f.set_running_or_notify_cancel()
    f.set_result(1)
    assert f.result() == 1
    assert f.done()
    assert not f.running()
    assert not f.cancelled()
    assert wait([f], timeout=0).done == {f}
    assert list(as_completed([cast("Future[int]", f)])) == [f]
    assert f._cond is None  # settled: served without a condition
    g: LazyFuture[int] = LazyFuture()
    g.add_done_callback(lambda _f: None)
    assert g._cond is not None


def test_settled_condition_is_shared_and_inert() -> None:
    a: LazyFuture[int] = LazyFuture()
    b: LazyFuture[int] = LazyFuture()
    a.set_result(1)
    b.set_exception(ValueError())
    assert a._condition is b._condition
    with a._condition, b._condition:  # as wait() holds many at once
        pass
    assert a._waiters is not b._waiters


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_base_exceptions_from_callbacks_are_contained_off_the_main_thread(
    exc_type: type[BaseException],
) -> None:
    f: LazyFuture[int] = LazyFuture()
    seen: list[int] = []

    def bad(_f: Future[int]) -> None:
        raise exc_type()

    f.add_done_callback(bad)
    f.add_done_callback(lambda _f: seen.append(1))
    errors: list[BaseException] = []

    def resolve() -> None:
        try:
            f.set_result(1)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=resolve)
    t.start()
    t.join(TIMEOUT)
    assert errors == []
    assert seen == [1]


def test_keyboard_interrupt_in_the_main_thread_goes_on_after_every_callback() -> None:
    f: LazyFuture[int] = LazyFuture()
    seen: list[int] = []
    f.add_done_callback(lambda _f: (_ for _ in ()).throw(KeyboardInterrupt()))
    f.add_done_callback(lambda _f: seen.append(1))
    with pytest.raises(KeyboardInterrupt):
        f.set_result(1)
    assert seen == [1]
    assert f.result() == 1


@pytest.mark.parametrize("make_plain", [False, True])
def test_cancel_future_of_a_running_future(make_plain: bool) -> None:
    f: Future[int] = Future() if make_plain else LazyFuture()
    f.set_running_or_notify_cancel()
    calls: list[int] = []
    f.add_done_callback(lambda _f: calls.append(1))
    t = threading.Thread(target=lambda: wait([f], timeout=TIMEOUT))
    t.start()
    cancel_future(f)
    t.join(TIMEOUT)
    assert not t.is_alive()
    assert calls == [1]
    with pytest.raises(CancelledError):
        f.result(timeout=0)
    # LazyFuture reports it cancelled, like one that never ran; a plain
    # Future cannot leave RUNNING that way and fails with CancelledError.
    assert f.cancelled() is (not make_plain)
    cancel_future(f)  # idempotent
    assert calls == [1]


def test_cancel_future_after_a_callers_cancel_runs_callbacks_once() -> None:
    f: LazyFuture[int] = LazyFuture()
    calls: list[int] = []
    f.add_done_callback(lambda _f: calls.append(1))
    f.cancel()
    cancel_future(f)
    assert calls == [1]
    assert wait([f], timeout=0).done == {f}


def _waiting(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in a ``Condition.wait`` now."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code is threading.Condition.wait.__code__:
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("timeout", [math.inf, 1e10, threading.TIMEOUT_MAX * 2])
@pytest.mark.parametrize("how", ["result", "exception"])
def test_a_wait_past_timeout_max_waits_without_limit(timeout: float, how: str) -> None:
    # The stdlib raises OverflowError for these; the dispatcher's futures read them as
    # "forever", as its own waits (drain, shutdown) do.
    f: LazyFuture[str] = LazyFuture()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(getattr(f, how)(timeout)), daemon=True)
    waiter.start()
    deadline = time.monotonic() + TIMEOUT
    while not _waiting(waiter):
        assert waiter.is_alive(), "the wait ended at once"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    f.set_result("done")
    waiter.join(TIMEOUT)
    assert got == (["done"] if how == "result" else [None])
