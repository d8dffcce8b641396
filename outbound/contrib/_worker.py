"""What the outbox worker commands share (``manage.py outbound_worker``, ``flask outbound worker``).

Signals that stop a worker, a drain bounded by a deadline, and one line on
standard error per failed delivery. Private: the commands are the API.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from outbound._log import log_failures
from outbound._signal_flag import SignalFlag
from outbound.outbox import RelayState

__all__ = ["FORCE_TIMEOUT", "TICK", "Signals", "drain_relay", "log_failures", "wait_replies"]

#: Longest one wait lasts before a command looks at its relay again.
TICK = 0.5
#: Seconds a forced stop waits for running handlers to return: after the
#: drain, or when the relay stops on an error.
FORCE_TIMEOUT = 1.0


class _Flag(Protocol):
    def is_set(self) -> bool: ...


def drain_relay(relay: Any, deadline: float, forced: _Flag) -> bool:
    """Stop ``relay`` gracefully by ``deadline`` (``time.monotonic()``); force it on a second
    signal or at the deadline. True if it drained. Blocks until then (plus FORCE_TIMEOUT)."""
    while True:
        left = deadline - time.monotonic()
        if relay.stop(max(0.0, min(TICK, left))):
            return True
        stats = relay.stats()
        if stats.state is RelayState.STOPPED and stats.inflight == 0 and stats.stuck == 0:
            # Its loop ended and no handler runs (not even one past its timeout,
            # which the drain waits for). A relay that stopped on an error (its
            # loop failed during the drain) says False at once, for good; one
            # whose last task is still ending (logging a late return) takes its time.
            wait = max(0.0, min(TICK, deadline - time.monotonic()))
            began = time.monotonic()
            if relay.stop(wait):
                return True
            if time.monotonic() - began < wait / 2:
                return False
        if forced.is_set() or left <= 0:
            end = time.monotonic() + FORCE_TIMEOUT
            # Nothing runs: the drain is done but for the relay's own closing
            # (a PostgreSQL relay's takes a tenth of a second), which a drain
            # of 0 s never left it. Given the force's time; rows a claim
            # brings meanwhile are finished or handed back.
            idle = stats.inflight == 0 and stats.stuck == 0
            if idle and not forced.is_set() and relay.stop(FORCE_TIMEOUT / 2):
                return True
            relay.force_stop(max(0.0, end - time.monotonic()))
            return False


def wait_replies(
    dispatcher: Any, deadline: float, forced: _Flag, say: Callable[[str], object]
) -> bool:
    """Close ``dispatcher`` (the replies the handlers queued; ``None``: none was
    built) and wait for them by ``deadline`` (``time.monotonic()``) or until a
    second signal (``forced``); ``say`` tells that it waits. True if they all
    ended. Blocks until then."""
    if dispatcher is None:
        return True
    dispatcher.close()
    if dispatcher.drain(0.0):
        return True
    left = deadline - time.monotonic()
    if left > 0 and not forced.is_set():
        say(f"waiting for the replies still being sent (at most {left:.1f}s)")
    while True:
        left = deadline - time.monotonic()
        if dispatcher.drain(max(0.0, min(TICK, left))):
            return True
        if forced.is_set() or left <= 0:
            return False


class Signals:
    """SIGTERM/SIGINT handlers: the first sets ``stop``, the next ones ``forced``.

    SIGHUP too (the terminal that started the worker closed), unless it is
    ignored (``nohup``): then it stays ignored. Installed only in the main
    thread (where Python runs signal handlers); :meth:`restore` puts the
    previous handlers back. The flags are :class:`SignalFlag`, not events: a
    handler setting an event while the main thread waited on it hung the
    worker for good.
    """

    def __init__(self) -> None:
        self.stop = SignalFlag()
        self.forced = SignalFlag()
        self._previous: dict[int, Any] = {}
        # One entry a signal, appended in one call: a second signal whose
        # handler ran inside the first's, between its look and its set,
        # counted as a first (the stop never forced).
        self._received: list[int] = []
        self._pid = os.getpid()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            # A process forked from the worker (a handler's multiprocessing
            # helper): the signal does to it what it would have done.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._received.append(signum)
        if len(self._received) > 1:
            self.forced.set()
        self.stop.set()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._on_signal)
        hangup = getattr(signal, "SIGHUP", None)  # (none on Windows)
        if hangup is not None and signal.getsignal(hangup) is signal.SIG_DFL:
            # Its default ended the worker at once, the rows it held left
            # processing until their leases ended: it drains instead.
            self._previous[hangup] = signal.signal(hangup, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self.stop.close()
        self.forced.close()
