"""Dispatcher against ThreadPoolExecutor: throughput, start latency, memory per queued task.

Run: ``python benchmarks/bench_dispatch.py [--quick]``. Every figure is
measured in this run, the stdlib baseline next to ours, so only ratios
matter on a noisy machine. The last line is one JSON object of the
headline figures.

- Throughput: no-op tasks through ``Dispatcher`` and through
  ``ThreadPoolExecutor`` with the same number of workers, for 1, 10, 1,000
  and all-distinct keys. Targets: >= 1.5x the stdlib with 10 or fewer hot
  keys, >= 0.8x with all keys distinct.
- Latency: submit-to-start p50/p99 with submissions paced at half the
  measured throughput.
- Memory: K keys x 10 queued tasks (workers held), bytes per queued task
  including its future (target < 1 KiB), and what is left once drained.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor

from outbound import Dispatcher

WORKERS = 8


def noop() -> None:
    return None


class Countdown:
    """A task that counts itself done; the last one sets ``done``.

    Waiting on one event rather than on every future keeps the measurement
    about the pool, not about ``concurrent.futures.wait``.
    """

    def __init__(self, n: int) -> None:
        self.left = n
        self.lock = threading.Lock()
        self.done = threading.Event()

    def __call__(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.done.set()


def best_of(runs: int, fn: Callable[[], float]) -> float:
    return max(fn() for _ in range(runs))


def throughput_dispatcher(n: int, keys: list[Hashable]) -> float:
    task = Countdown(n)
    with Dispatcher(max_inflight=WORKERS, queue_size=n + 1) as d:
        submit = d.submit
        nkeys = len(keys)
        start = time.perf_counter()
        for i in range(n):
            submit(keys[i % nkeys], task)
        assert task.done.wait(120)
        elapsed = time.perf_counter() - start
    return n / elapsed


def throughput_stdlib(n: int) -> float:
    task = Countdown(n)
    with ThreadPoolExecutor(max_workers=WORKERS) as ex:
        submit = ex.submit
        start = time.perf_counter()
        for _ in range(n):
            submit(task)
        assert task.done.wait(120)
        elapsed = time.perf_counter() - start
    return n / elapsed


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
    return [f.result(timeout=60) - t for t, f in futures]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_latency(n: int, rate: float) -> dict[str, float]:
    counter = iter(range(10**12))
    with Dispatcher(max_inflight=WORKERS, queue_size=n + 1) as d:
        ours = latencies(lambda fn: d.submit(next(counter) % 1000, fn), n, rate)
    with ThreadPoolExecutor(max_workers=WORKERS) as ex:
        theirs = latencies(ex.submit, n, rate)
    return {
        "p50_us": percentile(ours, 0.5) * 1e6,
        "p99_us": percentile(ours, 0.99) * 1e6,
        "stdlib_p50_us": percentile(theirs, 0.5) * 1e6,
        "stdlib_p99_us": percentile(theirs, 0.99) * 1e6,
    }


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one run each (CI)")
    args = parser.parse_args(argv)
    n = 20_000 if args.quick else 200_000
    runs = 1 if args.quick else 3
    mem_keys = 5_000 if args.quick else 100_000

    results: dict[str, float] = {}
    baseline = best_of(runs, lambda: throughput_stdlib(n))
    results["stdlib_tasks_per_s"] = baseline
    print(f"ThreadPoolExecutor({WORKERS}): {baseline:,.0f} tasks/s")
    cases: dict[str, Callable[[], list[Hashable]]] = {
        "1_key": lambda: [0],
        "10_keys": lambda: list(range(10)),
        "1000_keys": lambda: list(range(1000)),
        "distinct_keys": lambda: list(range(n)),
    }
    for name, make_keys in cases.items():
        keys = make_keys()
        rate = best_of(runs, lambda keys=keys: throughput_dispatcher(n, keys))  # type: ignore[misc]
        results[f"{name}_tasks_per_s"] = rate
        results[f"{name}_ratio"] = rate / baseline
        print(
            f"Dispatcher({WORKERS}), {name:>13}: {rate:,.0f} tasks/s = {rate / baseline:.2f}x stdlib"
        )

    lat_n = 2_000 if args.quick else 20_000
    half = 0.5 * min(baseline, results["1000_keys_tasks_per_s"])
    lat = measure_latency(lat_n, half)
    results.update({f"latency_{k}": v for k, v in lat.items()})
    print(
        f"submit-to-start at {half:,.0f}/s: p50 {lat['p50_us']:.0f} us, p99 {lat['p99_us']:.0f} us "
        f"(stdlib p50 {lat['stdlib_p50_us']:.0f} us, p99 {lat['stdlib_p99_us']:.0f} us)"
    )

    mem = measure_memory(mem_keys, 10)
    results.update(mem)
    print(
        f"memory, {mem_keys:,} keys x 10 queued: {mem['bytes_per_queued_task']:.0f} bytes per "
        f"queued task (with its future); {mem['bytes_left_after_drain']:,.0f} bytes left after drain"
    )
    targets = {
        "hot_keys_1_5x": min(results["1_key_ratio"], results["10_keys_ratio"]) >= 1.5,
        "distinct_0_8x": results["distinct_keys_ratio"] >= 0.8,
        "under_1KiB_per_task": mem["bytes_per_queued_task"] < 1024,
    }
    print("targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in targets.items()))
    print(json.dumps({k: round(v, 3) for k, v in results.items()} | {"targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
