"""``manage.py outbound_worker``: deliver the outbox to ``OUTBOUND["handlers"]`` until stopped.

Runs one relay in this process (claims committed rows, runs their
handlers, writes back the outcome; see :class:`~outbound.outbox.Relay`).
Run as many workers as you like, on any machines: per-key order and
``max_concurrency`` hold across all of them.

SIGTERM or SIGINT stops it gracefully: no new claims; the rows already
claimed finish, and then the replies their handlers queued, for at most
``drain_timeout`` seconds in all; then whatever is left is abandoned (a row
to its lease: another worker delivers it once the lease expires; a reply
still being sent is given up) and the process exits with status 1 at once
(after at most one more second to record what finished), even if a
handler never returns. A second signal stops at once the same way. Exit
status 0 after a complete drain. A relay that stops on an error ends the
process the same way, status 1, once its handlers return or a second
has passed.

Each failed delivery is one line on standard error (a retry, a dead row),
never a traceback, unless logging is configured for ``outbound`` (Django's
``LOGGING``): then the records go there instead. ``-v 0`` shows only dead
rows and errors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbound.contrib._worker import (
    FORCE_TIMEOUT,
    TICK,
    Signals,
    drain_relay,
    log_failures,
    wait_replies,
)
from outbound.contrib.django.conf import check_relay_option, get_settings
from outbound.contrib.django.outbox import build_bus, build_relay, close_stores, get_store
from outbound.contrib.django.sending import built_dispatcher, shutdown
from outbound.errors import OutboxError
from outbound.outbox import RelayState

# The options checked as their OUTBOUND["relay"] settings are.
_CHECKED = ("batch_size", "max_inflight", "max_concurrency", "poll_interval", "drain_timeout")


def _relay_option(name: str, kind: Callable[[str], int | float]) -> Callable[[str], Any]:
    """An argument type: ``kind`` of the text, checked as ``OUTBOUND["relay"][name]`` is."""

    def parse(text: str) -> Any:
        try:
            return check_relay_option(name, kind(text))
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


class Command(BaseCommand):  # type: ignore[misc]
    _abandoned = False  # set when a drain did not finish: run_from_argv exits at once

    help = "Deliver the outbound outbox to OUTBOUND['handlers'] until SIGTERM or SIGINT."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default=None, help="database alias (OUTBOUND 'using')")
        parser.add_argument(
            "--batch-size",
            type=_relay_option("batch_size", int),
            default=None,
            help="rows claimed at once (OUTBOUND relay)",
        )
        parser.add_argument(
            "--max-inflight",
            type=_relay_option("max_inflight", int),
            default=None,
            help="handlers running at once in this worker (OUTBOUND relay)",
        )
        parser.add_argument(
            "--max-concurrency",
            type=_relay_option("max_concurrency", int),
            default=None,
            help="rows being delivered at once across every worker (OUTBOUND relay)",
        )
        parser.add_argument(
            "--poll-interval",
            type=_relay_option("poll_interval", float),
            default=None,
            metavar="SECONDS",
            help="seconds between looks for new rows (OUTBOUND relay)",
        )
        parser.add_argument(
            "--drain-timeout",
            type=_relay_option("drain_timeout", float),
            default=None,
            metavar="SECONDS",
            help="on SIGTERM or Ctrl-C, how long the claimed rows get to finish (OUTBOUND relay)",
        )
        parser.add_argument("--name", default=None, help="a label added to the lease owner id")

    def handle(self, *args: Any, **options: Any) -> None:
        for name in _CHECKED:  # as parsed already, unless given to call_command()
            if options[name] is not None:
                try:
                    check_relay_option(name, options[name])
                except (TypeError, ValueError) as exc:
                    raise CommandError(f"--{name.replace('_', '-')}: {exc}") from exc
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
        using = options["database"] or conf.using
        try:
            bus = build_bus()
            store = get_store(using)
            store.create_schema()
            relay = build_relay(bus, using=using, **overrides)
        except (ImportError, ImproperlyConfigured, OutboxError, TypeError, ValueError) as exc:
            raise CommandError(f"cannot start the outbox relay: {exc}") from exc

        signals = Signals()
        signals.install()
        deadline: float | None = None
        drained = False
        try:
            with log_failures("outbound_worker", int(options.get("verbosity", 1))):
                try:
                    relay.start()
                except OutboxError as exc:
                    raise CommandError(f"cannot start the outbox relay: {exc}") from exc
                self.stdout.write(
                    f"outbound_worker: relaying table {store.table!r} of database {using!r} "
                    f"as {relay.owner} (types: {', '.join(sorted(bus.types()))})",
                )
                self.stdout.flush()
                if conf.sender is None and conf.telegram_token is None:
                    self.stderr.write(
                        "outbound_worker: warning: no sender: neither "
                        "OUTBOUND['telegram']['token'] (is the environment variable it is "
                        "read from set?) nor OUTBOUND['sender'] is set; a handler's reply "
                        "fails, and its row with it"
                    )
                    self.stderr.flush()
                while not signals.stop.wait(TICK):
                    if relay.state is RelayState.STOPPED:
                        raise CommandError("the outbox relay stopped on an error (see the log)")
                deadline = time.monotonic() + drain
                self._say(f"stopping, draining claimed rows (at most {drain:g}s)")
                drained = drain_relay(relay, deadline, signals.forced)
        finally:
            if deadline is None and not relay.force_stop(FORCE_TIMEOUT):
                # (An error: the relay stopped on its own, or never ran. A handler
                # that did not return: run_from_argv ends the process at once.)
                self._abandoned = True
            # The replies the handlers queued: what is left of the drain, until a
            # second signal; what is left then is given up as a row is (the exit
            # hooks would wait for it again).
            until = deadline if deadline is not None and drained else time.monotonic()
            replied = wait_replies(built_dispatcher(), until, signals.forced, self._say)
            shutdown(0.0)
            drained = drained and replied
            self._abandoned = self._abandoned or not replied
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
            cut = "a second signal cut the drain short" if signals.forced.is_set() else ""
            raise CommandError(
                f"{summary}; {cut or f'the drain did not finish in {drain:g}s'}: "
                "unfinished rows return "
                "to pending when their lease expires, replies still being sent are given up",
                returncode=1,
            )
        self._say(summary.removeprefix("outbound_worker: "))

    def _say(self, text: str) -> None:
        """``outbound_worker: <text>`` on standard output, if it can be written: a
        reader gone (a closed pipe) must not keep the worker from draining."""
        with contextlib.suppress(OSError):
            self.stdout.write(f"outbound_worker: {text}")
            self.stdout.flush()

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
        except BaseException:  # (--traceback: Django raises the CommandError on)
            if self._abandoned:
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
            raise
