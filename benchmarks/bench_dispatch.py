"""Dispatcher against ThreadPoolExecutor, the way users collect results.

Run: ``python benchmarks/bench_dispatch.py [--quick]``. Every figure is
measured in this run, the stdlib baseline beside ours and alternating with
it, so only ratios matter on a noisy machine. The last line is one JSON
object of the headline figures.

- Throughput: N tasks that return ``None`` through ``Dispatcher`` and
  through ``ThreadPoolExecutor`` with the same number of workers (8), timed
  from the first submit until the work is complete, in three modes:

  - ``forget``: fire and forget, completion by ``shutdown()``;
  - ``result``: ``future.result(timeout=...)`` on each future, in order;
  - ``wait``: ``concurrent.futures.wait`` on all the futures.

  and four key shapes: 1 key, 10 keys, 1,000 keys, every key distinct
  (the stdlib has no keys: it gets the same tasks, unordered). Targets:
  forget >= 2.0x with 10 or fewer keys and >= 0.9x distinct; result >= 1.5x
  hot and >= 0.9x distinct; wait >= 1.0x hot and >= 0.8x distinct.
- Rounds: a hundred tasks over a hundred keys, then ``wait`` on them, again
  and again (a relay's batch, a broadcast sent in chunks, a request that
  fans out), with 64 workers as a relay has, beside ``ThreadPoolExecutor``
  with 64 workers doing the same rounds. Tasks/s and CPU per task (the
  whole process), as a ratio. Not a target: every task of a round makes a
  lane and lets it go, and the stdlib pays neither.
- Hot path: the cost of one ``submit`` to a busy lane (no thread wake-up)
  and of running one queued task on a lane's worker, in microseconds.
- Latency: submit-to-start p50/p99 with submissions paced at half the
  measured throughput.
- Burst start: 64 blocking tasks submitted at once to 64 idle threads,
  the time until the last one started, with the dispatcher's tasks long
  lately (a thread woken per task) and right after short ones (threads
  woken one at a time), beside ``ThreadPoolExecutor``; alone, and with a
  CPU-bound thread in the process.
- Memory: K keys x 10 queued tasks (workers held), bytes per queued task
  including its future (target < 1 KiB), and what is left once drained.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from functools import partial

from outbound import Dispatcher

WORKERS = 8
TIMEOUT = 120.0
MODES = ("forget", "result", "wait")
SHAPES = ("1_key", "10_keys", "1000_keys", "distinct_keys")
# (mode, shape group) -> minimum ratio to the stdlib
TARGETS = {
    ("forget", "hot"): 2.0,
    ("forget", "distinct"): 0.9,
    ("result", "hot"): 1.5,
    ("result", "distinct"): 0.9,
    ("wait", "hot"): 1.0,
    ("wait", "distinct"): 0.8,
}


def noop() -> None:
    return None


def keys_for(shape: str, n: int) -> Sequence[Hashable]:
    return {
        "1_key": [0],
        "10_keys": list(range(10)),
        "1000_keys": list(range(1000)),
        "distinct_keys": list(range(n)),
    }[shape]


def collect(mode: str, futures: Sequence[Future[None]], finish: Callable[[], object]) -> None:
    """Complete the run the way a user of ``mode`` does."""
    if mode == "result":
        for f in futures:
            f.result(timeout=TIMEOUT)
    elif mode == "wait":
        _done, not_done = wait(futures, timeout=TIMEOUT)
        assert not not_done
    finish()


def run_stdlib(mode: str, n: int) -> float:
    ex = ThreadPoolExecutor(max_workers=WORKERS)
    submit = ex.submit
    start = time.perf_counter()
    if mode == "forget":
        for _ in range(n):
            submit(noop)
        ex.shutdown(wait=True)
    else:
        futures = [submit(noop) for _ in range(n)]
        collect(mode, futures, lambda: None)
    elapsed = time.perf_counter() - start
    ex.shutdown(wait=True)
    return n / elapsed


def run_dispatcher(mode: str, n: int, keys: Sequence[Hashable]) -> float:
    d = Dispatcher(max_inflight=WORKERS, queue_size=n + 1)
    submit = d.submit
    nkeys = len(keys)
    start = time.perf_counter()
    if mode == "forget":
        for i in range(n):
            submit(keys[i % nkeys], noop)
        assert d.shutdown(TIMEOUT)
    else:
        futures = [submit(keys[i % nkeys], noop) for i in range(n)]
        collect(mode, futures, lambda: None)
    elapsed = time.perf_counter() - start
    assert d.shutdown(TIMEOUT)
    return n / elapsed


def throughput(n: int, runs: int) -> dict[str, float]:
    """Best of ``runs`` for each side, the two sides alternating run by run."""
    results: dict[str, float] = {}
    for mode in MODES:
        for shape in SHAPES:
            keys = keys_for(shape, n)
            ours: list[float] = []
            theirs: list[float] = []
            for _ in range(runs):
                gc.collect()
                theirs.append(run_stdlib(mode, n))
                gc.collect()
                ours.append(run_dispatcher(mode, n, keys))
            results[f"{mode}_{shape}_tasks_per_s"] = max(ours)
            results[f"{mode}_{shape}_stdlib_tasks_per_s"] = max(theirs)
            results[f"{mode}_{shape}_ratio"] = max(ours) / max(theirs)
    return results


ROUND = 100
ROUND_WORKERS = 64


def run_rounds(submit: Callable[[int], Future[None]], n: int) -> tuple[float, float]:
    """Tasks/s and CPU seconds per task of ``n`` tasks in rounds of ROUND, each
    round submitted then waited for."""
    cpu = time.process_time()
    start = time.perf_counter()
    for first in range(0, n, ROUND):
        futures = [submit(i) for i in range(first, first + ROUND)]
        _done, not_done = wait(futures, timeout=TIMEOUT)
        assert not not_done
    elapsed = time.perf_counter() - start
    return n / elapsed, (time.process_time() - cpu) / n


def _stdlib_task(ex: Executor, i: int) -> Future[None]:
    return ex.submit(noop)


def _keyed_task(d: Dispatcher, i: int) -> Future[None]:
    return d.submit(i % 1000, noop)


def rounds(n: int, runs: int) -> dict[str, float]:
    """Best of ``runs`` rounds measurements each side, alternating (see the module)."""
    ours: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    for _ in range(runs):
        gc.collect()
        with ThreadPoolExecutor(max_workers=ROUND_WORKERS) as ex:
            theirs.append(run_rounds(partial(_stdlib_task, ex), n))
        gc.collect()
        d = Dispatcher(max_inflight=ROUND_WORKERS)
        try:
            ours.append(run_rounds(partial(_keyed_task, d), n))
        finally:
            assert d.shutdown(TIMEOUT)
    rate, stdlib_rate = max(r for r, _ in ours), max(r for r, _ in theirs)
    cpu, stdlib_cpu = min(c for _, c in ours), min(c for _, c in theirs)
    return {
        "rounds_tasks_per_s": rate,
        "rounds_stdlib_tasks_per_s": stdlib_rate,
        "rounds_ratio": rate / stdlib_rate,
        "rounds_cpu_us": cpu * 1e6,
        "rounds_stdlib_cpu_us": stdlib_cpu * 1e6,
    }


def hot_path(n: int, runs: int) -> dict[str, float]:
    """Microseconds per ``submit`` to a busy lane and per task run by a lane's worker.

    One worker, one lane held by a blocked first task: the submits only
    append. Then the gate opens and the worker runs the queue alone.
    """
    submit_us: list[float] = []
    run_us: list[float] = []
    for _ in range(runs):
        gate = threading.Event()
        started = threading.Event()
        done = threading.Event()

        def first(started: threading.Event = started, gate: threading.Event = gate) -> None:
            started.set()
            gate.wait(TIMEOUT)

        d = Dispatcher(max_inflight=1, queue_size=n + 1)
        d.submit("k", first)
        assert started.wait(TIMEOUT)
        submit = d.submit
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(n - 1):
            submit("k", noop)
        t1 = time.perf_counter()
        d.submit("k", done.set)
        t2 = time.perf_counter()
        gate.set()
        assert done.wait(TIMEOUT)
        t3 = time.perf_counter()
        assert d.shutdown(TIMEOUT)
        submit_us.append((t1 - t0) / (n - 1) * 1e6)
        run_us.append((t3 - t2) / n * 1e6)
    return {"hot_submit_us": min(submit_us), "hot_run_us": min(run_us)}


def latencies(
    submit: Callable[[Callable[[], float]], Future[float]], n: int, rate: float
) -> list[float]:
    """Submit ``n`` tasks at ``rate`` per second, in a batch each millisecond,
    sleeping in between (a busy loop would hold the GIL from the workers).
    Each task returns its start time; the result is start - submit per task."""
    per_batch = max(1, round(rate / 1000))
    futures: list[tuple[float, Future[float]]] = []
    next_at = time.perf_counter()
    while len(futures) < n:
        for _ in range(min(per_batch, n - len(futures))):
            futures.append((time.perf_counter(), submit(time.perf_counter)))
        next_at += per_batch / rate
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    return [f.result(timeout=TIMEOUT) - t for t, f in futures]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_latency(n: int, rate: float) -> dict[str, float]:
    counter = iter(range(10**12))
    with Dispatcher(max_inflight=WORKERS, queue_size=n + 1) as d:
        ours = latencies(lambda fn: d.submit(next(counter) % 1000, fn), n, rate)
    ex: Executor
    with ThreadPoolExecutor(max_workers=WORKERS) as ex:
        theirs = latencies(ex.submit, n, rate)
    return {
        "p50_us": percentile(ours, 0.5) * 1e6,
        "p99_us": percentile(ours, 0.99) * 1e6,
        "stdlib_p50_us": percentile(theirs, 0.5) * 1e6,
        "stdlib_p99_us": percentile(theirs, 0.99) * 1e6,
    }


BURST = 64


def burst_start(submit: Callable[[Callable[[], None]], object]) -> float:
    """Seconds from the first of BURST submits until the last blocking task started."""
    gate = threading.Event()
    cond = threading.Condition()
    started: list[float] = []

    def task() -> None:
        with cond:
            started.append(time.perf_counter())
            cond.notify_all()
        gate.wait(TIMEOUT)

    t0 = time.perf_counter()
    for _ in range(BURST):
        submit(task)
    with cond:
        assert cond.wait_for(lambda: len(started) == BURST, TIMEOUT), "a task never started"
    gate.set()
    return max(started) - t0


class Spinner:
    """A CPU-bound thread in the process (pure Python: it holds the GIL in turns)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.spin, daemon=True)

    def spin(self) -> None:
        x = 0
        while not self.stop.is_set():
            for i in range(1000):
                x ^= i

    def __enter__(self) -> Spinner:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)


def measure_bursts(rounds: int) -> dict[str, float]:
    """Median burst start (ms): dispatcher after long tasks, after short ones, stdlib."""
    out: dict[str, list[float]] = {}
    for spin in (False, True):
        tag = "_cpu" if spin else ""
        for _ in range(rounds):
            with Dispatcher(max_inflight=BURST, idle_timeout=60.0, queue_size=2000) as d:
                keys = iter(range(10**9))

                def keyed(
                    fn: Callable[[], None], d: Dispatcher = d, keys: Iterator[int] = keys
                ) -> object:
                    return d.submit(next(keys), fn)

                burst_start(keyed)  # warm: BURST idle threads; blocking tasks, a long pace
                assert d.drain(TIMEOUT)
                with Spinner() if spin else contextlib.nullcontext():
                    out.setdefault(f"burst_long{tag}_ms", []).append(burst_start(keyed) * 1e3)
                assert d.drain(TIMEOUT)
                short = [d.submit(i % WORKERS, noop) for i in range(2000)]
                collect("wait", short, lambda: None)
                with Spinner() if spin else contextlib.nullcontext():
                    out.setdefault(f"burst_after_short{tag}_ms", []).append(
                        burst_start(keyed) * 1e3
                    )
            with ThreadPoolExecutor(max_workers=BURST) as ex:
                burst_start(ex.submit)  # warm
                with Spinner() if spin else contextlib.nullcontext():
                    out.setdefault(f"burst_stdlib{tag}_ms", []).append(burst_start(ex.submit) * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def measure_memory(keys: int, per_key: int) -> dict[str, float]:
    gate = threading.Event()
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        with Dispatcher(max_inflight=1, queue_size=per_key) as d:
            blocker = d.submit("blocker", gate.wait, 60)
            futures = [d.submit(k, noop) for k in range(keys) for _ in range(per_key)]
            queued = d.stats().queued
            peak = tracemalloc.get_traced_memory()[0]
            gate.set()
            blocker.result(timeout=60)
            assert d.drain(timeout=600)
            del futures
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    tasks = keys * per_key
    assert queued == tasks, (queued, tasks)
    return {
        "bytes_per_queued_task": (peak - baseline) / tasks,
        "bytes_left_after_drain": float(after - baseline),
        "queued_tasks": float(tasks),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer runs (CI)")
    args = parser.parse_args(argv)
    n = 20_000 if args.quick else 100_000
    runs = 2 if args.quick else 5
    mem_keys = 5_000 if args.quick else 100_000

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load:.2f}")
    results: dict[str, float] = {"load_average": load}
    results.update(throughput(n, runs))
    print(f"\n{n:,} no-op tasks, {WORKERS} workers; ratio = Dispatcher / ThreadPoolExecutor")
    print(f"{'mode':<8}" + "".join(f"{s:>16}" for s in SHAPES))
    for mode in MODES:
        cells = "".join(f"{results[f'{mode}_{s}_ratio']:>15.2f}x" for s in SHAPES)
        print(f"{mode:<8}{cells}")
    print(
        "stdlib tasks/s: "
        + ", ".join(
            f"{m} {statistics.mean(results[f'{m}_{s}_stdlib_tasks_per_s'] for s in SHAPES):,.0f}"
            for m in MODES
        )
    )

    rnd = rounds(n, runs)
    results.update(rnd)
    print(
        f"\nrounds of {ROUND} tasks over {ROUND} keys, wait each, {ROUND_WORKERS} workers: "
        f"{rnd['rounds_ratio']:.2f}x ({rnd['rounds_tasks_per_s']:,.0f} tasks/s, stdlib "
        f"{rnd['rounds_stdlib_tasks_per_s']:,.0f}); CPU per task {rnd['rounds_cpu_us']:.1f} us, "
        f"stdlib {rnd['rounds_stdlib_cpu_us']:.1f} us"
    )

    hot = hot_path(n, runs)
    results.update(hot)
    print(
        f"\nhot path: submit to a busy lane {hot['hot_submit_us']:.2f} us, "
        f"one queued task run by its worker {hot['hot_run_us']:.2f} us"
    )

    lat_n = 2_000 if args.quick else 20_000
    half = 0.5 * results["forget_1000_keys_stdlib_tasks_per_s"]
    lat = measure_latency(lat_n, half)
    results.update({f"latency_{k}": v for k, v in lat.items()})
    print(
        f"submit-to-start at {half:,.0f}/s: p50 {lat['p50_us']:.0f} us, p99 {lat['p99_us']:.0f} us "
        f"(stdlib p50 {lat['stdlib_p50_us']:.0f} us, p99 {lat['stdlib_p99_us']:.0f} us)"
    )

    bursts = measure_bursts(3 if args.quick else 7)
    results.update(bursts)
    for tag, label in (("", "alone"), ("_cpu", "with a CPU-bound thread")):
        print(
            f"burst of {BURST} blocking tasks on {BURST} idle threads, {label}: last start after "
            f"{bursts[f'burst_long{tag}_ms']:.1f} ms (tasks long lately), "
            f"{bursts[f'burst_after_short{tag}_ms']:.1f} ms (right after short ones); "
            f"stdlib {bursts[f'burst_stdlib{tag}_ms']:.1f} ms"
        )

    mem = measure_memory(mem_keys, 10)
    results.update(mem)
    print(
        f"memory, {mem_keys:,} keys x 10 queued: {mem['bytes_per_queued_task']:.0f} bytes per "
        f"queued task (with its future); {mem['bytes_left_after_drain']:,.0f} bytes left "
        "after drain"
    )
    targets: dict[str, bool] = {}
    for (mode, group), bound in TARGETS.items():
        shapes = ("1_key", "10_keys") if group == "hot" else ("distinct_keys",)
        worst = min(results[f"{mode}_{s}_ratio"] for s in shapes)
        targets[f"{mode}_{group}_{bound}x"] = worst >= bound
    targets["under_1KiB_per_task"] = mem["bytes_per_queued_task"] < 1024
    print("targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in targets.items()))
    print(json.dumps({k: round(v, 3) for k, v in results.items()} | {"targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
