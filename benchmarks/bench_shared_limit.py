"""One bot, many processes: a shared rate limiter against one limiter per process.

Run: ``python benchmarks/bench_shared_limit.py [--quick] [--redis URL] [--postgres URL]``
(Redis: ``--redis``, else ``$OUTBOUND_TEST_REDIS``, else
``redis://127.0.0.1:6379/0``; PostgreSQL likewise with
``$OUTBOUND_TEST_POSTGRES``; without a PostgreSQL server the outbox is a
SQLite file).

One stand-in platform (``PlatformSimulator`` on loopback, answering 429s
in the real platforms' shape) enforces the bot's limits: ``OVERALL``
messages per second for the whole bot and ``PER_CHAT`` per chat. Two
workloads, each run twice in the same run, with the same limits given to
every process:

- **broadcast**: 4 processes each broadcast to their own chats through
  ``Outbound`` → retry → rate_limit → timeout → ``TelegramSender``, the
  way a bot behind 4 gunicorn workers does;
- **relays**: 3 outbox relay processes (``Store``/``Relay``/``EventBus``)
  deliver rows enqueued by the application, each handler sending through
  rate_limit → timeout → ``TelegramSender``.

``shared``: every process uses one ``RedisRateLimiter`` (one budget for
the bot). ``per-process``: each process its own ``RateLimiter`` with the
bot's limits, which is what a bot without a shared limiter does: together
they spend several times the budget.

Checked at the server: the most arrivals in any window of one second, and
in any window of one second less the stand-in's jitter tolerance (at most
``OVERALL``: the limiter decides on its store's clock, and a request
reaches the server after a delay that varies by a few milliseconds, tens
on a loaded machine); throughput as a fraction of ``OVERALL`` between the
first and the last arrival (at least 90%); 429s (none); per-chat order.
Beside the arrivals, the same two counts of the grants, noted in each
process as a send passes its limiter (on the host's monotonic clock, as
the arrivals): a window over the limit at the server whose grants kept
to it comes from the delay between grant and arrival, not from the
limiter. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from outbound.messages import Sender, SendRequest, SendResult, TextMessage
from outbound.middleware import chain, rate_limit, retry, timeout
from outbound.ratelimit import BaseRateLimiter, Rate, RateLimiter, RateLimits, RedisRateLimiter
from outbound.reply import Outbound
from outbound.simulator import PlatformSimulator, SimulatorConfig
from outbound.telegram import TelegramSender

OVERALL = 100  # messages per second for the bot
PER_CHAT = 10  # messages per second to one chat
LATENCY = 0.002
#: Seconds of arrival jitter the stand-in forgives before it answers 429 (as
#: a real platform, it judges arrivals, which reach it after a variable
#: delay: the limiter decides on its store's clock, a little earlier).
TOLERANCE = 0.02
LIMITS = RateLimits(overall=Rate(OVERALL), per_chat=Rate(PER_CHAT))
WAIT = 120.0
PREFIX = "outbound-bench"


def make_limiter(kind: str, redis_url: str, name: str) -> BaseRateLimiter:
    if kind == "shared":
        import redis  # noqa: PLC0415

        client = redis.Redis.from_url(redis_url)
        return RedisRateLimiter(client, LIMITS, name=name, prefix=PREFIX, timeout=0.5)
    return RateLimiter(LIMITS)


def drop_keys(redis_url: str, name: str) -> None:
    """Remove the shared limiter's keys of one run (they would expire, some in a day)."""
    import redis  # noqa: PLC0415

    with redis.Redis.from_url(redis_url) as client:
        for key in client.scan_iter(match=f"{PREFIX}:{{{name}}}:*", count=1000):
            client.delete(key)


# ------------------------------------------------------------------ workers


class Granted:
    """A sender that notes when each send passed the limiter (``time.monotonic()``,
    one clock for every process of this host, as the stand-in's arrival times).

    Placed right below ``rate_limit``: what it notes is the limiter's grant
    as this process saw it, before the request went out. Thread-safe
    (``list.append``).
    """

    def __init__(self, inner: Sender) -> None:
        self.inner = inner
        self.times: list[float] = []

    def send(self, request: SendRequest) -> SendResult:
        self.times.append(time.monotonic())
        return self.inner.send(request)

    def validate(self, request: SendRequest) -> None:
        getattr(self.inner, "validate", lambda _: None)(request)


def broadcaster(
    sim_url: str,
    token: str,
    chats: list[int],
    messages: int,
    kind: str,
    redis_url: str,
    name: str,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    """One process of the bot: broadcast ``messages`` to each of ``chats``."""
    limiter = make_limiter(kind, redis_url, name)
    with TelegramSender(token, base_url=sim_url) as telegram:
        granted = Granted(timeout(5.0)(telegram))
        sender = chain(retry(max_total=WAIT), rate_limit(limiter))(granted)
        with Outbound(None, sender, max_inflight=16, queue_size=max(64, messages)) as out:
            ready.release()
            go.wait(WAIT)
            futures = [
                out.reply_text(chat, f"{chat} {i}") for chat in chats for i in range(messages)
            ]
            failed = sum(1 for f in futures if f.exception(WAIT) is not None)
    results.put(
        {
            "failed": failed,
            "degraded": getattr(limiter, "degraded", False),
            "granted": granted.times,
        }
    )


def relay_worker(
    sim_url: str,
    token: str,
    store_spec: tuple[str, str],
    kind: str,
    redis_url: str,
    name: str,
    ready: Any,
    stop: Any,
    results: Any,
) -> None:
    """One outbox relay process delivering rows to the platform."""
    from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, SQLiteStore  # noqa: PLC0415

    where, spec = store_spec
    store: Any = PostgresStore(spec, table=name) if where == "postgres" else SQLiteStore(spec)
    limiter = make_limiter(kind, redis_url, name)
    with TelegramSender(token, base_url=sim_url) as telegram:
        granted = Granted(timeout(5.0)(telegram))
        sender = rate_limit(limiter)(granted)

        def deliver(message: OutboxMessage) -> None:
            sender.send(SendRequest(int(message.key), TextMessage(message.payload["text"])))

        bus = EventBus()
        bus.subscribe("reply", deliver)
        relay = Relay(store, bus, batch_size=100, max_inflight=32, lease=30.0)
        with relay:
            ready.release()
            stop.wait(WAIT)
        stats = relay.stats()
    store.close()
    results.put(
        {
            "sent": stats.sent,
            "requeued": stats.requeued,
            "parked": stats.parked,
            "dead": stats.dead,
            "granted": granted.times,
        }
    )


# ---------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Result:
    workload: str
    limiter: str
    processes: int
    messages: int
    delivered: int
    seconds: float
    rate: float
    fraction: float
    max_per_second: int
    max_per_window: int
    granted_per_second: int
    granted_per_window: int
    rate_limited: int
    order_violations: int
    failed: int


def max_in_window(times: list[float], period: float) -> int:
    times = sorted(times)
    best, j = 0, 0
    for i, start in enumerate(times):
        while j < len(times) and times[j] < start + period:
            j += 1
        best = max(best, j - i)
    return best


def measure(
    workload: str,
    kind: str,
    processes: int,
    sim: PlatformSimulator,
    total: int,
    failed: int,
    granted: list[float],
) -> Result:
    """What arrived at ``sim``; ``granted``: when the sends passed the limiters (see Granted)."""
    arrivals = sim.all_received()
    times = [m["time"] for m in arrivals]
    seconds = (max(times) - min(times)) if len(times) > 1 else 0.0
    rate = (len(times) - 1) / seconds if seconds else 0.0
    violations = 0
    by_chat: dict[Any, list[int]] = {}
    for m in arrivals:
        by_chat.setdefault(m["chat_id"], []).append(int(m["text"].rsplit(" ", 1)[1]))
    for seq in by_chat.values():
        violations += sum(1 for a, b in itertools.pairwise(seq) if b < a)
    return Result(
        workload=workload,
        limiter=kind,
        processes=processes,
        messages=total,
        delivered=len(times),
        seconds=round(seconds, 3),
        rate=round(rate, 1),
        fraction=round(rate / OVERALL, 3),
        max_per_second=max_in_window(times, 1.0),
        max_per_window=max_in_window(times, 1.0 - sim.config.tolerance),
        granted_per_second=max_in_window(granted, 1.0),
        granted_per_window=max_in_window(granted, 1.0 - sim.config.tolerance),
        rate_limited=sim.stats().rate_limited,
        order_violations=violations,
        failed=failed,
    )


def simulator() -> PlatformSimulator:
    config = SimulatorConfig(
        global_rate=float(OVERALL),
        global_burst=OVERALL / 10,
        chat_rate=float(PER_CHAT),
        chat_burst=1,
        latency=LATENCY,
        tolerance=TOLERANCE,
        real_429s=True,
    )
    return PlatformSimulator(config)


def run_broadcast(kind: str, processes: int, chats: int, messages: int, redis_url: str) -> Result:
    ctx = mp.get_context("spawn")
    name = f"bench-{uuid.uuid4().hex[:8]}"
    with simulator() as sim:
        ready, go, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(
                target=broadcaster,
                args=(
                    sim.url,
                    sim.token,
                    list(range(p * chats + 1, (p + 1) * chats + 1)),
                    messages,
                    kind,
                    redis_url,
                    name,
                    ready,
                    go,
                    results,
                ),
            )
            for p in range(processes)
        ]
        for proc in procs:
            proc.start()
        for _ in procs:
            if not ready.acquire(timeout=WAIT):
                raise RuntimeError("a broadcaster did not start")
        go.set()
        outcomes = [results.get(timeout=WAIT) for _ in procs]
        for proc in procs:
            proc.join(WAIT)
        if kind == "shared":
            drop_keys(redis_url, name)
        total = processes * chats * messages
        failed = sum(o["failed"] for o in outcomes)
        granted = [t for o in outcomes for t in o["granted"]]
        return measure("broadcast", kind, processes, sim, total, failed, granted)


def run_relays(
    kind: str, processes: int, chats: int, messages: int, redis_url: str, postgres_url: str | None
) -> Result:
    from outbound.outbox import PostgresStore, SQLiteStore  # noqa: PLC0415

    ctx = mp.get_context("spawn")
    name = f"bench_{uuid.uuid4().hex[:8]}"
    tmp = tempfile.TemporaryDirectory()
    store: Any
    if postgres_url:
        store = PostgresStore(postgres_url, table=name)
        spec = ("postgres", postgres_url)
    else:
        path = os.path.join(tmp.name, "outbox.db")
        store = SQLiteStore(path)
        spec = ("sqlite", path)
    total = chats * messages
    try:
        store.create_schema()
        conn: Any = store.connect()
        try:
            for i in range(messages):
                for chat in range(1, chats + 1):
                    store.enqueue(
                        conn, key=str(chat), type="reply", payload={"text": f"{chat} {i}"}
                    )
            conn.commit()
        finally:
            conn.close()
        with simulator() as sim:
            ready, stop, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
            procs = [
                ctx.Process(
                    target=relay_worker,
                    args=(sim.url, sim.token, spec, kind, redis_url, name, ready, stop, results),
                )
                for _ in range(processes)
            ]
            for proc in procs:
                proc.start()
            sim.wait_received(total, timeout=WAIT)
            stop.set()
            outcomes = [results.get(timeout=WAIT) for _ in procs]
            for proc in procs:
                proc.join(WAIT)
            failed = total - sim.stats().delivered
            requeued = sum(o["requeued"] for o in outcomes)
            parked = sum(o["parked"] for o in outcomes)
            print(
                f"  {kind} relays: {total} rows; deferrals: {parked} held by the relay until "
                f"due, {requeued} written back to wait"
            )
            granted = [t for o in outcomes for t in o["granted"]]
            return measure("relays", kind, processes, sim, total, failed, granted)
    finally:
        if postgres_url:
            store.drop_schema()
        store.close()
        tmp.cleanup()
        if kind == "shared":
            drop_keys(redis_url, name)


def report(r: Result) -> None:
    print(
        f"{r.workload:>9} {r.limiter:>11} x{r.processes}: {r.delivered}/{r.messages} delivered, "
        f"{r.rate:.1f} msgs/s = {r.fraction:.1%} of the bot's {OVERALL}/s; "
        f"most in any 1 s window {r.max_per_second}, in any {1 - TOLERANCE:g} s window "
        f"{r.max_per_window} (limit {OVERALL}); granted by the limiters "
        f"{r.granted_per_second} and {r.granted_per_window}; "
        f"429s {r.rate_limited}; order violations {r.order_violations}; failed {r.failed}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument("--redis", default=os.environ.get("OUTBOUND_TEST_REDIS"))
    parser.add_argument("--postgres", default=os.environ.get("OUTBOUND_TEST_POSTGRES"))
    args = parser.parse_args(argv)
    redis_url = args.redis or "redis://127.0.0.1:6379/0"
    # Broadcast: 4 processes x 25 chats x M messages; relays: C chats x 1 message
    # (a broadcast through the outbox). Bound by the overall limit either way.
    b_messages, r_chats = (3, 400) if args.quick else (10, 1500)
    print(
        f"limits: {OVERALL}/s for the bot, {PER_CHAT}/s per chat; platform latency "
        f"{LATENCY * 1000:g} ms; outbox on {'PostgreSQL' if args.postgres else 'SQLite'}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    results = []
    for kind in ("shared", "per-process"):
        results.append(run_broadcast(kind, 4, 25, b_messages, redis_url))
        report(results[-1])
    for kind in ("shared", "per-process"):
        results.append(run_relays(kind, 3, r_chats, 1, redis_url, args.postgres))
        report(results[-1])
    shared = [r for r in results if r.limiter == "shared"]
    targets = {
        "windows_within_limit": all(r.max_per_window <= OVERALL for r in shared),
        "grants_within_limit": all(r.granted_per_window <= OVERALL for r in shared),
        "throughput_90pct": all(r.fraction >= 0.9 for r in shared),
        "no_429s": all(r.rate_limited == 0 for r in shared),
        "all_delivered_in_order": all(
            r.delivered == r.messages and r.order_violations == 0 for r in shared
        ),
    }
    print("targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in targets.items()))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    headline = {f"{r.workload}_{r.limiter}": asdict(r) for r in results} | {"targets": targets}
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
