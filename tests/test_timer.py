"""The dispatcher's seams alone: Timer on a fake clock, and the forward-only Lifecycle."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import pytest
from dispatch_helpers import raising_log

from outbound._lifecycle import Lifecycle, State
from outbound._timer import Timer
from outbound.errors import BrokenDispatcher, DispatcherClosed

TIMEOUT = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Fired:
    def __init__(self) -> None:
        self.batches: list[list[object]] = []
        self.cond = threading.Condition()

    def __call__(self, take: Callable[[], list[object]]) -> None:
        with self.cond:
            self.batches.append(take())
            self.cond.notify_all()

    def wait_for(self, count: int) -> list[object]:
        with self.cond:
            assert self.cond.wait_for(lambda: sum(map(len, self.batches)) >= count, TIMEOUT)
            return [item for batch in self.batches for item in batch]


def moved(timer: Timer[object]) -> list[object]:
    """Every waiting item (these tests' are strings), moved out as force_close() moves them."""
    out: list[str] = []
    with timer.lock:
        timer.move_locked(str, out)
    return list(out)


def test_fires_in_due_order_when_the_clock_reaches_each() -> None:
    clock, fired = FakeClock(), Fired()
    timer: Timer[object] = Timer(fired, name="t", idle_timeout=60.0, clock=clock)
    thread = timer.add(5.0, "b")
    assert thread is not None
    assert timer.add(1.0, "a") is None  # one thread for all
    timer.add(5.0, "c")  # same due time: in add order
    timer.add(1e300, "far")  # far past TIMEOUT_MAX: waits in pieces
    clock.now = 1.0
    timer.poke()
    assert fired.wait_for(1) == ["a"]
    clock.now = 10.0
    timer.poke()
    assert fired.wait_for(3) == ["a", "b", "c"]
    assert timer.items() == ["far"]
    assert moved(timer) == ["far"]
    timer.stop()
    thread.join(TIMEOUT)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    ("error", "log"),
    [
        (SystemExit("from fire"), None),
        (ValueError("from fire"), RuntimeError),
        (ValueError("from fire"), SystemExit),
    ],
)
def test_a_raising_callback_does_not_stop_the_timer(
    error: BaseException, log: type[BaseException] | None, caplog: pytest.LogCaptureFixture
) -> None:
    # With a log whose handler raises the callback's error cannot even be logged:
    # the timer goes on all the same (its thread ending would leave every later item
    # unfired).
    with contextlib.ExitStack() as stack:
        if log is not None:
            stack.enter_context(raising_log(log))
        _a_raising_callback(error, log, caplog)


def _a_raising_callback(
    error: BaseException, log: type[BaseException] | None, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[object] = []
    got = threading.Condition()

    def fire(take: Callable[[], list[object]]) -> None:
        items = take()
        with got:
            seen.extend(items)
            got.notify_all()
        if "bad" in items:
            raise error

    timer: Timer[object] = Timer(fire, name="t", idle_timeout=60.0, clock=FakeClock())
    thread = timer.add(0.0, "bad")
    assert thread is not None
    with got:
        assert got.wait_for(lambda: "bad" in seen, TIMEOUT)
    timer.add(0.0, "good")
    with got:
        assert got.wait_for(lambda: "good" in seen, TIMEOUT)
    assert thread.is_alive()
    timer.stop()
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    if log is None:
        assert "from fire" in caplog.text


def test_the_thread_exits_when_idle_and_a_stopped_timer_starts_none() -> None:
    timer: Timer[object] = Timer(lambda take: None, name="t", idle_timeout=0.01)
    thread = timer.add(0.0, "x")
    assert thread is not None
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert timer.thread is None
    timer.stop()
    assert timer.add(0.0, "y") is None


def test_lifecycle_only_moves_forward() -> None:
    life = Lifecycle()
    assert life.state is State.OPEN
    assert life.advance(State.CLOSING)
    assert not life.advance(State.OPEN)
    assert not life.advance(State.CLOSING)
    assert isinstance(life.closed_error(), DispatcherClosed)
    assert life.advance(State.CLOSED)
    assert not life.advance(State.CLOSING)
    assert life.after_fork().state is State.CLOSED
    assert life.advance(State.BROKEN, "init failed")
    assert isinstance(life.closed_error(), BrokenDispatcher)
    assert "init failed" in str(life.closed_error())
    closing = Lifecycle(State.CLOSING)
    assert closing.after_fork().state is State.CLOSED
    assert Lifecycle().after_fork().state is State.OPEN


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("can't start new thread")])
def test_a_thread_that_began_as_its_start_raised_is_not_a_second_timer(
    monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """start() raises after the thread began: that thread steps aside, the item
    stays, and the next add starts the one timer thread, which fires both once."""
    real_start = threading.Thread.start
    began: list[threading.Thread] = []

    def start(self: threading.Thread) -> None:
        monkeypatch.undo()
        real_start(self)
        began.append(self)
        raise error

    fired = Fired()
    timer: Timer[object] = Timer(fired, name="t", idle_timeout=TIMEOUT)
    monkeypatch.setattr(threading.Thread, "start", start)
    if isinstance(error, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            timer.add(0.0, "first")
    else:
        assert timer.add(0.0, "first") is None
    began[0].join(TIMEOUT)
    assert not began[0].is_alive()  # stepped aside, fired nothing
    assert fired.batches == []
    thread = timer.add(0.0, "second")
    assert thread is not None
    assert sorted(map(str, fired.wait_for(2))) == ["first", "second"]
    timer.stop()
    thread.join(TIMEOUT)
    assert sum(map(len, fired.batches)) == 2


def test_a_due_batch_fire_has_not_taken_is_moved_or_taken_never_both() -> None:
    """What the dispatcher's force_close() relies on: it moves under the lock that
    fire takes under, so a due item is either moved (cancelled) or taken (run)."""
    seen: dict[str, list[object]] = {}
    done = threading.Event()

    def fire(take: Callable[[], list[object]]) -> None:
        seen["listed"] = timer.items()
        seen["cleared"] = moved(timer)
        seen["taken"] = take()
        seen["taken again"] = take()
        done.set()

    clock = FakeClock()
    timer: Timer[object] = Timer(fire, name="t", idle_timeout=60.0, clock=clock)
    timer.add(1.0, "a")
    timer.add(1.0, "b")
    timer.add(2.0, "later")
    clock.now = 1.0
    timer.poke()
    assert done.wait(TIMEOUT)
    assert sorted(map(str, seen["listed"])) == ["a", "b", "later"]
    assert seen["cleared"] == ["a", "b", "later"]
    assert seen["taken"] == seen["taken again"] == []
    timer.stop()


def test_a_due_batch_is_taken_once_and_what_fire_leaves_untaken_is_dropped() -> None:
    batches: list[list[object]] = []
    got = threading.Condition()

    def fire(take: Callable[[], list[object]]) -> None:
        with got:
            batches.append([] if len(batches) == 0 else take() + take())
            got.notify_all()
        if len(batches) == 1:
            raise ValueError("before taking")

    timer: Timer[object] = Timer(fire, name="t", idle_timeout=60.0, clock=FakeClock())
    timer.add(0.0, "untaken")
    with got:
        assert got.wait_for(lambda: len(batches) == 1, TIMEOUT)
    timer.add(0.0, "taken")
    with got:
        assert got.wait_for(lambda: len(batches) == 2, TIMEOUT)
    assert batches == [[], ["taken"]]
    assert timer.items() == []
    assert moved(timer) == []
    timer.stop()
