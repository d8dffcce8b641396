"""A flag that a signal handler sets and the main thread waits on (the commands' stops)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time

__all__ = ["SignalFlag"]

#: Longest single ``select`` of a wait (a longer wait is several).
_SLICE = 86400.0


class SignalFlag:
    """A one-way flag: :meth:`set` once (from a signal handler or any thread), then
    :meth:`is_set` is true for good and every :meth:`wait` returns at once.

    ``threading.Event`` cannot be set from a signal handler: Python runs the
    handler in the main thread between two bytecodes, and when those are
    inside that thread's own ``Event.wait`` (which holds the event's lock
    there), ``Event.set`` waits for that lock for ever; the process ignores
    every later signal but SIGKILL. ``set`` here takes no lock: it stores the
    flag and writes a byte to a socket pair that ``wait`` selects on, so a
    wait ends as soon as the handler has run, wherever the signal fell.

    Thread-safe. :meth:`wait` blocks up to its timeout; the others return at
    once. :meth:`close` releases the socket pair (a later :meth:`set` still
    sets the flag).
    """

    def __init__(self) -> None:
        self._set = False
        self._reader, self._writer = socket.socketpair()
        for end in (self._reader, self._writer):
            end.setblocking(False)
        self._pid = os.getpid()

    def set(self) -> None:
        """Set the flag and wake a waiter. Safe in a signal handler; never blocks.

        In a process forked since, only that process's flag is set: the
        socket pair is shared with the parent, whose waits it would wake."""
        self._set = True
        if os.getpid() != self._pid:
            return
        with contextlib.suppress(OSError):  # full (woken already) or closed
            self._writer.send(b"\0")

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or ``timeout`` seconds passed (``None``: no
        limit); return :meth:`is_set`."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while not self._set:
            left = _SLICE if deadline is None else deadline - time.monotonic()
            if left <= 0.0:
                break
            try:
                if select.select([self._reader], [], [], min(left, _SLICE))[0] and not self._set:
                    # A byte the flag did not come with (a process forked
                    # before set() looked at its pid) woke every later select
                    # at once: read out. Once set, left there: it wakes every
                    # waiter, whichever thread looked first.
                    with contextlib.suppress(OSError):
                        self._reader.recv(4096)
            except (OSError, ValueError):  # closed: the flag alone decides
                time.sleep(min(left, 0.05))
        return self._set

    def close(self) -> None:
        """Release the socket pair. Idempotent."""
        self._reader.close()
        self._writer.close()
