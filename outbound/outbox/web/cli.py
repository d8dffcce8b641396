"""``python -m outbound outbox serve``: the status page until Ctrl-C (or SIGTERM)."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, TextIO

from outbound.outbox._base import Store

from ._server import StatusServer

__all__ = ["check_serve_options", "serve", "sigterm_stops"]


def _port(text: str) -> int | None:
    text = text.strip()
    if not (text.isascii() and text.isdigit()):  # (int() refuses "²", which isdigit takes)
        return None
    value = int(text)
    return value if value <= 65535 else None


def _refresh(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0 <= value <= 3600 else None


def check_serve_options(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--port``, ``--refresh`` or ``--host``, in one line; None if nothing."""
    if _port(args.port) is None:
        return f"--port must be a whole number from 0 to 65535, not {args.port!r}"
    if _refresh(args.refresh) is None:
        return f"--refresh must be a number of seconds from 0 to 3600, not {args.refresh!r}"
    if not args.host.strip():
        return "--host must name an address to listen on, such as 127.0.0.1"
    try:
        args.host.strip().encode("idna")  # (what the bind does: its error was a TypeError)
    except UnicodeError:
        return f"--host must be a host name or an address, not {args.host!r}"
    return None


class _Stops:
    """The state :func:`sigterm_stops` shares between its nested uses (main thread only)."""

    #: Nested uses in progress: only the outermost installs and restores.
    depth = 0
    #: Set once the KeyboardInterrupt is raised, or while the handlers are put
    #: back: later signals are then only noted.
    raised = False


def _stop(signum: int, frame: Any) -> None:
    # Once: a second signal raised in the middle of the first one's unwinding
    # (a lock's wait left half undone: RuntimeError) or of the bounded stop it
    # started (a relay left running, its rows claimed).
    if _Stops.raised:
        return
    _Stops.raised = True
    raise KeyboardInterrupt


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """SIGTERM ends serving like Ctrl-C does, and so does SIGHUP (the terminal closed)
    unless it is ignored (``nohup``) or handled already: its default ended the process at
    once, the demo's claimed rows left to their leases and its temporary outbox behind.
    Within, one KeyboardInterrupt is raised for all of them (Ctrl-C included, where
    Python's own handler is in place), however the uses nest: the stop it starts is
    bounded, and goes on to its end whatever signals come meanwhile. The handlers are
    put back as the outermost use ends (a signal meanwhile is only noted). In the main
    thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _Stops.depth:  # within another use: its handlers, its one interrupt
        _Stops.depth += 1
        try:
            yield
        finally:
            _Stops.depth -= 1
        return
    previous: dict[int, Any] = {}
    _Stops.depth = 1
    _Stops.raised = False
    try:
        # Each previous handler noted before its replacement (a signal landing
        # as the replacement returned left it out of what is put back).
        previous[signal.SIGTERM] = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _stop)
        hangup = getattr(signal, "SIGHUP", None)  # (none on Windows)
        if hangup is not None and signal.getsignal(hangup) is signal.SIG_DFL:
            previous[hangup] = signal.SIG_DFL
            signal.signal(hangup, _stop)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            previous[signal.SIGINT] = signal.default_int_handler
            signal.signal(signal.SIGINT, _stop)
        yield
    finally:
        # Noted only from here: a Ctrl-C raised in this loop left the handlers
        # not yet put back on a spent handler, and Ctrl-C did nothing after.
        _Stops.raised = True
        for signum, handler in previous.items():
            if handler is not None:  # (None: not installed from Python; left)
                signal.signal(signum, handler)
        _Stops.depth = 0


@contextmanager
def _outages_in_one_line() -> Iterator[None]:
    """While serving: a database outage is one line on stderr when it starts and one when
    it ends (the monitor's warnings), not the driver's pool reporting each reconnection
    attempt with its traceback. Not thread-safe (the command's main thread)."""
    web = logging.getLogger("outbound.outbox.web")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("outbox: %(message)s"))
    handler.setLevel(logging.WARNING)
    quiet = logging.getLogger("psycopg")
    null = logging.NullHandler()
    propagate = quiet.propagate
    web.addHandler(handler)
    quiet.addHandler(null)
    quiet.propagate = False
    try:
        yield
    finally:
        web.removeHandler(handler)
        quiet.removeHandler(null)
        quiet.propagate = propagate


def serve(store: Store, args: argparse.Namespace, out: TextIO) -> int:
    """Serve the page of ``store`` until interrupted; the exit status (0, or 1 if the port
    cannot be had). Blocks."""
    port, refresh = _port(args.port), _refresh(args.refresh)
    # Both were checked by check_serve_options.
    assert port is not None
    assert refresh is not None
    host = args.host.strip()
    try:
        server = StatusServer(store, host, port, refresh=refresh)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(f"outbox: cannot listen on {host}:{port}: {reason}", file=sys.stderr)
        return 1
    try:
        # (A Ctrl-C as soon as the address is out stops it as one later does.)
        with suppress(KeyboardInterrupt):
            print(
                f"outbox {store.table!r}: status page at {server.url} "
                f"(JSON at {server.url}status.json); Ctrl-C to stop",
                file=out,
                flush=True,
            )
            if not server.loopback:
                print(
                    f"outbox: warning: listening on {host} without a login; anyone who can "
                    "reach this port sees the outbox",
                    file=sys.stderr,
                    flush=True,
                )
            with sigterm_stops(), _outages_in_one_line():
                server.serve_forever()
    finally:
        server.close()
    print("outbox: status page stopped", file=out, flush=True)
    return 0
