"""``python -m outbound demo``: a broadcast to a local stand-in platform, end to end.

It starts :class:`~outbound.simulator.PlatformSimulator` on loopback with
Telegram-like limits scaled down so that the run takes seconds, enqueues a
broadcast (every chat gets its messages, in order) into a durable outbox
(SQLite in a temporary directory, or ``--db``) in one transaction, and
relays it through a :class:`~outbound.Dispatcher` and the middleware chain
(metrics → retry → rate limit → timeout → the Telegram sender over real
HTTP); ``--direct`` skips the outbox and replies through
:class:`~outbound.Outbound`. It shows live progress and ends with a summary:
throughput against the limit, per-chat order as the platform recorded it,
latency percentiles, 429s, and whether anything was lost.

Needs nothing but the package. Blocks until the broadcast is done.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TextIO

from . import middleware
from .dispatcher import Dispatcher
from .messages import Sender, SendRequest, SendResult, TextMessage
from .outbox import EventBus, OutboxMessage, PostgresStore, Relay, SQLiteStore
from .outbox.cli import open_store
from .ratelimit import Rate, RateLimits
from .reply import Outbound
from .simulator import PlatformSimulator, SimulatorConfig
from .telegram import TelegramSender

__all__ = ["add_parser", "main", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``demo`` subcommand on an ``argparse`` subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="broadcast to a local stand-in chat platform and report",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chats", type=_positive_int, default=40, help="chats (default 40)")
    parser.add_argument(
        "--messages", type=_positive_int, default=10, help="messages per chat (default 10)"
    )
    parser.add_argument(
        "--chat-rate",
        type=_positive_int,
        default=2,
        help="platform limit per chat, messages/s (default 2)",
    )
    parser.add_argument(
        "--global-rate",
        type=_positive_int,
        default=60,
        help="platform limit overall, messages/s (default 60)",
    )
    parser.add_argument(
        "--latency", type=float, default=0.02, help="platform latency, seconds (default 0.02)"
    )
    parser.add_argument(
        "--inflight", type=_positive_int, default=16, help="max_inflight (default 16)"
    )
    parser.add_argument(
        "--db",
        default=None,
        help="outbox database: a SQLite path or a postgresql:// URL "
        "(default: SQLite in a temporary directory)",
    )
    parser.add_argument(
        "--direct", action="store_true", help="reply through the dispatcher, without the outbox"
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the demo with command-line arguments; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m outbound demo", description=__doc__)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the demo; 0 if every message arrived, in order; 1 otherwise."""
    out = out if out is not None else sys.stdout
    chats = [1000 + i for i in range(args.chats)]
    total = args.chats * args.messages
    bound = min(args.global_rate, args.chats * args.chat_rate)
    config = SimulatorConfig(
        global_rate=args.global_rate, chat_rate=args.chat_rate, latency=args.latency
    )
    limits = RateLimits(overall=Rate(args.global_rate), per_chat=Rate(args.chat_rate))
    metrics = middleware.metrics()
    path = "directly through Outbound.reply" if args.direct else "through the outbox"
    print(
        f"outbound demo: {args.chats} chats x {args.messages} messages = {total}, {path}; "
        f"platform limits {args.global_rate}/s overall and {args.chat_rate}/s per chat "
        f"(bound {bound}/s), max_inflight={args.inflight}",
        file=out,
    )
    texts = [f"message {n} of {args.messages}" for n in range(args.messages)]
    with PlatformSimulator(config) as platform:
        print(f"stand-in platform at {platform.url}", file=out)
        sender = middleware.chain(
            metrics,
            middleware.retry(),
            middleware.rate_limit(limits),
            middleware.timeout(),
        )(TelegramSender(platform.token, base_url=platform.url))
        started = time.monotonic()
        if args.direct:
            latencies, failed = _broadcast_direct(args, out, sender, chats, texts, platform)
        else:
            latencies, failed = _broadcast_outbox(args, out, sender, chats, texts, platform)
        elapsed = time.monotonic() - started
        stats = platform.stats()
        in_order = all([m["text"] for m in platform.received(chat)] == texts for chat in chats)
    snapshot = metrics.snapshot()
    ordered = sorted(latencies) or [0.0]
    rate = stats.delivered / elapsed
    print(
        f"\nsent {stats.delivered}/{total} in {elapsed:.2f} s: {rate:.1f} messages/s, "
        f"{rate / bound:.0%} of the {bound}/s bound",
        file=out,
    )
    print(
        f"latency enqueue -> sent: p50 {ordered[len(ordered) // 2]:.2f} s, "
        f"p99 {ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]:.2f} s",
        file=out,
    )
    print(
        f"429s from the platform: {stats.rate_limited}; sends deferred by the "
        f"client-side limiter: {snapshot.deferred.get('throttled', 0)}",
        file=out,
    )
    print(f"per-chat order as received: {'kept' if in_order else 'BROKEN'}", file=out)
    lost = total - stats.delivered
    ok = in_order and not lost and not failed
    print(f"nothing lost: {'yes' if ok else f'NO ({lost} missing, {failed} failed)'}", file=out)
    return 0 if ok else 1


class _Tally:
    """Latencies of finished sends; ``done`` is set when ``total`` are in. Thread-safe."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.latencies: list[float] = []
        self.done = threading.Event()
        self._lock = threading.Lock()  # guards latencies; taken by worker threads

    def add(self, seconds: float) -> None:
        with self._lock:
            self.latencies.append(seconds)
            if len(self.latencies) == self.total:
                self.done.set()


def _broadcast_direct(
    args: argparse.Namespace,
    out: TextIO,
    sender: Sender,
    chats: list[int],
    texts: list[str],
    platform: PlatformSimulator,
) -> tuple[list[float], int]:
    """Reply to every chat through a dispatcher; return latencies and failures."""
    tally = _Tally(len(chats) * len(texts))

    def when_done(start: float) -> Callable[[Future[SendResult]], None]:
        return lambda future: tally.add(time.monotonic() - start)

    started = time.monotonic()
    with Dispatcher(max_inflight=args.inflight, queue_size=len(texts)) as dispatcher:
        outbound = Outbound(dispatcher, sender)
        futures = []
        for text in texts:
            for chat in chats:
                future = outbound.reply_text(chat, text)
                future.add_done_callback(when_done(time.monotonic()))
                futures.append(future)
        _progress(out, tally, lambda: dispatcher.stats().queued, platform, started)
    return tally.latencies, sum(1 for f in futures if f.exception() is not None)


def _broadcast_outbox(
    args: argparse.Namespace,
    out: TextIO,
    sender: Sender,
    chats: list[int],
    texts: list[str],
    platform: PlatformSimulator,
) -> tuple[list[float], int]:
    """Enqueue the broadcast in one transaction, relay it; return latencies and dead rows."""
    tally = _Tally(len(chats) * len(texts))

    def deliver(message: OutboxMessage) -> None:
        payload = message.payload
        sender.send(SendRequest(payload["chat_id"], TextMessage(payload["text"])))
        tally.add(time.time() - message.created_at)

    with contextlib.ExitStack() as stack:
        store: SQLiteStore | PostgresStore
        if args.db:
            # A table of its own per run, so that nothing of an earlier or
            # concurrent run mixes in; dropped at the end on PostgreSQL.
            opened = open_store(args.db, table=f"outbound_demo_{os.getpid()}")
            assert isinstance(opened, (SQLiteStore, PostgresStore))
            store = opened
            store.create_schema()
            if isinstance(store, PostgresStore):
                stack.callback(store.drop_schema)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="outbound-demo-"))
            store = SQLiteStore(os.path.join(tmp, "outbox.db"), table="outbound_demo")
        stack.callback(store.close)
        print(f"outbox: {args.db or store}", file=out)
        bus = EventBus()
        bus.subscribe("message", deliver)
        conn = store.connect()
        try:
            with conn:  # one transaction: all of the broadcast, or none of it
                for text in texts:
                    for chat in chats:
                        store.enqueue(
                            conn,
                            key=str(chat),
                            type="message",
                            payload={"chat_id": chat, "text": text},
                        )
        finally:
            conn.close()
        started = time.monotonic()
        relay = Relay(store, bus, max_inflight=args.inflight, poll_interval=0.05)
        with relay.start():

            def unfinished() -> int:
                counts = store.status().counts
                return counts.get("pending", 0) + counts.get("processing", 0)

            # Ends when every send is in, or when nothing is left to try
            # (rows that failed for good are dead and counted below).
            _progress(out, tally, unfinished, platform, started, stop_at_zero=True)
        dead = store.status().counts.get("dead", 0)
    return tally.latencies, dead


def _progress(
    out: TextIO,
    tally: _Tally,
    queued: Callable[[], int],
    platform: PlatformSimulator,
    started: float,
    *,
    stop_at_zero: bool = False,
) -> None:
    """Print a progress line until every send is in, or (``stop_at_zero``) until
    ``queued()`` is 0; a bounded wait per line."""
    tty = out.isatty()
    interval = 0.25 if tty else 1.0
    while not tally.done.wait(interval):
        stats = platform.stats()
        elapsed = time.monotonic() - started
        left = queued()
        if stop_at_zero and left == 0:
            break
        line = (
            f"sent {stats.delivered:>5}/{tally.total}  queued {left:>5}  "
            f"{stats.delivered / elapsed:6.1f}/s  429s {stats.rate_limited}"
        )
        print(f"\r{line}" if tty else line, end="" if tty else "\n", file=out, flush=True)
    if tty:
        print(file=out)
