"""A Defer whose ``delay``/``scope`` attribute is missing (a subclass that forgot
``super().__init__``, or ``del exc.delay``) kills the worker thread: the task's
future, and every later task of its lane, stay pending forever.

_run._checked() validates a Defer's attributes but only catches TypeError and
ValueError; reading a missing attribute raises AttributeError, which escapes
execute() ("Never raises") and ends the worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import wait

import pytest

from outbound import Defer, Dispatcher


class ForgetfulDefer(Defer):
    """A user's Defer subclass that forgot to call super().__init__."""

    def __init__(self) -> None:
        pass


def _deleted_delay() -> None:
    exc = Defer(0.01)
    del exc.delay  # "its attributes can be changed after" (_run._checked docstring)
    raise exc


def _forgetful() -> None:
    raise ForgetfulDefer()


@pytest.mark.parametrize("task", [_forgetful, _deleted_delay], ids=["subclass", "del-delay"])
def test_broken_defer_fails_its_task_and_the_lane_goes_on(task) -> None:  # type: ignore[no-untyped-def]
    d = Dispatcher(max_inflight=1, queue_size=8)
    try:
        first = d.submit("k", task)
        second = d.submit("k", lambda: "second")
        _done, not_done = wait([first, second], timeout=5)
        # Invariant 1 / README: "The future is resolved, always"; "An exception in
        # a task (even SystemExit) fails that task's future only; the lane goes on
        # and the worker thread survives."
        assert not not_done, "futures left pending: the worker thread died"
        assert first.exception(0) is not None
        assert second.result(0) == "second"
    finally:
        d.force_close()


class FlippingDefer(Defer):
    """A Defer whose scope reads "lane" once, then "all": the dispatcher must read
    it once (it reads its copy under its lock, where no user code may run)."""

    def __init__(self) -> None:
        super().__init__(0.01)
        self.reads = 0

    @property  # type: ignore[override]
    def scope(self) -> str:
        self.reads += 1
        return "lane" if self.reads == 1 else "all"

    @scope.setter
    def scope(self, value: str) -> None:
        pass


class InterruptingDefer(Defer):
    """A Defer whose delay raises KeyboardInterrupt when read."""

    def __init__(self) -> None:
        pass

    @property
    def delay(self) -> float:
        raise KeyboardInterrupt

    @delay.setter
    def delay(self, value: float) -> None:
        pass


def test_a_defer_is_read_once_and_the_lane_alone_waits() -> None:
    raised: list[FlippingDefer] = []
    runs = []

    def task() -> str:
        runs.append(1)
        if len(runs) == 1:
            raised.append(FlippingDefer())
            raise raised[0]
        return "again"

    d = Dispatcher(max_inflight=2, queue_size=8)
    try:
        first = d.submit("k", task)
        other = d.submit("other", lambda: "other")
        assert first.result(5) == "again"
        assert other.result(5) == "other"
        assert raised[0].reads == 1
    finally:
        assert d.shutdown(5)


def test_a_defer_whose_delay_raises_a_base_exception_fails_its_task_only() -> None:
    def task() -> None:
        raise InterruptingDefer()

    d = Dispatcher(max_inflight=1, queue_size=8)
    try:
        first = d.submit("k", task)
        second = d.submit("k", lambda: "second")
        assert second.result(5) == "second"
        error = first.exception(0)
        assert isinstance(error, KeyboardInterrupt)
        assert isinstance(error.__cause__, InterruptingDefer)
        assert second.result(0) == "second"
    finally:
        assert d.shutdown(5)


class _Unreadable(Defer):
    """A Defer whose delay, once read, raises another Defer: ``inner``."""

    def __init__(self, inner: BaseException) -> None:  # no Defer.__init__: no attributes
        self.inner = inner

    @property
    def delay(self) -> float:
        raise self.inner

    @delay.setter
    def delay(self, value: float) -> None:
        pass


def _broken_defer() -> Defer:
    d = Defer(0.01)
    d.delay = "soon"  # type: ignore[assignment]  # "its attributes can be changed after"
    return d


class _RaisesItself(Defer):
    """Reading ``delay`` raises the Defer itself (which has no scope)."""

    def __init__(self) -> None:
        pass

    @property
    def delay(self) -> float:
        raise self

    @delay.setter
    def delay(self, value: float) -> None:
        pass


@pytest.mark.parametrize(
    "make",
    [lambda: _Unreadable(_broken_defer()), _RaisesItself],
    ids=["raises-a-broken-defer", "raises-itself"],
)
def test_a_defer_raised_while_reading_a_defer_fails_the_task_and_the_lane_goes_on(
    make: Callable[[], Defer],
) -> None:
    def task() -> None:
        raise make()

    d = Dispatcher(max_inflight=1, queue_size=8)
    try:
        first = d.submit("k", task)
        second = d.submit("k", lambda: "second")
        # README: "The future is resolved, always"; an error in a task fails
        # that task only, the lane goes on and the worker thread survives.
        assert second.result(5) == "second"
        error = first.exception(0)
        assert isinstance(error, TypeError), error  # a Defer raised there is no deferral
        assert "cannot be read" in str(error)
    finally:
        d.force_close()
