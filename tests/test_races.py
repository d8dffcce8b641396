"""Hard concurrency: randomized stress, the lane refill race, fairness, narrow windows."""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from concurrent.futures import CancelledError, Future

import pytest

import outbound.dispatcher as dispatcher_module
from outbound import Defer, Dispatcher, QueueFull, State, current_context
from outbound._lane import Job, Worker

TIMEOUT = 10.0


class Tracker:
    """Counts running tasks per key and overall, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[object, int] = defaultdict(int)
        self.inflight = 0
        self.max_inflight = 0
        self.overlaps: list[object] = []
        self.order: dict[object, list[int]] = defaultdict(list)

    def enter(self, key: object) -> None:
        with self.lock:
            self.running[key] += 1
            if self.running[key] > 1:
                self.overlaps.append(key)
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)

    def leave(self, key: object, seq: int | None = None) -> None:
        with self.lock:
            if seq is not None:
                self.order[key].append(seq)
            self.running[key] -= 1
            self.inflight -= 1


# -------------------------------------------------------------------- stress


@pytest.mark.parametrize(
    ("max_inflight", "quantum", "seed"), [(4, 16, 1), (3, 1, 2), (1, 2, 3), (8, 4, 4)]
)
def test_randomized_stress(max_inflight: int, quantum: int, seed: int) -> None:
    """Several submitters, many keys, random failures and defers: per-key order, no
    overlap within a key, the max_inflight cap, every future resolved right."""
    n_threads, n_keys, per_thread = 4, 40, 1200
    tracker = Tracker()
    key_locks = {k: threading.Lock() for k in range(n_keys)}
    next_seq = dict.fromkeys(range(n_keys), 0)
    # (key, seq, expected outcome, future) for every accepted task
    accepted: list[tuple[int, int, str, Future[object]]] = []
    rejected: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads, timeout=TIMEOUT)

    def task(key: int, seq: int, kind: str, spin: int) -> object:
        if kind == "defer" and current_context().attempt == 1:
            raise Defer(0.0)
        tracker.enter(key)
        try:
            assert current_context().key == key
            sum(range(spin))  # vary the run time
            if kind == "fail":
                raise ValueError(key, seq)
            return (key, seq)
        finally:
            tracker.leave(key, seq)

    def submitter(index: int) -> None:
        rng = random.Random(seed * 100 + index)
        try:
            barrier.wait()
            for _ in range(per_thread):
                key = rng.randrange(n_keys)
                kind = rng.choices(["ok", "fail", "defer"], [90, 5, 5])[0]
                with key_locks[key]:  # makes the submit order of one key known
                    seq = next_seq[key]
                    try:
                        fut = d.submit(key, task, key, seq, kind, rng.randrange(200))
                    except QueueFull:
                        rejected.append(key)
                        continue
                    next_seq[key] = seq + 1
                accepted.append((key, seq, kind, fut))
        except BaseException as exc:
            errors.append(exc)

    d = Dispatcher(max_inflight=max_inflight, queue_size=16, quantum=quantum)
    try:
        threads = [threading.Thread(target=submitter, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive()
        assert errors == []
        for key, seq, kind, fut in accepted:
            if kind == "fail":
                exc = fut.exception(timeout=TIMEOUT)
                assert isinstance(exc, ValueError)
                assert exc.args == (key, seq)
            else:
                assert fut.result(timeout=TIMEOUT) == (key, seq)
        assert d.drain(TIMEOUT)
        s = d.stats()
        assert (s.lanes, s.queued, s.running, s.parked) == (0, 0, 0, 0)
        assert s.threads <= max_inflight
    finally:
        assert d.shutdown(TIMEOUT)
    assert len(accepted) + len(rejected) == n_threads * per_thread
    assert tracker.overlaps == []
    assert 1 <= tracker.max_inflight <= max_inflight
    for key in range(n_keys):
        assert tracker.order[key] == list(range(next_seq[key]))


def test_max_inflight_cap_reached_not_exceeded() -> None:
    """With many blocked lanes, exactly max_inflight tasks run; the rest wait."""
    cap = 3
    tracker = Tracker()
    barrier = threading.Barrier(cap + 1, timeout=TIMEOUT)
    release = threading.Event()

    def task(key: int) -> int:
        tracker.enter(key)
        try:
            if key < cap:
                barrier.wait()
                assert release.wait(TIMEOUT)
            return key
        finally:
            tracker.leave(key)

    d = Dispatcher(max_inflight=cap)
    try:
        futs = [d.submit(k, task, k) for k in range(30)]
        barrier.wait()  # the first `cap` lanes are running
        s = d.stats()
        assert (s.running, s.queued, s.threads) == (cap, 30 - cap, cap)
        release.set()
        assert [f.result(timeout=TIMEOUT) for f in futs] == list(range(30))
    finally:
        release.set()
        assert d.shutdown(TIMEOUT)
    assert tracker.max_inflight == cap


# ------------------------------------------------------------ the refill race


def test_lane_refill_race_lockstep() -> None:
    """Submit task i+1 exactly as task i returns and its worker finds the lane empty,
    thousands of times, on two keys at once."""
    rounds = 2500
    tracker = Tracker()
    errors: list[BaseException] = []

    def run_key(key: str) -> None:
        barrier = threading.Barrier(2, timeout=TIMEOUT)

        def task(i: int) -> int:
            tracker.enter(key)
            barrier.wait()  # meet the submitter, then return at once
            tracker.leave(key, i)
            return i

        try:
            futs = []
            for i in range(rounds):
                futs.append(d.submit(key, task, i))
                barrier.wait()
            assert [f.result(timeout=TIMEOUT) for f in futs] == list(range(rounds))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    d = Dispatcher(max_inflight=4, queue_size=4)
    try:
        threads = [threading.Thread(target=run_key, args=(k,)) for k in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * TIMEOUT)
            assert not t.is_alive()
        assert errors == []
        assert d.drain(TIMEOUT)
        assert d.stats().lanes == 0
    finally:
        assert d.shutdown(TIMEOUT)
    assert tracker.overlaps == []
    assert tracker.order["a"] == list(range(rounds))
    assert tracker.order["b"] == list(range(rounds))


def test_lane_refill_race_free_running() -> None:
    """Trivial tasks submitted as fast as possible: the lane empties and refills all the
    time; order holds and tasks of a key never overlap."""
    per_key = 4000
    tracker = Tracker()
    errors: list[BaseException] = []
    barrier = threading.Barrier(3, timeout=TIMEOUT)

    def task(key: int, i: int) -> int:
        tracker.enter(key)
        tracker.leave(key, i)
        return i

    def submitter(key: int) -> None:
        try:
            barrier.wait()
            futs = [d.submit(key, task, key, i) for i in range(per_key)]
            assert [f.result(timeout=TIMEOUT) for f in futs] == list(range(per_key))
        except BaseException as exc:
            errors.append(exc)

    d = Dispatcher(max_inflight=2, queue_size=per_key)
    try:
        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * TIMEOUT)
            assert not t.is_alive()
        assert errors == []
    finally:
        assert d.shutdown(TIMEOUT)
    assert tracker.overlaps == []
    assert tracker.max_inflight <= 2
    for key in range(3):
        assert tracker.order[key] == list(range(per_key))


# ------------------------------------------------------------------ fairness


@pytest.mark.parametrize("quantum", [1, 4, 16])
def test_hot_key_does_not_starve_a_later_key(quantum: int) -> None:
    """max_inflight=1, thousands queued on a hot key: a key submitted later starts
    after at most about `quantum` more hot tasks."""
    hot_count = 3000
    ran: list[str] = []
    started, gate = threading.Event(), threading.Event()

    def first_hot() -> None:
        ran.append("hot")
        started.set()
        assert gate.wait(TIMEOUT)

    d = Dispatcher(max_inflight=1, queue_size=hot_count, quantum=quantum)
    try:
        hot = [d.submit("hot", first_hot)]
        assert started.wait(TIMEOUT)
        hot += [d.submit("hot", ran.append, "hot") for _ in range(hot_count - 1)]
        cold = d.submit("cold", ran.append, "cold")
        gate.set()
        cold.result(timeout=TIMEOUT)
        for f in hot:
            f.result(timeout=TIMEOUT)
    finally:
        gate.set()
        assert d.shutdown(TIMEOUT)
    hot_before_cold = ran.index("cold")
    # the running hot task counts toward its turn; allow one more for slack
    assert 1 <= hot_before_cold <= quantum + 1
    assert len(ran) == hot_count + 1


def test_two_hot_keys_alternate_in_quanta() -> None:
    quantum = 4
    ran: list[str] = []
    started, gate = threading.Event(), threading.Event()

    def first() -> None:
        ran.append("a")
        started.set()
        assert gate.wait(TIMEOUT)

    d = Dispatcher(max_inflight=1, queue_size=200, quantum=quantum)
    try:
        futs = [d.submit("a", first)]
        assert started.wait(TIMEOUT)
        futs += [d.submit("a", ran.append, "a") for _ in range(99)]
        futs += [d.submit("b", ran.append, "b") for _ in range(100)]
        gate.set()
        for f in futs:
            f.result(timeout=TIMEOUT)
    finally:
        gate.set()
        assert d.shutdown(TIMEOUT)
    runs: list[int] = []
    for i, key in enumerate(ran):
        if i and ran[i - 1] == key:
            runs[-1] += 1
        else:
            runs.append(1)
    # every run but the last (one key left alone) is at most one quantum
    assert runs[:-1]
    assert max(runs[:-1]) <= quantum
    assert len(runs) >= 2 * 100 // quantum - 1


def test_many_lanes_all_progress_with_one_permit() -> None:
    """50 lanes of 20 tasks on max_inflight=1, quantum=2: every lane starts within the
    first round of turns, not after others drained."""
    quantum, n_keys, per_key = 2, 50, 20
    ran: list[int] = []
    started, gate = threading.Event(), threading.Event()

    def first() -> None:
        ran.append(0)
        started.set()
        assert gate.wait(TIMEOUT)

    d = Dispatcher(max_inflight=1, queue_size=per_key, quantum=quantum)
    try:
        futs = [d.submit(0, first)]
        assert started.wait(TIMEOUT)
        futs += [d.submit(0, ran.append, 0) for _ in range(per_key - 1)]
        for k in range(1, n_keys):
            futs += [d.submit(k, ran.append, k) for _ in range(per_key)]
        gate.set()
        for f in futs:
            f.result(timeout=TIMEOUT)
    finally:
        gate.set()
        assert d.shutdown(TIMEOUT)
    first_round = ran[: n_keys * quantum]
    assert set(first_round) == set(range(n_keys))


# ----------------------------------------------------- narrow windows (white box)


class _RacingEvent(threading.Event):
    """An Event that can run a callback right after the next is_set() read."""

    def __init__(self) -> None:
        super().__init__()
        self.after_check: object = None

    def is_set(self) -> bool:
        value = super().is_set()
        callback, self.after_check = self.after_check, None
        if callable(callback):
            callback()
        return value


def test_force_close_between_defer_and_park() -> None:
    """force_close lands after the worker checked `cancelled` for a Defer but before it
    parked the lane: the future must be cancelled at once, the task never run again."""
    attempts: list[int] = []
    d = Dispatcher()
    racing = _RacingEvent()
    d._cancel = racing  # white box: open the window on purpose

    def task() -> str:
        attempts.append(current_context().attempt)
        if current_context().attempt == 1:
            racing.after_check = d.force_close
            raise Defer(60.0)
        return "re-run after force_close"

    try:
        fut = d.submit("k", task)
        # resolved by the worker right after the task returned; 1 s is generous
        with pytest.raises(CancelledError):
            fut.result(timeout=1.0)
        assert attempts == [1]
        assert d.drain(TIMEOUT)
    finally:
        d.force_close()  # drops the parked lane if the bug left one
        assert d.shutdown(TIMEOUT)


class _RacingWake:
    """Stands in for a worker's wake lock: its next timed acquire() lets `race` run
    (as if it came right after the idle timeout fired) and then reports a timeout."""

    def __init__(self, real: threading.Lock, race: object) -> None:
        self._real = real
        self._race = race

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        race, self._race = self._race, None
        if timeout != -1 and callable(race):
            race()
            return False
        return self._real.acquire(blocking, timeout)

    def release(self) -> None:
        self._real.release()


def test_idle_timeout_racing_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() wakes an idle worker just as its idle timeout fires: the worker exits
    cleanly (no exception in the thread) and the thread count goes back to 0."""
    thread_errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: thread_errors.append(args.exc_value))
    d = Dispatcher(max_inflight=1)
    raced = threading.Event()

    def race() -> None:
        raced.set()
        d.close()

    class RacingWorker(Worker):
        __slots__ = ()

        def __init__(self, job: Job | None) -> None:
            super().__init__(job)
            self.wake = _RacingWake(self.wake, race)  # type: ignore[assignment]

    monkeypatch.setattr(dispatcher_module, "Worker", RacingWorker)
    try:
        assert d.submit("k", lambda: 1).result(timeout=TIMEOUT) == 1
        assert raced.wait(TIMEOUT)  # the worker went idle and the race ran
    finally:
        assert d.shutdown(TIMEOUT)
    assert d.state is State.CLOSED
    assert thread_errors == []
    assert d.stats().threads == 0
