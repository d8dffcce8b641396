"""What both outbox stores share: checks, messages, the session contract, the admin code.

The row model, identical on both stores (see each store's SQL):

- ``status``: ``pending`` (waiting to be claimed), ``processing`` (claimed
  by a relay under a lease), ``sent`` (its handlers succeeded), ``dead``
  (rejected, attempts or age exhausted, or dead-lettered by an operator)
  or ``cancelled`` (by an operator; never delivered). ``pending`` and
  ``processing`` are *unfinished*; the others are *finished*.
- ``head``: the one unfinished row of its key that may be claimed. Every
  key with unfinished rows in line has exactly one head (a unique partial
  index holds it); the others *wait* behind it in ``seq`` order. When the
  head finishes, the next waiting row of its key becomes head in the same
  statement. So the claim reads only heads, through an index, and its cost
  does not depend on how many rows wait.
- ``lease_owner`` and ``lease_token``: who holds a processing row, and for
  which claim. The token is drawn at random for every claim and never
  reused, so an outcome from a claim that lost its lease (or whose row was
  purged, its id given to nobody else) can never match again.
- A counter per table (``{t}_counts``) holds the number of unfinished rows,
  so that ``max_pending`` is checked in constant time, whatever the backlog.

A schema version table (``{t}_schema``) records the migrations applied;
:meth:`Store.create_schema` brings any older schema to the current version.
"""

from __future__ import annotations

import abc
import contextlib
import datetime as _dt
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Protocol

from outbound.errors import DuplicateMessage, StoreError
from outbound.messages import _check_object_keys
from outbound.retry import RetryPolicy

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_PAYLOAD_DEPTH",
    "SCHEMA_VERSION",
    "BlockedKey",
    "Claimed",
    "Finished",
    "LeaseInfo",
    "Listener",
    "OutboxMessage",
    "OutboxStatus",
    "Outcome",
    "RetryPolicy",
    "RowInfo",
    "Session",
    "SlotInfo",
    "Store",
    "Throughput",
]

#: ``"strict"``: a row that failed and waits to be retried keeps its key
#: blocked, so a key's rows run in enqueue order, always. ``"mutex"``: at
#: most one row of a key runs at a time, but a row that failed goes to the
#: back of its key's line, so the rows behind it run first.
Ordering = Literal["strict", "mutex"]

#: The schema version this code reads and writes (see ``{t}_schema``).
SCHEMA_VERSION = 4

STATUSES: tuple[str, ...] = ("pending", "processing", "sent", "dead", "cancelled")
UNFINISHED: tuple[str, ...] = ("pending", "processing")
FINISHED: tuple[str, ...] = ("sent", "dead", "cancelled")

#: The most bytes (UTF-8) in a ``key``, ``type`` or ``dedupe_key``. Keys and
#: dedupe keys are indexed, and an index entry has a size limit (about
#: 2.7 KB on PostgreSQL): one over it would fail every later claim.
MAX_KEY_BYTES = 1024
# An int key this large has more digits than a key may have bytes (str()
# of an int over 4,300 digits raises, without naming the key).
_BIG_INT_KEY = 10**MAX_KEY_BYTES
#: The deepest nesting of arrays and objects accepted in a payload.
MAX_PAYLOAD_DEPTH = 100
#: The largest ``max_pending`` (and any other count a store is given).
MAX_COUNT = 2**31 - 1
#: The longest ``delay`` accepted by ``enqueue``: ten years, in seconds.
MAX_ENQUEUE_DELAY = 10 * 366 * 86400.0

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,39}")
#: The endings of the tables, indexes and sequences a store makes beside the
#: outbox's own (and a migration's): an outbox of such a name could be taken
#: for another's, or find its name taken.
_DERIVED = (
    *("_slots", "_counts", "_schema", "_look", "_v1"),
    *("_new", "_head", "_waiting", "_dedupe", "_state", "_ready", "_lease", "_pkey", "_seq"),
)
#: Columns every outbox table has, of version 1 (which had no version table)
#: and later (a reading may see one migrated meanwhile): a table without them
#: is not an outbox, and is never migrated.
V1_COLUMNS = frozenset({"id", "key", "type", "payload", "status", "head", "seq", "attempts"})


def not_an_outbox(table: str, schema_columns: Iterable[str] | None = None) -> str:
    """The error's text for a table of the outbox's name that is not an outbox.

    ``schema_columns``: the outbox table has an outbox's columns, and this
    is what the ``{table}_schema`` beside it has instead of an outbox's
    version table (another program's table of that name).
    """
    if schema_columns is not None:
        return (
            f"cannot use {table!r} as the outbox table: {table}_schema is not an outbox's "
            f"version table (its columns: {', '.join(sorted(schema_columns)) or 'none'}); "
            f"name the outbox otherwise"
        )
    return (
        f"cannot use {table!r} as the outbox table: a table of that name is there and is "
        f"not an outbox (no outbox's columns); name the outbox otherwise"
    )


#: The columns of every version's ``{table}_schema``: one that lacks them is
#: another program's table, never read as an outbox's version nor written.
SCHEMA_COLUMNS = frozenset({"version", "applied_at"})


#: Names a store cannot take (its statements name the table unquoted): the
#: words SQLite's grammar does not take for a table, and PostgreSQL's reserved
#: ones (its keywords of categories R and T, and ``current``), found by
#: running a store of each name on SQLite 3.40 and PostgreSQL 15, with 16's
#: ``system_user``. tests/outbox/test_schema.py checks the server's list.
_KEYWORDS = frozenset(
    """
    add all alter analyse analyze and any array as asc asymmetric authorization
    autoincrement between binary both case cast check collate collation column commit
    concurrently constraint create cross current current_catalog current_date
    current_role current_schema current_time current_timestamp current_user default
    deferrable delete desc distinct do drop else end escape except exists false fetch
    for foreign freeze from full grant group having if ilike in index initially inner
    insert intersect into is isnull join lateral leading left like limit localtime
    localtimestamp natural not nothing notnull null offset on only or order outer
    overlaps placing primary references returning right select session_user set similar
    some symmetric system_user table tablesample then to trailing transaction true union
    unique update user using values variadic verbose when where window with
    """.split()  # noqa: SIM905  (a paragraph of words reads better than 118 lines)
)
#: How long before they are due the rows of a claim's ``first`` (rows the
#: relay put back) may be claimed: the relay holds each until its time (see
#: :attr:`Claimed.wait`), so that its handler runs on time instead of a
#: wake-up and a claim's round trip late (a send slot a rate limiter booked
#: for it is lost past the limiter's slack).
CLAIM_AHEAD = 0.1
# How many times an operator looks for a key's head that relays keep moving.
_HEAD_TRIES = 100
# How many times an operator's change of one row is tried when the database
# ends it to break a deadlock.
_DEADLOCK_TRIES = 3
# A NUL character in JSON text: ``\u0000`` after an even number of
# backslashes (``\\u0000`` is an escaped backslash followed by "u0000").
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# What counts for the nesting depth of JSON text: brackets, and strings
# (skipped whole, so that a bracket inside one does not count).
_JSON_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


# ---------------------------------------------------------------------- checks


def check_table(name: object) -> str:
    """Return ``name`` if it is a valid table name (lowercase identifier, <= 40 chars,
    not an SQL keyword); else raise ``ValueError`` saying why."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise ValueError(
            f"table must be a lowercase SQL identifier of at most 40 characters "
            f"([a-z_][a-z0-9_]*), not {name!r}"
        )
    if name.endswith(_DERIVED) or name.startswith(("pg_", "sqlite_")):
        raise ValueError(
            f"table {name!r} ends as the tables and indexes an outbox makes beside its "
            f"own ({', '.join('name' + d for d in _DERIVED)}) or begins as a database's "
            f"own (pg_, sqlite_): name it otherwise"
        )
    if name in _KEYWORDS:
        raise ValueError(
            f"table {name!r} is an SQL keyword (of SQLite or PostgreSQL), which the "
            f"stores cannot take as a table's name: name it otherwise, such as {name}_outbox"
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
    return check_positive_int("max_pending", value)


def check_positive_int(name: str, value: object, maximum: int = MAX_COUNT) -> int:
    """``value`` if it is an int in ``1..maximum``; else ``TypeError``/``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 1 <= value <= maximum:
        raise ValueError(f"{name} must be between 1 and {maximum}, not {value!r}")
    return value


def check_seconds(
    name: str, value: object, *, zero: bool = False, maximum: float = math.inf
) -> float:
    if isinstance(value, _dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if isinstance(value, int) and abs(value) > 2**1000:
        # float() would raise OverflowError (and str() may refuse it).
        raise ValueError(f"{name} must be a finite number of seconds, not an int that large")
    ok = value >= 0 if zero else value > 0
    if not (ok and math.isfinite(value)):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, not {value!r}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum:g} seconds, not {value!r}")
    return float(value)


def check_ids(ids: object) -> list[int]:
    """Row ids as a sorted list without repeats; ``TypeError`` for anything but ints."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"ids must be an iterable of ints, not {type(ids).__name__}")
    out = set()
    for row_id in ids:
        if isinstance(row_id, bool) or not isinstance(row_id, int):
            raise TypeError(f"a row id must be an int, not {type(row_id).__name__}")
        if not 1 <= row_id < 2**63:
            raise ValueError(f"a row id must be between 1 and 2**63 - 1, not {row_id!r}")
        out.add(row_id)
    return sorted(out)


def _check_text(name: str, value: str) -> None:
    if not value:
        raise ValueError(f"{name} must not be empty")
    # PostgreSQL's text and jsonb cannot hold NUL; both stores refuse it alike.
    if "\x00" in value:
        raise ValueError(f"{name} must not contain a NUL character ('\\x00')")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(
            f"{name} must be valid Unicode text: it contains a lone surrogate"
        ) from None
    if size > MAX_KEY_BYTES:
        raise ValueError(f"{name} is {size} bytes in UTF-8, over the limit of {MAX_KEY_BYTES}")


def row_key(key: object) -> str:
    """A message's key as stored: a str as it is, an int as its digits; ``TypeError``
    or ``ValueError`` naming the problem (see :func:`_check_text`). Pure."""
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"key must be a str or an int, not {key.__class__.__name__}")
    if isinstance(key, int) and abs(key) >= _BIG_INT_KEY:
        raise ValueError(f"key is an int of more than {MAX_KEY_BYTES} digits, over the limit")
    # The value, not what a subclass's __str__ says (an enum member's name).
    text = int.__repr__(key) if isinstance(key, int) else str.__str__(key)
    _check_text("key", text)
    return text


def _json_depth(text: str) -> int:
    depth = deepest = 0
    for match in _JSON_NESTING.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


@dataclass(frozen=True, slots=True)
class NewRow:
    """A row checked and encoded by :func:`check_row`, ready to insert."""

    key: str
    type: str
    payload: str
    dedupe_key: str | None
    delay: float


def batch_duplicate(rows: Sequence[NewRow], dedupe_key: str) -> DuplicateMessage:
    """The refusal of a batch one of whose ``rows`` has ``dedupe_key``, which an
    unfinished row holds: naming the key and the message. Pure."""
    index = next((i for i, row in enumerate(rows) if row.dedupe_key == dedupe_key), None)
    where = "" if index is None else f"messages[{index}]: "
    return DuplicateMessage(
        f"{where}an unfinished outbox row already has the dedupe_key {dedupe_key!r}"
    )


def check_row(
    key: object,
    type: object,
    payload: object,
    dedupe_key: object,
    delay: object,
    max_payload_bytes: int,
) -> NewRow:
    """Check every argument of ``enqueue`` and encode the payload; raise before any write.

    ``TypeError`` for a value of the wrong type (a payload that is not
    JSON-serializable, or has a dict key that is not a str);
    ``ValueError`` for a value out of range: an empty
    or oversized key, type or dedupe key, a NUL or a lone surrogate in any
    of them or in the payload, a payload nested deeper than
    :data:`MAX_PAYLOAD_DEPTH` or larger than ``max_payload_bytes``, a delay
    that is negative, not finite or over ten years.
    """
    key = row_key(key)
    if not isinstance(type, str):
        raise TypeError(f"type must be a str, not {type.__class__.__name__}")
    type = str.__str__(type)
    _check_text("type", type)
    if dedupe_key is not None:
        if not isinstance(dedupe_key, str):
            raise TypeError(
                f"dedupe_key must be a str or None, not {dedupe_key.__class__.__name__}"
            )
        dedupe_key = str.__str__(dedupe_key)
        if not dedupe_key:
            raise ValueError("dedupe_key must not be empty (use None for no dedupe key)")
        _check_text("dedupe_key", dedupe_key)
    seconds = (
        0.0
        if delay is None
        else check_seconds("delay", delay, zero=True, maximum=MAX_ENQUEUE_DELAY)
    )
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except RecursionError:
        raise ValueError(
            f"payload is nested too deeply (the limit is {MAX_PAYLOAD_DEPTH} levels)"
        ) from None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"payload must be JSON-serializable: {exc}") from exc
    if "{" in text:
        _check_object_keys(payload, "payload")
    if "\\u0000" in text and _JSON_NUL.search(text):
        raise ValueError("payload must not contain a NUL character ('\\u0000') in any string")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(
            "payload must be valid Unicode text: a string in it contains a lone surrogate"
        ) from None
    if size > max_payload_bytes:
        raise ValueError(
            f"payload is {size} bytes of JSON, over the limit of {max_payload_bytes} bytes"
        )
    # Counting brackets is cheap; the exact depth is computed only when
    # there are enough of them to go past the limit.
    if text.count("[") + text.count("{") > MAX_PAYLOAD_DEPTH:
        depth = _json_depth(text)
        if depth > MAX_PAYLOAD_DEPTH:
            raise ValueError(
                f"payload is nested too deeply: {depth} levels, "
                f"over the limit of {MAX_PAYLOAD_DEPTH}"
            )
    return NewRow(key, type, text, dedupe_key, seconds)


def check_messages(messages: object, max_payload_bytes: int) -> list[NewRow]:
    """Check every message of ``enqueue_many``; raise before any write.

    Each message is a mapping with the keywords of ``enqueue``: ``key``,
    ``type``, ``payload``, optional ``dedupe_key`` and ``delay``. Raises
    ``TypeError``/``ValueError`` naming the message's index, and
    :class:`~outbound.errors.DuplicateMessage` if two messages share a
    dedupe key.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise TypeError(
            f"messages must be an iterable of mappings, not {messages.__class__.__name__}"
        )
    rows: list[NewRow] = []
    seen: dict[str, int] = {}
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{index}] must be a mapping, not {type(message).__name__}")
        unknown = set(message) - {"key", "type", "payload", "dedupe_key", "delay"}
        if unknown:
            raise TypeError(f"messages[{index}] has unknown fields: {sorted(map(str, unknown))}")
        missing = {"key", "type", "payload"} - set(message)
        if missing:
            raise TypeError(f"messages[{index}] misses {', '.join(sorted(missing))}")
        try:
            row = check_row(
                message["key"],
                message["type"],
                message["payload"],
                message.get("dedupe_key"),
                message.get("delay"),
                max_payload_bytes,
            )
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"messages[{index}]: {exc}") from exc
        if row.dedupe_key is not None:
            if row.dedupe_key in seen:
                raise DuplicateMessage(
                    f"messages[{seen[row.dedupe_key]}] and messages[{index}] have the same "
                    f"dedupe_key {row.dedupe_key!r}"
                )
            seen[row.dedupe_key] = index
        rows.append(row)
    return rows


def check_purge_statuses(statuses: Sequence[str]) -> list[str]:
    if isinstance(statuses, str):
        statuses = [statuses]
    out = list(statuses)
    for status in out:
        if status not in FINISHED:
            raise ValueError(
                f"only finished rows can be purged ({', '.join(FINISHED)}), not {status!r}"
            )
    return out


def check_list_status(status: str | None) -> str | None:
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    return status


def check_reason(reason: object) -> str | None:
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise TypeError(f"reason must be a str or None, not {type(reason).__name__}")
    return clean_error(reason)


def decode_payload(text: str) -> tuple[Any, str | None]:
    """A row's payload from its JSON text, or (None, why it cannot be decoded)."""
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as exc:
        return None, clean_error(f"the payload cannot be decoded: {exc.__class__.__name__}: {exc}")


def clean_error(text: str, limit: int = 2000) -> str:
    """``text`` made storable by every store (no NUL, no lone surrogate), cut to ``limit``."""
    text = text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- data types


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """One outbox row as a handler sees it. Immutable; safe to share between threads
    (its ``payload``, decoded JSON, is each handler call's own: a relay gives every
    call, a second handler's or a run again's, the payload as enqueued).

    ``attempt`` is 1 on the first delivery and counts every delivery that
    failed before (a delivery put back for lack of capacity is not
    counted). ``created_at`` is when it was enqueued, or revived by
    ``retry_dead`` (Unix seconds, the database's clock on PostgreSQL).
    Delivery is at least once: use ``id`` (never reused) or ``dedupe_key``
    to make a handler idempotent.
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
    """A row claimed by a relay: the message, its fencing token, its capacity slot.

    ``error`` is set when the row cannot be delivered at all (its payload
    does not decode): the relay dead-letters it without running a handler.
    """

    message: OutboxMessage
    token: int
    slot: int | None = None
    error: str | None = None
    #: Seconds from the claim's answer until the row is due (a row of
    #: ``first``, claimed up to :data:`CLAIM_AHEAD` early); 0.0 if due.
    #: Measured on the store's clock from when the answer was made, so that
    #: counting it from the answer's arrival never comes early.
    wait: float = 0.0
    #: The payload's JSON text as stored: the relay decodes it anew for each
    #: handler call but the first, so that no call sees what another changed.
    text: str | None = None


#: What became of one claimed row, as the relay writes it back.
#: ``sent``/``dead``: finished; ``retry``: pending again after ``delay``,
#: the attempt counted; ``requeue``: pending again after ``delay``, the
#: attempt not counted (no capacity, or the handler raised ``Defer``).
OutcomeKind = Literal["sent", "dead", "retry", "requeue"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One outcome to write back, fenced by ``id``, the relay's owner id and ``token``.

    ``since``: the ``time.monotonic()`` instant ``delay`` counts from (when
    the handler asked for it); the relay takes the time the outcome waited
    off the delay it writes, so that a row comes back when it was asked
    to. Stores read ``delay`` only.
    """

    id: int
    token: int
    key: str
    kind: OutcomeKind
    delay: float = 0.0
    error: str | None = None
    slot: int | None = None
    since: float | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """What :meth:`Session.finish` did: ``written`` outcomes, ``lost`` ones (the
    lease had passed on, or an operator changed the row), ``later``: the
    outcomes of rows another statement held at that moment, to write again
    (their slots are already freed), ``claimed``: rows the same step
    claimed for the relay (see ``take``), ordered by id, and
    ``lost_outcomes``: the lost ones, where the store can tell."""

    written: int
    lost: int
    later: tuple[Outcome, ...] = ()
    claimed: tuple[Claimed, ...] = ()
    lost_outcomes: tuple[Outcome, ...] = ()


@dataclass(frozen=True, slots=True)
class OutboxStatus:
    """Counts by status, the age in seconds of the oldest pending row (or None),
    and ``unfinished``: the counter ``max_pending`` is checked against."""

    counts: Mapping[str, int] = field(default_factory=dict)
    oldest_pending_age: float | None = None
    unfinished: int = 0


@dataclass(frozen=True, slots=True)
class RowInfo:
    """One row as an operator sees it (no payload). Times are Unix seconds.

    ``head``: the row is the next of its key to be delivered (or is being
    delivered). ``available_at``: when a pending row may be claimed next.
    ``lease_owner``/``lease_expires_at``: the relay delivering it.
    """

    id: int
    key: str
    type: str
    status: str
    attempts: int
    created_at: float
    last_error: str | None
    updated_at: float | None = None
    available_at: float | None = None
    head: bool = False
    dedupe_key: str | None = None
    lease_owner: str | None = None
    lease_expires_at: float | None = None


@dataclass(frozen=True, slots=True)
class BlockedKey:
    """A key whose next row cannot go out now, and the rows waiting behind it.

    ``head`` is that row: pending with a later ``available_at`` (backing
    off after a failure, deferred, or delayed), or processing (its handler
    is running, or its relay died and the lease has yet to expire).
    """

    key: str
    waiting: int
    head: RowInfo


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """The rows and capacity slots one relay (lease owner) holds now.

    ``expires_at``: when the first of its leases ends. ``latest_expiry``:
    when the lease it set last (at a claim or a renewal) ends; it moves
    forward while the relay lives, and stands still once it stopped.
    """

    owner: str
    rows: int
    slots: int
    expires_at: float | None
    latest_expiry: float | None = None


@dataclass(frozen=True, slots=True)
class Throughput:
    """Rows marked sent per time bucket, oldest bucket first. Times are Unix seconds.

    ``sent[i]`` rows were marked sent in ``[start + i * bucket, start +
    (i + 1) * bucket)``; the last bucket ends at ``end``, when it was read
    (the database's clock on PostgreSQL). A purged row is no longer counted.
    """

    start: float
    bucket: float
    sent: tuple[int, ...]

    @property
    def end(self) -> float:
        return self.start + self.bucket * len(self.sent)

    @property
    def per_second(self) -> tuple[float, ...]:
        """The rate of each bucket, in rows per second."""
        return tuple(n / self.bucket for n in self.sent)


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """One capacity slot (``max_concurrency``): its holder, if its lease is live."""

    slot: int
    owner: str | None
    expires_at: float | None


# ------------------------------------------------------------------- session


class Session(abc.ABC):
    """A store connection owned by one relay; used from one thread at a time.

    Every method is one statement (one short transaction) on PostgreSQL, so
    a relay that stalls between two calls holds no lock another relay could
    wait on; on SQLite each is one ``BEGIN IMMEDIATE`` transaction. All
    block on the database.
    """

    @abc.abstractmethod
    def ensure_slots(self, count: int) -> None:
        """Make capacity slots ``1..count`` exist."""

    @abc.abstractmethod
    def claim(
        self,
        owner: str,
        limit: int,
        lease: float,
        max_concurrency: int | None,
        skip_keys: Sequence[str] = (),
        *,
        held_keys: Sequence[str] = (),
        first: Sequence[int] = (),
        held_slots: Sequence[int] = (),
    ) -> list[Claimed]:
        """Claim up to ``limit`` claimable rows for ``lease`` seconds, under a new token.

        Claimable: the head of its key, pending and due, or processing with
        an expired lease; never a row of ``skip_keys``, nor an expired lease
        of a row of ``held_keys`` (the caller's own rows, whose deliveries
        still run: taking them back would deliver them twice). With
        ``max_concurrency``, each row takes a free capacity slot, and no
        more rows are claimed than slots were free; never one of
        ``held_slots`` (the caller's own, whose rows it still holds, even
        past their expiry: their outcomes free them, by slot and owner, and
        would free the slot of the row that took it). New rows are given
        their place in their key's line first. Expired leases come first,
        then the rows of ``first`` (ids) that are claimable (rows the caller
        put back, due now or within :data:`CLAIM_AHEAD` seconds, each with
        its :attr:`Claimed.wait`: a send slot a rate limiter booked for them
        is now; none of ``skip_keys``), then the other due heads, oldest
        first (PostgreSQL with ``max_concurrency`` takes the rows of
        ``first`` in that order too, when due).
        """

    @abc.abstractmethod
    def finish(
        self,
        owner: str,
        outcomes: Sequence[Outcome],
        *,
        take: int = 0,
        lease: float = 0.0,
        skip_keys: Sequence[str] = (),
    ) -> Finished:
        """Write the outcomes back, fenced by owner and token; free their slots.

        With ``take`` > 0 the store may also claim, for ``lease`` seconds and
        under a new token, up to ``take`` of the rows that move up to head
        because these outcomes finished their key's head (never a row of
        ``skip_keys``, never one not yet due), and return them in
        :attr:`Finished.claimed`: one write instead of a promotion and a
        claim. A store may claim none. Only without capacity slots.
        """

    @abc.abstractmethod
    def renew(self, owner: str, lease: float, held: Sequence[Claimed]) -> int:
        """Extend the leases of the ``held`` rows (and their slots); return how many rows.

        Only these: a row this relay no longer tracks (its outcome was
        written but lost in a database crash) is left to expire.
        """

    @abc.abstractmethod
    def reconcile(self, owner: str, held: Sequence[Claimed]) -> int:
        """Expire at once every lease and slot ``owner`` has but does not hold.

        Run after a reconnect: a database that restarted may have lost the
        last outcomes written, leaving their rows processing under ``owner``;
        a claim may have committed while its answer was lost with the
        connection (rows the relay never saw: a store that can tell does not
        count their attempt). Returns how many rows were released (each will
        be delivered again).
        """

    def reconnected(self) -> bool:
        """True once after the session replaced a connection that died."""
        return False

    def now(self) -> float:
        """The clock ``created_at`` is stamped with, now (Unix seconds): the
        database server's on PostgreSQL (one statement), this host's here."""
        return time.time()

    def hold_to(self, lease: float) -> None:  # noqa: B027 - a no-op unless overridden
        """Bound this session's statements as the relay's ``lease`` does, from its
        first (those before a claim too: its clock's read, its slots). Does
        not block."""

    def settled(self) -> bool:
        """False while the relay should claim nothing: a statement left on a
        dropped connection may still commit rows the next claim would take
        back (see the PostgreSQL store's reconcile). Does not block."""
        return True

    def refused(self, exc: StoreError) -> bool:
        """Whether ``exc``, raised by this session, is the database refusing the statement.

        True when the server answered that it will not run the statement
        with this data (it would answer so again); False when the database
        or the connection failed (a restart, a dropped or timed-out
        connection, a lock or resource limit): the same statement may
        succeed later. The relay writes an outcome the database refused as
        a plain retry instead, but keeps an outcome whose write failed
        otherwise and writes it again later: writing a retry in its place
        would deliver a sent row twice. Stores that cannot tell answer True.
        Does not block.
        """
        return True

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


# --------------------------------------------------------------- admin access


class Db(abc.ABC):
    """One admin connection inside one transaction, running the store's named SQL.

    The admin code below is written once against this; each store supplies
    its SQL (by name, in its ``_SQL`` class) and its way of running it.
    """

    @abc.abstractmethod
    def all(self, name: str, **params: Any) -> list[tuple[Any, ...]]:
        """Run statement ``name``; return every row."""

    def one(self, name: str, **params: Any) -> tuple[Any, ...] | None:
        """Run statement ``name``; return its first row, or None."""
        found = self.all(name, **params)
        return found[0] if found else None

    @abc.abstractmethod
    def run(self, name: str, **params: Any) -> int:
        """Run statement ``name``; return how many rows it changed."""


# The readers below take what an operator's reading finds. On SQLite a row
# may hold what another program wrote there (SQLite keeps any type in any
# column): such a value is shown as well as it can be, never a failure of
# the whole reading. PostgreSQL's columns only ever hold their own types.


def _time(value: Any) -> float | None:
    """A time column: None when unset, or not a number (another program's text)."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _count(value: Any) -> int:
    """A count column: 0 when not a number (as SQLite's arithmetic takes such text:
    ``attempts + 1`` of ``'many'`` is 1)."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an infinity)
        number = _time(value)
        return int(number) if number is not None and math.isfinite(number) else 0


def _shown(value: Any) -> Any:
    """A text column: bytes (a BLOB) decoded with what is not UTF-8 replaced, a number
    as its digits; None and text as they are."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _row_info(r: Sequence[Any]) -> RowInfo:
    """A RowInfo from the columns of the stores' ``row_columns``."""
    created_at = _time(r[5])
    return RowInfo(
        id=int(r[0]),
        key=_shown(r[1]),
        type=_shown(r[2]),
        status=_shown(r[3]),
        attempts=_count(r[4]),
        created_at=math.nan if created_at is None else created_at,
        last_error=_shown(r[6]),
        updated_at=_time(r[7]),
        available_at=_time(r[8]),
        head=bool(r[9]),
        dedupe_key=_shown(r[10]),
        lease_owner=_shown(r[11]),
        lease_expires_at=_time(r[12]),
    )


# --------------------------------------------------------------------- store


class Store(abc.ABC):
    """An outbox table in a database: where rows are enqueued and claimed from.

    Thread-safe: ``enqueue`` and ``enqueue_many`` run on the caller's
    connection; every other method opens a connection of its own and blocks
    on the database. The operator's methods (``status``, ``rows``,
    ``blocked``, ``leases``, ``slots``, ``throughput``, ``retry_dead``,
    ``cancel``, ``dead_letter``, ``purge``) are shared by both stores; each write is
    one transaction that waits for the rows it changes, so a relay racing
    it either wrote its outcome first or finds its fence broken. See
    :class:`~outbound.outbox.SQLiteStore` and
    :class:`~outbound.outbox.PostgresStore`.
    """

    table: str
    ordering: Ordering
    max_pending: int | None
    max_payload_bytes: int

    # ------------------------------------------------------------ the schema

    @abc.abstractmethod
    def create_schema(self) -> None:
        """Create the outbox's tables, or migrate them to the current version. Idempotent."""

    @abc.abstractmethod
    def schema_version(self) -> int | None:
        """The version of the schema in the database; None if there is no outbox table."""

    def check_schema(self) -> None:
        """Raise :class:`~outbound.errors.StoreError` unless the schema is the current one."""
        version = self.schema_version()
        if version is None:
            raise StoreError(
                f"the outbox table {self.table!r} does not exist: create it with "
                "create_schema() (or `python -m outbound outbox migrate`)"
            )
        if version < SCHEMA_VERSION:
            raise StoreError(
                f"the outbox table {self.table!r} has schema version {version}, this code needs "
                f"{SCHEMA_VERSION}: migrate it with create_schema() (or `python -m outbound "
                "outbox migrate`) after stopping the relays of the older version"
            )
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the outbox table {self.table!r} has schema version {version}, newer than this "
                f"code's {SCHEMA_VERSION}: upgrade outbound"
            )

    @abc.abstractmethod
    def drop_schema(self) -> None:
        """Drop the outbox's tables (tests, benchmarks). Irreversible."""

    # --------------------------------------------------------------- enqueue

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
    def enqueue_many(self, conn: Any, messages: Iterable[Mapping[str, Any]]) -> list[int]:
        """Write many pending rows in one statement on ``conn``; return their ids, in order.

        Each message is a mapping with ``enqueue``'s keywords (``key``,
        ``type``, ``payload``, optional ``dedupe_key`` and ``delay``). All
        or nothing: every message is checked before anything is written
        (errors name the message's index), and if the rows would pass
        ``max_pending`` (:class:`~outbound.errors.OutboxFull`) or one's
        dedupe key is taken (:class:`~outbound.errors.DuplicateMessage`,
        also for two messages of the batch), none is written. Rows of one
        key keep their order in the list. Same transaction handling and
        blocking as :meth:`enqueue`.
        """

    # ----------------------------------------------------------------- relays

    @abc.abstractmethod
    def session(self) -> Session:
        """Open a :class:`Session` for a relay."""

    def claim_session(self, beside: Session) -> Session | None:
        """A second :class:`Session` for a relay, on which it claims beside the writes
        of ``beside``, its first (a connection of its own), or None: it claims on
        the first, between its writes. A reconcile on either covers both."""
        return None

    def listener(self, wake: Callable[[], object]) -> Listener | None:
        """A listener calling ``wake()`` when rows are committed, or None (poll only)."""
        return None

    # --------------------------------------------------------------- operators

    @abc.abstractmethod
    def _admin(self, *, write: bool = False) -> contextlib.AbstractContextManager[Db]:
        """A :class:`Db` in a transaction of its own: committed on exit, rolled back on error."""

    def status(self) -> OutboxStatus:
        """Counts by status, the oldest pending row's age and the unfinished counter."""
        with self._admin() as db:
            counts = dict.fromkeys(STATUSES, 0)
            for status, count in db.all("counts"):
                counts[str(status)] = int(count)
            found = db.one("oldest_pending", now=time.time())
            unfinished = db.one("unfinished")
        age = None if found is None or found[0] is None else max(0.0, float(found[0]))
        total = int(unfinished[0]) if unfinished and unfinished[0] is not None else 0
        return OutboxStatus(counts, age, total)

    def rows(
        self, *, status: str | None = None, key: str | int | None = None, limit: int = 50
    ) -> list[RowInfo]:
        """Up to ``limit`` rows of ``status`` and ``key`` (or any), newest first.

        ``key`` as ``enqueue`` takes it (an int is its digits); one no row
        can have (empty, a NUL, a lone surrogate, too long) is a
        ``ValueError`` naming the problem."""
        check_list_status(status)
        check_positive_int("limit", limit)
        if key is not None:
            key = row_key(key)
        with self._admin() as db:
            found = db.all("rows", status=status, key=key, limit=limit)
        return [_row_info(r) for r in found]

    def get(self, row_id: int) -> RowInfo | None:
        """The row with this id, or None."""
        (row_id,) = check_ids([row_id])
        with self._admin() as db:
            found = db.one("row", id=row_id)
        return None if found is None else _row_info(found)

    def blocked(self, *, limit: int = 50) -> list[BlockedKey]:
        """Keys with rows waiting behind a head that cannot go out now, longest blocked first.

        The head is pending with a later ``available_at`` (a failure's
        backoff, a deferral, a delay) or processing (running, or held by a
        relay that died until its lease expires). Reads every head; meant
        for operators, not for a hot path.
        """
        check_positive_int("limit", limit)
        with self._admin() as db:
            found = db.all("blocked", now=time.time(), limit=limit)
        return [BlockedKey(_shown(r[13]), _count(r[14]), _row_info(r)) for r in found]

    def leases(self) -> list[LeaseInfo]:
        """The rows and slots each relay (lease owner) holds now, by owner."""
        with self._admin() as db:
            rows = {
                _shown(owner): (_count(n), _time(expiry)) for owner, n, expiry in db.all("leases")
            }
            slots = {
                _shown(owner): _count(n) for owner, n in db.all("slot_owners", now=time.time())
            }
            latest = {_shown(owner): _time(expiry) for owner, expiry in db.all("lease_ends")}
        out = []
        for owner in sorted(rows.keys() | slots.keys()):
            held, expiry = rows.get(owner, (0, None))
            out.append(LeaseInfo(owner, held, slots.get(owner, 0), expiry, latest.get(owner)))
        return out

    def throughput(self, *, window: float = 300.0, bucket: float = 5.0) -> Throughput:
        """How many rows were marked sent in each ``bucket`` seconds of the last ``window``.

        The buckets end now. Reads the sent rows' last update times: its
        cost grows with the sent rows kept (``purge`` them), not with the
        backlog. ``window`` is at most a day and holds at most 1,000
        buckets.
        """
        window = check_seconds("window", window, maximum=86400.0)
        bucket = check_seconds("bucket", bucket, maximum=window)
        count = math.ceil(window / bucket - 1e-9)
        if count > 1000:
            raise ValueError(
                f"window / bucket must be at most 1000 buckets, not {window:g} / {bucket:g}"
            )
        with self._admin() as db:
            found = db.one("clock", now=time.time())
            now = float(found[0]) if found else time.time()
            start = now - count * bucket
            sent = [0] * count
            for index, n in db.all("sent_since", start=start, end=now, bucket=bucket):
                # A row updated at the very end falls in the last bucket.
                sent[min(max(int(index), 0), count - 1)] += int(n)
        return Throughput(start, bucket, tuple(sent))

    def slots(self) -> list[SlotInfo]:
        """Every capacity slot, with its holder when its lease is live."""
        with self._admin() as db:
            found = db.all("slots", now=time.time())
        return [SlotInfo(_count(s), _shown(owner), _time(expiry)) for s, owner, expiry in found]

    def retry_dead(self, ids: Sequence[int] | None = None) -> int:
        """Make dead rows (these, or all) pending again, attempts reset, at the back of their key.

        A revived row is as if enqueued again: its ``created_at`` is now, so
        its age (the retry policy's ``max_total``) counts from its revival.
        A row whose dedupe key an unfinished row now holds is left dead.
        Revived rows count toward ``max_pending`` but are never refused.
        Returns how many rows were revived. One transaction per row: a row
        that fails raises ``StoreError`` saying how many rows before it were
        revived (they stay so); the rows after it are not tried.
        """
        if ids is None:
            with self._admin() as db:
                targets = [int(r[0]) for r in db.all("dead_ids")]
        else:
            targets = check_ids(ids)
        return self._each_row(targets, "revived", self._revive)

    def _each_row(
        self, ids: Sequence[int], verb: str, change: Callable[..., int], **options: str
    ) -> int:
        """Run ``change(db, row_id=id, **options)`` for each of ``ids``, a write
        transaction each (see _write_row); return how many rows changed. A row
        that fails raises ``StoreError`` naming it and how many rows before it
        were changed (they stay changed); the rows after it are not tried."""
        done = 0
        for n, row_id in enumerate(ids):
            try:
                done += self._write_row(partial(change, row_id=row_id, **options))
            except StoreError as exc:
                if len(ids) == 1:
                    raise
                left = len(ids) - n - 1
                raise StoreError(
                    f"row {row_id}: {exc} ({done} of the {n} rows before it {verb}; "
                    f"{left} after it not tried)"
                ) from exc
        return done

    def _write_row(self, change: Callable[[Db], int]) -> int:
        """Run ``change`` in a write transaction of its own; again (a few times) when
        the database ended it to break a deadlock with a relay moving the same line."""
        for attempt in range(1, _DEADLOCK_TRIES + 1):
            try:
                with self._admin(write=True) as db:
                    return change(db)
            except StoreError as exc:
                if attempt == _DEADLOCK_TRIES or not self._deadlocked(exc):
                    raise
        raise AssertionError("unreachable")

    def _deadlocked(self, exc: StoreError) -> bool:
        """The database ended the transaction to break a deadlock (worth one more try)."""
        return False

    @staticmethod
    def _lock_head(db: Db, key: str) -> tuple[Any, ...] | None:
        """Lock the head of ``key``'s line; None if the key has none.

        First the lock of the looks that make heads (none makes one while
        this transaction lasts), then the head: the order relays take them
        in. A head being finished while this waits is no longer head when
        the wait ends, and the next row may have been made head meanwhile:
        look again until no head is seen, or one is locked.
        """
        db.one("lock_lines")
        for _ in range(_HEAD_TRIES):
            head = db.one("lock_head", key=key)
            if head is not None or db.one("head_of", key=key) is None:
                return head
        raise StoreError(f"the line of key {key!r} kept moving; try again")

    @classmethod
    def _revive(cls, db: Db, row_id: int) -> int:
        found = db.one("row_state", id=row_id)
        if found is None or found[1] != "dead":
            return 0
        key, dedupe_key = found[0], found[3]
        head = cls._lock_head(db, key)
        if db.one("lock_row", id=row_id, statuses=["dead"]) is None:
            return 0
        if dedupe_key is not None and db.one("duplicate", dedupe_key=dedupe_key):
            return 0
        # At the back of the line: behind the head, or behind the key's
        # rows that wait for a head (the first of them, or this row, is
        # made head).
        db.run("revive", id=row_id, now=time.time())
        if head is not None:
            db.run("touch", id=head[0])
        else:
            db.run("promote", key=key)
        db.run("count", delta=1)
        return 1

    def cancel(self, ids: Sequence[int], *, reason: str | None = None) -> int:
        """Cancel unfinished rows: they will never be delivered. Returns how many.

        A row being delivered is cancelled too: its handler is not stopped,
        but its outcome is refused (fenced) and the next row of its key may
        start before that handler returns. A row a relay claimed but has not
        started does not start, unless it starts within half a second of
        when its relay last found it its own (a relay checks the rows that
        waited longer first). The next row of the key moves up. Waits for
        rows a relay is updating at that moment; one transaction per row: a
        row that fails raises ``StoreError`` saying how many rows before it
        were cancelled (they stay so); the rows after it are not tried.
        """
        error = check_reason(reason) or "cancelled by an operator"
        return self._close_rows(check_ids(ids), "cancelled", error)

    def dead_letter(self, ids: Sequence[int], *, reason: str | None = None) -> int:
        """Mark unfinished rows dead (to inspect, then :meth:`retry_dead` or purge).

        Like :meth:`cancel`, but the rows can be revived. Returns how many.
        """
        error = check_reason(reason) or "dead-lettered by an operator"
        return self._close_rows(check_ids(ids), "dead", error)

    def _close_rows(self, ids: list[int], status: str, error: str) -> int:
        verb = "cancelled" if status == "cancelled" else "dead-lettered"
        return self._each_row(ids, verb, self._close, status=status, error=error)

    @classmethod
    def _close(cls, db: Db, row_id: int, status: str, error: str) -> int:
        found = db.one("row_state", id=row_id)
        if found is None or found[1] not in UNFINISHED:
            return 0
        key = found[0]
        # The key's head first, then the row: the order a relay takes them
        # in. While the head is held, no relay changes the key's line; while
        # the key has none, none is made.
        head = cls._lock_head(db, key)
        locked = db.one("lock_row", id=row_id, statuses=list(UNFINISHED))
        if locked is None:
            return 0
        is_head = bool(locked[2])
        db.run("close", id=row_id, status=status, error=error, now=time.time())
        if is_head:
            db.run("promote", key=key)
        elif head is not None:
            db.run("touch", id=head[0])
        db.run("count", delta=-1)
        return 1

    def purge(self, *, statuses: Sequence[str] = ("sent",), older_than: float = 0.0) -> int:
        """Delete finished rows of ``statuses`` last updated over ``older_than`` seconds ago."""
        wanted = check_purge_statuses(statuses)
        # Past 300 years, older than any row: a bound every database's
        # timestamps and intervals hold (PostgreSQL's end near 294,000 years).
        older_than = min(check_seconds("older_than", older_than, zero=True), 1e10)
        if not wanted:
            return 0
        with self._admin(write=True) as db:
            return db.run(
                "purge", statuses=wanted, before=time.time() - older_than, older_than=older_than
            )

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store's own connections. Idempotent."""


@contextlib.contextmanager
def wrap_errors(
    error: type[BaseException] | tuple[type[BaseException], ...], what: str
) -> Iterator[None]:
    """Turn a driver's ``error`` into :class:`~outbound.errors.StoreError` (``what: ...``)."""
    try:
        yield
    except error as exc:
        raise StoreError(f"{what}: {exc}") from exc
