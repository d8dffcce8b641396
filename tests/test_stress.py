"""Stress under a short GIL switch interval: exactly once, in order, no overlap, all resolved.

The interpreter switches threads every 10-50 microseconds here (the default
is 5 ms), so the windows between an unlocked read and the action it decides
are hit thousands of times a run. Each test counts violations of the
README's guarantees and asserts there are none:

- every accepted task runs exactly once (a Defer re-run is the same run),
  or, after ``force_close``, is cancelled and never runs;
- tasks of one key start in submission order and never overlap;
- every future is resolved; ``shutdown()`` is True only when all are.

``OUTBOUND_SOAK=N`` multiplies the sizes (``OUTBOUND_SOAK=10`` runs about a
million tasks); the default keeps the file within a few seconds.
"""

from __future__ import annotations

import os
import random
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

import pytest

from outbound import Defer, Dispatcher, DispatcherClosed, KeyedExecutor, QueueFull, current_context

SOAK = max(1.0, float(os.environ.get("OUTBOUND_SOAK", "1")))
TIMEOUT = 30.0 * SOAK


@pytest.fixture(params=[1e-5, 5e-5], ids=["switch10us", "switch50us"])
def switch_interval(request: pytest.FixtureRequest) -> Iterator[float]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(request.param)
    try:
        yield request.param
    finally:
        sys.setswitchinterval(old)


@dataclass
class Ledger:
    """What ran, per key, checked against what was accepted."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    running: dict[object, int] = field(default_factory=lambda: defaultdict(int))
    started: dict[object, list[int]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[object, list[int]] = field(default_factory=lambda: defaultdict(list))
    runs: dict[tuple[object, int], int] = field(default_factory=lambda: defaultdict(int))
    violations: list[str] = field(default_factory=list)
    # Set when `milestone` tasks have started.
    milestone: int = 0
    reached: threading.Event = field(default_factory=threading.Event)
    total: int = 0

    def task(self, key: object, seq: int, kind: str) -> tuple[object, int]:
        ctx = current_context()
        with self.lock:
            self.running[key] += 1
            if self.running[key] != 1:
                self.violations.append(f"overlap on {key!r} at {seq}")
            if ctx.attempt == 1:
                self.started[key].append(seq)
                self.runs[key, seq] += 1
                self.total += 1
                if self.total == self.milestone:
                    self.reached.set()
                if self.runs[key, seq] != 1:
                    self.violations.append(f"{key!r}/{seq} ran twice")
        try:
            if kind == "defer" and ctx.attempt == 1:
                raise Defer(0.0)
            if kind == "fail":
                raise ValueError(key, seq)
            if kind == "spin":
                sum(range(200))
            elif kind == "pace":  # bytecode, so the interpreter may switch threads inside
                for _ in range(30):
                    pass
            return key, seq
        finally:
            with self.lock:
                self.running[key] -= 1
                if kind != "defer" or ctx.attempt > 1:
                    self.finished[key].append(seq)

    def check_order(self, accepted: dict[object, list[int]], *, complete: bool) -> None:
        for key, seqs in accepted.items():
            started = self.started.get(key, [])
            if started != seqs[: len(started)]:
                self.violations.append(f"{key!r} started out of order: {started[:20]}...")
            if complete and started != seqs:
                self.violations.append(f"{key!r}: {len(started)} of {len(seqs)} started")


def _report(name: str, switch_interval: float, tasks: int, violations: list[str]) -> None:
    """One line per run, shown with ``pytest -s`` (the soak's figures)."""
    print(
        f"\nstress {name}: {tasks} tasks, switch interval {switch_interval:g} s, "
        f"{len(violations)} violations"
    )


def _submitters(
    d: Dispatcher,
    ledger: Ledger,
    *,
    threads: int,
    per_thread: int,
    keys_per_thread: int,
    seed: int,
    stop: threading.Event | None = None,
) -> tuple[dict[object, list[int]], list[tuple[object, int, str, Future[Any]]], list[str]]:
    """Each thread owns its keys (so their submit order is known) and submits in bursts."""
    accepted: dict[object, list[int]] = defaultdict(list)
    futures: list[tuple[object, int, str, Future[Any]]] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads, timeout=TIMEOUT)

    def run(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        keys = [(index, k) for k in range(keys_per_thread)]
        seqs = dict.fromkeys(keys, 0)
        mine: list[tuple[object, int, str, Future[Any]]] = []
        barrier.wait()
        for _ in range(per_thread):
            if stop is not None and stop.is_set():
                break
            key = rng.choice(keys)
            kind = rng.choices(["ok", "spin", "fail", "defer", "bad-callback"], [70, 15, 5, 5, 5])[
                0
            ]
            seq = seqs[key]
            try:
                fut = d.submit(key, ledger.task, key, seq, kind)
            except QueueFull:
                continue
            except DispatcherClosed:
                break
            seqs[key] = seq + 1
            if kind == "bad-callback":
                fut.add_done_callback(lambda f: (_ for _ in ()).throw(SystemExit("callback")))
            mine.append((key, seq, kind, fut))
        with lock:
            for item in mine:
                accepted[item[0]].append(item[1])
                futures.append(item)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(TIMEOUT)
        if t.is_alive():
            errors.append("a submitter hung")
    for seqs in accepted.values():
        seqs.sort()
    return accepted, futures, errors


def _check_outcome(
    key: object, seq: int, kind: str, fut: Future[Any], violations: list[str]
) -> str:
    """'ran' or 'cancelled'; anything else is a violation."""
    if not fut.done():
        violations.append(f"{key!r}/{seq} future pending")
        return "pending"
    if fut.cancelled():
        return "cancelled"
    exc = fut.exception()
    if kind == "fail":
        if not (isinstance(exc, ValueError) and exc.args == (key, seq)):
            violations.append(f"{key!r}/{seq} wrong failure {exc!r}")
    elif exc is not None:
        if isinstance(exc, CancelledError):
            return "cancelled"
        violations.append(f"{key!r}/{seq} failed with {exc!r}")
    elif fut.result() != (key, seq):
        violations.append(f"{key!r}/{seq} wrong result {fut.result()!r}")
    return "ran"


@pytest.mark.parametrize(("max_inflight", "quantum"), [(2, 1), (8, 16)])
def test_every_task_runs_exactly_once_in_order(
    switch_interval: float, max_inflight: int, quantum: int
) -> None:
    """The refill race's own shape: few keys per thread, short tasks, lanes that
    empty and refill all the time; callbacks that raise SystemExit; defers."""
    ledger = Ledger()
    d = Dispatcher(max_inflight=max_inflight, queue_size=64, quantum=quantum)
    try:
        accepted, futures, errors = _submitters(
            d, ledger, threads=3, per_thread=int(15000 * SOAK), keys_per_thread=4, seed=quantum
        )
        assert d.shutdown(TIMEOUT)
    finally:
        d.force_close()
        d.shutdown(TIMEOUT)
    violations = list(errors)
    outcomes = [_check_outcome(*item, violations) for item in futures]
    assert outcomes.count("ran") == len(futures), violations[:5]
    ledger.check_order(accepted, complete=True)
    violations += ledger.violations
    assert violations == []
    assert sum(len(v) for v in ledger.started.values()) == len(futures)
    _report("exactly-once", switch_interval, len(futures), violations)


def test_force_close_mid_stream_runs_a_prefix_and_cancels_the_rest(switch_interval: float) -> None:
    """force_close lands while submitters and workers are busy: each task either ran
    once or is cancelled and never ran; per key, what ran is a prefix; shutdown() is
    True only with every future resolved."""
    ledger = Ledger()
    d = Dispatcher(max_inflight=4, queue_size=64, quantum=4)
    stop = threading.Event()
    closer_done = threading.Event()
    shutdown_results: list[tuple[bool, int]] = []

    ledger.milestone = int(3000 * SOAK)

    def closer() -> None:
        ledger.reached.wait(TIMEOUT)  # let work build up, then close
        d.force_close()
        stop.set()
        closer_done.set()

    def shutter() -> None:
        assert closer_done.wait(TIMEOUT)
        shutdown_results.append((d.shutdown(TIMEOUT), 0))

    helpers = [threading.Thread(target=closer), threading.Thread(target=shutter)]
    for t in helpers:
        t.start()
    try:
        accepted, futures, errors = _submitters(
            d, ledger, threads=3, per_thread=int(15000 * SOAK), keys_per_thread=6, seed=7, stop=stop
        )
    finally:
        # Submitters that met full lanes often may have had fewer tasks
        # accepted than the milestone: then the closer goes once they are done.
        ledger.reached.set()
        stop.set()
        for t in helpers:
            t.join(TIMEOUT)
        d.force_close()
        assert d.shutdown(TIMEOUT)
    violations = list(errors)
    assert shutdown_results
    assert shutdown_results[0][0] is True
    outcomes: defaultdict[str, int] = defaultdict(int)
    for key, seq, kind, fut in futures:
        outcome = _check_outcome(key, seq, kind, fut, violations)
        outcomes[outcome] += 1
        ran = ledger.runs.get((key, seq), 0)
        if outcome == "ran" and ran != 1:
            violations.append(f"{key!r}/{seq} resolved as run but ran {ran} times")
        if outcome == "cancelled" and ran and kind != "defer":
            violations.append(f"{key!r}/{seq} cancelled but ran")
    ledger.check_order(accepted, complete=False)
    violations += ledger.violations
    assert violations == []
    assert outcomes["ran"] > 0
    _report("force-close mid-stream", switch_interval, len(futures), violations)


def test_keyed_and_keyless_mixed_with_shutdown_cancel_futures(switch_interval: float) -> None:
    """KeyedExecutor with keyed and unordered tasks, shut down with cancel_futures."""
    ex = KeyedExecutor(max_workers=4)
    ledger = Ledger()
    keyed: list[tuple[object, int, str, Future[Any]]] = []
    keyless: list[tuple[int, Future[int]]] = []
    accepted: dict[object, list[int]] = defaultdict(list)
    rng = random.Random(3)
    for i in range(int(15000 * SOAK)):
        if rng.random() < 0.3:
            keyless.append((i, ex.submit(pow, i, 1)))
        else:
            key = rng.randrange(8)
            seq = len(accepted[key])
            accepted[key].append(seq)
            keyed.append((key, seq, "ok", ex.submit_keyed(key, ledger.task, key, seq, "ok")))
    ex.shutdown(wait=True, cancel_futures=True)
    violations: list[str] = []
    for item in keyed:
        _check_outcome(*item, violations)
    for i, f in keyless:
        if not f.done():
            violations.append(f"keyless {i} pending")
        elif not f.cancelled() and f.result() != i:
            violations.append(f"keyless {i} wrong result")
    ledger.check_order(accepted, complete=False)
    violations += ledger.violations
    assert violations == []
    _report("keyed+keyless", switch_interval, len(keyed) + len(keyless), violations)


def test_lanes_that_empty_as_the_next_task_arrives(switch_interval: float) -> None:
    """Paced so that a lane's last task ends about when the next one of its key is
    submitted: the refill window (an owner taking a task just appended) opens on
    almost every task. Two submitters, four keys each."""
    ledger = Ledger()
    per_thread = int(12000 * SOAK)
    accepted: dict[object, list[int]] = defaultdict(list)
    futures: list[tuple[object, int, str, Future[Any]]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    d = Dispatcher(max_inflight=8, queue_size=per_thread)

    def submitter(index: int) -> None:
        rng = random.Random(index)
        mine = []
        barrier.wait()
        for i in range(per_thread):
            key = (index, i % 4)
            mine.append((key, i // 4, "pace", d.submit(key, ledger.task, key, i // 4, "pace")))
            for _ in range(rng.randrange(20, 40)):  # about one task's time per key
                pass
        with lock:
            for key, seq, kind, fut in mine:
                accepted[key].append(seq)
                futures.append((key, seq, kind, fut))

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert d.shutdown(TIMEOUT)
    finally:
        d.force_close()
        d.shutdown(TIMEOUT)
    violations: list[str] = []
    for item in futures:
        if _check_outcome(*item, violations) != "ran":
            violations.append(f"{item[0]!r}/{item[1]} not run")
    for seqs in accepted.values():
        seqs.sort()
    ledger.check_order(accepted, complete=True)
    violations += ledger.violations
    assert violations == []
    assert len(futures) == 2 * per_thread
    _report("paced refill", switch_interval, len(futures), violations)


def test_worker_threads_failing_to_start_lose_and_repeat_nothing(
    switch_interval: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread.start fails at random, before the thread runs or after it began, and
    the pool empties between bursts so threads start all the time: every accepted
    task runs once, in order, at most max_inflight at once; a submit that raised left
    nothing that runs; no thread dies of the bookkeeping (a permit given back twice)."""
    real_start = threading.Thread.start
    rng = random.Random(11)
    rng_lock = threading.Lock()
    injected = [0, 0]
    thread_errors: list[BaseException] = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("faulty-worker"):
            with rng_lock:
                r = rng.random()
            if r < 0.1:
                injected[0] += 1
                raise RuntimeError("can't start new thread")
            if r < 0.2:
                injected[1] += 1
                real_start(self)
                raise RuntimeError("began, then failed")
        real_start(self)

    def excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            thread_errors.append(args.exc_value)

    cap = 3
    ledger = Ledger()
    inflight = [0, 0]  # now, most

    def task(key: object, seq: int, kind: str) -> tuple[object, int]:
        with ledger.lock:
            inflight[0] += 1
            inflight[1] = max(inflight[1], inflight[0])
        try:
            return ledger.task(key, seq, kind)
        finally:
            with ledger.lock:
                inflight[0] -= 1

    monkeypatch.setattr(threading, "excepthook", excepthook)
    monkeypatch.setattr(threading.Thread, "start", start)
    d = Dispatcher(max_inflight=cap, quantum=2, idle_timeout=1e-4, thread_name_prefix="faulty")
    accepted: dict[object, list[int]] = defaultdict(list)
    futures: list[tuple[object, int, str, Future[Any]]] = []
    refused = 0
    seqs: dict[object, int] = defaultdict(int)
    kinds = ["ok", "spin", "fail", "defer"]
    idle = threading.Event()
    for burst in range(int(40 * SOAK)):
        for i in range(12):
            key = (burst + i) % 7
            kind = kinds[(burst * 12 + i) % 4]
            seq = seqs[key]
            try:
                fut = d.submit(key, task, key, seq, kind)
            except RuntimeError:
                refused += 1
                continue
            seqs[key] = seq + 1
            accepted[key].append(seq)
            futures.append((key, seq, kind, fut))
        assert d.drain(TIMEOUT)
        for _ in range(1000):  # let the idle workers retire: the next burst starts threads
            if d.stats().threads == 0:
                break
            idle.wait(0.001)
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert d.shutdown(TIMEOUT)
    violations = ledger.violations
    for key_, seq_, kind_, fut_ in futures:
        if _check_outcome(key_, seq_, kind_, fut_, violations) != "ran":
            violations.append(f"{key_!r}/{seq_} accepted but not run")
    ledger.check_order(accepted, complete=True)
    _report("start failures", switch_interval, len(futures), violations)
    assert violations == []
    assert thread_errors == []
    assert inflight[1] <= cap
    assert injected[0] > 0, injected
    assert injected[1] > 0, injected
    assert refused < len(futures)
