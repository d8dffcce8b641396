"""FairLock: turns in the order asked, timeouts, a turn that comes as a wait
ends, a wait that raises, and mutual exclusion under a short switch interval."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from outbound import _fair as fair
from outbound._fair import FairLock


def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def _waiting(lock: FairLock) -> int:
    return len(lock._gates)


def test_turns_go_in_the_order_they_were_asked_for() -> None:
    lock = FairLock()
    assert lock.acquire(1.0)
    order: list[int] = []

    def take(n: int) -> None:
        assert lock.acquire(10.0)
        order.append(n)
        lock.release()

    threads = []
    for n in range(6):
        thread = threading.Thread(target=take, args=(n,))
        thread.start()
        threads.append(thread)
        queued = n + 1
        _until(lambda: _waiting(lock) == queued)  # queued before the next asks
    lock.release()
    for thread in threads:
        thread.join(10.0)
    assert order == list(range(6))
    assert not lock.locked()


def test_a_thread_that_releases_and_asks_again_waits_its_turn() -> None:
    # threading.Lock lets the releasing thread win again; here the waiter goes next.
    lock = FairLock()
    assert lock.acquire(1.0)
    got: list[str] = []

    def wait_then_release() -> None:
        assert lock.acquire(10.0)
        got.append("waiter")
        lock.release()

    waiter = threading.Thread(target=wait_then_release)
    waiter.start()
    _until(lambda: _waiting(lock) == 1)
    lock.release()
    assert lock.acquire(10.0)  # after the waiter's turn
    got.append("again")
    lock.release()
    waiter.join(10.0)
    assert got == ["waiter", "again"]


def test_the_waiter_never_releases_so_the_next_times_out() -> None:
    lock = FairLock()
    assert lock.acquire(1.0)
    start = time.monotonic()
    assert not lock.acquire(0.05)
    assert time.monotonic() - start >= 0.05 - 0.005
    assert not lock.acquire(0.0)
    lock.release()
    assert not lock.locked()
    assert lock.acquire(0.0)  # the two that gave up are passed over
    lock.release()
    assert lock._gone == set()


def test_a_ticket_that_gave_up_is_passed_over() -> None:
    lock = FairLock()
    assert lock.acquire(1.0)
    results: dict[str, bool] = {}
    quitter = threading.Thread(target=lambda: results.__setitem__("quitter", lock.acquire(0.1)))
    quitter.start()
    _until(lambda: _waiting(lock) == 1)
    stayer = threading.Thread(target=lambda: results.__setitem__("stayer", lock.acquire(10.0)))
    stayer.start()
    _until(lambda: _waiting(lock) == 2)
    quitter.join(10.0)  # times out while the lock is held
    assert results == {"quitter": False}
    lock.release()
    stayer.join(10.0)
    assert results == {"quitter": False, "stayer": True}
    assert lock.locked()  # held by the stayer, which never released
    lock.release()
    assert not lock.locked()


class _Gate:
    """A gate whose wait runs ``during`` (in the waiting thread) then ends as told."""

    during: Callable[[], None] = staticmethod(lambda: None)
    outcome: str = "timeout"

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):  # the lock's own first acquire
            return True
        type(self).during()
        if self.outcome == "interrupt":
            raise KeyboardInterrupt
        return False

    def release(self) -> None:
        self._lock.release()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> type[_Gate]:
    class Gate(_Gate):
        pass

    monkeypatch.setattr(fair, "_new_gate", Gate)
    return Gate


def test_a_turn_that_comes_as_the_wait_times_out_is_taken(gate: type[_Gate]) -> None:
    lock = FairLock()
    assert lock.acquire(1.0)
    gate.during = staticmethod(lock.release)  # the turn comes, then the wait ends
    gate.outcome = "timeout"
    assert lock.acquire(0.01)
    assert lock.locked()
    lock.release()
    assert not lock.locked()


@pytest.mark.parametrize("turn_came", [True, False])
def test_a_wait_that_raises_passes_its_turn_on(gate: type[_Gate], turn_came: bool) -> None:
    lock = FairLock()
    assert lock.acquire(1.0)
    gate.during = staticmethod(lock.release if turn_came else (lambda: None))
    gate.outcome = "interrupt"
    with pytest.raises(KeyboardInterrupt):
        lock.acquire(1.0)
    if not turn_came:
        assert lock.locked()  # still the first holder's
        lock.release()
    assert not lock.locked()
    assert lock.acquire(0.0)
    lock.release()
    assert lock._gates == {}
    assert lock._gone == set()


def test_release_of_an_unheld_lock_is_an_error() -> None:
    lock = FairLock()
    with pytest.raises(RuntimeError, match="unheld"):
        lock.release()
    assert lock.acquire(0.0)
    lock.release()
    with pytest.raises(RuntimeError, match="unheld"):
        lock.release()


@pytest.mark.parametrize("timeout", [threading.TIMEOUT_MAX, threading.TIMEOUT_MAX * 2, 1e300])
def test_timeouts_at_and_past_the_platforms_limit(timeout: float) -> None:
    lock = FairLock()
    assert lock.acquire(timeout)
    got = threading.Event()

    def take() -> None:
        if lock.acquire(timeout):
            got.set()

    thread = threading.Thread(target=take)
    thread.start()
    _until(lambda: _waiting(lock) == 1)
    lock.release()
    assert got.wait(10.0)
    thread.join(10.0)


def test_mutual_exclusion_and_no_lost_turn_under_a_short_switch_interval() -> None:
    lock = FairLock()
    inside = 0
    overlaps = 0
    entered = 0
    guard = threading.Lock()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:

        def work(seed: int) -> None:
            nonlocal inside, overlaps, entered
            rnd = random.Random(seed)
            for _ in range(300):
                # Some waits give up (short timeouts), most get their turn.
                if not lock.acquire(rnd.choice((0.0, 0.0005, 5.0, 5.0))):
                    continue
                try:
                    with guard:
                        inside += 1
                        overlaps += inside > 1
                        entered += 1
                    with guard:
                        inside -= 1
                finally:
                    lock.release()

        threads = [threading.Thread(target=work, args=(n,)) for n in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60.0)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        sys.setswitchinterval(interval)
    assert overlaps == 0
    assert entered > 0
    assert not lock.locked()
    assert lock._gates == {}
    assert lock._gone == set()
    assert lock.acquire(0.0)
    lock.release()


def test_a_gate_that_cannot_be_made_takes_no_ticket(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gate() -> Any:
        raise MemoryError("no gate")

    lock = FairLock()
    assert lock.acquire(1.0)
    monkeypatch.setattr(fair, "_new_gate", no_gate)
    with pytest.raises(MemoryError):
        lock.acquire(1.0)
    monkeypatch.undo()
    lock.release()
    assert not lock.locked()
    assert lock.acquire(0.0)
    lock.release()


class _FlakyMutex:
    """A mutex whose ``raise_on``-th entry raises KeyboardInterrupt (before it locks)."""

    def __init__(self, raise_on: int) -> None:
        self._lock = threading.Lock()
        self.entries = 0
        self.raise_on = raise_on

    def __enter__(self) -> None:
        self.entries += 1
        if self.entries == self.raise_on:
            raise KeyboardInterrupt
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@pytest.mark.parametrize("turn_came", [True, False])
def test_a_ctrl_c_in_leaving_the_queue_leaves_it_all_the_same(
    gate: type[_Gate], turn_came: bool
) -> None:
    # The waiter's wait ends (its turn came, or its timeout); the Ctrl-C
    # lands as it takes the mutex to leave the queue: it leaves all the
    # same, the turn passed on, then the Ctrl-C is raised.
    lock = FairLock()
    assert lock.acquire(1.0)
    # Entries: the ticket, (the holder's release in the wait,) leaving.
    mutex = _FlakyMutex(raise_on=3 if turn_came else 2)
    gate.during = staticmethod(lock.release if turn_came else (lambda: None))
    gate.outcome = "timeout"
    lock._mutex = mutex  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        lock.acquire(1.0)
    assert mutex.entries == (4 if turn_came else 3)  # left on the second try
    if not turn_came:
        assert lock.locked()
        lock.release()
    assert not lock.locked()
    assert lock._gates == {}
    assert lock._gone == set()
    assert lock.acquire(0.0)
    lock.release()
