"""A broadcast through the stand-in platform: paced sends against the naive way.

Run: ``python benchmarks/bench_broadcast.py [--quick]``. C chats x M
messages go through ``Outbound`` → metrics → retry → rate_limit → timeout
→ ``TelegramSender`` → ``PlatformSimulator`` over loopback, with limits
scaled so that a run takes seconds: 10/s per chat, 500/s overall, 5 ms
latency, ``max_inflight=8``. The simulator enforces the same limits and
answers 429 to anything faster.

Figures, per scenario:

- achieved messages per second (submit of the first to the resolution of
  the last), and as a fraction of the bound
  ``min(overall limit, chats x per-chat limit, max_inflight / latency)``.
  A short run can beat that steady-state rate a little, since each chat's
  first message needs no wait; ``efficiency`` compares the run with the
  shortest one the limits allow instead
  (``max((M - 1) / per_chat, (N - 1) / overall, N * latency / max_inflight)
  + latency``);
- 429s the platform answered, and order violations (a message of a chat
  arriving before one sent earlier to the same chat).

Messages are queued chat by chat (all of one chat's, then the next
chat's), as a loop over recipients does. Baseline, in the same run, on
the first scenario: the naive way, a ``ThreadPoolExecutor`` of the same
size with a lock per chat, that sleeps out each 429's ``retry_after``
while holding its thread and its chat's lock; it is stopped after a few
seconds and rated on what it delivered by then. Targets: >= 90% of the
bound, no order violation, 429s under 1% of messages. The last line is
one JSON object of the headline figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from outbound import Dispatcher
from outbound.errors import RateLimited
from outbound.messages import SendRequest, SendResult, TextMessage
from outbound.middleware import chain, metrics, rate_limit, retry, timeout
from outbound.ratelimit import Rate, RateLimits
from outbound.reply import Outbound
from outbound.simulator import PlatformSimulator, SimulatorConfig
from outbound.telegram import TelegramSender

PER_CHAT = 10.0  # messages per second to one chat
OVERALL = 500.0  # messages per second for the bot
LATENCY = 0.005  # seconds the platform takes to answer
MAX_INFLIGHT = 8
WAIT = 120.0  # the longest any run may take before it counts as stuck


@dataclass(frozen=True)
class Scenario:
    name: str
    chats: int
    messages: int

    @property
    def total(self) -> int:
        return self.chats * self.messages

    @property
    def bound(self) -> float:
        return min(OVERALL, self.chats * PER_CHAT, MAX_INFLIGHT / LATENCY)

    @property
    def shortest(self) -> float:
        n = self.total
        return (
            max((self.messages - 1) / PER_CHAT, (n - 1) / OVERALL, n * LATENCY / MAX_INFLIGHT)
            + LATENCY
        )


@dataclass(frozen=True)
class Result:
    seconds: float
    rate: float
    fraction: float
    efficiency: float
    rate_limited: int
    limited_by: str
    order_violations: int
    failed: int
    done: int


def simulator() -> PlatformSimulator:
    config = SimulatorConfig(
        global_rate=OVERALL,
        global_burst=OVERALL / 10,
        chat_rate=PER_CHAT,
        chat_burst=1,
        latency=LATENCY,
    )
    return PlatformSimulator(config)


def order_violations(sim: PlatformSimulator, chats: int) -> int:
    violations = 0
    for chat in range(1, chats + 1):
        seq = [int(m["text"].rsplit(" ", 1)[1]) for m in sim.received(chat)]
        violations += sum(1 for a, b in itertools.pairwise(seq) if b < a)
    return violations


def summarize(
    sc: Scenario, sim: PlatformSimulator, seconds: float, failed: int, done: int | None = None
) -> Result:
    rate = (sc.total if done is None else done) / seconds
    stats = sim.stats()
    return Result(
        seconds=seconds,
        rate=rate,
        fraction=rate / sc.bound,
        efficiency=sc.shortest / seconds if done is None else rate / sc.bound,
        rate_limited=stats.rate_limited,
        limited_by=(
            f"global {stats.global_limited}, chat {stats.chat_limited}, group {stats.group_limited}"
        ),
        order_violations=order_violations(sim, sc.chats),
        failed=failed,
        done=sc.total if done is None else done,
    )


def run_outbound(sc: Scenario) -> Result:
    limits = RateLimits(overall=Rate(int(OVERALL)), per_chat=Rate(int(PER_CHAT)))
    with (
        simulator() as sim,
        TelegramSender(sim.token, base_url=sim.url) as telegram,
        Dispatcher(max_inflight=MAX_INFLIGHT, queue_size=max(64, sc.messages)) as dispatcher,
    ):
        sender = chain(metrics(), retry(), rate_limit(limits), timeout(5.0))(telegram)
        out = Outbound(dispatcher, sender)
        start = time.monotonic()
        futures = [
            out.reply_text(chat, f"broadcast {i}")
            for chat in range(1, sc.chats + 1)
            for i in range(sc.messages)
        ]
        failed = sum(1 for f in futures if f.exception(WAIT) is not None)
        seconds = time.monotonic() - start
        return summarize(sc, sim, seconds, failed)


def run_naive(sc: Scenario, budget: float) -> Result:
    """ThreadPoolExecutor + a lock per chat; sleeps on 429 holding thread and lock.

    Stopped after ``budget`` seconds if not done: its rate is what it
    delivered by then.
    """
    locks: defaultdict[int, threading.Lock] = defaultdict(threading.Lock)
    stop = threading.Event()
    with (
        simulator() as sim,
        TelegramSender(sim.token, base_url=sim.url, timeout=5.0) as telegram,
        ThreadPoolExecutor(max_workers=MAX_INFLIGHT) as pool,
    ):

        def send(chat: int, text: str) -> SendResult:
            request = SendRequest(chat, TextMessage(text))
            with locks[chat]:
                while not stop.is_set():
                    try:
                        return telegram.send(request)
                    except RateLimited as exc:
                        time.sleep(exc.retry_after)
                raise TimeoutError("out of time")

        start = time.monotonic()
        futures: list[Future[SendResult]] = [
            pool.submit(send, chat, f"broadcast {i}")
            for chat in range(1, sc.chats + 1)
            for i in range(sc.messages)
        ]
        wait(futures, timeout=budget)
        seconds = time.monotonic() - start
        done = sim.stats().delivered
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        failed = sum(1 for f in futures if f.cancelled() or f.exception() is not None)
        if done == sc.total:
            return summarize(sc, sim, seconds, failed)
        return summarize(sc, sim, seconds, failed, done)


def report(label: str, sc: Scenario, r: Result) -> None:
    print(
        f"{label:>8} {sc.name:>14}: {r.done}/{sc.total} msgs in {r.seconds:.2f}s "
        f"= {r.rate:.0f} msgs/s, "
        f"{r.fraction:.1%} of the bound {sc.bound:.0f}/s, efficiency {r.efficiency:.1%}; "
        f"429s {r.rate_limited} ({r.rate_limited / max(1, r.done):.2%} of those sent: "
        f"{r.limited_by}), "
        f"order violations {r.order_violations}, failed or cut off {r.failed}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parser.parse_args(argv)
    if args.quick:
        scenarios = [Scenario("per-chat-bound", 20, 20), Scenario("overall-bound", 100, 5)]
    else:
        scenarios = [Scenario("per-chat-bound", 40, 40), Scenario("overall-bound", 300, 8)]
    print(
        f"limits: {PER_CHAT:g}/s per chat, {OVERALL:g}/s overall; latency {LATENCY * 1000:g} ms; "
        f"max_inflight={MAX_INFLIGHT}"
    )
    results = [(sc, run_outbound(sc)) for sc in scenarios]
    for sc, r in results:
        report("outbound", sc, r)
    naive_sc = scenarios[0]
    naive = run_naive(naive_sc, budget=4.0 if args.quick else 15.0)
    report("naive", naive_sc, naive)
    first = results[0][1]
    ratio = first.rate / naive.rate
    print(f"outbound / naive on {naive_sc.name}: {ratio:.2f}x")

    total = sum(sc.total for sc, _ in results)
    limited = sum(r.rate_limited for _, r in results)
    headline = {
        "fraction_of_bound_min": round(min(r.fraction for _, r in results), 3),
        "efficiency_min": round(min(r.efficiency for _, r in results), 3),
        **{f"{sc.name}_msgs_per_s": round(r.rate, 1) for sc, r in results},
        **{f"{sc.name}_bound": sc.bound for sc, _ in results},
        "rate_limited": limited,
        "rate_limited_pct": round(100.0 * limited / total, 3),
        "order_violations": sum(r.order_violations for _, r in results),
        "failed": sum(r.failed for _, r in results),
        "naive_msgs_per_s": round(naive.rate, 1),
        "naive_rate_limited": naive.rate_limited,
        "naive_order_violations": naive.order_violations,
        "ratio_vs_naive": round(ratio, 2),
    }
    targets = {
        "fraction_90pct": headline["fraction_of_bound_min"] >= 0.9,
        "no_order_violation": headline["order_violations"] == 0,
        "429s_under_1pct": headline["rate_limited_pct"] < 1.0,
    }
    print("targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in targets.items()))
    print(json.dumps(headline | {"targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
