"""``manage.py outbound_worker``: deliver the outbox to ``OUTBOUND["handlers"]`` until stopped.

Runs one relay in this process (claims committed rows, runs their
handlers, writes back the outcome; see :class:`~outbound.outbox.Relay`).
Run as many workers as you like, on any machines: per-key order and
``max_concurrency`` hold across all of them.

SIGTERM or SIGINT stops it gracefully: no new claims; the rows already
claimed finish, for at most ``drain_timeout`` seconds; then whatever is
left is abandoned to its lease (another worker delivers it once the lease
expires) and the command exits with status 1. A second signal stops at
once the same way. Exit status 0 after a complete drain.
"""

from __future__ import annotations

import signal
import threading
import time
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
# Seconds a forced stop waits for running handlers to return.
_FORCE_TIMEOUT = 5.0


class Command(BaseCommand):  # type: ignore[misc]
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
        try:
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
            self.stdout.write("outbound_worker: stopping, draining claimed rows")
            self.stdout.flush()
            drained = _drain(relay, drain, signals.forced)
        finally:
            if relay.state is not RelayState.STOPPED:
                relay.force_stop(_FORCE_TIMEOUT)
            shutdown(_FORCE_TIMEOUT)
            close_stores()
            signals.restore()
        stats = relay.stats()
        summary = (
            f"outbound_worker: stopped; sent {stats.sent}, retried {stats.retried}, "
            f"dead {stats.dead}"
        )
        if not drained:
            raise CommandError(
                f"{summary}; the drain did not finish in {drain:g}s: unfinished rows return "
                "to pending when their lease expires",
                returncode=1,
            )
        self.stdout.write(summary)


def _drain(relay: Any, timeout: float, forced: threading.Event) -> bool:
    """Stop ``relay`` gracefully within ``timeout``; force it on a second signal or at the end."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if relay.stop(max(0.0, min(_TICK, left))):
            return True
        if forced.is_set() or left <= 0:
            relay.force_stop(_FORCE_TIMEOUT)
            return False


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
