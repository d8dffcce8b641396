"""The relay: claims outbox rows and publishes them to an :class:`~outbound.outbox.EventBus`.

One relay is one loop thread plus a :class:`~outbound.Dispatcher`. The loop
claims a batch (pending → processing under a lease), submits each row to
the dispatcher keyed by the row's key, and writes back what the handlers
did, in batches, fenced by the lease: sent, pending again (with backoff,
or without counting the attempt), or dead. A store may claim, in the write
that finishes a key's row, that key's next row (see ``Session.finish``).
It renews the leases of the rows it holds every third of a lease. Where
the store gives a second session (``Store.claim_session``: PostgreSQL, a
connection of its own), a claim thread claims on it while the loop writes,
so that the database runs a claim and a write at once; the loop holds the
claims while its writes fail, and runs a reconcile only while no claim
does (the rows of a claim are tracked once it returns). Any
number of relays, in any number of processes, may share a table: per-key
order and ``max_concurrency`` hold across all of them (see
:mod:`outbound.outbox._base`).

What a handler raises decides the row's fate:

- nothing: ``sent``;
- :class:`~outbound.Defer` or :class:`~outbound.errors.RateLimited`:
  pending again after its delay, the attempt not counted (the seed's
  "capacity short: pending → pending"), unless the row would then be older
  than the retry policy's ``max_total``: ``dead``. A delay of at most two
  seconds (a rate limiter's booked send slot, say) the relay waits out
  itself: the row stays claimed, its lease renewed, nothing is written,
  and its handler runs again when the delay is over (on the dispatcher's
  timer: no thread is held), once the relay found the row still its own
  (one renewal, just before: a row an operator cancelled meanwhile, or
  whose lease passed to another relay, is not run again, and its
  write-back is refused). A row is held once per claim (put off again, it
  is written back, so that rows a rate limit keeps putting off leave the
  relay's room to other keys), and a stopping relay writes held rows back
  at once. A longer delay writes the row back; the relay claims it again a
  little before it is due and holds it until then. A delay over seven days
  is cut to seven days; one that is no delay (``Defer(math.inf)``, which
  to a dispatcher means "until ``force_close()``", or a NaN) is the retry
  policy's backoff: a relay has nothing to wait for that long;
- :class:`~outbound.errors.PermanentSendError`: ``dead`` at once;
- anything else: pending again after the retry policy's backoff, or
  ``dead`` once ``max_attempts`` attempts failed or the row would be older
  than ``max_total``.

A delivery that outlives ``timeout`` (plus a grace) is recorded as failed
(``TimeoutError``, retried or dead by the policy) and its capacity slot is
freed; its lease is no longer renewed and the relay claims no other row of
its key until the handler returns. Python cannot stop a thread: the stuck
handler keeps its worker thread until it returns, and its result is then
ignored. A row whose delivery timed out before it started is put back
without counting an attempt. A delivery that ended is never late: while
its outcome waits for the database, its lease is renewed.

Delivery is at least once: a relay that dies (or is force-stopped) leaves
its rows to their leases, and another relay claims them when they expire.
After a reconnect (the database restarted and may have lost the last
outcomes written) the relay releases at once every lease it holds but no
longer tracks, so those rows are delivered again without waiting out the
lease.

Writing outcomes back cannot wedge a relay: error texts are made storable
(no NUL), delays are cut to a week (a delay that is not a finite number
>= 0 becomes the retry policy's backoff), and if the database refuses a
batch of outcomes, they are written one by one, one that it still
refuses being written as a plain retry. When the database failed instead
(it is down, the connection dropped, a lock or resource limit), or even
the plain retry fails, outcomes are kept as they are to try again after a
pause (never replaced: a sent row written as a retry would be delivered
twice); meanwhile the relay claims nothing but keeps renewing the leases
of the rows it holds.
"""

from __future__ import annotations

import copy
import enum
import heapq
import json
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from typing_extensions import Self

from outbound._fork import renewed_after_fork
from outbound._log import Streaks, logger
from outbound._log import quiet as _log
from outbound.context import Defer, _bind_to_lease, _restore_context
from outbound.dispatcher import Dispatcher
from outbound.errors import (
    DispatcherClosed,
    PermanentSendError,
    QueueFull,
    RateLimited,
    StoreError,
)

from ._base import (
    CLAIM_AHEAD,
    Claimed,
    Listener,
    OutboxMessage,
    Outcome,
    RetryPolicy,
    Session,
    Store,
    check_positive_int,
    check_seconds,
    clean_error,
)
from .bus import EventBus

__all__ = ["DEFAULT_RETRY", "Relay", "RelayState", "RelayStats"]


#: The relay's retry policy when none is given: ten tries, backing off from
#: one second to five minutes (a fifth of each wait taken off at random),
#: and no requeue or retry that would leave a row older than a day: a
#: message that could not go out for a day is dead-lettered rather than
#: sent stale (``outbox retry`` revives it). Pass
#: ``RetryPolicy(max_total=math.inf, ...)`` for no age bound.
DEFAULT_RETRY = RetryPolicy(
    max_attempts=10, base_delay=1.0, max_delay=300.0, max_total=86400.0, jitter=0.2
)
#: The longest a relay puts a row off (``Defer``, ``RateLimited``, a
#: retry): longer delays are cut to this.
_MAX_DELAY = 7 * 24 * 3600.0
#: The largest ``batch_size`` and ``max_inflight``, and ``max_concurrency``.
_MAX_BATCH = 10_000
_MAX_INFLIGHT = 10_000
_MAX_SLOTS = 100_000
#: The longest ``poll_interval``.
_MAX_POLL = 3600.0


def check_option(name: str, value: object) -> Any:
    """``value`` checked as the :class:`Relay` keyword option ``name``, as the
    relay checks it (``batch_size``, ``max_inflight``, ``max_concurrency``,
    ``lease``, ``timeout``, ``poll_interval``); ``TypeError`` or
    ``ValueError`` naming it. For integrations that check their settings
    before they build a relay. Pure."""
    if name in ("max_concurrency", "timeout") and value is None:
        return None
    if name == "batch_size":
        return check_positive_int(name, value, maximum=_MAX_BATCH)
    if name == "max_inflight":
        return check_positive_int(name, value, maximum=_MAX_INFLIGHT)
    if name == "max_concurrency":
        return check_positive_int(name, value, maximum=_MAX_SLOTS)
    if name == "lease":
        lease = check_seconds(name, value, maximum=_MAX_DELAY)
        if lease < _MIN_LEASE:
            raise ValueError(
                f"lease must be at least {_MIN_LEASE:g} seconds (it is renewed every third "
                f"of it, and a handler starts only while a third is left), not {value!r}"
            )
        return lease
    if name == "timeout":
        return check_seconds(name, value, maximum=_MAX_DELAY)
    if name == "poll_interval":
        return check_seconds(name, value, maximum=_MAX_POLL)
    raise ValueError(f"{name!r} is not a relay option this checks")


#: The shortest lease a relay takes: one shorter than a few round trips to the
#: database would be past its last third before any handler started.
_MIN_LEASE = 0.1
#: The most often the loop looks for deliveries past their timeout.
_MIN_CHECK_EVERY = 0.01
#: A handler starts only while at least this part of the lease is known to be
#: left: renewals run every third of it, so a relay whose renewals stopped
#: (a connection that hangs, a stopped process) starts none past a round.
_LEASE_LEFT = 1.0 / 3.0
#: The longest pause between two tries to write outcomes the database refused.
_MAX_WRITE_PAUSE = 5.0
#: The pause before writing again the outcomes of rows another statement held.
_LATER_PAUSE = 0.01
#: The longest an outcome waits for others to be written with it.
_GATHER = 0.002
#: A row this relay put back is claimed again this long after it is due, by
#: this relay's clock from the end of the write (the database starts the
#: delay somewhere in the write).
_DUE_MARGIN = 0.001
#: The longest a row put off by its handler (``Defer``, ``RateLimited``) is
#: held by the relay and run again when due, rather than written back and
#: claimed again: its handler runs on time (a rate limiter's booked slot),
#: and nothing is written meanwhile.
_PARK_AT_MOST = 2.0
#: How often the loop reads the store's clock again (see Relay._age): a row's
#: age is the database's, not this host's, whose clock may be off from it;
#: and how soon after a read that failed.
_CLOCK_EVERY = 60.0
_CLOCK_RETRY = 1.0
#: The longest round trip of a clock read taken over the last reading (see
#: Relay._read_clock).
_CLOCK_TIGHT = 0.5
#: How long before a held row runs again the loop checks that it is still
#: this relay's (one renewal for every such row): a row an operator
#: cancelled meanwhile, or whose lease passed to another relay, does not run.
_PARK_CHECK_AHEAD = 0.05
#: A claimed row whose handler has not started this long after the relay last
#: found it its own (its claim, or a renewal of every row it holds) is
#: checked like a held row before it starts: a row an operator cancelled
#: while it waited for a thread, or for its due time, does not run.
_START_CHECK_AFTER = 0.5
#: The longest a held row waits before it looks again whether its overdue
#: check came (it waits as long as the check is overdue, up to this).
_CHECK_LOOK_MOST = 0.25
#: The most put-back rows whose due times a relay keeps (see ``_due``); the
#: others come back at a poll.
_MAX_DUE = 10_000
#: The longest the loop waits for a claim of the claim thread to end before
#: a reconcile (it tries again when the claim ends).
_CLAIM_END_WAIT = 0.05
#: While rows run, a claim of the claim thread for less than a quarter of a
#: batch waits this long after the previous claim: fewer, larger claims.
_CLAIM_GATHER = 0.02


class RelayState(enum.Enum):
    """Lifecycle of a :class:`Relay`; it only moves down this list."""

    #: Built, not started.
    NEW = "new"
    #: Claiming and delivering.
    RUNNING = "running"
    #: ``stop()``/``force_stop()`` called: no more claims; finishing up.
    STOPPING = "stopping"
    #: The loop thread has exited and the connection is closed.
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class RelayStats:
    """A snapshot of a relay's counters, taken under its lock.

    ``claimed`` rows claimed; ``sent``, ``retried`` (attempt counted),
    ``requeued`` (not counted), ``dead`` outcomes written; ``parked``
    deferrals the relay held, not written, to run again when due (a held
    row written back after all, the relay stopping or the row no longer
    its own, counts in ``requeued`` too: ``parked`` counts holds, not the
    runs that followed); ``lost``
    outcomes the fence refused (the lease had passed to another relay, an
    operator cancelled the row, or the same outcome was written before and
    the database's answer was lost with the connection); ``inflight`` rows
    claimed whose outcome is not yet known (once the relay has stopped, the
    handlers still running: rows a forced stop left to their leases are
    not counted); ``timed_out`` deliveries given up after ``timeout``;
    ``stuck`` handlers that timed out and have not returned yet (each
    holds a worker thread); ``released`` leases given back after a
    reconnect; ``errors`` database errors the loop survived.
    """

    state: RelayState
    owner: str
    claimed: int
    sent: int
    retried: int
    requeued: int
    dead: int
    lost: int
    inflight: int
    errors: int
    timed_out: int = 0
    stuck: int = 0
    released: int = 0
    parked: int = 0


@dataclass(slots=True)
class _Held:
    """A row this relay holds, from its claim until its outcome is written.

    Fields are guarded by the relay's lock.
    """

    claimed: Claimed
    dispatched_at: float  # time.monotonic()
    # Its handler runs no sooner (a row claimed before it was due, or held).
    not_before: float = 0.0
    # Held (see Relay._parks) until not_before: not running, not queued for
    # a thread; ``checked`` once the loop found it still this relay's.
    parked: bool = False
    checked: bool = False
    # When the loop checks it (time.monotonic()), while held and not checked:
    # its handler waits until then, not polling meanwhile.
    check_at: float = 0.0
    held_once: bool = False  # held before: put off again, it is written back
    # The claimed message went to a handler: the next call (another handler,
    # a run again) gets its payload decoded anew. The running worker's alone.
    handed: bool = False
    # A copy of its payload as claimed, for a store that gives no text (see
    # _handed); the running worker's alone.
    pristine: tuple[Any] | None = None
    started_at: float | None = None  # its handler started
    timed_out: bool = False  # given up: outcome recorded, lease no longer renewed
    # Its outcome is recorded and waits to be written (the handler returned,
    # or the row was never run): never late, its lease is still renewed.
    recorded: bool = False
    # Its lease lasts at least until then (time.monotonic()), as this relay
    # knows: from before the statement that claimed or last renewed it was
    # sent. No handler starts past _LEASE_LEFT of it (see Relay._deliver).
    lease_until: float = math.inf
    # A renewal found its lease gone (an operator closed the row, or its lease
    # passed on): not renewed again, and its handler begins no more sends.
    lease_lost: bool = False
    # Its handler returned, and its "sent" outcome was written: what it queued
    # to send (a reply) goes on whatever its lease (no other relay runs the
    # row again). See outbound.context._Fence.
    returned: bool = False
    # The row is to be run again, or never (an outcome other than "sent"
    # recorded, its handler given up, its lease lost): what its handler
    # sends, or queued to send, from now on is refused at once.
    released: bool = False


class Relay:
    """Delivers the rows of one outbox table to the handlers of an :class:`EventBus`.

    - ``batch_size``: the most rows one claim takes, and the outcomes
      written at once when they come in fast enough (otherwise within
      2 ms of the first).
    - ``max_inflight``: the most handlers this relay runs at once (its
      dispatcher's thread pool size); it runs or queues at most
      ``max_inflight + batch_size`` claimed rows, so the next batch is
      claimed while the last one runs. On PostgreSQL, the write of a
      batch's outcomes may claim the next row of each key it finishes, for
      up to three quarters of that room.
    - ``max_concurrency``: the most handlers running at once across *every*
      relay of the table (a capacity gate in the database; ``None``: no
      gate). Relays of one table should agree on it. A row that finds no
      free slot stays pending, its attempt not counted; a crashed relay's
      slots come back when its lease expires.
    - ``lease``: seconds a claim lasts (at least 0.1); renewed while the
      handler runs. A relay that stops renewing (crashed, stalled) loses
      its rows to others after this long.
    - ``timeout``: seconds one delivery may take, the handlers' deadline
      (``current_context().deadline``); default ``lease``. Past it and a
      grace (a tenth of it, at least one second) the delivery is recorded
      as failed, and a row still waiting for a thread is put back. In a
      handler, :func:`~outbound.context.time_allowed` (which the built-in
      senders call before each send) also raises ``SendTimeout`` once the
      lease as last renewed, less a third of it, has passed: a relay that
      stalled past its lease (its row and the next ones of its key run by
      another by then) begins no send when it wakes. A send begun in time
      has the whole deadline.
    - ``poll_interval``: seconds between claims when idle. On PostgreSQL a
      LISTEN/NOTIFY listener wakes the relay as soon as a row commits
      (``listen=False`` to poll only); a row this relay put back with a
      delay (``Defer``, a retry) is claimed up to a tenth of a second
      before it is due, and its handler runs when it is due.
    - ``retry``: the :class:`RetryPolicy` of failed deliveries and, through
      its ``max_total``, the age bound of every requeue;
      :data:`DEFAULT_RETRY` by default.
    - ``name``: added to the lease owner id (host:pid:random) for logs.
      A relay built in one process and started in another (built before a
      fork) takes an owner id of its own at :meth:`start`.

    Thread-safe. :meth:`start` blocks until connected; :meth:`stop` until
    drained (or ``timeout``); the other methods never block.
    """

    def __init__(
        self,
        store: Store,
        bus: EventBus,
        *,
        batch_size: int = 100,
        max_inflight: int = 64,
        max_concurrency: int | None = None,
        lease: float = 30.0,
        timeout: float | None = None,
        poll_interval: float = 1.0,
        retry: RetryPolicy | None = None,
        listen: bool = True,
        name: str | None = None,
    ) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"store must be an outbox Store, not {store.__class__.__name__}")
        if not isinstance(bus, EventBus):
            raise TypeError(f"bus must be an EventBus, not {bus.__class__.__name__}")
        self._store = store
        self._bus = bus
        self._batch_size: int = check_option("batch_size", batch_size)
        self._max_inflight: int = check_option("max_inflight", max_inflight)
        self._max_concurrency: int | None = check_option("max_concurrency", max_concurrency)
        self._lease: float = check_option("lease", lease)
        self._timeout = self._lease
        if timeout is not None:
            self._timeout = check_option("timeout", timeout)
        self._grace = max(1.0, self._timeout / 10.0)
        # Seconds between two looks of the loop for deliveries past their timeout.
        # (Not more often than _MIN_CHECK_EVERY: the grace is a second at least.)
        self._check_every = max(_MIN_CHECK_EVERY, min(1.0, self._timeout / 10.0))
        # Outcomes written at once when they come fast enough (see _deliver).
        self._write_batch = self._batch_size
        self._poll_interval: float = check_option("poll_interval", poll_interval)
        self._retry = retry if retry is not None else DEFAULT_RETRY
        if not isinstance(self._retry, RetryPolicy):
            raise TypeError("retry must be a RetryPolicy or None")
        self._listen = bool(listen)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, not {type(name).__name__}")
        self._label = f"{name}@" if name else ""
        self.owner = _owner(self._label)
        self._owner_pid = os.getpid()
        # Failures that repeat (a database away, a full disk): logged in
        # full once, then counted (see Streaks).
        self._streaks = Streaks()
        self._dispatcher = Dispatcher(
            max_inflight=self._max_inflight,
            queue_size=self._max_inflight,
            send_timeout=self._timeout,
            thread_name_prefix="outbound-relay",
        )
        # Set to wake the loop: a row was committed (listener), an outcome
        # is ready (worker), or a stop was asked. The loop clears it before
        # it looks at the state, so no wake-up is lost.
        self._wake = renewed_after_fork(threading.Event())
        # The store's clock (which stamps created_at) less time.monotonic(),
        # read by start() and then by the loop (see _sync_clock); None until
        # then. Replaced whole: read without a lock.
        self._clock_offset: float | None = None
        # The last read of it in start() was quick (see _read_clock).
        self._clock_tight = False

        # Guards every field marked "guarded" below. Held only for O(1)
        # bookkeeping (O(rows held) to list them for a renewal or to look
        # for deliveries past their timeout), never while a handler or a
        # database call runs. The loop thread, the dispatcher's workers and
        # the callers of stop()/stats() take it.
        # Made new in a forked child (with the events and the condition over
        # it): a parent thread holding one at the fork left it held there.
        self._lock = renewed_after_fork(threading.Lock())
        # guarded: lifecycle, only moves forward (see RelayState).
        self._state = RelayState.NEW
        # guarded: force_stop() was called, or the loop or the claim thread
        # failed (``_crashed``): rows are left to their leases.
        self._forced = False
        self._crashed = False
        # guarded: outcomes the workers produced and the loop has not written,
        # and when the first of them came.
        self._results: list[Outcome] = []
        self._first_result_at = 0.0
        # The loop thread's alone: outcomes of rows another statement held
        # when they were written, to write again from _later_at on.
        self._later: list[Outcome] = []
        self._later_at = 0.0
        # guarded: a heap of the instants (time.monotonic()) at which rows
        # this relay put back with a delay are due again, with their ids.
        # The relay claims then, those rows first: a row deferred for a
        # booked send slot of a rate limit comes back on time, not at the
        # next poll nor behind older rows.
        self._due: list[tuple[float, int, str]] = []
        # guarded: rows this relay put back are due and it has no room to
        # claim them: the next outcome wakes the loop.
        self._room_wanted = False
        # With a claim session (see Store.claim_session), the claim thread
        # claims on it while the loop writes. Set to wake the claim thread
        # (cleared before it looks at the state, as _wake).
        self._claim_wake = renewed_after_fork(threading.Event())
        # guarded: the room the claim (``_claiming``: its limit) and the
        # write (``_taking``: its take) in progress may fill; each leaves it
        # to the other.
        self._claiming = 0
        self._taking = 0
        # guarded: the loop holds the claims (the writes fail, a reconcile
        # is due or runs, the loop's session has not settled); and the claim
        # session needs a reconcile (it reconnected, or a claim failed with
        # no answer), which the loop runs while no claim does. Notified when
        # a claim ends.
        self._claims_held = False
        self._side_reconcile = False
        self._claim_ended = renewed_after_fork(threading.Condition(self._lock))
        # The loop thread's alone: a claim, or a write that could take rows,
        # failed with no answer (it may have committed); the loop reconciles
        # before it claims again.
        self._unanswered = False
        # guarded: rows submitted whose outcome is not yet in _results (the
        # rows held meanwhile, _parked of them, not counted).
        self._inflight = 0
        self._parked = 0
        # guarded: a heap of the instants (time.monotonic()) the held rows
        # are due, with their ids and tokens, until the loop checks them.
        self._to_check: list[tuple[float, int, int]] = []
        # guarded: every row held, by id and claim token, from its claim until
        # its outcome is written (or refused). Its leases are the ones renewed.
        # (A row may be held twice: an operator dead-lettered and revived it
        # while its handler ran, and it was claimed again.)
        self._held: dict[tuple[int, int], _Held] = {}
        # guarded: keys whose handler timed out and has not returned, with
        # how many such handlers; no row of them is claimed meanwhile.
        self._stuck: dict[str, int] = {}
        # guarded: counters of stats().
        self._counts = dict.fromkeys(
            (
                "claimed",
                "sent",
                "retried",
                "requeued",
                "parked",
                "dead",
                "lost",
                "errors",
                "timed_out",
                "released",
            ),
            0,
        )
        self._thread: threading.Thread | None = None
        self._claimer: threading.Thread | None = None
        self._session: Session | None = None
        self._side: Session | None = None
        # ``handling`` is true in a dispatcher worker while it runs one of
        # this relay's deliveries (stop() there would wait for itself).
        self._local = threading.local()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        """Connect and start the loop thread; return ``self``.

        Raises :class:`~outbound.errors.StoreError` if the database cannot
        be reached or its schema is missing or not the current version,
        ``RuntimeError`` if already started. Blocks while it connects (and
        until LISTEN is in place on PostgreSQL).
        """
        with self._lock:
            if self._state is not RelayState.NEW:
                raise RuntimeError(f"relay already started (state {self._state.value})")
            self._state = RelayState.RUNNING
            if self._owner_pid != os.getpid():
                # Made in another process (before a fork): an owner of this
                # one, or processes started from one relay object would
                # share leases and slots, and free each other's.
                self.owner = _owner(self._label)
                self._owner_pid = os.getpid()
        try:
            self._store.check_schema()
            session = self._store.session()
            try:
                session.hold_to(self._lease)
                if self._max_concurrency is not None:
                    session.ensure_slots(self._max_concurrency)
                # Before any claim (the claim thread's too): rows' ages are
                # counted on it from the first.
                self._clock_tight = self._read_clock(session)
                side = self._store.claim_session(session)
                if side is not None:
                    side.hold_to(self._lease)
            except BaseException:
                session.close()
                raise
        except BaseException:
            with self._lock:
                self._state = RelayState.STOPPED
            self._dispatcher.shutdown()
            raise
        self._session = session
        self._side = side
        listener = self._store.listener(self._wake_up) if self._listen else None
        if listener is not None:
            listener.start()
        if side is not None:
            self._claimer = threading.Thread(
                target=self._claims,
                args=(side,),
                name=f"outbound-relay-claims-{self._store.table}",
                daemon=True,
            )
            self._claimer.start()
        self._thread = threading.Thread(
            target=self._loop,
            args=(session, listener),
            name=f"outbound-relay-{self._store.table}",
            daemon=True,
        )
        self._thread.start()
        return self

    def _wake_up(self) -> None:
        """Wake the loop and the claim thread (a row was committed, a stop was asked)."""
        self._wake.set()
        self._claim_wake.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop claiming, let every claimed row finish and be written, then close.

        Returns True if all of it happened within ``timeout`` seconds
        (``None`` or ``math.inf``: as long as it takes); False too if the relay had
        stopped because its loop or its claim thread failed (its rows were
        left to their leases). Idempotent. Raises ``RuntimeError`` in a
        handler this relay runs: it would wait for itself.
        """
        self._check_not_handler("stop")
        deadline = _deadline(timeout)
        with self._lock:
            if self._state is RelayState.NEW:
                self._state = RelayState.STOPPED
            elif self._state is RelayState.RUNNING:
                self._state = RelayState.STOPPING
        self._wake_up()
        if not self._join(deadline):
            return False
        with self._lock:
            # Every claimed row is written; no handler runs unless one timed
            # out. What the dispatcher still holds are the lanes of rows held
            # and written back, waiting on its timer to find them written:
            # dropped, not waited out.
            idle = not self._stuck and not self._forced
            crashed = self._crashed
        if idle:
            self._dispatcher.force_close()
        return self._dispatcher.shutdown(_left(deadline)) and not crashed

    def force_stop(self, timeout: float | None = None) -> bool:
        """Stop at once: queued rows are dropped, running handlers are flagged cancelled.

        Rows not finished stay ``processing`` until their lease expires,
        then another relay delivers them again; outcomes already known
        are still written. Waits up to ``timeout`` for running handlers to
        return and the threads to exit; returns True if they did. Idempotent.
        Raises ``RuntimeError`` in a handler this relay runs.
        """
        self._check_not_handler("force_stop")
        deadline = _deadline(timeout)
        with self._lock:
            self._forced = True
            if self._state is RelayState.NEW:
                self._state = RelayState.STOPPED
            elif self._state is RelayState.RUNNING:
                self._state = RelayState.STOPPING
        self._dispatcher.force_close()
        self._wake_up()
        if not self._join(deadline):
            return False
        return self._dispatcher.shutdown(_left(deadline))

    def _check_not_handler(self, method: str) -> None:
        if getattr(self._local, "handling", False):
            raise RuntimeError(
                f"Relay.{method}() called from a handler of the same relay: it would wait "
                "for that handler to return"
            )

    def _join(self, deadline: float | None) -> bool:
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(_left(deadline))
        return not thread.is_alive()

    def __enter__(self) -> Self:
        if self.state is RelayState.NEW:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------- loop

    def _loop(self, session: Session, listener: Listener | None) -> None:
        """Body of the loop thread: write outcomes, claim, dispatch, renew, wait.

        While outcomes cannot be written (the database is failing) the loop
        claims nothing and tries again after a growing pause
        (``write_after``), but keeps renewing the leases of the rows it holds.
        With a claim session the claim thread claims instead (see
        :meth:`_claims`), beside the writes, while the loop lets it.
        """
        side = self._side
        renew_every = self._lease / 3.0
        check_every = self._check_every
        next_renew = time.monotonic() + renew_every
        next_check = time.monotonic() + check_every
        next_claim = 0.0
        write_after = 0.0  # > 0: try writing again at this time (a write failed)
        write_failures = 0
        # A reconcile has yet to succeed: after a reconnect, or a statement
        # that failed with no answer (it may have committed: a claim's rows
        # would be this relay's, unseen). No claim until it has: a claim
        # would take those rows back as expired leases, an attempt counted.
        reconcile = False
        stop_seen = False
        try:
            # (start() read it: again soon if that read was slow.)
            clock_due = time.monotonic() + (_CLOCK_EVERY if self._clock_tight else _CLOCK_RETRY)
            while True:
                self._wake.clear()
                if session.reconnected() or self._unanswered:
                    self._unanswered = False
                    reconcile = True
                    clock_due = 0.0  # (another server, maybe)
                if time.monotonic() >= clock_due:
                    read = self._sync_clock(session)
                    clock_due = time.monotonic() + (_CLOCK_EVERY if read else _CLOCK_RETRY)
                side_due = False
                if side is not None:
                    reconcile, side_due = self._reconcile_both(session, reconcile)
                elif reconcile:
                    reconcile = not self._reconcile(session)
                self._check_parked(session)
                blocked = False
                # With a claim thread, outcomes are written when a batch's
                # worth came in, when no row runs, or _GATHER after the first
                # (without one, the loop writes them before each claim).
                gather_until = 0.0
                if side is not None:
                    with self._lock:
                        if (
                            0 < len(self._results) < self._write_batch
                            and self._inflight > 0
                            and self._state is RelayState.RUNNING
                        ):
                            gather_until = self._first_result_at + _GATHER
                if time.monotonic() >= max(write_after, gather_until):
                    written = self._flush(session)
                    if side is not None and written == "done":
                        # The room, and the heads, changed (an idle turn
                        # wakes no claim: it waits for its poll).
                        self._claim_wake.set()
                    if written == "failed":
                        write_failures += 1
                        write_after = time.monotonic() + self._write_pause(write_failures)
                        blocked = True
                    else:
                        write_failures = 0
                        write_after = 0.0
                else:
                    blocked = write_failures > 0
                with self._lock:
                    state, forced, inflight = self._state, self._forced, self._inflight
                    parked = self._parked
                    unwritten = bool(self._results)
                    stuck = sum(self._stuck.values())
                    claim_runs = self._claiming > 0
                if forced or (
                    state is RelayState.STOPPING
                    and inflight == 0
                    and not parked
                    and not unwritten
                    and not self._later
                    and not claim_runs
                ):
                    break
                if state is RelayState.STOPPING and not stop_seen:
                    # A stop tries a failed write again at once, not after
                    # its pause (up to _MAX_WRITE_PAUSE): the database may
                    # be back, and stop() has a timeout.
                    stop_seen = True
                    write_after = min(write_after, time.monotonic())
                now = time.monotonic()
                full = False
                # Claims wait for a reconcile that has yet to succeed, and
                # for the session to settle (see Session.settled).
                claiming = (
                    state is RelayState.RUNNING
                    and not blocked
                    and not reconcile
                    and session.settled()
                )
                if side is not None:
                    self._hold_claims(not claiming or side_due)
                    claiming = False  # the claim thread's
                # Rows put back are claimed up to CLAIM_AHEAD before they
                # are due, and held until then (see _deliver).
                with self._lock:
                    due = claiming and bool(self._due) and self._due[0][0] <= now + CLAIM_AHEAD
                if due:
                    next_claim = now
                # Due rows left after the claim wait for room or, if it
                # failed, for the next poll; otherwise they are claimed next.
                due_held = False
                if claiming and now >= next_claim:
                    # Hold up to one batch beyond the running rows, so the
                    # next rows are claimed while these run; a stuck handler
                    # keeps its thread, so it keeps its place too.
                    free = 0
                    if stuck < self._max_inflight:
                        # (Held rows take their room.)
                        free = self._max_inflight + self._batch_size - inflight - stuck - parked
                    if free > 0:
                        limit = min(self._batch_size, free)
                        first = self._due_first(now, limit)
                        claimed = self._claim(session, limit, [(i, k) for _, i, k in first])
                        if claimed is not None:
                            self._dispatch(claimed)
                        full = claimed is not None and len(claimed) == limit
                        if claimed is None:
                            self._due_again(first)
                            due_held = True
                        # A row of ``first`` the claim did not take was taken
                        # by another relay, or changed by an operator.
                    # Rows due and no room: the next outcome wakes the loop.
                    with self._lock:
                        self._room_wanted = due and free <= 0
                    due_held = due_held or free <= 0
                    next_claim = now + self._poll_interval
                    if full:
                        next_claim = now
                if now >= next_check:
                    next_check = now + check_every
                    self._check_timeouts()
                if now >= next_renew:
                    next_renew = now + renew_every
                    self._renew(session)
                if not full:
                    wake_at = min(next_renew, next_check)
                    if write_after > 0.0:
                        wake_at = min(wake_at, write_after)
                    else:
                        if unwritten:
                            # Outcomes came in since the write: write them with
                            # those that follow within _GATHER (a wake-up for a
                            # full batch comes sooner).
                            wake_at = min(
                                wake_at, gather_until if gather_until > now else now + _GATHER
                            )
                        if self._later:
                            wake_at = min(wake_at, self._later_at)
                    with self._lock:
                        if self._to_check:
                            wake_at = min(wake_at, self._to_check[0][0] - _PARK_CHECK_AHEAD)
                    if claiming:
                        wake_at = min(wake_at, next_claim)
                        if not due_held:
                            wake_at = min(wake_at, self._next_due())
                    self._wake.wait(max(0.0, wake_at - time.monotonic()))
                    if self._wake.is_set():
                        next_claim = 0.0
        except BaseException:
            self._crash("the outbox relay loop failed; the relay stops")
        finally:
            self._close(session, listener, reconcile=reconcile or self._unanswered)

    def _due_first(self, now: float, limit: int) -> list[tuple[float, int, str]]:
        """Take the rows put back that are due within CLAIM_AHEAD, up to ``limit``."""
        first: list[tuple[float, int, str]] = []
        with self._lock:
            while self._due and self._due[0][0] <= now + CLAIM_AHEAD and len(first) < limit:
                first.append(heapq.heappop(self._due))
        return first

    def _due_again(self, entries: Sequence[tuple[float, int, str]]) -> None:
        """Keep ``entries`` (taken by :meth:`_due_first`) for the next claim: it failed."""
        with self._lock:
            for entry in entries:
                heapq.heappush(self._due, entry)

    def _next_due(self) -> float:
        """When the next claim for a row put back is due (inf: none)."""
        with self._lock:
            return self._due[0][0] - CLAIM_AHEAD if self._due else math.inf

    def _hold_claims(self, hold: bool) -> None:
        """Let the claim thread claim, or not (the loop's view, at each of its turns)."""
        with self._lock:
            released = self._claims_held and not hold
            self._claims_held = hold
        if released:
            self._claim_wake.set()

    def _reconcile_both(self, session: Session, reconcile: bool) -> tuple[bool, bool]:
        """Run the reconcile if one is due (``reconcile``: for the loop's session;
        or the claim session asked) while no claim runs; return whether it is
        still due, for each.

        One reconcile covers both sessions (the store's sessions share what
        failed with no answer: see Store.claim_session): run on two, the
        first would release the rows of a claim whose answer the other lost
        without taking their attempt back, and another relay could claim
        them (attempt counted) before the second ran. A reconcile releases
        the leases this relay has but does not track: it must not run while
        a claim does, whose rows are tracked only once it returns. The claims
        are held, and the reconcile waits for a claim in progress to end, at
        most _CLAIM_END_WAIT (the claim thread wakes the loop when it ends:
        the reconcile is tried again then).
        """
        with self._lock:
            if not (reconcile or self._side_reconcile):
                return False, False
            self._claims_held = True
            if not self._claim_ended.wait_for(lambda: self._claiming == 0, _CLAIM_END_WAIT):
                return reconcile, self._side_reconcile
            # (Read once no claim runs: one that failed meanwhile asked too.)
            asked = self._side_reconcile
        if not self._reconcile(session):
            return True, asked
        with self._lock:
            self._side_reconcile = False
        return False, False

    def _claims(self, side: Session) -> None:
        """Body of the claim thread (with a claim session): claim beside the loop's writes.

        It claims when the loop would (see :meth:`_loop`): when woken (a row
        committed, a write done, a stop asked), when rows put back come due,
        every ``poll_interval``, and at once again after a full claim. Not
        while the loop holds the claims (its writes fail, a reconcile is due
        or runs, its session has not settled), nor while its own session
        waits for a reconcile (after a reconnect, or a claim that failed with
        no answer): the loop runs that one, while no claim does.
        """
        next_claim = 0.0
        claimed_at = -math.inf  # the last claim's start
        try:
            while True:
                self._claim_wake.clear()
                now = time.monotonic()
                limit = 0
                gather_until = math.inf
                with self._lock:
                    if self._forced or self._state is not RelayState.RUNNING:
                        break
                    held = self._claims_held or self._side_reconcile
                    due = not held and bool(self._due) and self._due[0][0] <= now + CLAIM_AHEAD
                    if due:
                        next_claim = now
                    free = 0
                    if not held and now >= next_claim:
                        stuck = sum(self._stuck.values())
                        if stuck < self._max_inflight:
                            # Every row held counts, its outcome written or
                            # not: a row's room comes back with the write of
                            # its outcome (which takes the next rows of the
                            # keys it finishes, see _take_budget), and a
                            # write held up holds the claims up too.
                            free = (
                                self._max_inflight
                                + self._batch_size
                                - len(self._held)
                                - stuck
                                - self._taking
                            )
                        # Rows due and no room: the next outcome wakes the
                        # loop, whose write wakes this thread.
                        self._room_wanted = due and free <= 0
                        limit = max(0, min(self._batch_size, free))
                        # Fewer, larger claims while rows run: a quarter of
                        # a batch, or what is free _CLAIM_GATHER after the
                        # last claim (rows put back that are due: at once).
                        small = limit < self._batch_size // 4
                        if (
                            small
                            and not due
                            and self._inflight + self._parked > 0
                            and now < claimed_at + _CLAIM_GATHER
                        ):
                            limit = 0
                            gather_until = claimed_at + _CLAIM_GATHER
                        self._claiming = limit
                due_held = free <= 0
                if limit:
                    claimed_at = now
                    claimed, settled = self._claim_beside(side, now, limit)
                    due_held = claimed is None
                    if claimed is not None and len(claimed) == limit:
                        next_claim = now  # full: claim again at once
                    elif settled:
                        next_claim = now + self._poll_interval
                    else:
                        # Not before the loop's next check (the claim session
                        # looks again at its dropped connection's process
                        # every _ORPHAN_RECHECK): no spin meanwhile.
                        next_claim = now + max(self._poll_interval, self._check_every)
                elif gather_until < math.inf:
                    next_claim = gather_until
                elif not held and now >= next_claim:
                    next_claim = now + self._poll_interval
                wake_at = next_claim if not held else now + self._poll_interval
                if not held and not (due_held and due):
                    # (A row due and no room: the next outcome wakes it.)
                    wake_at = min(wake_at, self._next_due())
                self._claim_wake.wait(max(0.0, wake_at - time.monotonic()))
                if self._claim_wake.is_set():
                    next_claim = 0.0
        except BaseException:
            with self._lock:
                self._claiming = 0
                self._claim_ended.notify_all()
            self._crash("the outbox relay's claim thread failed; the relay stops")

    def _crash(self, message: str) -> None:
        """After the loop or the claim thread failed: stop the relay (its rows are left
        to their leases), then log ``message`` with the failure. Stopped first: a
        logging handler that raises must not leave the relay running, claiming
        nothing."""
        try:
            with self._lock:
                self._forced = self._crashed = True
            self._wake.set()
            self._claim_wake.set()
            self._dispatcher.force_close()
        finally:
            # Not quiet: if even this cannot be logged, the failure goes on
            # to the thread's excepthook, said rather than hidden.
            logger.exception("outbound: %s", message)

    def _claim_beside(
        self, side: Session, now: float, limit: int
    ) -> tuple[list[Claimed] | None, bool]:
        """One claim of the claim thread, of up to ``limit`` rows (its room, reserved
        in ``_claiming``, given back once the rows are dispatched); return the
        rows (None: the claim failed, or did not run), and whether the claim
        session has settled (see Session.settled)."""
        claimed: list[Claimed] | None = None
        first: list[tuple[float, int, str]] = []
        settled = True
        try:
            if side.reconnected():
                # Rows a claim committed before the connection died are this
                # relay's, unseen: a reconcile first (run by the loop).
                with self._lock:
                    self._side_reconcile = True
                self._wake.set()
            else:
                settled = side.settled()
                if settled:
                    first = self._due_first(now, limit)
                    claimed = self._claim(side, limit, [(i, k) for _, i, k in first], beside=True)
                    if claimed is not None:
                        self._dispatch(claimed)
        finally:
            if claimed is None:
                self._due_again(first)
            with self._lock:
                self._claiming = 0
                self._claim_ended.notify_all()
                wanted = self._claims_held or self._side_reconcile
            if wanted:
                self._wake.set()  # the loop waits for no claim to run
        return claimed, settled

    def _close(self, session: Session, listener: Listener | None, *, reconcile: bool) -> None:
        """The loop's end: write what is known, reconcile if due, release the slots, close.

        The claim thread ends first (it ends at its next turn once the relay
        stops; a claim in progress ends within the statement bound).
        """
        claimer, side = self._claimer, self._side
        if claimer is not None:
            self._claim_wake.set()
            claimer.join()
        with self._lock:
            results, self._results = self._later + self._results, []
            forced = self._forced
            side_due = self._side_reconcile
        self._later = []
        if results:
            left, _ = self._write(session, results)
            if left:
                _log.warning(
                    "outbound: %d outbox outcomes not written: their rows are left to their leases",
                    len(left),
                )
        # (A session that asks for one now: a statement's rows it could not
        # deliver, their payloads unread, in the loop's last turn.)
        due = session.reconnected() or (side is not None and side.reconnected())
        if (reconcile or side_due or due) and not forced:
            self._reconcile(session)  # for both sessions
        if not forced:
            try:
                session.release_slots(self.owner)
            except Exception:
                _log.warning("outbound: cannot release capacity slots", exc_info=True)
        if listener is not None:
            listener.stop()
        for each in (side, session):
            if each is None:
                continue
            try:
                each.close()
            except Exception:
                _log.warning("outbound: error closing the relay's connection", exc_info=True)
        with self._lock:
            self._state = RelayState.STOPPED

    def _write_pause(self, failures: int) -> float:
        """Seconds to wait before writing again after ``failures`` failed writes in a row."""
        base = min(1.0, self._poll_interval)
        return min(_MAX_WRITE_PAUSE, base * 2.0 ** min(failures - 1, 16))

    def _flush(self, session: Session) -> str:
        """Write the outcomes the workers produced; ``"done"``, ``"none"`` (there were
        none), or ``"failed"``.

        ``"failed"``: the database failed; the outcomes are kept for later.
        The outcomes of rows another statement held at that moment are put
        aside and written again with the outcomes due _LATER_PAUSE later;
        the others are written meanwhile. Outcomes that came in during the
        write are written too (once) before the next claim, so that it sees
        the next rows of all their keys. Otherwise the rows in flight split
        into two halves that alternate forever, each round trip carrying
        half a batch.
        """
        later_due = bool(self._later) and time.monotonic() >= self._later_at
        written = "none"
        for attempt in range(2):
            with self._lock:
                results, self._results = self._results, []
                # (Reserved at once: a claim beside sees it.)
                take = self._taking = self._take_budget()
            try:
                if attempt == 0 and later_due:
                    results[:0] = self._later
                    self._later = []
                if not results:
                    break
                left, failed = self._write(session, results, take)
            finally:
                with self._lock:
                    self._taking = 0
            if failed:
                with self._lock:
                    self._results[:0] = left
                return "failed"
            written = "done"
            if left:
                if not self._later:
                    self._later_at = time.monotonic() + _LATER_PAUSE
                self._later.extend(left)
        return written

    def _take_budget(self) -> int:
        """How many rows the next write may claim at once (guarded by the lock).

        Three quarters of the room for one batch: a row moved up by an
        outcome is taken in the write that moves it (one write instead of a
        promotion and a claim), and at least a quarter of the room is left
        to the claim, oldest rows first, so that a few keys with long lines
        cannot starve the others. None with capacity slots.
        """
        if self._state is not RelayState.RUNNING or self._max_concurrency is not None:
            return 0
        stuck = sum(self._stuck.values())
        if stuck >= self._max_inflight:
            return 0
        taken = self._inflight + self._parked + stuck + self._claiming
        room = min(self._batch_size, self._max_inflight + self._batch_size - taken)
        return max(0, room - room // 4)

    def _claim(
        self,
        session: Session,
        limit: int,
        first: Sequence[tuple[int, str]] = (),
        *,
        beside: bool = False,
    ) -> list[Claimed] | None:
        """Claim up to ``limit`` rows, those of ``first`` (ids and keys of rows
        put back, now due) first, and hold them; None if the claim failed.
        ``beside``: on the claim session, in the claim thread.

        Never a row of a stuck key, nor a row this relay holds whose lease
        ran out meanwhile (the loop, the database, or this very claim was
        held up past it: a lock, a paused server): the claim would take it
        back and deliver it twice. (A row an operator revived while its
        delivery ran is pending again: that one is claimed.)
        """
        with self._lock:
            skip = list(self._stuck)
            held = [h.claimed.message.key for h in self._held.values()]
            # Its own slots, also past their expiry (renewals held up): an
            # outcome written late frees its slot by slot and owner, and would
            # free it under the row this claim gave it to.
            slots = [h.claimed.slot for h in self._held.values() if h.claimed.slot is not None]
        sent = time.monotonic()
        try:
            claimed = session.claim(
                self.owner,
                limit,
                self._lease,
                self._max_concurrency,
                skip,
                held_keys=held,
                first=[i for i, key in first if key not in skip],
                held_slots=slots,
            )
        except Exception as exc:
            self._streaks.failed("claim", "outbound: outbox claim failed; retrying later")
            with self._lock:
                self._counts["errors"] += 1
            if not _refused(session, exc):
                # It may have committed: reconcile first.
                if beside:
                    with self._lock:
                        self._side_reconcile = True
                    self._wake.set()
                else:
                    self._unanswered = True
            return None
        self._streaks.ok("claim")
        self._track(claimed, sent)
        return claimed

    def _track(self, claimed: Sequence[Claimed], sent: float) -> None:
        """Hold the rows just claimed (by a statement sent at ``sent``): their
        leases are renewed from now on."""
        now = time.monotonic()
        until = sent + self._lease
        with self._lock:
            self._counts["claimed"] += len(claimed)
            for item in claimed:
                due = now + item.wait if item.wait > 0.0 else 0.0
                self._held[(item.message.id, item.token)] = _Held(item, now, due, lease_until=until)

    def _renewed(self, items: Sequence[Claimed], sent: float) -> None:
        """Every one of ``items`` was renewed by a statement sent at ``sent``."""
        until = sent + self._lease
        with self._lock:
            for item in items:
                held = self._held.get((item.message.id, item.token))
                if held is not None and held.lease_until < until:
                    held.lease_until = until

    def _dispatch(self, claimed: Sequence[Claimed]) -> None:
        # A row whose payload cannot be decoded is dead: no handler could use it.
        undeliverable = [item for item in claimed if item.error is not None]
        with self._lock:
            self._inflight += len(claimed) - len(undeliverable)
            for item in undeliverable:
                self._record_locked(_outcome(item, "dead", error=item.error))
        for item in undeliverable:
            _log.error("outbound: outbox row %d is dead: %s", item.message.id, item.error)
        for item in claimed:
            if item.error is not None:
                continue
            try:
                self._dispatcher.submit(item.message.key, self._deliver, item)
            except (QueueFull, DispatcherClosed):
                # Closed: a forced stop; the row is left to its lease.
                # Full: cannot happen (one head per key), but be safe.
                with self._lock:
                    self._inflight -= 1
                    if not self._forced:
                        self._record_locked(_outcome(item, "requeue"))

    def _deliver(self, item: Claimed) -> None:
        """Run in a dispatcher worker: publish one message and record its outcome."""
        message = item.message
        check = False
        with self._lock:
            held = self._held.get((message.id, item.token))
            if held is None or held.timed_out or held.recorded:
                return  # given up, or written back while held: already recorded
            now = time.monotonic()
            early = held.not_before - now
            if (
                early <= 0.0
                and (held.checked or not held.parked)
                and now - (held.lease_until - self._lease) > _START_CHECK_AFTER
            ):
                # Found this relay's too long ago (it waited for a thread, or
                # for its due time): held, the loop checks it (again) first,
                # as a row a handler put off.
                if not held.parked:
                    held.parked = True
                    self._inflight -= 1
                    self._parked += 1
                held.checked = False
                held.not_before = held.check_at = now
                check = not self._to_check or now < self._to_check[0][0]
                heapq.heappush(self._to_check, (now, message.id, item.token))
            if held.parked:
                if not held.checked:
                    # Held, and not yet found still this relay's: the loop
                    # checks it (or writes it back) first, at check_at. A
                    # check overdue (its statement waits on a database that
                    # does not answer) is looked for less and less often.
                    early = max(
                        early,
                        held.check_at - now,
                        _PARK_CHECK_AHEAD / 10,
                        min(now - held.check_at, _CHECK_LOOK_MOST),
                    )
                elif early <= 0.0:
                    held.parked = False
                    self._parked -= 1
                    self._inflight += 1
            # Its lease may have passed to another relay that runs it, and the
            # rows of its key after it: not run (see _LEASE_LEFT).
            lapsed = early <= 0.0 and now > held.lease_until - self._lease * _LEASE_LEFT
            if early <= 0.0:
                held.started_at = now
        if check:
            self._wake.set()  # the loop plans its check
        if early > 0.0:
            # Claimed before it was due (a row put back), or held: its lane
            # waits on the dispatcher's timer, holding no thread, and this
            # runs again.
            raise Defer(early)
        outcome: Outcome | None = None
        park = 0.0  # > 0: held here for this long, then run again (see _park)
        self._local.handling = True
        try:
            if lapsed:
                outcome = _outcome(item, "requeue")
                _log.warning(
                    "outbound: outbox row %d not run: its lease may have passed to another "
                    "relay (not renewed for %.1f s); put back for delivery",
                    message.id,
                    now - (held.lease_until - self._lease),
                )
            elif message.attempt > self._retry.max_attempts:
                outcome = _outcome(
                    item, "dead", error=f"{message.attempt - 1} attempts made (lease expired)"
                )
            elif not (handlers := self._bus.handlers(message.type)):
                # A failed attempt, not dead at once: in a rolling deploy
                # the relays of another version (or this one, once its
                # handler is subscribed again) may have it.
                outcome = self._failed(item, f"no handler subscribed for type {message.type!r}")
            else:
                # A send must not begin once the lease may have passed to another
                # relay (this one stalled: a SIGSTOP, a frozen VM), which runs the
                # row and those after it: time_allowed() refuses past the lease
                # as last renewed, less the part a handler needs to start.
                assert held is not None  # (returned above if not)
                context = _bind_to_lease(held, self._lease * _LEASE_LEFT)
                try:
                    for handler in handlers:  # as EventBus.publish does, handlers read once
                        handler(_handed(item, held))
                finally:
                    _restore_context(context)
                outcome = _outcome(item, "sent")
        except (Defer, RateLimited) as exc:
            delay = (
                exc.delay
                if isinstance(exc, Defer)
                else self._retry.rate_limited_delay(exc.retry_after)
            )
            if not 0.0 <= delay < math.inf:  # not a delay (NaN, inf, negative): back off
                delay = self._retry.delay(message.attempt)
            if self._parks(item, delay, held):
                park = max(delay, 1e-6)
            else:
                outcome = self._put_back(item, "requeue", delay, None)
        except PermanentSendError as exc:
            outcome = _outcome(item, "dead", error=_describe(exc))
            _log.warning("outbound: outbox row %d rejected: %s", message.id, outcome.error)
        except Exception as exc:
            outcome = self._failed(item, _describe(exc))
        finally:
            self._local.handling = False
            if outcome is None and not park:  # a BaseException: try again later, attempt counted
                outcome = self._failed(item, "the handler raised a BaseException")
            with self._lock:
                held = self._held.get((message.id, item.token))
                timed_out = held is None or held.timed_out
                if park and not timed_out:
                    # Not written: run again once due, once the loop found it
                    # still this relay's.
                    assert held is not None
                    due = time.monotonic() + park
                    held.started_at = None
                    held.dispatched_at = held.not_before = due
                    held.parked = True
                    held.checked = False
                    held.held_once = True
                    self._inflight -= 1
                    self._parked += 1
                    self._counts["parked"] += 1
                    held.check_at = due - _PARK_CHECK_AHEAD
                    first = not self._to_check or due < self._to_check[0][0]
                    heapq.heappush(self._to_check, (due, message.id, item.token))
                    # The loop plans its check.
                    wake = first
                elif timed_out:
                    # Given up already (and its outcome recorded): the key
                    # may be claimed again.
                    left = self._stuck.get(message.key, 0) - 1
                    if left > 0:
                        self._stuck[message.key] = left
                    else:
                        self._stuck.pop(message.key, None)
                    wake = True
                else:
                    assert outcome is not None
                    self._inflight -= 1
                    self._record_locked(outcome)
                    # Outcomes are written in batches: the loop is woken by
                    # the outcome that completes one, or the last running;
                    # otherwise it writes within _GATHER.
                    # (With a claim thread, the loop's turns come from the
                    # writes alone: the first outcome wakes it too, and it
                    # writes _GATHER later.)
                    wake = (
                        self._inflight == 0
                        or len(self._results) >= self._write_batch
                        or self._room_wanted
                        or (self._side is not None and len(self._results) == 1)
                    )
            if timed_out:
                _log.warning(
                    "outbound: the handler of outbox row %d returned after its timeout; "
                    "its result is ignored",
                    message.id,
                )
            if wake:
                self._wake.set()
        if park and not timed_out:
            # The lane waits on the dispatcher's timer, holding no thread;
            # the lease is renewed meanwhile.
            raise Defer(park)

    def _check_parked(self, session: Session) -> None:
        """Check the held rows due within _PARK_CHECK_AHEAD: those still this
        relay's (renewed) run when due; the others (an operator cancelled them,
        or their leases passed to another relay) are written back, and the
        fenced write refuses them. A stopping relay writes back at once every
        held row not due yet (a forced stop: every one); those due (that
        waited for a thread only) are checked, and run.
        """
        now = time.monotonic()
        with self._lock:
            stopping = self._state is not RelayState.RUNNING
            forced = self._forced
            entries: list[tuple[float, int, int]] = []
            while self._to_check and (stopping or self._to_check[0][0] <= now + _PARK_CHECK_AHEAD):
                entries.append(heapq.heappop(self._to_check))
            items: list[Claimed] = []
            check: list[Claimed] = []  # those to check (renew)
            for _, row_id, token in entries:
                held = self._held.get((row_id, token))
                if held is not None and held.parked:
                    items.append(held.claimed)
                    if not forced and held.not_before <= now + _PARK_CHECK_AHEAD:
                        check.append(held.claimed)
        if not items:
            return
        renewed: list[Claimed] = []
        if check:
            try:
                renewed, sent = self._renew_each(session, check)
                self._renewed(renewed, sent)
                self._streaks.ok("check")
            except Exception:
                self._streaks.failed("check", "outbound: cannot check the outbox rows held")
                again = time.monotonic() + _PARK_CHECK_AHEAD + min(1.0, self._poll_interval)
                with self._lock:
                    self._counts["errors"] += 1
                    if not stopping:
                        for _, row_id, token in entries:  # they wait: checked again later
                            heapq.heappush(self._to_check, (again, row_id, token))
                            if (held := self._held.get((row_id, token))) is not None:
                                held.check_at = again - _PARK_CHECK_AHEAD
                        return
        checked = {(c.message.id, c.token) for c in renewed}
        with self._lock:
            for item in items:
                held = self._held.get((item.message.id, item.token))
                if held is None or not held.parked or held.timed_out or held.recorded:
                    continue
                if (item.message.id, item.token) in checked:
                    held.checked = True
                    continue
                held.parked = False
                self._parked -= 1
                left = max(0.0, held.not_before - time.monotonic())
                self._record_locked(_outcome(item, "requeue", delay=left, since=time.monotonic()))

    def _parks(self, item: Claimed, delay: float, held: _Held) -> bool:
        """Whether a row put off for ``delay`` seconds is held here and run again
        then (no write, no claim: its handler runs on time), rather than put back.

        Short delays only (at most _PARK_AT_MOST), while the relay runs, not
        past the retry policy's ``max_total`` (see _put_back), and once per
        claim: a row put off again goes back to the database, so that rows a
        rate limit keeps putting off do not keep the room (held rows take
        theirs) from the other keys. (Unlocked reads: a relay stopping
        meanwhile has the loop write back what is held; held_once is this
        thread's while the row runs.)
        """
        if delay > _PARK_AT_MOST or self._state is not RelayState.RUNNING or held.held_once:
            return False
        age = self._age(item.message)
        return age is None or not self._retry.expired(age + delay)

    def _read_clock(self, session: Session) -> bool:
        """Read the store's clock, on which rows' ages are counted (see _age).

        The server read it somewhere in the round trip: taken as read at its
        end, so that no age is counted long (a stall in the middle of the
        round trip, or the session's connect before it, made every row older
        by half of it: young rows dead as past max_total), and one is counted
        short by at most the round trip. A read whose round trip took longer
        than ``_CLOCK_TIGHT`` replaces no reading (it is kept if there is
        none) and returns False: read again soon. Raises ``StoreError`` if
        the read fails."""
        began = time.monotonic()
        now = session.now()
        ended = time.monotonic()
        tight = ended - began <= _CLOCK_TIGHT
        if tight or self._clock_offset is None:
            self._clock_offset = now - ended
        return tight

    def _sync_clock(self, session: Session) -> bool:
        """:meth:`_read_clock`; False if the read failed or was slow (the last
        reading is kept; the loop's statements report outages)."""
        try:
            return self._read_clock(session)
        except StoreError:
            return False

    def _age(self, message: OutboxMessage) -> float | None:
        """Seconds since ``message`` was enqueued, on the clock that stamped it (this
        host's may be off from a database server's: a day ahead, every row that
        failed once was dead as past max_total; behind, none ever expired).
        None while that clock was never read: no row expires then."""
        offset = self._clock_offset
        if offset is None:
            return None
        return time.monotonic() + offset - message.created_at

    def _record_locked(self, outcome: Outcome) -> None:
        """Queue ``outcome`` to be written; its row is no longer checked for lateness."""
        held = self._held.get((outcome.id, outcome.token))
        if held is not None:
            held.recorded = True
        self._queue_locked(outcome)

    def _queue_locked(self, outcome: Outcome) -> None:
        """Queue ``outcome`` to be written, noting when the first of a batch came."""
        if outcome.kind != "sent" and (held := self._held.get((outcome.id, outcome.token))):
            held.released = True  # (to be run again, or never: see _Held.released)
        if not self._results:
            self._first_result_at = time.monotonic()
        self._results.append(outcome)

    def _failed(self, item: Claimed, error: str) -> Outcome:
        """The outcome of a failed delivery: retry after a backoff, or dead."""
        message = item.message
        if message.attempt >= self._retry.max_attempts:
            _log.warning(
                "outbound: outbox row %d dead after %d attempts: %s",
                message.id,
                message.attempt,
                error,
            )
            return _outcome(item, "dead", error=error)
        outcome = self._put_back(item, "retry", self._retry.delay(message.attempt), error)
        if outcome.kind == "retry":
            _log.info(
                "outbound: outbox row %d attempt %d failed, retry in %.3gs: %s",
                message.id,
                message.attempt,
                outcome.delay,
                error,
            )
        return outcome

    def _put_back(self, item: Claimed, kind: str, delay: float, error: str | None) -> Outcome:
        """Pending again after ``delay``; dead instead if the row would be past ``max_total``."""
        message = item.message
        age = self._age(message)
        if age is not None and self._retry.expired(age + delay):
            reason = (
                f"expired: {age:.0f}s old, it would have been tried again past "
                f"max_total={self._retry.max_total:g}s"
            )
            if error:
                reason = f"{reason}; last error: {error}"
            _log.warning("outbound: outbox row %d is dead: %s", message.id, reason)
            return _outcome(item, "dead", error=reason)
        return _outcome(item, kind, delay=delay, error=error, since=time.monotonic())

    def _check_timeouts(self) -> None:
        """Give up the deliveries past their timeout (see the class's notes)."""
        now = time.monotonic()
        expired: list[tuple[_Held, bool]] = []
        with self._lock:
            for held in self._held.values():
                if held.timed_out or held.recorded or held.parked:
                    # given up, done (its outcome may wait out a failing
                    # database), or held (not running, not waiting for a thread)
                    continue
                if held.started_at is not None:
                    late = now > held.started_at + self._timeout + self._grace
                else:
                    late = now > held.dispatched_at + self._timeout + self._grace
                if not late:
                    continue
                held.timed_out = True
                held.released = True
                started = held.started_at is not None
                expired.append((held, started))
                self._inflight -= 1
                self._counts["timed_out"] += 1
                if started:
                    key = held.claimed.message.key
                    self._stuck[key] = self._stuck.get(key, 0) + 1
        for held, started in expired:
            item = held.claimed
            if started:
                error = (
                    f"TimeoutError: the handler did not return within {self._timeout:g}s "
                    "(it may still be running)"
                )
                outcome = self._failed(item, error)
                _log.error(
                    "outbound: outbox row %d: the handler did not return within %gs; "
                    "recorded as failed, its key waits for it to return",
                    item.message.id,
                    self._timeout,
                )
            else:
                outcome = self._put_back(item, "requeue", 0.0, None)
            with self._lock:
                self._queue_locked(outcome)
        if expired:
            self._wake.set()

    def _write(
        self, session: Session, results: list[Outcome], take: int = 0
    ) -> tuple[list[Outcome], bool]:
        """Write ``results``; return those to write again later, and whether the database failed.

        The batch may claim up to ``take`` next rows of the keys it
        finishes; they are dispatched at once. If the database refuses the
        batch (see :meth:`Session.refused`), each outcome is written on its
        own, so that one it refuses (whatever its cause) cannot hold back
        the others: that one is replaced by a plain retry. If the database
        failed instead, or even the plain retry fails, the outcomes not yet
        written are returned and the loop tries again later: an outcome is
        never replaced because the database was away (a sent row written as
        a retry would be delivered twice). A returned outcome's delay counts
        from as much later as the failed write took (see :func:`_after_failed`).
        """
        began = time.monotonic()
        try:
            left = self._finish(session, results, take)
            self._streaks.ok("write")
            return left, False
        except Exception as exc:
            self._streaks.failed("write", "outbound: cannot write %d outbox outcomes", len(results))
            with self._lock:
                self._counts["errors"] += 1
            if not _refused(session, exc):
                if take:
                    self._unanswered = True  # it may have taken rows: reconcile first
                return _after_failed(results, time.monotonic() - began), True
        later: list[Outcome] = []
        for i, outcome in enumerate(results):
            written = self._write_one(session, outcome, tried=len(results) == 1)
            if written is None:
                return later + _after_failed(results[i:], time.monotonic() - began), True
            later.extend(written)
        return later, False

    def _write_one(
        self, session: Session, outcome: Outcome, *, tried: bool
    ) -> list[Outcome] | None:
        """Write one outcome (unless ``tried``: it was just refused), else a plain retry instead.

        Returns what to write again later, or None if the database failed.
        """
        if not tried:
            try:
                left = self._finish(session, [outcome])
                self._streaks.ok("write")
                return left
            except Exception as exc:
                with self._lock:
                    self._counts["errors"] += 1
                if not _refused(session, exc):
                    self._streaks.failed("write", "outbound: cannot write outbox outcomes")
                    return None
        plain = Outcome(
            outcome.id,
            outcome.token,
            outcome.key,
            "retry",
            _clamp(self._retry.delay(1)),
            f"outbound: the outcome ({outcome.kind}) of this delivery could not be written",
            outcome.slot,
        )
        try:
            left = self._finish(session, [plain])
        except Exception:
            self._streaks.failed("write", "outbound: cannot write outbox outcomes; retrying")
            with self._lock:
                self._counts["errors"] += 1
            return None
        self._streaks.ok("write")
        _log.error(
            "outbound: the database refused the %s outcome of outbox row %d; "
            "written as a retry instead",
            outcome.kind,
            outcome.id,
        )
        return left

    def _finish(self, session: Session, results: list[Outcome], take: int = 0) -> list[Outcome]:
        """Write ``results`` in one step and count them; return those to write again later.

        Rows the step claimed (``take``) are held and dispatched. A delay
        is written less the time its outcome waited (see ``Outcome.since``);
        the rows put back are claimed again when due (see ``_due``).
        """
        at = time.monotonic()
        writing = [
            o if o.since is None else replace(o, delay=max(0.0, o.delay - (at - o.since)))
            for o in results
        ]
        sent = time.monotonic()
        if take:
            with self._lock:
                skip = list(self._stuck)
            finished = session.finish(
                self.owner, writing, take=take, lease=self._lease, skip_keys=skip
            )
        else:
            finished = session.finish(self.owner, writing)
        if finished.claimed:
            self._track(finished.claimed, sent)
            self._dispatch(finished.claimed)
        later = {(o.id, o.token) for o in finished.later}
        lost = {(o.id, o.token) for o in finished.lost_outcomes}
        # (Lost ones the store did not name: none of the sent is known written.)
        named = finished.lost <= len(finished.lost_outcomes)
        with self._lock:
            counts = self._counts
            for outcome in results:
                held = (outcome.id, outcome.token)
                if held not in later:
                    if held not in lost:  # a lost one is counted once, as lost
                        counts[_COUNTER[outcome.kind]] += 1
                    done = self._held.pop(held, None)
                    if done is None:
                        pass
                    elif outcome.kind != "sent" or held in lost:
                        # (To run again, or never; or the row was no longer
                        # this relay's: a plain retry for a refused "sent", an
                        # operator's change while it ran.)
                        done.released = True
                    elif named:
                        done.returned = True  # (written: no other relay runs it again)
            counts["lost"] += finished.lost
        end = time.monotonic()
        for outcome in writing:
            held = (outcome.id, outcome.token)
            # (A lost one too: it may be this very outcome, written before
            # and its answer lost.)
            if outcome.kind in ("retry", "requeue") and held not in later:
                due = (end + outcome.delay + _DUE_MARGIN, outcome.id, outcome.key)
                with self._lock:
                    if len(self._due) < _MAX_DUE:
                        heapq.heappush(self._due, due)
        if finished.lost:
            _log.warning(
                "outbound: %d outbox outcomes refused: the lease had passed to another relay, "
                "an operator changed the row, or the outcome was written before (the "
                "database's answer was lost)",
                finished.lost,
            )
        if not finished.later:
            return []
        # Written again later with the delay as asked: it still counts from
        # when it was asked for.
        asked = {(o.id, o.token): o for o in results}
        out = []
        for o in finished.later:
            a = asked.get((o.id, o.token))
            out.append(o if a is None else replace(o, delay=a.delay, since=a.since))
        return out

    def _tracked(self) -> list[Claimed]:
        """The rows whose leases this relay keeps: held, and not given up."""
        with self._lock:
            return [h.claimed for h in self._held.values() if not h.timed_out]

    def _renew(self, session: Session) -> None:
        with self._lock:
            held = [h.claimed for h in self._held.values() if not (h.timed_out or h.lease_lost)]
        if not held:
            return
        try:
            renewed, sent = self._renew_each(session, held)
        except Exception:
            self._streaks.failed("renew", "outbound: cannot renew outbox leases")
            with self._lock:
                self._counts["errors"] += 1
            return
        self._streaks.ok("renew")
        if len(renewed) != len(held):
            kept = {(item.message.id, item.token) for item in renewed}
            with self._lock:
                for item in held:
                    key = (item.message.id, item.token)
                    if key not in kept and (found := self._held.get(key)) is not None:
                        found.lease_lost = True
                        found.released = True
        self._renewed(renewed, sent)

    def _renew_each(
        self, session: Session, items: Sequence[Claimed]
    ) -> tuple[list[Claimed], float]:
        """Renew the leases of ``items``; return those renewed, and when the
        renewal that counts was sent (monotonic).

        All at once; if fewer were renewed (an operator closed some, or their
        leases passed to another relay; rare), one by one, so that the others
        count as renewed. Raises what the session raises. Blocks on the
        database; the loop thread's.
        """
        sent = time.monotonic()
        if session.renew(self.owner, self._lease, items) == len(items):
            return list(items), sent
        sent = time.monotonic()
        return [item for item in items if session.renew(self.owner, self._lease, [item]) == 1], sent

    def _reconcile(self, session: Session) -> bool:
        """After a reconnect, or a statement that failed with no answer: release the
        leases this relay has but does not hold (see :meth:`Session.reconcile`).

        Returns False if the database failed (the loop tries again, and claims
        nothing meanwhile).
        """
        try:
            released = session.reconcile(self.owner, self._tracked())
        except Exception as exc:
            self._streaks.failed("reconcile", "outbound: cannot reconcile outbox leases")
            with self._lock:
                self._counts["errors"] += 1
            # One the database refuses would be refused again: claims go
            # on, and the rows it would have released wait out their leases.
            return _refused(session, exc)
        self._streaks.ok("reconcile")
        with self._lock:
            self._counts["released"] += released
        if released:
            _log.warning(
                "outbound: %d outbox rows were still leased to this relay after a reconnect "
                "(the database lost their outcomes); released for delivery again",
                released,
            )
        return True

    # ------------------------------------------------------------ observation

    @property
    def state(self) -> RelayState:
        """The lifecycle state now."""
        with self._lock:
            return self._state

    def stats(self) -> RelayStats:
        """A consistent snapshot of the counters. Never blocks."""
        with self._lock:
            c = self._counts
            inflight = self._inflight + self._parked
            if self._state is RelayState.STOPPED:
                # Rows a forced stop dropped never run: count what still does.
                inflight = sum(
                    1
                    for held in self._held.values()
                    if held.started_at is not None and not (held.recorded or held.timed_out)
                )
            return RelayStats(
                state=self._state,
                owner=self.owner,
                claimed=c["claimed"],
                sent=c["sent"],
                retried=c["retried"],
                requeued=c["requeued"],
                dead=c["dead"],
                lost=c["lost"],
                inflight=inflight,
                errors=c["errors"],
                timed_out=c["timed_out"],
                stuck=sum(self._stuck.values()),
                released=c["released"],
                parked=c["parked"],
            )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<Relay table={self._store.table!r} state={s.state.value} "
            f"inflight={s.inflight} sent={s.sent}>"
        )


_COUNTER = {"sent": "sent", "retry": "retried", "requeue": "requeued", "dead": "dead"}


def _owner(label: str) -> str:
    """A new lease owner id for this process: ``label`` host:pid:random."""
    return f"{label}{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _handed(item: Claimed, held: _Held) -> OutboxMessage:
    """The message for one handler call: the claimed one the first time, and one
    with a payload of its own each other time (a second handler, a run again after
    a ``Defer`` or a 429), so that every call gets the payload as enqueued,
    whatever an earlier one did to it: decoded anew from the row's text, or, from
    a store that gives none, a deep copy of the payload as claimed (taken before
    the first call; a payload that cannot be copied is shared)."""
    message = item.message
    if not isinstance(message.payload, (dict, list)):
        return message  # nothing a handler could change
    if not held.handed:
        held.handed = True
        if item.text is None:
            try:
                held.pristine = (copy.deepcopy(message.payload),)
            except Exception:
                held.pristine = None
        return message
    if item.text is not None:
        return replace(message, payload=json.loads(item.text))
    if held.pristine is None:
        return message
    try:
        return replace(message, payload=copy.deepcopy(held.pristine[0]))
    except Exception:
        return message


def _outcome(
    item: Claimed,
    kind: str,
    *,
    delay: float = 0.0,
    error: str | None = None,
    since: float | None = None,
) -> Outcome:
    return Outcome(
        item.message.id,
        item.token,
        item.message.key,
        kind,  # type: ignore[arg-type]
        _clamp(delay),
        error,
        item.slot,
        since,
    )


def _after_failed(results: Sequence[Outcome], took: float) -> list[Outcome]:
    """``results`` to write again after a write that failed in ``took`` seconds.

    The failed write may have committed (its answer lost), the delays of its
    rows put back begun on the server as late as it ended: found written
    when written again, such a row is claimed when the relay reckons it due,
    from the delay it asked. Each delay now counts from ``took`` later, so
    that reckoning is never early (a claim before the row is due takes
    nothing, and the row was left to the poll). A row the failed write did
    not put back comes back that much later. Pure.
    """
    return [
        replace(o, since=o.since + took) if o.since is not None and o.delay > 0.0 else o
        for o in results
    ]


def _clamp(delay: float) -> float:
    """``delay`` within [0, _MAX_DELAY] (NaN: 0), so that every store can write it."""
    return min(_MAX_DELAY, delay) if delay > 0.0 else 0.0


def _refused(session: Session, exc: Exception) -> bool:
    """Whether a write that raised ``exc`` was refused for its data (see
    :meth:`Session.refused`); an error not from the store (a defect) counts
    as refused, so that it cannot hold back the other outcomes."""
    return not isinstance(exc, StoreError) or session.refused(exc)


def _describe(exc: BaseException) -> str:
    """``Class: message``, cut to 2000 characters, storable as text (no NUL, no lone surrogate)."""
    try:
        message = str(exc)
    except Exception:
        message = "<the exception's str() failed>"
    return clean_error(f"{exc.__class__.__name__}: {message}")


def _deadline(timeout: float | None) -> float | None:
    """When a wait of ``timeout`` seconds ends (None: never; also for ``math.inf``
    and anything past ``threading.TIMEOUT_MAX``, which no wait can take)."""
    if timeout is None:
        return None
    if not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 or None, not {timeout!r}")
    if timeout > threading.TIMEOUT_MAX:
        return None
    return time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
