"""A dispatcher's lifecycle: :class:`State`, and :class:`Lifecycle`, which only moves forward."""

from __future__ import annotations

import enum

from .errors import BrokenDispatcher, DispatcherClosed

__all__ = ["Lifecycle", "State"]


class State(enum.Enum):
    """Lifecycle of a :class:`~outbound.Dispatcher`; it only moves down this list."""

    #: Accepting work.
    OPEN = "open"
    #: ``close()``/``shutdown()``/``force_close()`` was called: new work is
    #: refused, what was accepted still runs (or was cancelled by force_close).
    CLOSING = "closing"
    #: Closed and nothing is left queued, running or being resolved; threads
    #: are exiting.
    CLOSED = "closed"
    #: A worker initializer failed: all queued work failed with
    #: :class:`~outbound.errors.BrokenDispatcher`, new work is refused.
    BROKEN = "broken"


_RANK = {State.OPEN: 0, State.CLOSING: 1, State.CLOSED: 2, State.BROKEN: 3}


class Lifecycle:
    """A state that only moves forward (OPEN → CLOSING → CLOSED, or → BROKEN).

    Not thread-safe on its own: the owner guards it with its lock. Reads of
    ``state`` without that lock see some state it had (one attribute load).
    """

    __slots__ = ("broken_reason", "closed_reason", "state")

    def __init__(
        self,
        state: State = State.OPEN,
        broken_reason: str | None = None,
        closed_reason: str | None = None,
    ) -> None:
        self.state = state
        self.broken_reason = broken_reason
        #: Why it was closed, if not by a call to close (named by closed_error).
        self.closed_reason = closed_reason

    def advance(self, to: State, reason: str | None = None) -> bool:
        """Move to ``to`` if that is forward; return whether the state changed."""
        if _RANK[to] <= _RANK[self.state]:
            return False
        self.state = to
        if to is State.BROKEN:
            self.broken_reason = reason or "a worker initializer failed"
        return True

    def closed_error(self) -> DispatcherClosed:
        """The error that refuses new work in this state."""
        if self.state is State.BROKEN:
            return BrokenDispatcher(self.broken_reason or "a worker initializer failed")
        if self.closed_reason is not None:
            return DispatcherClosed(
                f"dispatcher is closed: cannot accept new tasks ({self.closed_reason})"
            )
        return DispatcherClosed("dispatcher is closed: cannot accept new tasks")

    def after_fork(self) -> Lifecycle:
        """The state a forked child starts in: open stays open, closing is closed."""
        state = State.CLOSED if self.state is State.CLOSING else self.state
        return Lifecycle(state, self.broken_reason, self.closed_reason)
