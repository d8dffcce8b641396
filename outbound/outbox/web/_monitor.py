"""Snapshots of one outbox for the status page, and the relays the page has seen."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from outbound._fork import renewed_after_fork
from outbound.errors import OutboxError, StoreError
from outbound.outbox._base import (
    STATUSES,
    BlockedKey,
    RowInfo,
    SlotInfo,
    Store,
    Throughput,
    check_positive_int,
    check_seconds,
)

__all__ = ["RelaySeen", "StatusMonitor", "StatusSnapshot", "describe_store", "snapshot_json"]

logger = logging.getLogger("outbound.outbox.web")


@dataclass(frozen=True, slots=True)
class RelaySeen:
    """A relay (lease owner) as the page saw it. Times are the store's clock, Unix seconds.

    ``rows``/``slots``: what it holds now (0 when it holds nothing any more).
    ``expires_at``: when its first lease ends; ``latest_expiry``: when the
    lease it set last ends (a live relay keeps pushing it forward).
    ``renewed_at``: when the page saw ``latest_expiry`` move forward last,
    that is the relay's last claim or renewal, to within one refresh; None
    until the page has seen it move. ``last_seen``: the last snapshot in
    which it held anything.
    """

    owner: str
    rows: int
    slots: int
    expires_at: float | None
    latest_expiry: float | None
    renewed_at: float | None
    first_seen: float
    last_seen: float

    @property
    def holding(self) -> bool:
        return self.rows > 0 or self.slots > 0


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    """Everything the status page shows, read from one store. Immutable.

    ``now`` is the store's clock when the snapshot was taken (the
    database's on PostgreSQL, this process's on SQLite): every age on the
    page is measured against it. ``took`` is how long reading took.
    """

    table: str
    database: str
    now: float
    took: float
    counts: Mapping[str, int]
    unfinished: int
    oldest_pending_age: float | None
    throughput: Throughput
    dead: tuple[RowInfo, ...]
    blocked: tuple[BlockedKey, ...]
    relays: tuple[RelaySeen, ...]
    slots: tuple[SlotInfo, ...]
    #: More keys are blocked than ``blocked`` lists (it holds the monitor's ``blocked_limit``).
    blocked_more: bool = False

    @property
    def slots_in_use(self) -> int:
        return sum(1 for slot in self.slots if slot.owner is not None)


def _readable_path(path: str) -> str:
    """``path`` as text that can be sent: a file name's bytes that are not UTF-8 (a
    str holds them as lone surrogates on POSIX) replaced with U+FFFD."""
    try:
        return os.fsencode(path).decode("utf-8", "replace")
    except UnicodeError:  # a lone surrogate that stands for no byte
        return path.encode("utf-8", "replace").decode("utf-8")


def describe_store(store: Store) -> str:
    """Where the store's table lives, for people: a SQLite path, or PostgreSQL host and
    database (never a password)."""
    from outbound.outbox.postgres import PostgresStore  # noqa: PLC0415 - avoids a cycle at import
    from outbound.outbox.sqlite import SQLiteStore  # noqa: PLC0415

    if isinstance(store, SQLiteStore):
        return f"SQLite {_readable_path(store.path)}"
    if isinstance(store, PostgresStore):
        try:
            import psycopg  # noqa: PLC0415 - the store has imported it already

            params = psycopg.conninfo.conninfo_to_dict(store.conninfo)
        except Exception:  # a store built without psycopg cannot exist; be safe
            return "PostgreSQL"
        host = params.get("host") or "localhost"
        port = params.get("port")
        where = f"{host}:{port}" if port else str(host)
        name = params.get("dbname") or params.get("user")
        return f"PostgreSQL database {name} on {where}" if name else f"PostgreSQL on {where}"
    return type(store).__name__


#: The most keys one reading asks ``blocked()`` for.
_MOST_BLOCKED: Final = 100_001


def _running(head: RowInfo, now: float) -> bool:
    """True if a relay is delivering ``head`` under a live lease."""
    return head.status == "processing" and (head.lease_expires_at or 0.0) >= now


@dataclass(slots=True)
class _Memory:
    """What the monitor remembers of one relay between snapshots."""

    first_seen: float
    last_seen: float
    latest_expiry: float | None
    renewed_at: float | None
    last: RelaySeen | None = None


class StatusMonitor:
    """Reads snapshots of one outbox for the status page; remembers the relays it saw.

    - ``window``/``bucket``: the sent-per-second chart covers the last
      ``window`` seconds in buckets of ``bucket`` seconds.
    - ``dead_limit``/``blocked_limit``: the most dead rows (newest first)
      and blocked keys listed. A key is blocked when its next row cannot go
      out now for another reason than being delivered: backing off after a
      failure, deferred or delayed, or held by a relay that stopped (its
      lease has ended).
    - ``min_interval``: a snapshot younger than this is served again
      rather than read anew, so that any number of open pages cost one
      reader. A reading that failed is kept the same way: its error is
      raised again until the next reading is due.
    - ``max_load``: the largest share of the time readings may keep the
      database busy: a reading that took T seconds is served again for
      ``T / max_load`` seconds if that is longer, however many rows the
      table holds and however often pages ask (None: no such bound). T is
      the shorter of the time the reading took and the time the last
      reading that succeeded took (the first success's own; no time for a
      failure before any success): a reading slower
      than that one mostly waited (for a connection, a lock, a deadline)
      rather than kept the database busy, and the page should show the
      database back, and moving, soon after it is. So a failure is kept
      the same way.
    - ``forget_after``: seconds a relay that holds nothing any more stays
      listed.

    Thread-safe: one thread reads at a time; the others wait for its
    snapshot, or its error. :meth:`snapshot` blocks on the database and
    raises what the store raises (:class:`~outbound.errors.StoreError`;
    any other exception of a reading is raised as a ``StoreError`` from it),
    paced like the snapshots: a failing database is not read more often
    than a working one. An outage is one warning under
    ``outbound.outbox.web`` when the first reading fails, and one when a
    reading succeeds again, however often pages ask meanwhile.
    """

    def __init__(
        self,
        store: Store,
        *,
        window: float = 300.0,
        bucket: float = 5.0,
        dead_limit: int = 20,
        blocked_limit: int = 20,
        min_interval: float = 1.0,
        max_load: float | None = 0.1,
        forget_after: float = 600.0,
    ) -> None:
        self.store = store
        self.window = check_seconds("window", window, maximum=86400.0)
        self.bucket = check_seconds("bucket", bucket, maximum=self.window)
        if math.ceil(self.window / self.bucket - 1e-9) > 1000:
            raise ValueError("window / bucket must be at most 1000 buckets")
        self.dead_limit = check_positive_int("dead_limit", dead_limit, maximum=10_000)
        self.blocked_limit = check_positive_int("blocked_limit", blocked_limit, maximum=10_000)
        self.min_interval = check_seconds("min_interval", min_interval, zero=True)
        if max_load is not None and not (isinstance(max_load, (int, float)) and 0 < max_load <= 1):
            raise ValueError(f"max_load must be a share of the time in (0, 1], not {max_load!r}")
        self.max_load = max_load
        self.forget_after = check_seconds("forget_after", forget_after)
        self.database = describe_store(store)
        # Held while a snapshot is read, so that concurrent callers wait for
        # that one instead of reading their own. Taken before _lock.
        self._reading = renewed_after_fork(threading.Lock())
        # Guards _last, _error, _fresh_until and _relays; held only for bookkeeping.
        # Both made new in a forked child (a parent thread may hold them).
        self._lock = renewed_after_fork(threading.Lock())
        # The last reading's outcome: a snapshot, or the error it raised.
        self._last: StatusSnapshot | None = None
        self._error: OutboxError | None = None
        self._fresh_until = -math.inf  # time.monotonic()
        self._relays: dict[str, _Memory] = {}
        # The last answer that could not be made of a snapshot (cannot_show); guarded by _lock.
        self._unshown: str | None = None
        # The last reading's error, one line (None: it succeeded); guarded by _reading.
        self._failing: str | None = None
        # Seconds the last reading that succeeded took (None: none has); guarded by _reading.
        self._cost: float | None = None

    def __repr__(self) -> str:
        return f"<StatusMonitor table={self.store.table!r} database={self.database!r}>"

    def snapshot(self) -> StatusSnapshot:
        """The outbox as it is now, or as it was less than ``min_interval`` (or
        ``took / max_load``) ago; raises the last reading's error while that reading
        is that fresh (see ``max_load``). Blocks while another thread reads."""
        cached = self._cached()
        if cached is not None:
            return cached
        with self._reading:
            cached = self._cached()
            if cached is not None:
                return cached
            started = time.monotonic()
            try:
                try:
                    snapshot = self._read()
                except OutboxError:
                    raise
                except Exception as exc:
                    # Anything else (what a store made of a value it could not
                    # convert, a bug) fails this reading like a database error
                    # does: said on the page, paced, logged once; not a dropped
                    # connection for every viewer at every refresh.
                    logger.debug("reading outbox %r failed", self.store.table, exc_info=True)
                    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
                    raise StoreError(f"reading the outbox failed: {reason}") from exc
            except OutboxError as exc:
                if self._failing is None:
                    logger.warning(
                        "outbox %r (%s) cannot be read: %s; the status page says so until it "
                        "can be read again",
                        self.store.table,
                        self.database,
                        " ".join(str(exc).split()),
                    )
                self._failing = str(exc)
                # Served to the threads waiting for this reading and to those
                # asking until it is stale, as a snapshot is: a failing
                # database is not read more often than a working one.
                # (Before any success, none of its time: a database down at
                # the start is read again soon, not after ten pool timeouts.)
                took = time.monotonic() - started
                self._keep(None, exc, 0.0 if self._cost is None else min(took, self._cost))
                raise
            if self._failing is not None:
                self._failing = None
                logger.warning("outbox %r (%s) can be read again", self.store.table, self.database)
            took = time.monotonic() - started
            # As for a failure: a reading that waited (for a lock, for the
            # connection a restart dropped) longer than the last one took
            # did not keep the database busy meanwhile; served again for its
            # own time, the page would freeze for ten times the wait.
            cost = took if self._cost is None else min(took, self._cost)
            self._cost = took
            snapshot = dataclasses.replace(snapshot, took=took)
            self._keep(snapshot, None, cost)
            return snapshot

    def _keep(
        self, snapshot: StatusSnapshot | None, error: OutboxError | None, took: float
    ) -> None:
        """Remember a reading's outcome, fresh for ``min_interval`` or ``took / max_load``.
        Called with _reading held."""
        with self._lock:
            self._last = snapshot
            self._error = error
            fresh = self.min_interval
            if self.max_load is not None:
                fresh = max(fresh, took / self.max_load)
            self._fresh_until = time.monotonic() + fresh

    def cannot_show(self, exc: Exception) -> str:
        """One line saying why a snapshot could not be made into an answer (``exc``);
        a warning the first time that line comes, debug after."""
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        line = f"the status page cannot show this reading: {reason}"
        with self._lock:
            first, self._unshown = self._unshown != line, line
        if first:
            logger.warning("outbox %r: %s", self.store.table, line, exc_info=True)
        else:
            logger.debug("outbox %r: %s", self.store.table, line)
        return line

    def _cached(self) -> StatusSnapshot | None:
        """The last snapshot while fresh, or None; raises (a copy of) the last reading's
        error while that is fresh."""
        with self._lock:
            if time.monotonic() >= self._fresh_until:
                return None
            snapshot, error = self._last, self._error
        if error is not None:
            # A copy: one exception object raised in many threads would
            # collect every raise's traceback.
            raise _again(error) from error.__cause__
        return snapshot

    def _read(self) -> StatusSnapshot:
        store = self.store
        # The chart first: it reads the store's clock, which every age is
        # measured against.
        throughput = store.throughput(window=self.window, bucket=self.bucket)
        now = throughput.end
        status = store.status()
        dead = tuple(store.rows(status="dead", limit=self.dead_limit))
        # Heads running on a live lease are the outbox working, not blocked:
        # there are at most as many as processing rows, so asking for that
        # many more leaves blocked_limit of the others.
        # (One more than listed: whether there are more.)
        running = int(status.counts.get("processing", 0))
        limit = min(self.blocked_limit + 1 + running, _MOST_BLOCKED)
        while True:
            found = store.blocked(limit=limit)
            blocked = tuple(item for item in found if not _running(item.head, now))
            # (A relay may have claimed since the count: heads running then that
            # filled the answer leave too few. Asked again, for twice as many.)
            if len(found) < limit or len(blocked) > self.blocked_limit or limit >= _MOST_BLOCKED:
                break
            limit = min(2 * limit, _MOST_BLOCKED)
        leases = store.leases()
        slots = tuple(store.slots())
        counts = {name: int(status.counts.get(name, 0)) for name in STATUSES}
        return StatusSnapshot(
            table=store.table,
            database=self.database,
            now=now,
            took=0.0,
            counts=counts,
            unfinished=status.unfinished,
            oldest_pending_age=status.oldest_pending_age,
            throughput=throughput,
            dead=dead,
            blocked=blocked[: self.blocked_limit],
            relays=self._remember(now, leases),
            slots=slots,
            blocked_more=len(blocked) > self.blocked_limit,
        )

    def _remember(self, now: float, leases: list[Any]) -> tuple[RelaySeen, ...]:
        """Fold the relays holding leases now into what was seen before."""
        with self._lock:
            current = set()
            for lease in leases:
                current.add(lease.owner)
                memory = self._relays.get(lease.owner)
                latest = lease.latest_expiry
                if memory is None:
                    memory = self._relays[lease.owner] = _Memory(now, now, latest, None)
                elif latest is not None and (
                    memory.latest_expiry is None or latest > memory.latest_expiry
                ):
                    # A claim or a renewal set a later lease since the last look.
                    memory.renewed_at = now
                    memory.latest_expiry = latest
                memory.last_seen = now
                memory.last = RelaySeen(
                    lease.owner,
                    lease.rows,
                    lease.slots,
                    lease.expires_at,
                    latest if latest is not None else memory.latest_expiry,
                    memory.renewed_at,
                    memory.first_seen,
                    now,
                )
            seen = []
            for owner in sorted(self._relays):
                memory = self._relays[owner]
                if owner in current and memory.last is not None:
                    seen.append(memory.last)
                elif now - memory.last_seen > self.forget_after:
                    del self._relays[owner]
                else:
                    seen.append(
                        RelaySeen(
                            owner,
                            0,
                            0,
                            None,
                            memory.latest_expiry,
                            memory.renewed_at,
                            memory.first_seen,
                            memory.last_seen,
                        )
                    )
            return tuple(seen)


def _again(error: OutboxError) -> OutboxError:
    """A new exception like ``error``, to raise once more."""
    try:
        again = copy.copy(error)
    except Exception:  # an __init__ that does not take its own args
        again = StoreError(str(error))
    return again


def _row(row: RowInfo) -> dict[str, Any]:
    return dataclasses.asdict(row)


def snapshot_json(snapshot: StatusSnapshot) -> dict[str, Any]:
    """The snapshot as JSON-ready data: what ``/status.json`` serves.

    Times are Unix seconds of the store's clock; ``now`` is the moment of
    the snapshot, so that ages need no clock of the reader's.
    """
    throughput = snapshot.throughput
    return {
        "outbox": {"table": snapshot.table, "database": snapshot.database},
        "now": snapshot.now,
        "counts": dict(snapshot.counts),
        "unfinished": snapshot.unfinished,
        "oldest_pending_age": snapshot.oldest_pending_age,
        "sent_per_second": {
            "start": throughput.start,
            "end": throughput.end,
            "bucket": throughput.bucket,
            "sent": list(throughput.sent),
            "rates": list(throughput.per_second),
        },
        "dead": {
            "total": snapshot.counts.get("dead", 0),
            "rows": [_row(row) for row in snapshot.dead],
        },
        "blocked": [
            {"key": item.key, "waiting": item.waiting, "head": _row(item.head)}
            for item in snapshot.blocked
        ],
        "blocked_more": snapshot.blocked_more,
        "relays": [
            {
                "owner": relay.owner,
                "rows": relay.rows,
                "slots": relay.slots,
                "holding": relay.holding,
                "lease_expires_at": relay.expires_at,
                "latest_lease_expiry": relay.latest_expiry,
                "renewed_at": relay.renewed_at,
                "first_seen": relay.first_seen,
                "last_seen": relay.last_seen,
            }
            for relay in snapshot.relays
        ],
        "slots": {
            "total": len(snapshot.slots),
            "in_use": snapshot.slots_in_use,
            "slots": [dataclasses.asdict(slot) for slot in snapshot.slots],
        },
        "took": snapshot.took,
    }
