"""Deterministic interleavings: a thread paused exactly where an unlocked read decides.

Each test names a seam marked "Unlocked read" (or a check-then-act) in
outbound/dispatcher.py or outbound/_handoff.py, holds one thread right
there through an instrumented deque, list, dict or method, runs the racing
operation in another thread, and checks the outcome the argument next to
the seam promises. The refill race (an owner taking a task in the instant
after submit appended it) is in test_dispatcher_guarantees.py.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any, cast

import pytest
from dispatch_helpers import blocker as _blocker
from dispatch_helpers import until
from interrupts import interrupt_after_call, line_of

import outbound._handoff as handoff_module
import outbound._lane as lane_module
import outbound.dispatcher as dispatcher_module
from outbound import Defer, Dispatcher, KeyedExecutor, State, current_context
from outbound._handoff import Handoff

TIMEOUT = 10.0


def _on_a_worker() -> bool:
    return threading.current_thread().name.startswith("outbound-worker")


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, out


class _RacingDeque(deque):  # type: ignore[type-arg]
    """A deque whose next popleft by a worker thread, made while the deque is empty
    (``when_empty``) or not, runs ``race`` in another thread and waits for it: just
    after the pop read the deque empty (it then reports that emptiness, as a pop
    made an instant earlier would, unless ``then_pop``: then it pops what the race
    put there, as a pop made an instant later would), or just before a pop that
    takes an item."""

    race: Callable[[], None] | None = None
    when_empty = False
    then_pop = False

    def popleft(self) -> Any:
        race = type(self).race
        if race is not None and (not self) is type(self).when_empty and _on_a_worker():
            type(self).race = None
            t, out = _in_thread(race)
            t.join(TIMEOUT)
            assert out == [None], out
            if type(self).when_empty and not type(self).then_pop:
                raise IndexError("pop from an empty deque")
        return super().popleft()


def _racing_deque(*, when_empty: bool, then_pop: bool = False) -> type[_RacingDeque]:
    """A subclass of its own per test: its class attributes are the test's state."""
    attrs = {"race": None, "when_empty": when_empty, "then_pop": then_pop}
    return cast("type[_RacingDeque]", type("RacingDeque", (_RacingDeque,), attrs))


def _wait_idle(d: Dispatcher) -> None:
    """Wait (bounded) until every thread of ``d`` is idle: nothing runs, or will."""
    deadline = time.monotonic() + TIMEOUT
    while not (d.stats().running == 0 and d.stats().idle_threads == d.stats().threads):
        assert time.monotonic() < deadline, d.stats()
        time.sleep(0.001)


# ---------------------------------------------- submit: the unlocked table read


class _PausingDict(dict):  # type: ignore[type-arg]
    """The lane table: an armed get() runs ``race`` after the read, before returning."""

    race: Callable[[], None] | None = None

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        race, self.race = self.race, None
        if race is not None and threading.current_thread() is threading.main_thread():
            race()
        return value


def test_lane_retires_between_the_table_read_and_its_lock() -> None:
    """submit read a live lane; it retires before submit takes its lock: the task goes
    to a new lane, once, after the earlier task of its key."""
    ran: list[int] = []
    started, release = threading.Event(), threading.Event()
    retired = threading.Event()
    d = Dispatcher(max_inflight=2)
    try:
        first = d.submit("k", _blocker(started, release, 1))
        assert started.wait(TIMEOUT)
        table = _PausingDict(d._lanes)
        d._lanes = table
        original_retire = d._retire_locked

        def retire(lane: Any) -> bool:
            emptied = original_retire(lane)
            retired.set()
            return emptied

        d._retire_locked = retire  # type: ignore[method-assign]

        def race() -> None:
            release.set()  # the first task ends; its worker retires the lane
            assert retired.wait(TIMEOUT)

        table.race = race
        second = d.submit("k", ran.append, 2)
        assert first.result(timeout=TIMEOUT) == 1
        assert second.result(timeout=TIMEOUT) is None
        assert d.drain(TIMEOUT)
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert ran == [2]


# ------------------------------------ the owner's unlocked pop finds the queue empty


def test_submit_lands_between_the_owners_empty_pop_and_its_locked_recheck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queue_cls = _racing_deque(when_empty=True)  # a lane's queue
    monkeypatch.setattr(lane_module, "deque", queue_cls)
    ran: list[str] = []
    d = Dispatcher(max_inflight=2)
    late: list[Any] = []

    def race() -> None:
        late.append(d.submit("k", ran.append, "second"))

    def first() -> str:
        queue_cls.race = race
        return "first"

    try:
        assert d.submit("k", first).result(timeout=TIMEOUT) == "first"
        assert d.drain(TIMEOUT)
        assert late[0].result(timeout=TIMEOUT) is None
        assert d.stats().lanes == 0
    finally:
        assert d.shutdown(TIMEOUT)
    assert ran == ["second"]


# ---------------------------------------------- the pause read by a lane's owner


def test_a_pause_that_begins_after_the_owner_looked_starts_no_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner read 'no pause', then the pause began, before it took its next task:
    that task goes back to the head of its lane (it might have been submitted after
    the pause began), and no task of any lane starts until the pause ends."""
    queue_cls = _racing_deque(when_empty=False)  # a lane's queue
    monkeypatch.setattr(lane_module, "deque", queue_cls)
    ran: list[int] = []
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=1)
    try:
        blocked = d.submit("k", _blocker(started, release))
        assert started.wait(TIMEOUT)
        futures = [d.submit("k", ran.append, i) for i in range(1, 4)]
        other = d.submit("other", ran.append, 99)
        queue_cls.race = lambda: d.pause(60.0)
        release.set()
        blocked.result(timeout=TIMEOUT)
        _wait_idle(d)
        assert d.stats().paused_for > 30
        assert d.stats().queued == 4
        assert not any(f.done() for f in [*futures, other])
        assert ran == []
    finally:
        release.set()
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert all(f.cancelled() for f in [*futures, other])


def test_a_task_added_to_a_running_lane_after_pause_returned_waits_for_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner read 'no pause' and found its lane empty; pause() returns, then a task
    of its key comes, and the owner takes it: it must not start during the pause."""
    queue_cls = _racing_deque(when_empty=True, then_pop=True)  # a lane's queue
    monkeypatch.setattr(lane_module, "deque", queue_cls)
    late: list[Future[str]] = []

    def race() -> None:
        d.pause(60.0)
        late.append(d.submit("k", lambda: "late"))

    d = Dispatcher(max_inflight=1)
    try:
        gate = threading.Event()
        first = d.submit("k", gate.wait, TIMEOUT)
        queue_cls.race = race
        gate.set()
        assert first.result(timeout=TIMEOUT) is True
        _wait_idle(d)
        assert len(late) == 1
        assert not late[0].done()
        assert d.stats().paused_for > 30
    finally:
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert late[0].cancelled()


# --------------------------------------------------- the hand-off, lock-free


def test_a_job_pushed_while_the_only_worker_goes_idle_is_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """max_inflight=1: the worker found the ready queue empty and has not listed itself
    idle; a submit pushes a new lane and finds no idle worker and no permit. The
    worker's second look, after listing itself, must find it."""
    ready_cls = _racing_deque(when_empty=True)  # the ready queue
    monkeypatch.setattr(handoff_module, "deque", ready_cls)
    d = Dispatcher(max_inflight=1, idle_timeout=60.0)
    late: list[Any] = []
    raced = threading.Event()

    def race() -> None:
        late.append(d.submit("b", lambda: "b"))
        raced.set()

    try:
        ready_cls.race = race
        assert d.submit("a", lambda: "a").result(timeout=TIMEOUT) == "a"
        assert raced.wait(TIMEOUT)
        # without the second look this would wait for idle_timeout (60 s)
        assert late[0].result(timeout=TIMEOUT) == "b"
        assert d.stats().threads == 1
    finally:
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("where", ["lane", "ready"])
def test_cancel_futures_as_a_pause_begins_leaves_no_future_waiting(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A worker took a task (a lane's next, or a keyless one from the ready queue)
    after reading 'no pause'; then a pause began and shutdown(cancel_futures=True)
    took the rest. The task taken must not go back to wait for the pause's end:
    every future is resolved once shutdown has taken the waiting ones."""
    armed = threading.Event()

    def race() -> None:
        ex._dispatcher.pause(30.0)  # as a Defer(scope="all") of another lane would
        ex.shutdown(wait=False, cancel_futures=True)

    class AfterTaking(deque):  # type: ignore[type-arg]
        """The worker's next pop that takes an item runs ``race`` right after it."""

        def popleft(self) -> Any:
            item = super().popleft()
            if armed.is_set() and _on_a_worker():
                armed.clear()
                t, out = _in_thread(race)
                t.join(TIMEOUT)
                assert out == [None], out
            return item

    monkeypatch.setattr(lane_module if where == "lane" else handoff_module, "deque", AfterTaking)
    # (its queues made with the class above; its workers named as _on_a_worker reads)
    ex = KeyedExecutor(max_workers=1, thread_name_prefix="outbound")
    ran: list[int] = []
    started, release = threading.Event(), threading.Event()

    try:
        if where == "lane":
            blocked = ex.submit_keyed("k", _blocker(started, release))
            assert started.wait(TIMEOUT)
            rest = [ex.submit_keyed("k", ran.append, i) for i in (1, 2, 3)]
        else:
            blocked = ex.submit(_blocker(started, release))
            assert started.wait(TIMEOUT)
            rest = [ex.submit(ran.append, i) for i in (1, 2, 3)]
        armed.set()
        release.set()
        blocked.result(timeout=TIMEOUT)
        assert until(lambda: all(f.done() for f in rest)), [f._state for f in rest]
        assert ran == [1]  # the one taken ran, as one a worker had taken does
        assert all(f.cancelled() for f in rest[1:])
    finally:
        release.set()
        ex._dispatcher.force_close()
        assert ex._dispatcher.shutdown(TIMEOUT)


def test_a_worker_retiring_as_a_pause_begins_starts_no_thread_for_work_queued_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker idle too long leaves its loop; before it gives its permit back, a pause
    begins and a new key is submitted (which wakes nobody: paused). The retiring
    worker saw work ready and grew the pool for it: the new thread ran it at once,
    in the pause."""
    real_fork = dispatcher_module._fork  # type: ignore[attr-defined]
    d = Dispatcher(max_inflight=2, idle_timeout=0.05)
    armed = threading.Event()
    late: list[Future[str]] = []

    def race() -> None:
        d.pause(60.0)
        late.append(d.submit("late", lambda: "late"))

    class ForksRead:
        """``_fork``, whose ``forks`` a retiring worker reads just before its last lock."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real_fork, name)

        @property
        def forks(self) -> int:
            current = threading.current_thread()
            if armed.is_set() and _on_a_worker():
                with d._lock:
                    retiring = not any(w.thread is current for w in d._workers)
                if retiring:
                    armed.clear()
                    t, out = _in_thread(race)
                    t.join(TIMEOUT)
                    assert out == [None], out
            return int(real_fork.forks)

    monkeypatch.setattr(dispatcher_module, "_fork", ForksRead())
    try:
        d.submit("k", lambda: None).result(timeout=TIMEOUT)
        armed.set()  # the worker retires after 50 ms idle
        assert until(lambda: len(late) == 1 and d.stats().threads == 0), d.stats()
        assert not late[0].done()
        assert d.stats().queued == 1
        assert d.stats().paused_for > 30
    finally:
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert late[0].cancelled()


def test_a_pause_that_begins_as_an_idle_worker_takes_a_job_starts_no_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker read 'no pause' and takes the next ready lane; the pause begins
    right then: that lane goes back first in line, and no task starts until the
    pause ends."""
    ready_cls = _racing_deque(when_empty=False)  # the ready queue
    monkeypatch.setattr(handoff_module, "deque", ready_cls)
    ran: list[str] = []
    started, release = threading.Event(), threading.Event()
    d = Dispatcher(max_inflight=1)
    try:
        blocked = d.submit("busy", _blocker(started, release))
        assert started.wait(TIMEOUT)
        futures = [d.submit(k, ran.append, k) for k in "abc"]
        ready_cls.race = lambda: d.pause(60.0)
        release.set()
        blocked.result(timeout=TIMEOUT)
        _wait_idle(d)
        assert d.stats().paused_for > 30
        assert not any(f.done() for f in futures)
        assert ran == []
    finally:
        release.set()
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert all(f.cancelled() for f in futures)


def test_a_key_submitted_after_pause_returned_waits_for_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker read 'no pause' and found the ready queue empty; pause() returns, a
    new key is submitted, and the worker's take finds its lane: it must not start
    during the pause."""
    ready_cls = _racing_deque(when_empty=True, then_pop=True)  # the ready queue
    monkeypatch.setattr(handoff_module, "deque", ready_cls)
    late: list[Future[str]] = []
    d = Dispatcher(max_inflight=1)

    def race() -> None:
        d.pause(60.0)
        late.append(d.submit("late", lambda: "late"))

    try:
        ready_cls.race = race
        d.submit("first", lambda: None).result(timeout=TIMEOUT)
        _wait_idle(d)
        assert len(late) == 1
        assert not late[0].done()
        assert d.stats().paused_for > 30
    finally:
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert late[0].cancelled()


def test_a_task_deferred_with_scope_all_is_not_run_again_by_another_worker_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second worker read 'no pause' and found the ready queue empty; the task of the
    first raises Defer(60, scope="all"): a pause, and its lane pushed first in line.
    The second worker's take finds that lane: it must not run it again at once."""
    ready_cls = _racing_deque(when_empty=True, then_pop=True)  # the ready queue
    monkeypatch.setattr(handoff_module, "deque", ready_cls)
    runs: list[int] = []
    gate = threading.Event()

    def deferring() -> None:
        runs.append(1)
        if len(runs) == 1:
            assert gate.wait(TIMEOUT)
            raise Defer(60.0, scope="all")

    d = Dispatcher(max_inflight=2)

    def race() -> None:  # in the second worker's take, the queue found empty
        gate.set()
        until(lambda: d.stats().paused_for > 30)  # parked: its lane is first in line

    try:
        deferred = d.submit("D", deferring)
        until(lambda: runs == [1])
        ready_cls.race = race
        d.submit("x", lambda: None).result(timeout=TIMEOUT)  # starts the second worker
        _wait_idle(d)
        assert runs == [1]
        assert not deferred.done()
        assert d.stats().queued == 1
    finally:
        gate.set()
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert deferred.cancelled()


class _Sleeper:
    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()


def test_handoff_a_worker_found_work_after_a_scheduler_popped_it() -> None:
    """Listed idle, the worker's second look finds a job; a scheduler had popped it off
    the idle list and released its wake lock: that release is consumed, not left to
    cut its next sleep short."""
    h: Handoff[str, _Sleeper] = Handoff()
    w = _Sleeper()

    class Ready(deque):  # type: ignore[type-arg]
        def popleft(self) -> Any:
            # between the worker's listing and its look: a scheduler pushes and wakes
            super().append("job")
            h.idle.remove(w)
            w.wake.release()
            Ready.popleft = deque.popleft  # type: ignore[method-assign]
            return super().popleft()

    h.ready = Ready()
    assert h.list_idle(w) == "job"
    assert h.idle == []
    assert w.wake.acquire(blocking=False) is False  # no stale wake-up left
    h.idle.append(w)  # listed again, it really sleeps: times out, unlisted
    assert h.sleep(w, 0.01) is False
    assert h.idle == []


def test_handoff_timeout_racing_a_wake() -> None:
    """The sleep timed out just as a scheduler popped the worker: it counts as woken."""
    h: Handoff[str, _Sleeper] = Handoff()
    w = _Sleeper()
    h.idle.append(w)

    class Wake:
        def __init__(self, real: threading.Lock) -> None:
            self.real = real
            self.first = True

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            if self.first:
                self.first = False
                assert h.wake_one()  # the scheduler's pop and release, at the timeout
                return False
            return self.real.acquire(blocking, timeout)

        def release(self) -> None:
            self.real.release()

    w.wake = Wake(w.wake)  # type: ignore[assignment]
    assert h.sleep(w, 0.01) is True
    assert w.wake.real.acquire(blocking=False) is False  # type: ignore[attr-defined]


# ------------------------------------------------ one wake-up at a time (waking)


def _waking(h: Handoff[Any, Any]) -> bool:
    return h.waking  # a call: mypy does not narrow it across the steps of a test


def test_handoff_wakes_nobody_more_while_a_woken_worker_has_not_looked() -> None:
    """Two jobs, two idle workers: the second wake_one finds the first woken worker
    pending and wakes nobody; once that worker consumed its wake-up, wake_one wakes
    the other (the dispatcher's _pass_on)."""
    h: Handoff[str, _Sleeper] = Handoff()
    h.fast_until = math.inf  # tasks are short (see test_handoff_keeps_the_pace_of_tasks)
    w1, w2 = _Sleeper(), _Sleeper()
    h.idle.extend([w1, w2])
    h.push("a")
    assert h.wake_one()
    assert _waking(h)
    h.push("b")
    assert h.wake_one()  # says "taken care of" ...
    assert h.idle == [w1]  # ... without waking anybody
    assert w1.wake.acquire(blocking=False) is False
    assert h.sleep(w2, 0.0) is True  # w2 consumes its wake-up
    assert not _waking(h)
    assert h.take() == "a"
    assert h.ready  # "b" left behind: pass the wake-up on
    assert h.wake_one()
    assert h.idle == []
    assert h.sleep(w1, 0.0) is True


@pytest.mark.parametrize("fast_until", [0.0, "lapsed"])
def test_handoff_wakes_one_worker_per_job_unless_tasks_were_short_lately(
    fast_until: float | str,
) -> None:
    """Tasks long (or not measured yet), or the last short one more than FAST_FOR ago:
    a second job wakes a second worker, pending wake-up or not."""
    h: Handoff[str, _Sleeper] = Handoff()
    h.fast_until = time.monotonic() - 1e-3 if fast_until == "lapsed" else float(fast_until)
    w1, w2 = _Sleeper(), _Sleeper()
    h.idle.extend([w1, w2])
    h.push("a")
    assert h.wake_one()
    h.push("b")
    assert h.wake_one()
    assert h.idle == []
    assert h.sleep(w1, 0.0) is True
    assert h.sleep(w2, 0.0) is True


def test_handoff_keeps_the_pace_of_tasks() -> None:
    """New: tasks count as long. Short runs bring the average under SHORT and keep
    wake-ups one at a time for FAST_FOR after the last; one long run ends that."""
    h: Handoff[str, _Sleeper] = Handoff()
    assert h.fast_until == 0.0
    assert h.pace >= handoff_module.SHORT
    runs = 0
    while h.fast_until == 0.0:
        h.ran(1e-6, 100.0)
        runs += 1
        assert runs < 1000
    assert h.fast_until == 100.0 + handoff_module.FAST_FOR
    assert h.pace < handoff_module.SHORT
    h.ran(0.01, 101.0)  # one 10 ms task among short ones
    assert h.fast_until == 0.0
    h.ran(1e-6, 102.0)  # the average is still long
    assert h.fast_until == 0.0


def test_the_wake_up_mode_follows_the_tasks() -> None:
    """A real dispatcher: no-op tasks make the pace short (one wake-up at a time);
    a task that blocks 20 ms ends it before its future resolves."""
    d = Dispatcher(max_inflight=4, idle_timeout=60.0)
    try:
        assert d._handoff.fast_until == 0.0
        for _ in range(50):  # bounded: preempted tasks may keep the pace long a while
            futures = [d.submit(i % 4, int) for i in range(200)]
            assert [f.result(timeout=TIMEOUT) for f in futures] == [0] * 200
            if d._handoff.pace < handoff_module.SHORT:
                break
        assert d._handoff.pace < handoff_module.SHORT
        assert d.submit("slow", threading.Event().wait, 0.02).result(timeout=TIMEOUT) is False
        assert d._handoff.fast_until == 0.0
    finally:
        assert d.shutdown(TIMEOUT)


def test_blocking_tasks_right_after_short_ones_all_start() -> None:
    """The mode is not pinned: after short tasks (wake-ups one at a time), a burst of
    16 tasks that each wait for all the others still gets 16 threads."""
    n = 16
    d = Dispatcher(max_inflight=n, idle_timeout=60.0)
    try:
        for _ in range(3):
            for _ in range(50):  # bounded, as in test_the_wake_up_mode_follows_the_tasks
                futures = [d.submit(i % n, int) for i in range(400)]
                assert [f.result(timeout=TIMEOUT) for f in futures] == [0] * 400
                if d._handoff.pace < handoff_module.SHORT:
                    break
            barrier = threading.Barrier(n, timeout=TIMEOUT)
            futures = [d.submit(("b", i), barrier.wait) for i in range(n)]
            assert sorted(f.result(timeout=TIMEOUT) for f in futures) == list(range(n))
    finally:
        assert d.shutdown(TIMEOUT)


def test_handoff_wake_all_wakes_every_idle_worker_while_one_is_pending() -> None:
    h: Handoff[str, _Sleeper] = Handoff()
    sleepers = [_Sleeper() for _ in range(3)]
    h.idle.extend(sleepers)
    h.push("a")
    assert h.wake_one()  # one pending
    h.wake_all()
    assert h.idle == []
    assert all(h.sleep(w, 0.0) for w in sleepers)
    assert not h.waking


def test_handoff_a_worker_unlisting_itself_consumes_the_wake_up_and_clears_waking() -> None:
    """Listed idle, the worker's second look finds a job; a scheduler popped it and
    set ``waking`` meanwhile: unlisting consumes that wake-up and clears ``waking``."""
    h: Handoff[str, _Sleeper] = Handoff()
    w = _Sleeper()

    class Ready(deque):  # type: ignore[type-arg]
        def popleft(self) -> Any:
            super().append("job")
            assert h.wake_one()  # pops w, sets waking, releases
            Ready.popleft = deque.popleft  # type: ignore[method-assign]
            return super().popleft()

    h.ready = Ready()
    assert h.list_idle(w) == "job"
    assert not h.waking
    assert w.wake.acquire(blocking=False) is False


class _RacingWake:
    """A worker's wake lock: the first time an armed lock wakes its worker from a
    sleep, ``race`` runs (in another thread, waited for) right after the wake-up was
    consumed, before the worker clears ``waking`` and looks at the ready queue."""

    race: Callable[[], None] | None = None

    def __init__(self) -> None:
        self.real = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self.real.acquire(blocking, timeout)
        race = type(self).race
        if got and timeout != -1 and race is not None and _on_a_worker():
            type(self).race = None
            t, out = _in_thread(race)
            t.join(TIMEOUT)
            assert out == [None], out
        return got

    def release(self) -> None:
        self.real.release()


def _racing_wakes(monkeypatch: pytest.MonkeyPatch) -> type[_RacingWake]:
    """Every worker made from now on gets a racing wake lock (a class per test)."""
    wake_cls = cast("type[_RacingWake]", type("RacingWake", (_RacingWake,), {"race": None}))

    class RacingWorker(lane_module.Worker):
        def __init__(self, job: Any) -> None:
            super().__init__(job)
            self.wake = wake_cls()  # type: ignore[assignment]
            self.wake.acquire()

    monkeypatch.setattr(dispatcher_module, "Worker", RacingWorker)
    return wake_cls


def _warm(d: Dispatcher, threads: int) -> None:
    """Start ``threads`` workers and let them all go idle."""
    release = threading.Event()
    starts = [threading.Event() for _ in range(threads)]
    futures = [d.submit(f"warm{i}", _blocker(s, release)) for i, s in enumerate(starts)]
    assert all(s.wait(TIMEOUT) for s in starts)
    release.set()
    for f in futures:
        f.result(timeout=TIMEOUT)
    _until(lambda: d.stats().idle_threads == threads)


def _until(predicate: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(int(TIMEOUT / 0.01)):
        if predicate():
            return
        done.wait(0.01)  # polling a state no event reports; bounded
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("idle", [2, 1])
def test_a_job_pushed_while_a_woken_worker_has_not_looked_gets_a_thread(
    monkeypatch: pytest.MonkeyPatch, idle: int
) -> None:
    """A submit wakes an idle worker; before it looks, more submits find it pending
    (``waking``) and wake nobody. Having taken its job it sees the others ready: it
    wakes the other idle worker (idle=2) or, with none, grows the pool (idle=1), so
    that every task starts while the first one still blocks."""
    monkeypatch.setattr(handoff_module, "_short", lambda now, until: True)  # tasks short
    wake_cls = _racing_wakes(monkeypatch)
    d = Dispatcher(max_inflight=3, idle_timeout=60.0)
    release = threading.Event()
    started = {k: threading.Event() for k in "abc"}
    later = "bc"[: 3 - idle]
    seen: list[object] = []
    try:
        _warm(d, idle)

        def race() -> None:
            seen.append(d._handoff.waking)
            for k in later:
                d.submit(k, _blocker(started[k], release))
            seen.append(len(d._handoff.idle))  # nobody more was woken
            seen.append(d.stats().threads)  # nor was the pool grown

        wake_cls.race = race
        d.submit("a", _blocker(started["a"], release))
        for k in "a" + later:
            assert started[k].wait(TIMEOUT), k
        assert seen == [True, idle - 1, idle]
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


# ------------------------------------ the idle path reads the state without the lock


class _CloseOnListing(list):  # type: ignore[type-arg]
    """The idle list: a worker's lock-free append first runs ``race`` (close()), which
    finds nobody to wake: the worker read 'open' just before."""

    race: Callable[[], None] | None = None

    def append(self, item: Any) -> None:
        race, self.race = self.race, None
        if race is not None:
            t, _ = _in_thread(race)
            t.join(TIMEOUT)
        super().append(item)


def test_close_lands_as_a_worker_lists_itself_idle() -> None:
    """The worker read 'open' and lists itself without the lock; close() lands then:
    the worker must exit at once, not after idle_timeout."""
    d = Dispatcher(max_inflight=1, idle_timeout=60.0)
    idle = _CloseOnListing()
    d._handoff.idle = idle
    idle.race = d.close
    try:
        assert d.submit("k", lambda: 1).result(timeout=TIMEOUT) == 1
        t, out = _in_thread(lambda: d.shutdown(5.0))
        t.join(TIMEOUT)
        assert out == [True]
    finally:
        assert d.shutdown(TIMEOUT)
    assert d.state is State.CLOSED


# ------------------------------------------ drain() against the retire's hint


def test_drain_starting_as_the_last_lane_retires_returns_promptly() -> None:
    """The retirer read 'nobody drains' and skipped the wake-up; drain() starts right
    then. It must still see the empty table (within its re-check period)."""
    d = Dispatcher(max_inflight=1)
    original = d._lanes_emptied
    results: list[object] = []

    def emptied() -> None:
        t, out = _in_thread(lambda: d.drain(5.0))
        t.join(TIMEOUT)
        results.extend(out)
        original()

    d._lanes_emptied = emptied  # type: ignore[method-assign]
    try:
        assert d.submit("k", lambda: 1).result(timeout=TIMEOUT) == 1
        assert d.drain(TIMEOUT)
    finally:
        assert d.shutdown(TIMEOUT)
    assert results == [True]


# ------------------------------------------------ the timer against force_close


@pytest.mark.parametrize("keyless", [False, True])
def test_force_close_between_the_timer_taking_an_item_and_firing_it(keyless: bool) -> None:
    """The timer popped a parked lane (or a deferred keyless task); force_close runs
    before it fires: the task is cancelled by the time force_close returns, never
    re-run, and shutdown() completes."""
    attempts: list[int] = []
    fired = threading.Event()
    submitted = threading.Event()
    resolved_at_return: list[bool] = []

    def task() -> str:
        attempts.append(current_context().attempt)
        if current_context().attempt == 1:
            # Deferred only once `fut` is bound below: else the timer can fire
            # (0.01 s later) before submit() has returned on a slow runner,
            # and fire() fails on an unbound `fut` (NameError, logged).
            assert submitted.wait(TIMEOUT)
            raise Defer(0.01)
        return "re-run"

    ex = KeyedExecutor(max_workers=2) if keyless else None
    d = ex._dispatcher if ex is not None else Dispatcher(max_inflight=2)
    original_fire = d._timer._fire

    def fire(take: Callable[[], list[Any]]) -> None:
        if any(item is not None for item in d._timer.items()):
            d.force_close()
            resolved_at_return.append(fut.cancelled())
            fired.set()
        original_fire(take)

    d._timer._fire = fire
    try:
        fut = ex.submit(task) if ex is not None else d.submit("k", task)
        submitted.set()
        assert fired.wait(TIMEOUT)
        with pytest.raises(CancelledError):
            fut.result(timeout=TIMEOUT)
        assert fut.cancelled()
        assert d.shutdown(TIMEOUT)
    finally:
        submitted.set()
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert attempts == [1]
    assert resolved_at_return == [True]


# ------------------------------------------- force_close after the cancel check


class _RacingEvent(threading.Event):
    """An Event that runs a callback right after the next is_set() that reads False."""

    after_check: Callable[[], None] | None = None

    def is_set(self) -> bool:
        value = super().is_set()
        callback, self.after_check = self.after_check, None
        if callback is not None and not value:
            callback()
        return value


def test_force_close_right_after_a_worker_checked_cancel_lets_that_task_see_it() -> None:
    d = Dispatcher(max_inflight=1)
    racing = _RacingEvent()
    d._cancel = racing
    seen: list[bool] = []
    try:
        racing.after_check = d.force_close

        def task() -> str:
            seen.append(current_context().cancelled)
            return "ran"

        fut = d.submit("k", task)
        assert fut.result(timeout=TIMEOUT) == "ran"
        assert d.shutdown(TIMEOUT)
    finally:
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert seen == [True]


def test_cancelling_a_lane_leaves_its_worker_a_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """shutdown(cancel_futures=True) takes a lane's waiting tasks while its worker,
    unlocked, takes the next one: here the worker takes one just after the
    canceller's first take. The worker's task must be the lane's front (it
    was the second task when the canceller took from the front)."""
    canceller = threading.current_thread()
    armed = threading.Event()
    release = threading.Event()
    started: list[int] = []
    next_started = threading.Event()
    first_started = threading.Event()

    class RacingDeque(deque):  # type: ignore[type-arg]
        """The canceller's first take lets the worker take its next task, then goes on."""

        def _race(self) -> None:
            if armed.is_set() and threading.current_thread() is canceller:
                armed.clear()
                release.set()  # the running task returns; the worker takes the next
                assert next_started.wait(TIMEOUT)

        def pop(self) -> Any:  # type: ignore[override]
            item = super().pop()
            self._race()
            return item

        def popleft(self) -> Any:
            item = super().popleft()
            self._race()
            return item

    monkeypatch.setattr(lane_module, "deque", RacingDeque)

    def task(seq: int) -> None:
        started.append(seq)
        if seq == 0:
            first_started.set()
            assert release.wait(TIMEOUT)
        elif len(started) == 2:
            next_started.set()

    ex = KeyedExecutor(max_workers=1)
    futures = [ex.submit_keyed("k", task, seq) for seq in range(5)]
    assert first_started.wait(TIMEOUT)
    armed.set()
    ex.shutdown(wait=True, cancel_futures=True)
    assert started == list(range(len(started)))  # a prefix: none after a cancelled one
    assert started[:2] == [0, 1]
    for seq, future in enumerate(futures):
        assert future.done()
        assert future.cancelled() == (seq not in started)


@pytest.mark.parametrize("idle", [3, 1])
def test_the_end_of_a_pause_starts_every_waiting_lane_from_one_wake_up(idle: int) -> None:
    """At a pause's end the timer wakes one worker for all the lanes that waited; it
    passes the wake-up on (to the other idle workers, or by growing the pool) until
    each lane has a thread: the three blocking tasks run at once."""
    d = Dispatcher(max_inflight=3, idle_timeout=60.0)
    release = threading.Event()
    started = {k: threading.Event() for k in "abc"}
    try:
        _warm(d, idle)
        d.pause(0.05)
        for k in "abc":
            d.submit(k, _blocker(started[k], release))
        for k in "abc":
            assert started[k].wait(TIMEOUT), k
        assert d.stats().running == 3
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("by", ["the timer", "submit"])
def test_force_close_before_a_grown_worker_starts_cancels_its_keyless_task(by: str) -> None:
    """A keyless task handed to a worker the pool grew for, before its thread began
    (the timer firing a deferred task, or a submit, with no worker idle), was in no
    queue: force_close() returned with its future pending, and stats() missed it."""
    ex = KeyedExecutor(max_workers=3 if by == "the timer" else 2)
    d = ex._dispatcher
    release = threading.Event()
    seen: dict[str, Any] = {}
    deferred = threading.Event()

    def deferring() -> str:
        if current_context().attempt == 1:
            deferred.set()
            raise Defer(0.3)
        return "re-run"

    original = d._start_workers
    armed = threading.Event()

    def start_workers(workers: list[Any]) -> BaseException | None:
        if armed.is_set() and "done" not in seen:
            seen["thread"] = threading.current_thread().name
            seen["queued"] = d.stats().queued
            # Its future, from the mailbox: submit has not returned it yet.
            handed = [w.job.future for w in workers if type(w.job) is lane_module.Task]
            d.force_close()
            seen["done"] = [f.done() for f in handed]
            seen["cancelled"] = [f.cancelled() for f in handed]
        return original(workers)

    d._start_workers = start_workers  # type: ignore[method-assign]
    try:
        busy = [ex.submit(release.wait, TIMEOUT)]  # no worker idle from here on
        assert until(lambda: d.stats().running == 1)
        if by == "the timer":
            ex.submit(deferring)
            assert deferred.wait(TIMEOUT)
            assert until(lambda: d.stats().running == 1 and d.stats().idle_threads == 1)
            busy.append(ex.submit(release.wait, TIMEOUT))  # takes the idle worker
            assert until(lambda: d.stats().running == 2)
            armed.set()  # the timer's firing grows a third worker
        else:
            armed.set()
            ex.submit(abs, -1)
        assert until(lambda: "done" in seen)
        assert seen["thread"].endswith("-timer") == (by == "the timer")
        assert seen["queued"] == 1
        assert seen["done"] == [True]
        assert seen["cancelled"] == [True]
    finally:
        release.set()
        d.force_close()
        assert d.shutdown(TIMEOUT)
    assert [f.result(timeout=TIMEOUT) for f in busy] == [True] * len(busy)


def test_force_close_goes_on_when_a_worker_takes_the_last_ready_job_under_it() -> None:
    # Seam: _drop_jobs_locked looks at the ready queue's first job under
    # _lock, but workers take from it without _lock. One that took the last
    # job between force_close()'s look at the queue and its read of the job
    # made force_close() raise IndexError, skipping the rest: a deferred task
    # left unresolved, no shutdown ending until force_close() was called again.
    drop_line = line_of(Dispatcher._drop_jobs_locked, "job = ready[0]")
    take_line = line_of(Dispatcher._next_job, "job = handoff.take()")
    drop_code = Dispatcher._drop_jobs_locked.__code__
    next_code = Dispatcher._next_job.__code__
    ex = KeyedExecutor(max_workers=1)
    d = ex._dispatcher
    armed = threading.Event()
    worker_at_take = threading.Event()
    worker_go = threading.Event()

    def defer_once() -> str:
        if current_context().attempt > 1:
            return "again"
        raise Defer(math.inf)  # until force_close()

    def worker_trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not next_code:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if (
                event == "line"
                and frame.f_lineno == take_line
                and armed.is_set()
                and not worker_at_take.is_set()
            ):
                worker_at_take.set()
                worker_go.wait(TIMEOUT)
            return local

        return local

    threading.settrace(worker_trace)  # the pool's first thread is traced
    try:
        deferred = ex.submit(defer_once)
        assert until(lambda: len(d._timer.items()) == 1)
        gate = threading.Event()
        busy = ex.submit(gate.wait, TIMEOUT)
        assert until(busy.running)
    finally:
        threading.settrace(None)
    queued = ex.submit(str, "queued")  # waits in the ready queue
    armed.set()
    gate.set()
    assert worker_at_take.wait(TIMEOUT), "the worker was not held before its take()"

    def closer_trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not drop_code:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == drop_line and not worker_go.is_set():
                worker_go.set()  # the worker takes the job now
                assert until(lambda: not d._handoff.ready)
            return local

        return local

    sys.settrace(closer_trace)
    try:
        d.force_close()
    finally:
        sys.settrace(None)
        worker_go.set()
    assert deferred.cancelled(), "force_close() stopped before the deferred task"
    assert d.shutdown(TIMEOUT)
    assert queued.done()  # the worker's: run, or cancelled as it took it after the close
    assert d._keyless == 0


class _HeldStarter:
    """A thread that submits ``fn(*args)`` to ``d`` under the key "k", held at
    ``thread.start()`` of the pool thread that submit makes (it is made and
    tracked, not started) until :meth:`go_on`; ``fail``: then its start
    raises, as the system's "can't start new thread"."""

    def __init__(self, d: Dispatcher, fn: Any, *args: Any, fail: bool = False) -> None:
        start_line = line_of(Dispatcher._start_workers, "thread.start()")
        code = Dispatcher._start_workers.__code__
        self.at_start, self._go_on = threading.Event(), threading.Event()
        self.submitted: list[Future[Any]] = []
        self.failed: list[BaseException] = []

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == start_line and not self.at_start.is_set():
                self.at_start.set()
                self._go_on.wait(TIMEOUT)
                if fail:
                    raise RuntimeError("can't start new thread")  # (as the system says)
            return local

        def submit() -> None:
            sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
            try:
                self.submitted.append(d.submit("k", fn, *args))
            except BaseException as exc:
                self.failed.append(exc)
            finally:
                sys.settrace(None)

        self.thread = threading.Thread(target=submit)
        self.thread.start()
        assert self.at_start.wait(TIMEOUT)

    def go_on(self) -> None:
        self._go_on.set()
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()


@pytest.mark.parametrize("ends", ["started", "given up"])
def test_shutdown_waits_for_a_thread_a_submit_made_and_has_yet_to_start(ends: str) -> None:
    # Seam: a submit that grows the pool registers the new thread under _lock
    # and starts it after. shutdown() joined only the threads alive at its
    # look: one not yet started is not alive, and shutdown() said True with a
    # pool thread about to start (stats().threads 1; it ran after).
    d = Dispatcher(max_inflight=2)
    starter = _HeldStarter(d, str, "ran", fail=ends == "given up")
    try:
        d.force_close()  # its task is cancelled; the thread is still to start
        shutdown: list[bool] = []
        closer = threading.Thread(target=lambda: shutdown.append(d.shutdown()))
        closer.start()
        # It waits for the start (it said True at once).
        assert until(lambda: bool(shutdown) or getattr(d, "_joining", 0) == 1)
        assert not shutdown, "shutdown() returned with a pool thread yet to start"
        starter.go_on()
        closer.join(TIMEOUT)
        assert shutdown == [True]
        assert d.stats().threads == 0
        assert all(t.ident is not None and not t.is_alive() for t in d._threads)
    finally:
        starter.go_on()
    assert starter.submitted or starter.failed


def test_a_thread_whose_starter_was_held_past_the_grace_runs_nothing_after_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Seam: as above, the starter held (descheduled) at thread.start() past
    # shutdown()'s grace for threads not begun: shutdown() said True, then the
    # thread began, claimed its worker and ran the initializer (user code)
    # after shutdown() had returned.
    monkeypatch.setattr(dispatcher_module, "_START_GRACE", 0.05)
    ran: list[str] = []
    d = Dispatcher(max_inflight=2, initializer=lambda: ran.append("initializer"))
    starter = _HeldStarter(d, ran.append, "task")
    try:
        made = list(d._threads)  # (the thread to start)
        d.force_close()  # its task is cancelled; the thread is still to start
        assert d.shutdown() is True  # (past the grace)
    finally:
        starter.go_on()
    assert len(made) == 1
    made[0].join(TIMEOUT)  # (started after all: it exits at once)
    assert not made[0].is_alive()
    assert d.stats().threads == 0
    assert ran == []


def test_shutdown_ends_when_a_ctrl_c_cut_the_giving_up_of_a_thread_that_never_began(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker's thread failed to start, and a Ctrl-C landed in _give_up
    # before it dropped that thread from the list: shutdown() waited for it
    # to begin, for good (the task itself had run on the rescue).
    real_start = threading.Thread.start
    fails = [1]

    def start(thread: threading.Thread) -> None:
        if "worker" in thread.name and fails[0]:
            fails[0] -= 1
            raise RuntimeError("can't start new thread")
        real_start(thread)

    d = Dispatcher(max_inflight=2)
    monkeypatch.setattr(threading.Thread, "start", start)
    profile, fired = interrupt_after_call(Dispatcher._give_up.__code__, 1)
    sys.setprofile(profile)
    try:
        future: Future[str] | None = d.submit("k", str, "ran")
    except KeyboardInterrupt:
        future = None
    finally:
        sys.setprofile(None)
        monkeypatch.undo()
    assert fired
    if future is not None:
        assert future.result(TIMEOUT) == "ran"
    done: list[bool] = []
    closer = threading.Thread(target=lambda: done.append(d.shutdown()), daemon=True)
    closer.start()
    closer.join(TIMEOUT)
    assert done == [True], "shutdown() waited for a thread nobody would start"


def test_shutdown_waits_for_a_thread_whose_start_a_ctrl_c_cut_as_it_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The starter gave the worker up (a Ctrl-C as start() returned) and took its
    # thread off the list, though it had begun: shutdown() said True with it
    # alive (it finds itself given up, and exits).
    d = Dispatcher(max_inflight=2)
    real_start = threading.Thread.start
    real_work = d._work
    began, go_on = threading.Event(), threading.Event()

    def slow_work(worker: Any) -> None:  # (the system slow to run the new thread)
        began.set()
        go_on.wait(TIMEOUT)
        real_work(worker)

    def start(thread: threading.Thread) -> None:
        real_start(thread)
        if "worker" in thread.name:
            raise KeyboardInterrupt  # a Ctrl-C as start() returns

    monkeypatch.setattr(d, "_work", slow_work)
    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        with pytest.raises(KeyboardInterrupt):
            d.submit("k", str, "x")
    finally:
        monkeypatch.setattr(threading.Thread, "start", real_start)
    try:
        assert began.wait(TIMEOUT)
        held = next(t for t in threading.enumerate() if "outbound-worker" in t.name)
        joined = threading.Event()
        real_join = held.join

        def join(timeout: float | None = None) -> None:
            joined.set()
            real_join(timeout)

        monkeypatch.setattr(held, "join", join)
        done: list[bool] = []
        closer = threading.Thread(target=lambda: done.append(d.shutdown()))
        closer.start()
        assert until(lambda: bool(done) or joined.is_set())
        assert not done, "shutdown() returned with a pool thread running"
    finally:
        go_on.set()
    closer.join(TIMEOUT)
    assert done == [True]
    assert not [t for t in threading.enumerate() if "outbound-worker" in t.name and t.is_alive()]


def test_a_thread_starting_as_another_is_listed_stays_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A thread with its ident but not yet started (is_alive() False) was taken
    # for one that exited when another starter listed its thread: shutdown()
    # no longer waited for it, and shutdown() from a callback on it waited
    # for itself instead of raising RuntimeError.
    real = threading.Thread._set_native_id  # type: ignore[attr-defined]
    reached, go_on = threading.Event(), threading.Event()

    def set_native_id(thread: threading.Thread) -> None:
        if thread.name == "held-worker-1" and not reached.is_set():
            reached.set()
            go_on.wait(TIMEOUT)  # between its ident and its start
        real(thread)

    monkeypatch.setattr(threading.Thread, "_set_native_id", set_native_id)
    d = Dispatcher(max_inflight=4, thread_name_prefix="held")
    gate = threading.Event()
    first = threading.Thread(target=lambda: d.submit("a", gate.wait, TIMEOUT))
    first.start()
    try:
        assert reached.wait(TIMEOUT)
        held = next(t for t in threading.enumerate() if t.name == "held-worker-1")
        assert d.submit("b", str, "b").result(TIMEOUT) == "b"  # another thread is listed
        assert held in d._threads, "a starting pool thread was forgotten"
    finally:
        go_on.set()
        gate.set()
        first.join(TIMEOUT)
    assert d.shutdown(TIMEOUT)
    assert not held.is_alive()
    assert d.stats().threads == 0
