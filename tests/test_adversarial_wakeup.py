"""Adversarial tests of waking workers for bursts of tasks.

A burst of tasks for idle lanes must start as many threads as it needs,
at once: blocking tasks all run together up to ``max_inflight``, and a
woken worker that is slow to run (the GIL, the OS) holds back no other
task. (Waking one worker at a time, each passing the wake-up on, made the
64th blocking task of a burst start 5 to 15 times later under CPU
contention: it is now done only while tasks are short, and the burst test
below guards the long mode.) The barrier tests make every task wait until all of them
started: one that never gets a thread breaks the barrier. The seam tests
hold the first woken worker right after it consumed its wake-up and make
the racing operation happen there: a submit, close, a pause, a fork.

Wake-ups go one at a time only while tasks are short (see
:mod:`outbound._handoff`): every test runs with the mode pinned both ways
(the ``tasks`` fixture), except those about one mode.

The test marked ``xfail(strict=True)`` is a known defect, kept as a
regression test that fails on the current code.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, cast

import pytest
from dispatch_helpers import TIMEOUT, blocker
from dispatch_helpers import Counter as _Counter
from dispatch_helpers import on_a_worker as _on_a_worker
from dispatch_helpers import until as _until

import outbound._handoff as handoff_module
import outbound.dispatcher as dispatcher_module
from outbound import Defer, Dispatcher, Hooks, KeyedExecutor, current_context
from outbound._lane import Worker

_real_start = threading.Thread.start

# How long a barrier's tasks wait for each other: a task that never gets a
# thread breaks it (BrokenBarrierError) instead of hanging the test.
_BARRIER_WAIT = TIMEOUT


@pytest.fixture(params=["short", "long"], autouse=True)
def tasks(request: pytest.FixtureRequest) -> Iterator[str]:
    """Pin the wake-up mode: one at a time ("short": tasks were short lately) or one
    per job ("long"), whatever the tasks of the test take."""
    mode = cast("str", request.param)
    with pytest.MonkeyPatch.context() as mp:
        # wake_one asks _short whether wake-ups go one at a time now
        mp.setattr(handoff_module, "_short", lambda now, until: mode == "short")
        yield mode


def _warm(d: Dispatcher, threads: int) -> None:
    """Start ``threads`` workers and let them all go idle."""
    release = threading.Event()
    starts = [threading.Event() for _ in range(threads)]
    futures = [d.submit(("warm", i), blocker(s, release)) for i, s in enumerate(starts)]
    assert all(s.wait(TIMEOUT) for s in starts)
    release.set()
    for f in futures:
        f.result(timeout=TIMEOUT)
    assert _until(lambda: d.stats().idle_threads == threads)


def _flag(d: Dispatcher) -> bool | None:
    """``Handoff.waking`` (None before it existed: the tests run on 7ec1caa too)."""
    return cast("bool | None", getattr(d._handoff, "waking", None))


def _quiet(d: Dispatcher) -> None:
    """Every worker goes idle again and the flag clears (a woken worker clears it as
    it looks; one left set would keep every later submit from waking anybody); then a
    submit still gets a thread."""

    def quiet() -> bool:
        s = d.stats()  # one snapshot: two could see different workers
        return s.idle_threads == s.threads and _flag(d) is not True

    assert _until(quiet)
    assert d.submit(("probe",), int).result(timeout=TIMEOUT) == 0


def _barrier_task(barrier: threading.Barrier) -> Callable[[], int]:
    def task() -> int:
        return barrier.wait()

    return task


def _results(futures: list[Future[Any]]) -> list[Any]:
    return [f.result(timeout=TIMEOUT) for f in futures]


# ------------------------------------------------------------ a held woken worker


class _HoldingWake:
    """A worker's wake lock. Armed with ``hook``, the first worker that consumes a
    wake-up (asleep in ``Handoff.sleep``, or unlisting itself after its second look
    found a job) runs ``hook`` right then, in its own thread: after the release was
    consumed, before it clears ``waking`` and looks at (or past) ``ready``."""

    hook: Callable[[], None] | None = None

    def __init__(self) -> None:
        self.real = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self.real.acquire(blocking, timeout)
        hook = type(self).hook
        if got and hook is not None and _on_a_worker():
            type(self).hook = None
            hook()
        return got

    def release(self) -> None:
        self.real.release()

    def locked(self) -> bool:
        return self.real.locked()


def _holding_wakes(monkeypatch: pytest.MonkeyPatch) -> type[_HoldingWake]:
    """Every worker made from now on gets a holding wake lock (a class per test)."""
    wake_cls = cast("type[_HoldingWake]", type("HoldingWake", (_HoldingWake,), {"hook": None}))

    class HoldingWorker(Worker):
        def __init__(self, job: Any) -> None:
            super().__init__(job)
            wake = wake_cls()
            wake.real.acquire()  # not a wake-up consumed
            self.wake = wake  # type: ignore[assignment]

    monkeypatch.setattr(dispatcher_module, "Worker", HoldingWorker)
    return wake_cls


def _race(fn: Callable[[], None]) -> Callable[[], None]:
    """A hook that runs ``fn`` in another thread and waits for it (the worker held)."""

    def hook() -> None:
        out: list[BaseException | None] = []

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                out.append(exc)
            else:
                out.append(None)

        t = threading.Thread(target=run)
        t.start()
        t.join(TIMEOUT)
        assert out == [None], out

    return hook


# ------------------------------------------------------------------- barriers


@pytest.mark.parametrize("idle", [0, 1, 17, 64])
def test_64_blocking_tasks_all_start_whatever_the_idle_pool(idle: int) -> None:
    """64 tasks on 64 keys, each waiting until all 64 started, max_inflight=64: the
    wake-up is passed on (or the pool grown) until every one has a thread."""
    n = 64
    d = Dispatcher(max_inflight=n, idle_timeout=60.0)
    try:
        _warm(d, idle)
        barrier = threading.Barrier(n, timeout=_BARRIER_WAIT)
        futures = [d.submit(i, _barrier_task(barrier)) for i in range(n)]
        assert sorted(_results(futures)) == list(range(n))
        assert d.stats().threads == n
        _quiet(d)
    finally:
        assert d.shutdown(TIMEOUT)


def test_a_burst_on_as_many_idle_workers_starts_no_thread_more() -> None:
    """8 idle workers, 8 blocking tasks: the 8 run on them. Woken workers that see
    jobs left behind pass the wake-up on only where one was left to them, so one
    wake-up per job (long tasks) grows no thread for a job a woken worker takes."""
    n = 8
    release = threading.Event()
    started = _Counter()

    def task() -> None:
        started.hit()
        assert release.wait(TIMEOUT)

    d = Dispatcher(max_inflight=4 * n, idle_timeout=60.0)
    try:
        _warm(d, n)
        for _ in range(3):
            futures = [d.submit(i, task) for i in range(n)]
            assert started.wait_for(n, timeout=TIMEOUT), started.n
            assert d.stats().threads == n
            release.set()
            _results(futures)
            release.clear()
            started = _Counter()
            assert _until(lambda: d.stats().idle_threads == n)
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)


def test_blocking_keyless_tasks_of_a_keyed_executor_all_start() -> None:
    n = 32
    ex = KeyedExecutor(max_workers=n)
    try:
        barrier = threading.Barrier(n, timeout=_BARRIER_WAIT)
        assert len(set(_results([ex.submit(barrier.wait) for _ in range(n)]))) == n
        assert _until(lambda: ex.stats().idle_threads == n)
        barrier = threading.Barrier(n, timeout=_BARRIER_WAIT)  # now from n idle threads
        assert len(set(_results([ex.submit(barrier.wait) for _ in range(n)]))) == n
    finally:
        ex.shutdown(wait=True)


@pytest.mark.parametrize("idle", [0, 1, 16])
def test_lanes_that_waited_out_a_pause_all_start_from_one_wake_up(idle: int) -> None:
    n = 16
    d = Dispatcher(max_inflight=n, idle_timeout=60.0)
    try:
        _warm(d, idle)
        d.pause(0.05)
        barrier = threading.Barrier(n, timeout=_BARRIER_WAIT)
        futures = [d.submit(i, _barrier_task(barrier)) for i in range(n)]
        assert sorted(_results(futures)) == list(range(n))
        _quiet(d)
    finally:
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("scope", ["lane", "all"])
def test_lanes_unparked_or_unpaused_by_the_timer_all_start(scope: str) -> None:
    """Each task defers once (its lane parked, or every lane paused), then waits for
    all the others: the timer's single wake-up must reach every lane."""
    n = 16
    d = Dispatcher(max_inflight=n, idle_timeout=60.0)
    barrier = threading.Barrier(n, timeout=_BARRIER_WAIT)

    def task() -> int:
        if current_context().attempt == 1:
            raise Defer(0.02, scope=scope)  # type: ignore[arg-type]
        return barrier.wait()

    try:
        _warm(d, n)
        futures = [d.submit(i, task) for i in range(n)]
        assert sorted(_results(futures)) == list(range(n))
        _quiet(d)
    finally:
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_hooks_raising_base_exceptions_do_not_stop_the_wake_up_chain(
    error: type[BaseException],
) -> None:
    """on_start and on_done raise a BaseException in every worker: each is logged,
    and every blocking task still gets a thread."""
    n = 16

    def hook(*args: object) -> None:
        raise error

    d = Dispatcher(max_inflight=n, idle_timeout=60.0, hooks=Hooks(on_start=hook, on_done=hook))
    try:
        for _ in range(2):  # from a cold pool, then from n idle threads
            barrier = threading.Barrier(n, timeout=_BARRIER_WAIT)
            futures = [d.submit(i, _barrier_task(barrier)) for i in range(n)]
            assert sorted(_results(futures)) == list(range(n))
            _quiet(d)
    finally:
        assert d.shutdown(TIMEOUT)


def test_blocking_tasks_all_start_while_workers_keep_retiring() -> None:
    """idle_timeout of 0.1 ms: threads retire between and during the bursts, and a
    wake-up may find a worker whose timeout just fired."""
    n = 12
    d = Dispatcher(max_inflight=n, idle_timeout=1e-4)
    rng = random.Random(7)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for _ in range(30):
            barrier = threading.Barrier(n, timeout=_BARRIER_WAIT)
            futures = [d.submit(i, _barrier_task(barrier)) for i in range(n)]
            assert sorted(_results(futures)) == list(range(n))
            short = [d.submit(rng.randrange(5), int) for _ in range(rng.randrange(50))]
            assert _results(short) == [0] * len(short)
    finally:
        sys.setswitchinterval(old)
        assert d.shutdown(TIMEOUT)


# --------------------------------------------------- at the seam: a woken worker held


def test_close_while_a_woken_worker_has_not_looked_runs_everything() -> None:
    """Submits land while the woken worker is held, then close(): the worker finds
    the jobs, passes the wake-up on (grows), all three run at once, shutdown ends."""
    with pytest.MonkeyPatch.context() as mp:
        wake_cls = _holding_wakes(mp)
        d = Dispatcher(max_inflight=3, idle_timeout=60.0)
        barrier = threading.Barrier(3, timeout=_BARRIER_WAIT)
        futures: list[Future[int]] = []
        try:
            _warm(d, 1)

            def race() -> None:
                assert _flag(d) is not False
                futures.extend(d.submit(k, _barrier_task(barrier)) for k in "bc")
                d.close()

            wake_cls.hook = _race(race)
            futures.insert(0, d.submit("a", _barrier_task(barrier)))
            assert sorted(_results(futures)) == [0, 1, 2]
            assert d.shutdown(TIMEOUT)
            assert _flag(d) is not True
        finally:
            barrier.abort()
            assert d.shutdown(TIMEOUT)


def test_a_pause_while_a_woken_worker_has_not_looked_still_starts_every_lane() -> None:
    """The held worker then sees the pause and sleeps again without passing anything
    on; the pause's end must wake it (and the pool grow) for the three lanes."""
    with pytest.MonkeyPatch.context() as mp:
        wake_cls = _holding_wakes(mp)
        d = Dispatcher(max_inflight=3, idle_timeout=60.0)
        barrier = threading.Barrier(3, timeout=_BARRIER_WAIT)
        futures: list[Future[int]] = []
        try:
            _warm(d, 1)

            def race() -> None:
                futures.extend(d.submit(k, _barrier_task(barrier)) for k in "bc")
                d.pause(0.05)

            wake_cls.hook = _race(race)
            futures.insert(0, d.submit("a", _barrier_task(barrier)))
            assert sorted(_results(futures)) == [0, 1, 2]
            _quiet(d)
        finally:
            barrier.abort()
            assert d.shutdown(TIMEOUT)


def test_jobs_given_back_by_a_failed_grow_run_with_no_further_submit() -> None:
    """As above, but nothing else happens: the worker that could not grow runs the
    jobs it gave back once its own is done."""
    calls: list[int] = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("outbound-worker"):
            calls.append(1)
            raise RuntimeError("can't start new thread")
        _real_start(self)

    with pytest.MonkeyPatch.context() as mp:
        wake_cls = _holding_wakes(mp)
        d = Dispatcher(max_inflight=4, idle_timeout=60.0)
        futures: list[Future[str]] = []
        try:
            _warm(d, 1)
            mp.setattr(threading.Thread, "start", start)
            wake_cls.hook = _race(
                lambda: futures.extend(d.submit(k, lambda k=k: k) for k in "bc")  # type: ignore[misc]
            )
            futures.insert(0, d.submit("a", lambda: "a"))
            assert sorted(_results(futures)) == ["a", "b", "c"]
            assert calls
            _quiet(d)
        finally:
            mp.undo()
            assert d.shutdown(TIMEOUT)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("tasks", ["short"], indirect=True)  # the flag set when forking
def test_fork_while_a_woken_worker_has_not_looked() -> None:
    """The parent's flag is set at the fork: the child starts with a fresh hand-off,
    and runs blocking tasks concurrently; the parent loses nothing."""
    child_status: list[int] = []

    def fork_and_check() -> None:
        assert _flag(d) is not False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded fork"
            pid = os.fork()
        if pid == 0:  # the child: only this thread exists
            ok = False
            try:
                ok = _flag(d) is not True and d.stats().threads == 0
                b = threading.Barrier(4, timeout=_BARRIER_WAIT)
                fs = [d.submit(i, _barrier_task(b)) for i in range(4)]
                ok = ok and sorted(f.result(timeout=TIMEOUT) for f in fs) == [0, 1, 2, 3]
                ok = ok and d.shutdown(TIMEOUT)
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        child_status.append(os.waitstatus_to_exitcode(status))

    with pytest.MonkeyPatch.context() as mp:
        wake_cls = _holding_wakes(mp)
        d = Dispatcher(max_inflight=4, idle_timeout=60.0)
        barrier = threading.Barrier(2, timeout=_BARRIER_WAIT)
        try:
            _warm(d, 2)
            wake_cls.hook = _race(fork_and_check)
            futures = [d.submit(k, _barrier_task(barrier)) for k in "ab"]
            assert sorted(_results(futures)) == [0, 1]
            assert child_status == [0]
            _quiet(d)
        finally:
            barrier.abort()
            assert d.shutdown(TIMEOUT)


# ------------------------------------------------------------------- stress


def test_stress_no_job_left_behind_and_the_flag_clear_when_quiet() -> None:
    """Bursts from two threads over a few keys with tiny idle timeouts, pauses and
    both kinds of Defer, at a 10 µs switch interval: every future completes, and
    once every worker is idle the flag is clear."""
    rng = random.Random(20261201)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for round_ in range(12):
            cap = rng.choice([1, 2, 3, 8])
            d = Dispatcher(
                max_inflight=cap,
                idle_timeout=rng.choice([1e-4, 1e-3, 60.0]),
                queue_size=10_000,
                quantum=rng.choice([1, 16]),
            )

            def task(i: int, defer: float) -> int:
                if defer and current_context().attempt == 1:
                    raise Defer(defer, scope="all" if i % 2 else "lane")
                return i

            futures: list[Future[int]] = []
            lock = threading.Lock()

            def submitter(seed: int) -> None:
                r = random.Random(seed)
                for i in range(300):
                    if r.random() < 0.01:
                        d.pause(r.choice([0.0, 1e-4, 1e-3]))
                    defer = r.choice([0.0, 1e-4]) if r.random() < 0.05 else 0.0
                    f = d.submit(r.randrange(12), task, i, defer)
                    with lock:
                        futures.append(f)

            threads = [threading.Thread(target=submitter, args=(round_ * 10 + j,)) for j in (1, 2)]
            try:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(TIMEOUT)
                _results(futures)
                _quiet(d)
            finally:
                assert d.shutdown(TIMEOUT)
    finally:
        sys.setswitchinterval(old)


# ----------------------------------------------------------------- defects


@pytest.mark.parametrize("tasks", ["long"], indirect=True)
def test_a_woken_worker_that_is_slow_to_run_does_not_hold_back_the_rest_of_a_burst() -> None:
    """8 idle workers, 8 blocking tasks: the worker woken first is held right after its
    wake-up. With one wake-up per job (7ec1caa) the 7 other tasks start on the 7 other
    idle workers at once; with one wake-up at a time none starts until it runs. So
    wake-ups go one at a time only while tasks are short: a burst of blocking tasks
    right after short ones pays this once (see test_the_wake_up_mode_follows_the_tasks)."""
    n = 8
    go = threading.Event()
    started = _Counter()
    release = threading.Event()

    def task() -> None:
        started.hit()
        assert release.wait(TIMEOUT)

    with pytest.MonkeyPatch.context() as mp:
        wake_cls = _holding_wakes(mp)
        d = Dispatcher(max_inflight=n, idle_timeout=60.0)
        try:
            _warm(d, n)

            def hold() -> None:  # the worker woken first, right after its wake-up
                go.wait(TIMEOUT)

            wake_cls.hook = hold
            for i in range(n):
                d.submit(i, task)
            assert started.wait_for(n - 1, timeout=5.0), started.n
        finally:
            go.set()
            release.set()
            assert d.shutdown(TIMEOUT)


def _timer_start_fails_once(failed: list[int]) -> Callable[[threading.Thread], None]:
    """A ``Thread.start`` that fails once for a timer thread (noted in ``failed``)."""

    def start(self: threading.Thread) -> None:
        if self.name.endswith("-timer") and not failed:
            failed.append(1)
            raise RuntimeError("can't start new thread")
        _real_start(self)

    return start


def _deferred_once(defer: bool = True) -> Callable[[], str]:
    """A task that raises ``Defer(0.0)`` on its first attempt (if ``defer``), then returns."""

    def task() -> str:
        if defer and current_context().attempt == 1:
            raise Defer(0.0)
        return "ran"

    return task


@pytest.mark.parametrize("how", ["defer", "pause"])
def test_a_timer_thread_that_cannot_start_once_strands_no_lane(how: str) -> None:
    failed: list[int] = []
    d = Dispatcher(max_inflight=2, idle_timeout=60.0)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(threading.Thread, "start", _timer_start_fails_once(failed))
            if how == "pause":
                d.pause(0.01)
            future = d.submit("k", _deferred_once(how == "defer"))
            assert _until(lambda: bool(failed))
        # drain() retries a start that failed ("it tries again while it waits")
        assert d.drain(5.0)
        assert future.result(timeout=0) == "ran"
    finally:
        d.pause(0.0)  # a timer add: starts the timer, which fires what waits
        assert d.shutdown(TIMEOUT)


def test_a_timer_thread_that_cannot_start_is_started_again_by_the_next_submit() -> None:
    """Only drain() started it again: a deferred lane stayed parked while later
    submits (to other keys) ran, and so did the tasks queued behind it."""
    failed: list[int] = []
    d = Dispatcher(max_inflight=2, idle_timeout=60.0)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(threading.Thread, "start", _timer_start_fails_once(failed))
            deferred = d.submit("k", _deferred_once())
            assert _until(lambda: bool(failed))
            behind = d.submit("k", lambda: "behind")
        assert d.submit("other", lambda: "other").result(timeout=5.0) == "other"
        assert deferred.result(timeout=5.0) == "ran"
        assert behind.result(timeout=5.0) == "behind"
    finally:
        assert d.shutdown(TIMEOUT)


class _InterruptedPop(list):  # type: ignore[type-arg]
    """The idle list: armed, the next pop by the arming thread takes a worker and then
    raises KeyboardInterrupt, as a Ctrl-C handled right after ``idle.pop()`` returned
    (the eval loop checks for signals after a call) would."""

    armed: threading.Thread | None = None
    lost: list[Worker]

    def pop(self, *args: Any) -> Any:
        worker = super().pop(*args)
        if self.armed is threading.current_thread():
            self.armed = None
            self.lost.append(worker)
            raise KeyboardInterrupt
        return worker


@pytest.mark.xfail(
    strict=True,
    reason="pre-existing (7ec1caa too): a Ctrl-C landing in submit right after wake_one "
    "popped an idle worker loses that worker and its permit for good",
)
def test_ctrl_c_after_an_idle_worker_was_popped_loses_no_thread() -> None:
    d = Dispatcher(max_inflight=1, idle_timeout=60.0)
    idle = _InterruptedPop()
    idle.lost = []
    try:
        _warm(d, 1)
        idle.extend(d._handoff.idle)
        d._handoff.idle = idle
        idle.armed = threading.current_thread()
        with pytest.raises(KeyboardInterrupt):
            d.submit("a", lambda: "a")
        assert d.submit("b", lambda: "b").result(timeout=5.0) == "b"
        assert d.shutdown(TIMEOUT)
    finally:
        for worker in idle.lost:  # let the lost thread go, so that none leaks
            if worker not in d._handoff.idle and worker.wake.locked():
                worker.wake.release()
        assert d.shutdown(TIMEOUT)


@pytest.fixture(autouse=True)
def _restore_switch_interval() -> Iterator[None]:
    old = sys.getswitchinterval()
    yield
    sys.setswitchinterval(old)
