"""``python -m outbound demo``: a broadcast to a local stand-in platform, end to end.

It starts :class:`~outbound.simulator.PlatformSimulator` on loopback with
Telegram-like limits scaled down so that the run takes seconds, enqueues a
broadcast (every chat gets its messages, in order) into a durable outbox
(SQLite in a temporary directory, or ``--db``) in one transaction, and
relays it through a :class:`~outbound.Dispatcher` and the middleware chain
(metrics → retry → rate limit → timeout → the Telegram sender over real
HTTP); ``--direct`` skips the outbox and replies through
:class:`~outbound.Outbound`. It shows live progress and ends with a summary:
throughput against what the platform's limits allow, per-chat order as the
platform recorded it, latency percentiles, 429s, and whether anything was
lost.

With ``--db``, the outbox is the table ``--table`` (default ``outbox``, the
table ``python -m outbound outbox`` looks at) and stays there after the
run, so that it can be inspected. The demo writes only into a table that
holds nothing but its own rows, and a row an earlier, interrupted run left
unfinished is marked dead (its stand-in platform is gone), so the same
command runs again and again; one at a time per table (a second run
started while one runs is refused). SIGTERM stops it like Ctrl-C.

Needs nothing but the package. Blocks until the broadcast is done.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TextIO, cast

from . import middleware
from ._log import log_failures
from .dispatcher import Dispatcher
from .errors import OutboxError, PermanentSendError, StoreError
from .messages import Sender, SendRequest, SendResult, TextMessage
from .outbox import EventBus, OutboxMessage, PostgresStore, Relay, SQLiteStore
from .outbox.cli import (
    BROKEN_PIPE_STATUS,
    _CannotWrite,
    _Output,
    database_of,
    mask_password,
    quiet_broken_pipe,
)
from .outbox.web import StatusMonitor, StatusServer
from .outbox.web.cli import sigterm_stops
from .ratelimit import Rate, RateLimits
from .reply import Outbound
from .simulator import PlatformSimulator, SimulatorConfig, SimulatorStats
from .telegram import TelegramSender

__all__ = ["DEMO_TYPE", "add_parser", "main", "run"]

#: The outbox type of the demo's rows; a table holding unfinished rows of
#: another type belongs to someone else, and the demo leaves it alone.
DEMO_TYPE = "outbound.demo"


class DemoError(Exception):
    """A problem with the demo's arguments or database: one line for the user."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``demo`` subcommand on an ``argparse`` subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="broadcast to a local stand-in chat platform and report",
        description=_DESCRIPTION,
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
        "--latency", type=_seconds, default=0.02, help="platform latency, seconds (default 0.02)"
    )
    parser.add_argument("--inflight", type=_inflight, default=16, help="max_inflight (default 16)")
    path = parser.add_mutually_exclusive_group()
    path.add_argument(
        "--db",
        default=None,
        help="outbox database, kept after the run: a SQLite file or a postgresql:// URL "
        "(default: SQLite in a temporary directory, deleted at the end)",
    )
    path.add_argument(
        "--direct", action="store_true", help="reply through the dispatcher, without the outbox"
    )
    parser.add_argument(
        "--table",
        default=None,
        help="outbox table (default: outbox), in --db or the temporary file",
    )
    parser.add_argument(
        "--serve",
        nargs="?",
        const=0,
        default=None,
        type=_port,
        metavar="PORT",
        help="serve the outbox's status page on 127.0.0.1 while the demo runs, and after it "
        "until Ctrl-C (PORT: default any free one)",
    )


_DESCRIPTION = (
    "Broadcast to a local stand-in chat platform through outbound and report: "
    "throughput against the platform's limits, per-chat order, latency, 429s, "
    "and whether anything was lost. With --db the outbox stays in that database "
    "for 'python -m outbound outbox --db ... status'."
)


#: The most relay handler threads (the relay's own bound), and the longest
#: stand-in latency: a demo of hours shows nothing.
_MAX_INFLIGHT = 10_000
_MAX_LATENCY = 3600.0
#: The most messages one demo sends.
_MAX_TOTAL = 10_000_000


def _positive_int(text: str, maximum: int = 1_000_000) -> int:
    digits = text.strip()
    value = int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 12 else 0
    if not 1 <= value <= maximum:
        raise argparse.ArgumentTypeError(
            f"must be a whole number from 1 to {maximum:,}, not {text!r}"
        )
    return value


def _inflight(text: str) -> int:
    return _positive_int(text, _MAX_INFLIGHT)


def _port(text: str) -> int:
    digits = text.strip()
    value = int(digits) if digits.isascii() and digits.isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 0 to 65535, not {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= _MAX_LATENCY:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from 0 to {_MAX_LATENCY:g}, not {text!r}"
        )
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the demo with command-line arguments; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m outbound demo", description=_DESCRIPTION)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the demo; 0 if every message arrived, in order; 1 otherwise.

    Blocks. SIGTERM (in the main thread) raises ``KeyboardInterrupt`` like
    Ctrl-C, after which everything the run started is stopped and removed.

    A bad ``--db`` or a database that cannot be used or fails is one line
    on standard error and status 1 (2 for bad usage, such as a URL of an
    unsupported kind).
    """
    try:
        # SIGTERM stops the demo the way Ctrl-C does: sends under way finish
        # (within a bound), the stand-in platform and the status page stop,
        # and a temporary outbox is deleted.
        with sigterm_stops():
            if out is not None:
                return _run(args, out)
            # Text the output cannot carry is escaped; a closed or failing
            # output (>&-, a full disk) is one line on standard error.
            stdout = _Output(sys.stdout)
            try:
                status = _run(args, cast(TextIO, stdout))
                stdout.flush()
            except BrokenPipeError:  # piped into head: stop quietly
                quiet_broken_pipe()
                return BROKEN_PIPE_STATUS
            return status
    except _CannotWrite as exc:
        quiet_broken_pipe()
        message, status = f"cannot write to standard output: {exc}", 1
    except DemoError as exc:
        message, status = str(exc), exc.status
    except OutboxError as exc:  # the database failed during the run
        message, status = f"the outbox failed: {exc}", 1
    # One line, even when a driver's message has several; never a password.
    print(f"demo: {mask_password(' '.join(message.split()))}", file=sys.stderr)
    return status


def _table(args: argparse.Namespace) -> str:
    return "outbox" if args.table is None else str(args.table)


def _run(args: argparse.Namespace, out: TextIO) -> int:
    if args.direct and args.table is not None:
        raise DemoError("--table names the outbox table; --direct sends without an outbox", 2)
    serve = getattr(args, "serve", None)
    if args.direct and serve is not None:
        raise DemoError("--serve shows the outbox; --direct sends without an outbox", 2)
    total = args.chats * args.messages
    if total > _MAX_TOTAL:
        raise DemoError(
            f"--chats x --messages is {total:,} messages, over the demo's {_MAX_TOTAL:,}", 2
        )
    chats = [1000 + i for i in range(args.chats)]
    bound = min(args.global_rate, args.chats * args.chat_rate)
    config = SimulatorConfig(
        global_rate=args.global_rate, chat_rate=args.chat_rate, latency=args.latency
    )
    limits = RateLimits(overall=Rate(args.global_rate), per_chat=Rate(args.chat_rate))
    metrics = middleware.metrics()
    texts = [f"message {n} of {args.messages}" for n in range(args.messages)]
    with contextlib.ExitStack() as stack:
        # The database first: a bad --db ends the demo before anything starts.
        store = None if args.direct else _open_store(args, stack)
        path = "directly through Outbound.reply" if args.direct else "through the outbox"
        print(
            f"outbound demo: {args.chats} chats x {args.messages} messages = {total}, {path}; "
            f"platform limits {args.global_rate}/s overall and {args.chat_rate}/s per chat "
            f"(so at most {bound}/s), max_inflight={args.inflight}",
            file=out,
        )
        if store is not None:
            where = mask_password(args.db) if args.db else "a temporary SQLite file"
            print(f"outbox: table {store.table!r} in {where}", file=out)
        server = None if store is None or serve is None else _serve(store, serve, stack, out)
        platform = stack.enter_context(PlatformSimulator(config))
        print(f"stand-in platform at {platform.url}", file=out)
        sender = middleware.chain(
            metrics,
            middleware.retry(),
            middleware.rate_limit(limits),
            middleware.timeout(),
        )(TelegramSender(platform.token, base_url=platform.url))
        started = time.monotonic()
        if store is None:
            latencies, failed = _broadcast_direct(args, out, sender, chats, texts, platform)
        else:
            latencies, failed = _broadcast_outbox(store, args, out, sender, chats, texts, platform)
        elapsed = time.monotonic() - started
        stats = platform.stats()
        in_order = all([m["text"] for m in platform.received(chat)] == texts for chat in chats)
        status = _report(out, metrics, config, chats, total, elapsed, stats, latencies)
        ok = in_order and status == 0 and not failed
        lost = total - stats.delivered
        print(
            f"per-chat order as received: {'kept' if in_order else 'BROKEN'}",
            file=out,
        )
        print(f"nothing lost: {'yes' if ok else f'NO ({lost} missing, {failed} failed)'}", file=out)
        if args.db and not args.direct:
            table = "" if _table(args) == "outbox" else f" --table {shlex.quote(args.table)}"
            db = mask_password(args.db)
            print(
                f"the outbox stays in {db}: "
                f"python -m outbound outbox --db {shlex.quote(db)}{table} status",
                file=out,
            )
        if server is not None:
            _linger(server, out)
    return 0 if ok else 1


def _serve(
    store: SQLiteStore | PostgresStore, port: int, stack: contextlib.ExitStack, out: TextIO
) -> StatusServer:
    """The status page of the demo's outbox, on loopback, closed by ``stack``."""
    try:
        server = StatusServer(
            StatusMonitor(store, window=120.0, bucket=1.0), "127.0.0.1", port, refresh=1.0
        )
    except OSError as exc:
        reason = exc.strerror or exc
        raise DemoError(f"cannot serve the status page on port {port}: {reason}") from None
    stack.callback(server.close)
    server.start()
    print(f"status page: {server.url} (open it to watch the broadcast)", file=out, flush=True)
    return server


def _linger(server: StatusServer, out: TextIO) -> None:
    """Keep the status page up until Ctrl-C (or SIGTERM)."""
    print(f"the status page stays up at {server.url}: Ctrl-C to stop", file=out, flush=True)
    with sigterm_stops():
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


def _report(
    out: TextIO,
    metrics: middleware.Metrics,
    config: SimulatorConfig,
    chats: list[int],
    total: int,
    elapsed: float,
    stats: SimulatorStats,
    latencies: list[float],
) -> int:
    """Print throughput, latency and 429s; 1 if messages are missing, else 0."""
    snapshot = metrics.snapshot()
    ordered = sorted(latencies) or [0.0]
    allowed, rate, burst = _most_allowed(config, len(chats), elapsed)
    print(
        f"\nsent {stats.delivered}/{total} in {elapsed:.2f} s: "
        f"{stats.delivered / elapsed:.1f} messages/s",
        file=out,
    )
    print(
        f"throughput: {stats.delivered / allowed:.0%} of the most the platform's limits allow "
        f"in that time ({rate:g}/s after a first burst of {burst:g})",
        file=out,
    )
    print(
        f"latency enqueue -> sent: p50 {ordered[len(ordered) // 2]:.2f} s, "
        f"p99 {ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]:.2f} s",
        file=out,
    )
    print(
        f"429s from the platform: {stats.rate_limited}; times the client-side limiter held a "
        f"send back until the platform would take it: {snapshot.deferred.get('throttled', 0)}",
        file=out,
    )
    return 0 if stats.delivered == total else 1


def _most_allowed(
    config: SimulatorConfig, chats: int, seconds: float
) -> tuple[float, float, float]:
    """The most messages the platform's limits let through in ``seconds``.

    Each limit is a token bucket that starts full (its burst) and refills
    at its rate, and the platform forgives arrivals up to ``tolerance``
    early, so ``seconds`` allow ``burst + rate * (seconds + tolerance)``;
    a short run gets more than ``rate`` per second out of the first burst.
    Returns that number for the tightest limit, with its rate and burst.
    """
    window = seconds + config.tolerance
    candidates: list[tuple[float, float, float]] = []
    if config.global_rate is not None:
        burst = config.global_burst or max(1.0, config.global_rate)
        candidates.append((burst + config.global_rate * window, config.global_rate, burst))
    if config.chat_rate is not None:
        burst = chats * (config.chat_burst or max(1.0, config.chat_rate))
        rate = chats * config.chat_rate
        candidates.append((burst + rate * window, rate, burst))
    return min(candidates, default=(math.inf, math.inf, math.inf))


def _open_store(
    args: argparse.Namespace, stack: contextlib.ExitStack
) -> SQLiteStore | PostgresStore:
    """The demo's outbox, its schema created; closed (and deleted if temporary) by ``stack``.

    Raises :class:`DemoError` when ``--db`` or ``--table`` cannot be used.
    """
    try:
        store: SQLiteStore | PostgresStore
        if args.db is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="outbound-demo-"))
            store = SQLiteStore(os.path.join(tmp, "outbox.db"), table=_table(args))
        else:
            store = _store_at(args.db, _table(args))
    except (TypeError, ValueError) as exc:
        raise DemoError(str(exc), status=2) from None
    except (ImportError, OutboxError) as exc:
        raise DemoError(f"cannot use the outbox database {args.db}: {exc}") from None
    stack.callback(store.close)
    if args.db is not None:
        _hold_the_table(store, stack)
    _check_table_is_the_demos(store, args.db)
    return store


def _hold_the_table(store: SQLiteStore | PostgresStore, stack: contextlib.ExitStack) -> None:
    """Make this run the only demo on ``store``'s table until ``stack`` closes, or refuse.

    Two runs on one table would relay each other's rows (and mark them
    dead as left by an interrupted run). On PostgreSQL a session advisory
    lock named after the table, on its own connection; on SQLite an
    exclusive lock on a file beside the database (``<file>.<table>.demo-lock``,
    removed at the end). Raises :class:`DemoError` when another run holds
    it; blocks on the database only to connect.
    """
    where = mask_password(str(store.conninfo if isinstance(store, PostgresStore) else store.path))
    busy = (
        f"another demo is running on table {store.table!r} in {where}{{who}}: wait for it "
        "to end, or give this run another --table or --db"
    )
    if isinstance(store, PostgresStore):
        try:
            conn = store.connect()
            conn.autocommit = True
            stack.callback(conn.close)
            row = conn.execute(
                "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))",
                (f"outbound.demo:{store.table}",),
            ).fetchone()
            got = bool(row and row[0])
        except Exception as exc:  # psycopg.Error, or StoreError from connect
            raise DemoError(f"cannot use the outbox database {where}: {exc}") from None
        if not got:
            raise DemoError(busy.format(who=""))
        return
    # Beside the file itself, however --db reaches it (a symlink, another
    # spelling): two runs on one table take one lock. (A hard link elsewhere
    # is another name for the file: not covered.)
    path = f"{os.path.realpath(store.path)}.{store.table}.demo-lock"
    try:
        holder = _lock_file(path)
    except OSError as exc:  # (a full disk, a folder it may not write in)
        raise DemoError(f"cannot make the demo's lock file {path}: {exc.strerror or exc}") from None
    if isinstance(holder, str):
        raise DemoError(busy.format(who=f" (process {holder})" if holder else ""))
    stack.callback(_unlock_file, path, holder)


def _lock_file(path: str) -> int | str:
    """An exclusive lock on ``path`` (created): its descriptor, or the pid of the holder
    ("" if unknown). Never blocks."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_lock(fd):
                holder = os.read(fd, 32).decode("ascii", "replace").strip()
                os.close(fd)
                return holder
            # The previous holder may have removed the file between our open
            # and our lock: hold the file that is at ``path`` now, or retry.
            if os.path.exists(path) and os.path.samestat(os.fstat(fd), os.stat(path)):
                os.ftruncate(fd, 0)
                os.write(fd, str(os.getpid()).encode())
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _try_lock(fd: int) -> bool:
    if sys.platform == "win32":  # pragma: no cover - not tested here
        import msvcrt  # noqa: PLC0415

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl  # noqa: PLC0415

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _unlock_file(path: str, fd: int) -> None:
    """Remove the lock file, then release it (a run waiting to lock it retries)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    os.close(fd)


def _store_at(db: str, table: str) -> SQLiteStore | PostgresStore:
    """The store a ``--db`` value names, read as ``outbox --db`` reads it (so the
    printed follow-up finds it), its schema created (a SQLite file is created)."""
    kind, where = database_of(db)
    if kind == "postgresql":
        return PostgresStore(where, table=table)
    folder = os.path.dirname(os.path.abspath(where))
    if not os.path.isdir(folder):
        raise DemoError(f"cannot create the SQLite file {where}: no directory {folder}")
    return SQLiteStore(where, table=table)


def _check_table_is_the_demos(store: SQLiteStore | PostgresStore, db: str | None) -> None:
    """Refuse a table with unfinished rows of another type, wherever they are in it:
    the demo's relay would take them."""
    mark = "?" if isinstance(store, SQLiteStore) else "%s"
    sql = (
        f"SELECT id, type FROM {store.table} WHERE status IN ('pending', 'processing') "
        f"AND type <> {mark} LIMIT 1"
    )
    conn = store.connect()
    try:
        found = conn.execute(sql, (DEMO_TYPE,)).fetchone()
    finally:
        conn.close()
    if found is not None:
        raise DemoError(
            f"table {store.table!r} in {db} holds unfinished rows that are not the "
            f"demo's (row {found[0]}, type {found[1]!r}): its relay would deliver "
            "them; choose another table with --table, or another --db"
        )


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


# Seconds an interrupted demo waits for the sends already under way.
_STOP_TIMEOUT = 5.0

_LEFT_BEHIND = "left by an earlier demo run whose stand-in platform is gone"


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
    dispatcher = Dispatcher(max_inflight=args.inflight, queue_size=len(texts))
    futures = []
    try:
        outbound = Outbound(dispatcher, sender)
        for text in texts:
            for chat in chats:
                future = outbound.reply_text(chat, text)
                future.add_done_callback(when_done(time.monotonic()))
                futures.append(future)
        _progress(out, tally, lambda: dispatcher.stats().queued, platform, started)
    except BaseException:
        # Interrupted: drop the queued rest at once, and wait for the sends
        # under way within the demo's bound, not each to its own timeout.
        dispatcher.force_close()
        dispatcher.shutdown(_STOP_TIMEOUT)
        raise
    dispatcher.shutdown()
    return tally.latencies, sum(1 for f in futures if f.exception() is not None)


def _broadcast_outbox(
    store: SQLiteStore | PostgresStore,
    args: argparse.Namespace,
    out: TextIO,
    sender: Sender,
    chats: list[int],
    texts: list[str],
    platform: PlatformSimulator,
) -> tuple[list[float], int]:
    """Enqueue the broadcast in one transaction, relay it; return latencies and dead rows.

    Rows of an earlier run that it left unfinished (interrupted) go dead:
    the platform they were meant for is gone.
    """
    tally = _Tally(len(chats) * len(texts))
    run_id = uuid.uuid4().hex
    stale: list[int] = []  # ids of rows left by earlier runs; list.append is thread-safe

    def deliver(message: OutboxMessage) -> None:
        payload = message.payload
        if payload.get("run") != run_id:
            stale.append(message.id)
            raise PermanentSendError(_LEFT_BEHIND)
        sender.send(SendRequest(payload["chat_id"], TextMessage(payload["text"])))
        tally.add(time.time() - message.created_at)

    bus = EventBus()
    bus.subscribe(DEMO_TYPE, deliver)
    # Rows an earlier run's relay held when it died (killed, or stopped past
    # its bound) wait for its lease, on the chats this run sends to: dead now
    # (this run holds the table's demo lock: no other demo's relay has them).
    left = _dead_letter_leftovers(store)
    dead_before = store.status().counts.get("dead", 0)
    conn = store.connect()
    try:
        with conn:  # one transaction: all of the broadcast, or none of it
            for text in texts:
                for chat in chats:
                    store.enqueue(
                        conn,
                        key=str(chat),
                        type=DEMO_TYPE,
                        payload={"chat_id": chat, "text": text, "run": run_id},
                    )
    except _driver_errors() as exc:  # (the commit's own: a full disk, say)
        raise StoreError(f"the broadcast could not be written: {exc}") from exc
    finally:
        conn.close()
    started = time.monotonic()
    relay = Relay(store, bus, max_inflight=args.inflight, poll_interval=0.05)
    # (The relay's database errors, one line each on standard error: a full
    # disk left the progress lines counting nothing, and nothing said why.)
    with log_failures("demo", verbosity=0):
        try:
            # (Within: a signal as start() returned left the relay running.)
            relay.start()

            def unfinished() -> int:
                counts = store.status().counts
                return counts.get("pending", 0) + counts.get("processing", 0)

            # Ends when every send is in, or when nothing is left to try
            # (rows that failed for good are dead and counted below).
            _progress(out, tally, unfinished, platform, started, stop_at_zero=True)
        finally:
            # Interrupted: what was claimed finishes (within a bound); the rest
            # stays pending, and the next run marks it dead.
            if not relay.stop(_STOP_TIMEOUT):
                relay.force_stop(_STOP_TIMEOUT)
    if stale or left:
        print(
            f"rows an earlier, interrupted run left unfinished: {len(stale) + left}, now dead",
            file=out,
        )
    dead = store.status().counts.get("dead", 0) - dead_before - len(stale)
    return tally.latencies, dead


def _driver_errors() -> tuple[type[BaseException], ...]:
    """The database drivers' errors (psycopg's if it was imported): a commit raises them."""
    errors: list[type[BaseException]] = [sqlite3.Error]
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None:
        errors.append(psycopg.Error)
    return tuple(errors)


def _dead_letter_leftovers(store: SQLiteStore | PostgresStore) -> int:
    """Mark dead the rows being processed in the demo's table; return how many."""
    done = 0
    for _ in range(10):  # 10,000 at a time: at most 100,000 (a demo sends no more at once)
        ids = [r.id for r in store.rows(status="processing", limit=10_000)]
        if not ids:
            break
        done += store.dead_letter(ids, reason=_LEFT_BEHIND)
    return done


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
