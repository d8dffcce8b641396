"""Helpers shared by the dispatcher's tests."""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from outbound import Defer, Dispatcher, Hooks, current_context

T = TypeVar("T")

TIMEOUT = 10.0


class _RaisingLogHandler(logging.Handler):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__(logging.DEBUG)
        self.error = error

    def emit(self, record: logging.LogRecord) -> None:
        raise self.error("the log is broken")


@contextlib.contextmanager
def raising_log(error: type[BaseException] = RuntimeError) -> Iterator[None]:
    """The ``outbound`` logger at DEBUG, with a handler whose emit raises ``error``."""
    logger = logging.getLogger("outbound")
    handler = _RaisingLogHandler(error)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def blocker(
    started: threading.Event, release: threading.Event, value: object = None
) -> Callable[[], object]:
    """A task that says it started, then waits (bounded) to be released."""

    def task() -> object:
        started.set()
        assert release.wait(TIMEOUT), "blocker was never released"
        return value

    return task


def returning(value: T) -> Callable[[], T]:
    """A task that returns ``value``, bound now (as ``lambda i=i: i`` would, but typed)."""
    return lambda: value


def on_a_worker() -> bool:
    """Whether the calling thread is a dispatcher's worker."""
    return threading.current_thread().name.startswith("outbound-worker")


def until(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> bool:
    """Poll a state that no event reports; bounded."""
    tick = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return True
        tick.wait(0.005)
    return predicate()


class Counter:
    """Counts events; ``wait_for(n)`` blocks (bounded) until ``n`` happened."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.n = 0

    def hit(self) -> None:
        with self._cond:
            self.n += 1
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = TIMEOUT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.n >= n, timeout)


def spinner(stop: threading.Event) -> threading.Thread:
    """A started thread running a pure-Python loop (it holds the GIL in turns) until ``stop``."""

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(500):
                x ^= i

    t = threading.Thread(target=spin, name="spinner", daemon=True)
    t.start()
    return t


class KeyChecker:
    """Per-key order, one task at a time per key, and how many tasks ran at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[object, int] = {}
        self.order: dict[object, list[int]] = {}
        self.overlaps = 0
        self.inflight = 0
        self.most = 0

    def enter(self, key: object, seq: int) -> None:
        with self.lock:
            if self.running.get(key, 0):
                self.overlaps += 1
            self.running[key] = self.running.get(key, 0) + 1
            self.order.setdefault(key, []).append(seq)
            self.inflight += 1
            self.most = max(self.most, self.inflight)

    def leave(self, key: object) -> None:
        with self.lock:
            self.running[key] -= 1
            self.inflight -= 1


def mixed_bursts(
    d: Dispatcher,
    n: int,
    variant: str,
    *,
    per_submitter: int,
    keys: int,
    rounds: int,
    iterations: int,
    check_most: bool,
) -> None:
    """Stress ``d`` (max_inflight ``n``) for about 1.5 s and check what it guarantees.

    Two submitters send mixes of no-op, briefly blocking, deferring and (variant
    "tasks raise") raising tasks over ``keys`` keys each, or tasks that pause the
    dispatcher (variant "pauses"), while this thread sends ``rounds`` bursts of
    ``n`` tasks that wait for each other. Every future resolves with no further
    submit, each key's tasks run in order and one at a time, and the pool never
    passes ``n`` threads (with ``check_most``, nor do more than ``n`` tasks run).
    """
    checker = KeyChecker()
    most_threads = [0]
    errors: list[BaseException] = []

    def make(key: object, seq: int, kind: int) -> Callable[[], int]:
        def task() -> int:
            checker.enter(key, seq)
            try:
                most_threads[0] = max(most_threads[0], len(d._workers))
                if kind == 1:
                    threading.Event().wait(0.001)  # long: the pace turns long
                elif kind == 2 and current_context().attempt == 1:
                    raise Defer(0.001)
                elif kind == 3 and variant == "tasks raise":
                    raise random.choice([KeyboardInterrupt, SystemExit, ValueError])
                elif kind == 3 and variant == "pauses":
                    d.pause(0.001)
                return seq
            finally:
                checker.leave(key)

        return task

    def submitter(seed: int, out: list[tuple[object, int, Future[int]]]) -> None:
        rng = random.Random(seed)
        try:
            for seq in range(per_submitter):
                key = (seed % 2, rng.randrange(keys))
                kind = rng.choices([0, 1, 2, 3], [80, 8, 4, 8])[0]
                out.append((key, seq, d.submit(key, make(key, seq, kind))))
        except BaseException as exc:
            errors.append(exc)

    deadline = time.monotonic() + 1.5
    for iteration in range(iterations):
        if time.monotonic() > deadline:
            break
        outs: list[list[tuple[object, int, Future[int]]]] = [[], []]
        threads = [
            threading.Thread(target=submitter, args=(iteration * 2 + s, outs[s])) for s in (0, 1)
        ]
        for t in threads:
            t.start()
        for round_ in range(rounds):
            barrier = threading.Barrier(n, timeout=TIMEOUT)
            burst = [d.submit(("b", iteration, round_, i), barrier.wait) for i in range(n)]
            assert sorted(f.result(timeout=TIMEOUT) for f in burst) == list(range(n))
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive()
        assert errors == []
        for out in outs:
            for key, seq, f in out:
                try:
                    f.result(timeout=TIMEOUT)
                except (KeyboardInterrupt, SystemExit, ValueError):
                    assert variant == "tasks raise"
                assert f.done(), (key, seq)
        assert d.drain(TIMEOUT)
        assert checker.overlaps == 0
        for key, seqs in checker.order.items():
            if key[0] != "b":  # type: ignore[index]
                # a deferred task runs twice in a row; otherwise strictly increasing
                assert seqs == sorted(seqs), key
        checker.order.clear()
        if check_most:
            assert checker.most <= n
        assert most_threads[0] <= n
        assert d.stats().threads <= n


def stress_mixed(
    n: int,
    variant: str,
    meddlers: Callable[[Dispatcher, threading.Event], list[threading.Thread]],
    *,
    hook_rate: float,
    queue_size: int,
    per_submitter: int,
    keys: int,
    rounds: int,
    iterations: int,
    check_most: bool,
) -> None:
    """mixed_bursts() on a dispatcher of ``n`` threads made for ``variant``, beside
    the threads ``meddlers`` starts (stopped by the event), at a 10 us switch
    interval; shut down after. The other arguments are mixed_bursts()'s.

    Variants: "retiring" (idle timeout 0.1 ms), "hooks raise" (on_start and
    on_done raise KeyboardInterrupt or SystemExit, each call with probability
    ``hook_rate``), and those mixed_bursts() knows.
    """
    hooks = None
    if variant == "hooks raise":

        def hook(*args: object) -> None:
            if random.random() < hook_rate:
                raise random.choice([KeyboardInterrupt, SystemExit])

        hooks = Hooks(on_start=hook, on_done=hook)
    d = Dispatcher(
        max_inflight=n,
        idle_timeout=1e-4 if variant == "retiring" else 60.0,
        hooks=hooks,
        quantum=2,
        queue_size=queue_size,
    )
    stop = threading.Event()
    sys.setswitchinterval(1e-5)
    helpers = meddlers(d, stop)
    try:
        mixed_bursts(
            d,
            n,
            variant,
            per_submitter=per_submitter,
            keys=keys,
            rounds=rounds,
            iterations=iterations,
            check_most=check_most,
        )
    finally:
        stop.set()
        for t in helpers:
            t.join(TIMEOUT)
        sys.setswitchinterval(0.005)
        assert d.shutdown(TIMEOUT)
