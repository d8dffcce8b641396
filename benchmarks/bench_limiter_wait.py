"""Many threads, one PostgreSQL rate limiter: how long a decision waits its turn.

Run: ``python benchmarks/bench_limiter_wait.py [--quick] [--postgres URL]``
(``--postgres``, else ``$OUTBOUND_TEST_POSTGRES``, else
``postgresql://postgres@127.0.0.1:5432/test``; without a server the run
says so and exits 0). The last line is one JSON object.

A ``PostgresRateLimiter`` makes one round trip per decision on one
connection per process, so the threads of a process take turns on it,
and each must have its turn within the limiter's ``timeout`` (past it, the
decision falls back to the local share). The limiter hands the connection
over in the order it was asked for (``outbound._fair.FairLock``). The
baseline is the same limiter with the ``threading.Lock`` it used before:
a thread that releases that lock and asks again at once usually takes it
back before a waiter wakes, so some waiters wait many turns.

``THREADS`` threads (the relay's default ``max_inflight``) each decide for
chats of their own in a loop, as handlers do, for ``seconds``; the limits
are far above what they ask for, so every call is a decision sent at once.
Both locks run in each of ``rounds`` rounds, alternating. Reported per
lock: decisions per second, and each call's time from asking to its answer
(p50, p99, the longest). Ratios fair / plain, median of the rounds: the
longest call (target <= 0.5) and decisions per second (target >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

from outbound.ratelimit import PostgresRateLimiter, Rate, RateLimits

THREADS = 64
LIMITS = RateLimits(overall=Rate(1_000_000), per_chat=Rate(1_000_000))


class PlainLock:
    """``threading.Lock`` with :class:`~outbound._fair.FairLock`'s interface."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, timeout: float) -> bool:
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()


def drop(url: str, table: str) -> None:
    import psycopg  # noqa: PLC0415

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_recent")
        for fn in ("decide", "record", "handover", "ban", "put"):
            conn.execute(f"DROP FUNCTION IF EXISTS {table}_{fn}")


def run(url: str, lock: str, threads: int, seconds: float) -> dict[str, float]:
    """Decisions/s and call times (ms) of ``threads`` threads on one limiter."""
    table = f"bench_rl_{uuid.uuid4().hex[:12]}"
    limiter = PostgresRateLimiter(url, LIMITS, table=table, timeout=60.0)
    if lock == "plain":
        setattr(limiter, "_conn_lock", PlainLock())  # noqa: B010  (a Final attribute)
    times: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def decide(me: int) -> None:
        mine = times[me]
        chat = 0
        try:
            start.wait(60.0)
            while not stop.is_set():
                chat += 1
                asked = time.perf_counter()
                if limiter.acquire(f"{me}:{chat}") != 0.0:
                    raise AssertionError("the limits are far above the load: no call waits")
                mine.append(time.perf_counter() - asked)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            stop.set()

    workers = [threading.Thread(target=decide, args=(i,), daemon=True) for i in range(threads)]
    try:
        for worker in workers:
            worker.start()
        start.wait(60.0)
        began = time.perf_counter()
        stop.wait(seconds)
        stop.set()
        for worker in workers:
            worker.join(120.0)
        elapsed = time.perf_counter() - began
        if errors:
            raise errors[0]
        if limiter.degraded:
            raise AssertionError("the limiter fell back to its local share: no figures")
    finally:
        stop.set()
        limiter.close()
        drop(url, table)
    calls = sorted(t for mine in times for t in mine)
    if not calls:
        raise AssertionError("no decision was made")
    return {
        "per_s": len(calls) / elapsed,
        "p50_ms": calls[len(calls) // 2] * 1e3,
        "p99_ms": calls[min(len(calls) - 1, int(len(calls) * 0.99))] * 1e3,
        "max_ms": calls[-1] * 1e3,
    }


def reachable(url: str) -> str | None:
    """Why PostgreSQL cannot be used here, or None."""
    try:
        import psycopg  # noqa: PLC0415
    except ImportError:
        return "psycopg is not installed"
    try:
        with psycopg.connect(url, connect_timeout=5):
            return None
    except psycopg.Error as exc:
        return f"cannot connect to {url}: {exc}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter rounds (CI)")
    parser.add_argument("--postgres", default=None)
    args = parser.parse_args(argv)
    url = (
        args.postgres
        or os.environ.get("OUTBOUND_TEST_POSTGRES")
        or "postgresql://postgres@127.0.0.1:5432/test"
    )
    rounds, seconds = (1, 1.0) if args.quick else (3, 3.0)
    out: dict[str, Any] = {"quick": args.quick, "threads": THREADS, "seconds": seconds}
    why = reachable(url)
    if why is not None:
        print(f"skipped: {why}")
        out["skipped"] = why
        print(json.dumps(out))
        return 0
    print(
        f"== {THREADS} threads on one PostgresRateLimiter, {seconds:g} s per run, "
        f"{rounds} round(s); load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    results: dict[str, list[dict[str, float]]] = {"fair": [], "plain": []}
    for _ in range(rounds):
        for lock in ("plain", "fair"):
            figures = run(url, lock, THREADS, seconds)
            results[lock].append(figures)
            print(
                f"  {lock:<5} {figures['per_s']:>7,.0f} decisions/s   call p50 "
                f"{figures['p50_ms']:6.2f} ms   p99 {figures['p99_ms']:7.2f} ms   longest "
                f"{figures['max_ms']:7.1f} ms",
                flush=True,
            )
    longest = statistics.median(
        f["max_ms"] / p["max_ms"] for f, p in zip(results["fair"], results["plain"], strict=True)
    )
    rate = statistics.median(
        f["per_s"] / p["per_s"] for f, p in zip(results["fair"], results["plain"], strict=True)
    )
    print(
        f"  fair / plain: longest call {longest:.2f} (target <= 0.5), "
        f"decisions/s {rate:.2f} (target >= 0.9)"
    )
    for lock, runs in results.items():
        for name in ("per_s", "p50_ms", "p99_ms", "max_ms"):
            out[f"{lock}_{name}"] = round(statistics.median(r[name] for r in runs), 2)
    out["longest_ratio"] = round(longest, 2)
    out["rate_ratio"] = round(rate, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
