"""Adversarial tests of the pace-chosen wake-up mode (``Handoff.pace``, ``chained``).

While tasks are short, a burst of ready jobs wakes one idle worker at a time
and each woken worker passes the wake-up on (``Dispatcher._pass_on``) while
``Handoff.chained`` is set; otherwise every job wakes a worker of its own.
These tests flip the mode in the middle of bursts, hold woken workers right
after they consumed their wake-up, and check that no job is left behind, that
the pool grows no thread a job does not need, and that per-key order holds.

The tests of a long burst after a short spell and of a Ctrl-C in
``wake_one`` failed before the fixes they come with (``chained`` cleared by
a worker going idle; ``waking`` cleared when ``submit`` is interrupted).
"""

from __future__ import annotations

import math
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, cast

import pytest
from dispatch_helpers import TIMEOUT, spinner, stress_mixed
from dispatch_helpers import Counter as _Counter
from dispatch_helpers import on_a_worker as _on_a_worker
from dispatch_helpers import until as _until

import outbound._handoff as handoff_module
import outbound.dispatcher as dispatcher_module
from outbound import Dispatcher
from outbound._lane import Worker


@pytest.fixture(autouse=True)
def _restore_switch_interval() -> Iterator[None]:
    old = sys.getswitchinterval()
    yield
    sys.setswitchinterval(old)


def _pin(mp: pytest.MonkeyPatch, mode: str) -> None:
    """Pin the wake-up mode whatever the tasks take: "short" (one wake-up at a time)
    or "long" (one per job)."""
    mp.setattr(handoff_module, "_short", lambda now, until: mode == "short")


def _warm(d: Dispatcher, threads: int) -> None:
    """Start ``threads`` workers (blocking tasks: the pace stays long) and let them idle."""
    release = threading.Event()
    started = _Counter()

    def task() -> None:
        started.hit()
        assert release.wait(TIMEOUT)

    futures = [d.submit(("warm", i), task) for i in range(threads)]
    assert started.wait_for(threads)
    release.set()
    for f in futures:
        f.result(timeout=TIMEOUT)
    assert _until(lambda: d.stats().idle_threads == threads)


# ------------------------------------------------ woken workers held at a gate


class _GatedWake:
    """A worker's wake lock. While ``passes`` is set, a worker that consumed a
    wake-up (in ``Handoff.sleep`` or ``unlist``) says so (``arrived``) and waits
    for a pass before it clears ``waking`` and looks at ``ready``: a woken thread
    the OS is slow to run."""

    passes: threading.Semaphore | None = None
    arrived: _Counter

    def __init__(self) -> None:
        self.real = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self.real.acquire(blocking, timeout)
        passes = type(self).passes
        if got and passes is not None and _on_a_worker():
            type(self).arrived.hit()
            assert passes.acquire(timeout=TIMEOUT), "a held worker was never let go"
        return got

    def release(self) -> None:
        self.real.release()

    def locked(self) -> bool:
        return self.real.locked()


def _gated_wakes(mp: pytest.MonkeyPatch) -> type[_GatedWake]:
    """Every worker made from now on gets a gated wake lock (a class per test)."""
    wake_cls = cast("type[_GatedWake]", type("GatedWake", (_GatedWake,), {"passes": None}))
    wake_cls.arrived = _Counter()

    class GatedWorker(Worker):
        def __init__(self, job: Any) -> None:
            super().__init__(job)
            wake = wake_cls()
            wake.real.acquire()  # not a wake-up consumed
            self.wake = wake  # type: ignore[assignment]

    mp.setattr(dispatcher_module, "Worker", GatedWorker)
    return wake_cls


@pytest.mark.parametrize("entry", ["submit", "pause end"])
def test_a_long_burst_after_a_short_spell_grows_no_thread_on_as_many_idle_workers(
    entry: str,
) -> None:
    """n idle workers. A short spell (one wake-up in the one-at-a-time mode) sets
    ``chained``; then tasks are long, and a burst of n blocking tasks wakes the n idle
    workers, one per job. The woken threads are slow to run: the first that looks
    takes its job and still sees the others' jobs ready. No wake-up was left to it,
    so it must not pass one on: the others take their jobs, and no thread is started.
    Before the fix (a worker going idle clears ``chained``) it was still set from the
    short spell, and the first worker grew the pool for the n - 1 jobs its woken peers
    were about to take."""
    n = 4
    release = threading.Event()
    started = _Counter()

    def task() -> None:
        started.hit()
        assert release.wait(TIMEOUT)

    with pytest.MonkeyPatch.context() as mp:
        wake_cls = _gated_wakes(mp)
        d = Dispatcher(max_inflight=4 * n, idle_timeout=60.0)
        passes = threading.Semaphore(0)
        try:
            _warm(d, n)
            _pin(mp, "short")  # a short spell: one job woken for in the one-at-a-time mode
            assert d.submit("short", int).result(timeout=TIMEOUT) == 0
            assert _until(lambda: d.stats().idle_threads == n)
            _pin(mp, "long")  # then tasks are long: one wake-up per job
            wake_cls.passes = passes
            if entry == "pause end":
                d.pause(0.02)  # the jobs wait; the timer wakes a worker per job
            futures = [d.submit(i, task) for i in range(n)]
            assert wake_cls.arrived.wait_for(n)  # all n woken, none has looked yet
            passes.release()  # the first one looks
            assert started.wait_for(1)
            passes.release(n - 1)  # then the others
            assert started.wait_for(n)
            assert d.stats().threads == n
            release.set()
            assert [f.result(timeout=TIMEOUT) for f in futures] == [None] * n
        finally:
            wake_cls.passes = None
            passes.release(4 * n)
            release.set()
            assert d.shutdown(TIMEOUT)


def _all_idle(d: Dispatcher) -> bool:
    stats = d.stats()
    return stats.idle_threads == stats.threads


def test_a_long_burst_after_short_tasks_grows_no_thread_unpinned() -> None:
    """As above with nothing pinned nor held: no-op tasks make the pace short, a few
    new keys are submitted while workers idle (one wake-up at a time), one 20 ms task
    makes the pace long again; then bursts of 8 blocking tasks on 8 idle workers must
    start no thread. Before the fix, nearly every burst grew the pool."""
    n = 8
    d = Dispatcher(max_inflight=4 * n, idle_timeout=60.0)
    try:
        _warm(d, n)
        for _ in range(3):
            for _ in range(50):  # bounded: preempted tasks may keep the pace long a while
                futures = [d.submit(i % 4, int) for i in range(200)]
                assert [f.result(timeout=TIMEOUT) for f in futures] == [0] * 200
                if d._handoff.pace < handoff_module.SHORT:
                    break
            else:
                pytest.skip("the pace never became short on this machine")
            assert _until(lambda: _all_idle(d))
            # n threads, or more: on a crowded machine, workers woken for the
            # no-op tasks that are slow to look may grow the pool (a known
            # limit: test_adversarial_late's xfail). What follows grows none.
            idle = d.stats().threads
            assert idle >= n
            # new keys while the pace is short: one wake-up at a time
            assert [d.submit(("new", i), int).result(timeout=TIMEOUT) for i in range(3)] == [0] * 3
            assert d.submit("slow", threading.Event().wait, 0.02).result(timeout=TIMEOUT) is False
            assert d._handoff.fast_until == 0.0  # long: one wake-up per job
            assert _until(lambda: _all_idle(d))
            assert d.stats().threads == idle
            release = threading.Event()
            started = _Counter()

            def task() -> None:
                started.hit()
                assert release.wait(TIMEOUT)

            futures2 = [d.submit(("b", i), task) for i in range(n)]
            try:
                assert started.wait_for(n)
                assert d.stats().threads == idle
            finally:
                release.set()
            assert [f.result(timeout=TIMEOUT) for f in futures2] == [None] * n
            assert _until(lambda: d.stats().idle_threads == d.stats().threads)
    finally:
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("flip", ["short to long", "long to short", "window lapses"])
def test_a_mode_flip_while_woken_workers_have_not_looked_leaves_no_job_behind(
    flip: str,
) -> None:
    """Two idle workers, max_inflight 4: a burst of four tasks that wait for each
    other while every woken worker is held before it looks; the mode flips in the
    middle of the burst. All four must get a thread when the workers are let go one
    at a time (each pass-on, wake-up or grow, is the only way the others start)."""
    n = 4
    barrier = threading.Barrier(n, timeout=TIMEOUT)
    clock = [-math.inf if flip != "long to short" else math.inf]

    with pytest.MonkeyPatch.context() as mp:
        wake_cls = _gated_wakes(mp)
        d = Dispatcher(max_inflight=n, idle_timeout=60.0)
        passes = threading.Semaphore(0)
        try:
            _warm(d, 2)
            mp.setattr(handoff_module, "_monotonic", lambda: clock[0])
            if flip == "window lapses":
                clock[0] = 0.0
                d._handoff.fast_until = 0.0 + handoff_module.FAST_FOR
            wake_cls.passes = passes
            futures = [d.submit(0, barrier.wait)]
            assert wake_cls.arrived.wait_for(1)
            futures.append(d.submit(1, barrier.wait))
            if flip == "short to long":
                clock[0] = math.inf
            elif flip == "long to short":
                clock[0] = -math.inf
            else:
                clock[0] = handoff_module.FAST_FOR + 1.0  # the 50 ms lapsed
            futures += [d.submit(k, barrier.wait) for k in (2, 3)]
            # Let each held worker go, one at a time, as it arrives.
            for i in range(1, 5):
                passes.release()
                if not _until(lambda i=i: wake_cls.arrived.n > i, 0.2):  # type: ignore[misc]
                    break
            wake_cls.passes = None
            passes.release(8)
            assert sorted(f.result(timeout=TIMEOUT) for f in futures) == list(range(n))
            assert d.stats().threads <= n
        finally:
            wake_cls.passes = None
            passes.release(8)
            barrier.abort()
            assert d.shutdown(TIMEOUT)


# ------------------------------------------------ a Ctrl-C inside wake_one


class _InterruptedRelease:
    """A worker's wake lock: armed, the next release from the arming thread raises
    KeyboardInterrupt before releasing, as a Ctrl-C handled right before the call
    to ``release`` (after ``waking`` was set) would."""

    armed: threading.Thread | None = None
    lost: list[_InterruptedRelease]

    def __init__(self) -> None:
        self.real = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.real.acquire(blocking, timeout)

    def release(self) -> None:
        cls = type(self)
        if cls.armed is threading.current_thread():
            cls.armed = None
            cls.lost.append(self)
            raise KeyboardInterrupt
        self.real.release()

    def locked(self) -> bool:
        return self.real.locked()


def test_ctrl_c_after_waking_was_set_leaves_later_submits_a_thread() -> None:
    """Two idle workers, tasks short. A Ctrl-C lands in submit("a") right after
    wake_one set ``waking``, before it released the popped worker: submit raises and
    "a" is cancelled (that one worker is lost: a known, older defect). "b", submitted
    next, must still run on the other idle worker, as it did before ``waking``
    existed. Before the fix (submit clears ``waking`` when interrupted) wake_one saw
    it set forever and woke nobody."""
    wake_cls = cast(
        "type[_InterruptedRelease]",
        type("InterruptedRelease", (_InterruptedRelease,), {"armed": None}),
    )
    wake_cls.lost = []
    with pytest.MonkeyPatch.context() as mp:

        class Interrupted(Worker):
            def __init__(self, job: Any) -> None:
                super().__init__(job)
                wake = wake_cls()
                wake.real.acquire()
                self.wake = wake  # type: ignore[assignment]

        mp.setattr(dispatcher_module, "Worker", Interrupted)
        d = Dispatcher(max_inflight=2, idle_timeout=60.0)
        try:
            _warm(d, 2)
            _pin(mp, "short")
            wake_cls.armed = threading.current_thread()
            with pytest.raises(KeyboardInterrupt):
                d.submit("a", lambda: "a")
            assert d.submit("b", lambda: "b").result(timeout=1.0) == "b"
        finally:
            wake_cls.armed = None
            _pin(mp, "long")
            for wake in wake_cls.lost:  # let the lost thread go, so that none leaks
                wake.real.release()
            with d._lock:
                d._handoff.waking = False
                d._handoff.wake_all()
            assert d.shutdown(TIMEOUT)


# ------------------------------------------------ stress: the mode flips constantly


def _flipper(d: Dispatcher, stop: threading.Event, seed: int) -> threading.Thread:
    """A thread that keeps flipping the mode (and the pace) under the dispatcher."""
    rng = random.Random(seed)

    def run() -> None:
        h = d._handoff
        while not stop.is_set():
            r = rng.random()
            if r < 0.4:
                h.fast_until = math.inf
            elif r < 0.8:
                h.fast_until = 0.0
            else:
                h.pace = rng.choice([0.0, 1.0])
            stop.wait(rng.choice([0.0, 0.0, 0.0005]))

    t = threading.Thread(target=run, name="flipper", daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("variant", ["plain", "retiring", "hooks raise", "tasks raise"])
def test_bursts_with_the_mode_flipping_constantly_leave_nothing_behind(variant: str) -> None:
    """A thread flips the mode all the time (fast_until, pace) while two submitters
    send mixes of no-op, briefly blocking, deferring and raising tasks over few keys,
    and the main thread sends bursts of blocking tasks that wait for each other up to
    max_inflight. Every future resolves with no further submit, each key's tasks run
    in order and one at a time, and the pool never passes max_inflight."""
    stress_mixed(
        8,
        variant,
        lambda d, stop: [_flipper(d, stop, seed=hash(variant) & 0xFFFF)],
        hook_rate=1.0,
        queue_size=1024,
        per_submitter=300,
        keys=6,
        rounds=3,
        iterations=200,
        check_most=True,
    )


@pytest.mark.parametrize("mode", ["short", "long"])
def test_blocking_bursts_from_idle_workers_with_flips_all_start(mode: str) -> None:
    """Bursts of 12 tasks that wait for each other on a pool that keeps some
    workers idle, with the mode pinned one way then flipped the other mid-burst
    by a racing thread: every burst gets its 12 threads."""
    n = 12
    d = Dispatcher(max_inflight=n, idle_timeout=60.0)
    sys.setswitchinterval(1e-5)
    try:
        rng = random.Random(3)
        for round_ in range(100):
            h = d._handoff
            h.fast_until = math.inf if mode == "short" else 0.0
            flip = threading.Thread(
                target=lambda: setattr(h, "fast_until", 0.0 if mode == "short" else math.inf)
            )
            barrier = threading.Barrier(n, timeout=TIMEOUT)
            futures: list[Future[int]] = []
            cut = rng.randrange(n)
            for i in range(n):
                if i == cut:
                    flip.start()
                futures.append(d.submit(("r", round_, i), barrier.wait))
            flip.join(TIMEOUT)
            assert sorted(f.result(timeout=TIMEOUT) for f in futures) == list(range(n))
            assert d.stats().threads <= n
            short = [d.submit(rng.randrange(3), int) for _ in range(rng.randrange(40))]
            assert [f.result(timeout=TIMEOUT) for f in short] == [0] * len(short)
    finally:
        sys.setswitchinterval(0.005)
        assert d.shutdown(TIMEOUT)


@pytest.mark.parametrize("how", ["close", "force_close", "drain", "pause"])
def test_lifecycle_calls_while_a_short_burst_is_chained(how: str) -> None:
    """Short mode pinned, workers held right after their wake-up while a burst of
    keyed tasks is queued; then close(), force_close(), drain() or a pause lands,
    and the workers are let go: every future resolves and shutdown() ends."""
    n = 6
    with pytest.MonkeyPatch.context() as mp:
        wake_cls = _gated_wakes(mp)
        d = Dispatcher(max_inflight=3, idle_timeout=60.0)
        passes = threading.Semaphore(0)
        try:
            _warm(d, 2)
            _pin(mp, "short")
            wake_cls.passes = passes
            futures = [d.submit(i % 4, lambda i=i: i) for i in range(n)]  # type: ignore[misc]
            assert wake_cls.arrived.wait_for(1)
            if how == "close":
                d.close()
            elif how == "force_close":
                d.force_close()
            elif how == "pause":
                d.pause(0.02)
            wake_cls.passes = None
            passes.release(16)
            if how == "drain":
                assert d.drain(TIMEOUT)
            for i, f in enumerate(futures):
                if how == "force_close":
                    assert f.cancelled() or f.result(timeout=TIMEOUT) == i
                else:
                    assert f.result(timeout=TIMEOUT) == i
            assert d.shutdown(TIMEOUT)
        finally:
            wake_cls.passes = None
            passes.release(16)
            assert d.shutdown(TIMEOUT)


# ---------------------------------------------- a woken worker late to look


@pytest.mark.parametrize("late", [True, False])
def test_a_late_woken_worker_wakes_one_per_job_left_at_once(late: bool) -> None:
    """Tasks short, 8 idle workers, 8 blocking tasks: one worker is woken, and the
    others' wake-ups are left to it. Held before it looks, it is late (or, with its
    wake-up dated in the future, not): let go, it wakes the 7 others at once, and
    the mode turns long; not late, it wakes one, which passes the wake-up on."""
    n = 8
    release = threading.Event()
    with pytest.MonkeyPatch.context() as mp:
        wake_cls = _gated_wakes(mp)
        d = Dispatcher(max_inflight=n, idle_timeout=60.0)
        passes = threading.Semaphore(0)
        try:
            _warm(d, n)
            _pin(mp, "short")
            wake_cls.arrived = _Counter()
            wake_cls.passes = passes
            futures = [d.submit(i, release.wait, TIMEOUT) for i in range(n)]
            assert wake_cls.arrived.wait_for(1)
            assert wake_cls.arrived.n == 1  # the others' wake-ups were left to it
            d._handoff.fast_until = math.inf
            d._handoff.woke_at = time.monotonic() + (-1.0 if late else 3600.0)
            passes.release()  # the first worker looks
            if late:
                assert wake_cls.arrived.wait_for(n)  # the 7 others woken at once
                assert d._handoff.fast_until == 0.0
            else:
                assert wake_cls.arrived.wait_for(2)
                assert not _until(lambda: wake_cls.arrived.n > 2, 0.2)  # one at a time
                assert d._handoff.fast_until == math.inf
            wake_cls.passes = None
            passes.release(2 * n)
            release.set()
            assert all(f.result(timeout=TIMEOUT) for f in futures)
            assert d.stats().threads == n
        finally:
            wake_cls.passes = None
            passes.release(2 * n)
            release.set()
            assert d.shutdown(TIMEOUT)


def test_blocking_tasks_after_short_ones_all_start_beside_a_cpu_bound_thread() -> None:
    """Nothing pinned: after short tasks, 32 tasks that wait for each other start
    while a pure-Python loop holds the GIL in turns (woken workers are late)."""
    n = 32
    stop = threading.Event()
    d = Dispatcher(max_inflight=n, idle_timeout=60.0, queue_size=1000)
    spinning: threading.Thread | None = None
    try:
        for _ in range(3):
            short = [d.submit(i % 4, int) for i in range(400)]
            assert [f.result(timeout=TIMEOUT) for f in short] == [0] * 400
            if spinning is None:
                spinning = spinner(stop)
            barrier = threading.Barrier(n, timeout=TIMEOUT)
            futures = [d.submit(("b", i), barrier.wait) for i in range(n)]
            assert sorted(f.result(timeout=TIMEOUT) for f in futures) == list(range(n))
    finally:
        stop.set()
        if spinning is not None:
            spinning.join(TIMEOUT)
        assert d.shutdown(TIMEOUT)
