"""What both outbox stores share: messages, checks, the store and session interfaces.

The row model, identical on both stores (see each store's schema):

- ``status``: ``pending`` (waiting to be claimed), ``processing`` (claimed by
  a relay under a lease), ``sent`` (its handlers succeeded) or ``dead``
  (rejected, or attempts exhausted). ``pending`` and ``processing`` are
  *unfinished*.
- ``head``: the one unfinished row of its key that may be claimed. Every key
  with unfinished rows has exactly one head (a unique partial index holds
  it); the others *wait* behind it in ``seq`` order. When the head finishes,
  the next waiting row of its key becomes head in the same transaction.
  This is what keeps per-key FIFO cheap: the claim query reads only heads,
  through an index, so its cost does not depend on how many rows wait.
- ``claims``: incremented by every claim; with ``lease_owner`` it fences
  every update a relay makes to a row it claimed.
"""

from __future__ import annotations

import abc
import datetime as _dt
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from outbound.retry import RetryPolicy

__all__ = [
    "Claimed",
    "Listener",
    "OutboxMessage",
    "OutboxStatus",
    "Outcome",
    "RetryPolicy",
    "RowInfo",
    "Session",
    "Store",
]

#: ``"strict"``: a row that failed and waits to be retried keeps its key
#: blocked, so a key's rows run in enqueue order, always. ``"mutex"``: at
#: most one row of a key runs at a time, but a row that failed goes to the
#: back of its key's line, so the rows behind it run first.
Ordering = Literal["strict", "mutex"]

STATUSES: tuple[str, ...] = ("pending", "processing", "sent", "dead")
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,39}")
# A NUL character in JSON text: ``\u0000`` after an even number of
# backslashes (``\\u0000`` is an escaped backslash followed by "u0000").
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def check_table(name: object) -> str:
    """Return ``name`` if it is a valid table name (lowercase identifier, <= 40 chars)."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise ValueError(
            f"table must be a lowercase SQL identifier of at most 40 characters "
            f"([a-z_][a-z0-9_]*), not {name!r}"
        )
    return name


def check_ordering(ordering: object) -> Ordering:
    if ordering == "strict":
        return "strict"
    if ordering == "mutex":
        return "mutex"
    raise ValueError(f"ordering must be 'strict' or 'mutex', not {ordering!r}")


def check_max_pending(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_pending must be an int or None, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"max_pending must be >= 1, not {value!r}")
    return value


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, not {value!r}")
    return value


def check_seconds(name: str, value: object, *, zero: bool = False) -> float:
    if isinstance(value, _dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    ok = value >= 0 if zero else value > 0
    if not (ok and math.isfinite(value)):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, not {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class NewRow:
    """A row checked and encoded by :func:`check_row`, ready to insert."""

    key: str
    type: str
    payload: str
    dedupe_key: str | None
    delay: float


def check_row(
    key: object,
    type: object,
    payload: object,
    dedupe_key: object,
    delay: object,
    max_payload_bytes: int,
) -> NewRow:
    """Check every argument of ``enqueue`` and encode the payload; raise before any write."""
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"key must be a str or an int, not {key.__class__.__name__}")
    key = str(key)
    if not key:
        raise ValueError("key must not be empty")
    if not isinstance(type, str):
        raise TypeError(f"type must be a str, not {type.__class__.__name__}")
    if not type:
        raise ValueError("type must not be empty")
    if dedupe_key is not None and not isinstance(dedupe_key, str):
        raise TypeError(f"dedupe_key must be a str or None, not {dedupe_key.__class__.__name__}")
    if dedupe_key == "":
        raise ValueError("dedupe_key must not be empty (use None for no dedupe key)")
    # PostgreSQL's text and jsonb cannot hold NUL; both stores refuse it alike.
    for name, value in (("key", key), ("type", type), ("dedupe_key", dedupe_key)):
        if value is not None and "\x00" in value:
            raise ValueError(f"{name} must not contain a NUL character ('\\x00')")
    seconds = 0.0 if delay is None else check_seconds("delay", delay, zero=True)
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"payload must be JSON-serializable: {exc}") from exc
    if "\\u0000" in text and _JSON_NUL.search(text):
        raise ValueError("payload must not contain a NUL character ('\\u0000') in any string")
    size = len(text.encode("utf-8"))
    if size > max_payload_bytes:
        raise ValueError(
            f"payload is {size} bytes of JSON, over the limit of {max_payload_bytes} bytes"
        )
    return NewRow(key, type, text, dedupe_key, seconds)


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """One outbox row as a handler sees it. Immutable; safe to share between threads.

    ``attempt`` is 1 on the first delivery and counts every delivery that
    failed before (a delivery put back for lack of capacity is not
    counted). Delivery is at least once: use ``id`` or ``dedupe_key`` to
    make a handler idempotent.
    """

    id: int
    key: str
    type: str
    payload: Any
    attempt: int
    dedupe_key: str | None
    created_at: float


@dataclass(frozen=True, slots=True)
class Claimed:
    """A row claimed by a relay: the message, its fencing token, its capacity slot."""

    message: OutboxMessage
    claims: int
    slot: int | None = None


#: What became of one claimed row, as the relay writes it back.
#: ``sent``/``dead``: finished; ``retry``: pending again after ``delay``,
#: the attempt counted; ``requeue``: pending again after ``delay``, the
#: attempt not counted (no capacity, or the handler raised ``Defer``).
OutcomeKind = Literal["sent", "dead", "retry", "requeue"]


@dataclass(frozen=True, slots=True)
class Outcome:
    id: int
    claims: int
    key: str
    kind: OutcomeKind
    delay: float = 0.0
    error: str | None = None
    slot: int | None = None


@dataclass(frozen=True, slots=True)
class OutboxStatus:
    """Counts by status and the age in seconds of the oldest pending row (or None)."""

    counts: Mapping[str, int] = field(default_factory=dict)
    oldest_pending_age: float | None = None


@dataclass(frozen=True, slots=True)
class RowInfo:
    """One row as the command line lists it."""

    id: int
    key: str
    type: str
    status: str
    attempts: int
    created_at: float
    last_error: str | None


class Session(abc.ABC):
    """A store connection owned by one relay; used from one thread at a time.

    Every method is one short transaction of its own and blocks on the
    database (on SQLite up to the busy timeout).
    """

    @abc.abstractmethod
    def ensure_slots(self, count: int) -> None:
        """Make capacity slots ``1..count`` exist."""

    @abc.abstractmethod
    def claim(
        self, owner: str, limit: int, lease: float, max_concurrency: int | None
    ) -> list[Claimed]:
        """Claim up to ``limit`` claimable rows for ``lease`` seconds.

        Claimable: the head of its key, pending and due, or processing with
        an expired lease. With ``max_concurrency``, a capacity slot is taken
        first for each row, and no more rows are claimed than slots were free.
        """

    @abc.abstractmethod
    def finish(self, owner: str, outcomes: Sequence[Outcome]) -> int:
        """Write the outcomes back, fenced by owner and claim; free their slots.

        Returns how many rows were updated (the others were lost to an
        expired lease and belong to another claim now).
        """

    @abc.abstractmethod
    def renew(self, owner: str, lease: float) -> None:
        """Extend the lease of every row and slot ``owner`` holds."""

    @abc.abstractmethod
    def release_slots(self, owner: str) -> None:
        """Free every slot ``owner`` holds."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the connection. Idempotent."""


class Listener(Protocol):
    """Wakes a relay when a row is committed (PostgreSQL LISTEN/NOTIFY)."""

    def start(self) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...


class Store(abc.ABC):
    """An outbox table in a database: where rows are enqueued and claimed from.

    Thread-safe: ``enqueue`` runs on the caller's connection; every other
    method opens its own. See :class:`~outbound.outbox.SQLiteStore` and
    :class:`~outbound.outbox.PostgresStore`.
    """

    table: str
    ordering: Ordering
    max_pending: int | None
    max_payload_bytes: int

    @abc.abstractmethod
    def create_schema(self) -> None:
        """Create the table, its indexes and its slot table if missing. Idempotent."""

    @abc.abstractmethod
    def enqueue(
        self,
        conn: Any,
        *,
        key: str | int,
        type: str,
        payload: Any,
        dedupe_key: str | None = None,
        delay: float | _dt.timedelta | None = None,
    ) -> int:
        """Write one pending row on ``conn``, inside its current transaction; return its id."""

    @abc.abstractmethod
    def session(self) -> Session:
        """Open a :class:`Session` for a relay."""

    def listener(self, wake: Callable[[], object]) -> Listener | None:
        """A listener calling ``wake()`` when rows are committed, or None (poll only)."""
        return None

    @abc.abstractmethod
    def status(self) -> OutboxStatus:
        """Counts by status and the age of the oldest pending row."""

    @abc.abstractmethod
    def rows(self, *, status: str | None = None, limit: int = 50) -> list[RowInfo]:
        """Rows of one status (or all), newest first."""

    @abc.abstractmethod
    def retry_dead(self, ids: Sequence[int] | None = None) -> int:
        """Make dead rows (these, or all) pending again, at the back of their key."""

    @abc.abstractmethod
    def purge(self, *, statuses: Sequence[str] = ("sent",), older_than: float = 0.0) -> int:
        """Delete finished rows of ``statuses`` last updated over ``older_than`` s ago."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store's own connections. Idempotent."""


def check_purge_statuses(statuses: Sequence[str]) -> list[str]:
    out = list(statuses)
    for status in out:
        if status not in ("sent", "dead"):
            raise ValueError(f"only finished rows can be purged ('sent', 'dead'), not {status!r}")
    return out


def check_list_status(status: str | None) -> str | None:
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    return status
