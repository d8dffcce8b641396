"""``manage.py outbound_worker``: deliver the outbox to ``OUTBOUND["handlers"]`` until stopped.

Runs one relay in this process (claims committed rows, runs their
handlers, writes back the outcome; see :class:`~outbound.outbox.Relay`).
Run as many workers as you like, on any machines: per-key order and
``max_concurrency`` hold across all of them.

SIGTERM or SIGINT stops it gracefully: no new claims; the rows already
claimed finish, for at most ``drain_timeout`` seconds; then whatever is
left is abandoned to its lease (another worker delivers it once the lease
expires) and the process exits with status 1 at once (after at most one
more second to record what finished), even if a handler never returns.
A second signal stops at once the same way. Exit status 0 after a
complete drain.

Each failed delivery is one line on standard error (a retry, a dead row),
never a traceback, unless logging is configured for ``outbound`` (Django's
``LOGGING``): then the records go there instead. ``-v 0`` shows only dead
rows and errors.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbound.contrib.django.conf import get_settings
from outbound.contrib.django.outbox import build_bus, build_relay, close_stores, get_store
from outbound.contrib.django.sending import shutdown
from outbound.errors import OutboxError
from outbound.outbox import RelayState

# Longest one wait lasts before the command looks at the relay again.
_TICK = 0.5
# Seconds a forced stop waits for running handlers to return: after the
# drain, or when the relay stops on an error.
_FORCE_TIMEOUT = 1.0


class Command(BaseCommand):  # type: ignore[misc]
    _abandoned = False  # set when a drain did not finish: run_from_argv exits at once

    help = "Deliver the outbound outbox to OUTBOUND['handlers'] until SIGTERM or SIGINT."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default=None, help="database alias (OUTBOUND 'using')")
        parser.add_argument("--batch-size", type=int, default=None)
        parser.add_argument("--max-inflight", type=int, default=None)
        parser.add_argument("--max-concurrency", type=int, default=None)
        parser.add_argument("--poll-interval", type=float, default=None)
        parser.add_argument("--drain-timeout", type=float, default=None, metavar="SECONDS")
        parser.add_argument("--name", default=None, help="a label added to the lease owner id")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            conf = get_settings()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        if not conf.handlers:
            raise CommandError("OUTBOUND['handlers'] is empty: no outbox type to deliver")
        overrides = {
            name: options[name]
            for name in ("batch_size", "max_inflight", "max_concurrency", "poll_interval", "name")
            if options[name] is not None
        }
        drain = options["drain_timeout"]
        drain = conf.relay.drain_timeout if drain is None else drain
        if drain < 0:
            raise CommandError("--drain-timeout must be >= 0")
        using = options["database"] or conf.using
        try:
            bus = build_bus()
            store = get_store(using)
            store.create_schema()
            relay = build_relay(bus, using=using, **overrides)
        except (ImportError, ImproperlyConfigured, OutboxError, TypeError, ValueError) as exc:
            raise CommandError(f"cannot start the outbox relay: {exc}") from exc

        signals = _Signals()
        signals.install()
        deadline: float | None = None
        drained = False
        try:
            with _log_failures(int(options.get("verbosity", 1))):
                try:
                    relay.start()
                except OutboxError as exc:
                    raise CommandError(f"cannot start the outbox relay: {exc}") from exc
                self.stdout.write(
                    f"outbound_worker: relaying table {store.table!r} of database {using!r} "
                    f"as {relay.owner} (types: {', '.join(sorted(bus.types()))})",
                )
                self.stdout.flush()
                while not signals.stop.wait(_TICK):
                    if relay.state is RelayState.STOPPED:
                        raise CommandError("the outbox relay stopped on an error (see the log)")
                deadline = time.monotonic() + drain
                self.stdout.write(
                    f"outbound_worker: stopping, draining claimed rows (at most {drain:g}s)"
                )
                self.stdout.flush()
                drained = _drain(relay, deadline, signals.forced)
        finally:
            if relay.state is not RelayState.STOPPED and deadline is None:
                relay.force_stop(_FORCE_TIMEOUT)
            # The replies the handlers queued: what is left of the drain.
            left = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
            shutdown(left if drained else 0.0)
            close_stores()
            signals.restore()
        stats = relay.stats()
        summary = (
            f"outbound_worker: stopped; sent {stats.sent}, retried {stats.retried}, "
            f"dead {stats.dead}"
        )
        if not drained:
            # Handlers that did not return hold threads (and the exit hooks
            # of their dispatchers would wait for them): run_from_argv ends
            # the process without waiting.
            self._abandoned = True
            raise CommandError(
                f"{summary}; the drain did not finish in {drain:g}s: unfinished rows return "
                "to pending when their lease expires",
                returncode=1,
            )
        self.stdout.write(summary)

    def run_from_argv(self, argv: list[str]) -> None:
        """As Django runs it (``manage.py outbound_worker``): after an unfinished drain, the
        process exits at once, without waiting for the handlers still running."""
        self._abandoned = False
        try:
            super().run_from_argv(argv)
        except SystemExit as exc:
            if self._abandoned:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(exc.code if isinstance(exc.code, int) else 1)
            raise


def _drain(relay: Any, deadline: float, forced: threading.Event) -> bool:
    """Stop ``relay`` gracefully by ``deadline``; force it on a second signal or at the end."""
    while True:
        left = deadline - time.monotonic()
        if relay.stop(max(0.0, min(_TICK, left))):
            return True
        if forced.is_set() or left <= 0:
            relay.force_stop(_FORCE_TIMEOUT)
            return False


class _OneLine(logging.Formatter):
    """``outbound_worker: <message>``; an exception as its type and message, on the same line."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if message.startswith("outbound: "):
            message = message[len("outbound: ") :]
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            message = f"{message}: {type(error).__name__}: {' '.join(str(error).split())}"
        return f"outbound_worker: {message}"


class _RelayRecords(logging.Filter):
    """INFO from the relay itself (retries); WARNING and above from every ``outbound`` logger
    (so that the sending layer's per-send INFO records stay out)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name == "outbound"


def _configured(logger: logging.Logger) -> bool:
    """True if records of ``logger`` reach a handler other than a NullHandler."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


@contextmanager
def _log_failures(verbosity: int) -> Iterator[None]:
    """Failures (retries, dead rows, database errors) as one line each on stderr, unless
    logging is configured for ``outbound`` already. Not thread-safe (main thread only)."""
    logger = logging.getLogger("outbound")
    if _configured(logger):
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    handler.addFilter(_RelayRecords())
    level = logger.level
    logger.setLevel(logging.INFO if verbosity >= 1 else logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _Signals:
    """SIGTERM/SIGINT handlers: the first sets ``stop``, the next ones ``forced``.

    Installed only in the main thread (where Python runs signal handlers);
    :meth:`restore` puts the previous handlers back.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.forced = threading.Event()
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop.is_set():
            self.forced.set()
        self.stop.set()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
