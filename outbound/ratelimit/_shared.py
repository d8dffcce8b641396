"""A limiter whose state lives in a store shared by processes, with a fail-safe fallback.

:class:`SharedRateLimiter` is the part Redis and PostgreSQL have in
common: it asks the store for each decision, every call bounded by a
client-side deadline (``timeout``), and when the store cannot answer in
time it decides locally at a conservative share of every limit
(``fallback_share``, say 1/4 for four processes), logging loudly, and
asks the store again every ``retry_interval`` seconds. It never sends
unlimited, and no limit is exceeded across a switch:

- **Store to fallback.** What the store saw is unknown from here, so the
  fallback starts as if every chat, every group and the bot had just
  spent their whole budget: its first send of a chat comes no sooner
  than the store could have allowed after any history. From then on it
  paces at its share, which is stricter than the limit itself.
- **Fallback to store.** Every ``retry_interval`` one decision tries the
  store (the others go on locally meanwhile, however long the try takes).
  Once it answers, and before it decides again, everything the fallback
  holds that still matters (the pace of each chat, group and of the bot,
  and every ban) is written to it, merged with what it holds by taking
  the later instant; during that write, one round trip or a few, no
  decision is granted (each is told to wait a moment). So the store picks
  up where the fallback left off.
- **Bans.** A 429's ban is kept locally as well as in the store, and
  bans the store reports (recorded by other processes) are copied
  locally: a local ban is honoured first, whatever the store says, until
  it ends; so a ban outlives a store that loses it (a restart) or stops
  answering. A store found to have lost its state (see
  :meth:`SharedRateLimiter._store_reset`) is handed this process's state
  back at once; a decision answered from a local ban writes the bans to
  the store again, at most once a ``retry_interval`` (see
  :meth:`SharedRateLimiter._ban_answered`).

Within one process these keep every window within ``limit + burst - 1``.
Processes that lose the store each decide alone at their share: when all
of them lose it, on average they keep to the limit (``fallback_share = 1 /
processes``), but two of them may send to one chat closer together than
its interval. When only some lose it, the store still gives the others
the whole limit, and each process cut off adds its share on top.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Final, TypeVar

from outbound._fork import renewed_after_fork

from ._core import (
    BaseRateLimiter,
    Gcra,
    RateLimiterStats,
    Scope,
    _check_setting,
    make_fallback,
)
from ._limits import RateLimits

__all__ = ["SharedRateLimiter", "call_deadline", "chat_text", "check_name", "encodes"]

logger = logging.getLogger("outbound.ratelimit")

_T = TypeVar("_T")

#: While the store is down, a reminder is logged this often (seconds).
_REMIND_EVERY: Final = 30.0

#: The wait (seconds) a decision answers while another thread writes the
#: fallback's state to a store that answers again: nothing is granted until
#: the store has it.
_SETTLING: Final = 0.05

#: Entries written to the store per call when the fallback's state is handed over.
_HANDOVER_CHUNK: Final = 500
# Seconds past a try's timeout after which its claim (see _trying_until) ends.
_TRY_SLACK: Final = 1.0

# The store's health.
_UP: Final = 0  # decisions go to the store
_DOWN: Final = 1  # decisions are local; the store is tried every retry_interval
_HANDOVER: Final = 2  # the store answers again; one thread writes the fallback's state to it

#: One entry of the fallback's state: (kind, chat, seconds from now); see RateLimiter._export.
Entry = tuple[str, Hashable, float]


def check_timeout(value: object) -> float:
    """A store call's time limit: a number of seconds in [0.001, 3600)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, not {type(value).__name__}")
    if not 0.001 <= value < 3600:  # NaN fails too
        raise ValueError(f"timeout must be a number of seconds in [0.001, 3600), not {value!r}")
    return float(value)


# .deadline: the time.monotonic() by which the decision this thread is making
# (an acquire or a record_429 of a shared limiter) must be done with its store;
# None outside one. One decision may make several calls (a try of a store
# marked down, the handover, then the decision itself): together they wait
# for the store no longer than the limiter's timeout.
_decision = threading.local()


def call_deadline(timeout: float) -> float:
    """When a store call made now must end: ``timeout`` from now, or the end of the
    running decision if sooner (``time.monotonic()`` seconds). Thread-safe."""
    own = time.monotonic() + timeout
    deadline: float | None = getattr(_decision, "deadline", None)
    return own if deadline is None else min(own, deadline)


class ConnectGate:
    """One connect at a time for one store (see :func:`connect_by`): while the
    resolver does not answer, tries of the store wait for the lookup in flight
    instead of starting one thread more each. Thread-safe; fork-safe."""

    __slots__ = ("lock", "thread")

    def __init__(self) -> None:
        self.lock: Final = renewed_after_fork(threading.Lock())
        self.thread: threading.Thread | None = None  # the connect in flight, if alive


def connect_by(
    connect: Callable[[], _T],
    deadline: float,
    discard: Callable[[_T], object],
    gate: ConnectGate,
) -> _T:
    """``connect()``, run in a daemon thread of its own and waited for until
    ``deadline`` (``time.monotonic()``): for a connect that no timeout of its own
    reaches, the lookup of a host name (``getaddrinfo``) above all. One at a time
    per ``gate``: while another still runs (a lookup the resolver never
    answers), this one waits for it to end first, until the deadline.

    Returns what it returned, raises what it raised, or ``TimeoutError`` at the
    deadline (or on a Ctrl-C while waiting, the Ctrl-C): a connection made after
    that goes to ``discard`` (which closes it), in that thread. ``OSError`` if no
    thread can be started. Blocks until the deadline at most. Thread-safe.
    """
    lock = threading.Lock()
    came = threading.Event()
    made: list[_T] = []
    failed: list[BaseException] = []
    abandoned = False

    def run() -> None:
        try:
            value = connect()
        except BaseException as exc:  # (raised in the caller's thread, if it waits)
            with lock:
                failed.append(exc)
            came.set()
            return
        with lock:
            late = abandoned
            if not late:
                made.append(value)
        came.set()
        if late:
            with contextlib.suppress(Exception):
                discard(value)

    thread = threading.Thread(target=run, name="outbound-connect", daemon=True)
    try:
        while True:
            # (A thread of the gate is alive from its start() to its end: one a
            # Ctrl-C kept from starting, or a parent's in a forked child, is not.)
            with gate.lock:
                before = gate.thread
                if before is None or not before.is_alive():
                    gate.thread = thread
                    try:
                        thread.start()
                    except RuntimeError as exc:  # "can't start new thread"
                        raise OSError(f"cannot connect: {exc}") from exc
                    break
            before.join(max(0.0, deadline - time.monotonic()))
            if before.is_alive():
                raise TimeoutError(
                    "a connect of this store still runs (a host name's lookup?): "
                    "the time allowed passed waiting for it"
                )
        came.wait(max(0.0, deadline - time.monotonic()))
        with lock:
            abandoned = not (made or failed)
            kept, errors = made[:1], failed[:1]
    except BaseException:  # a Ctrl-C: what came, or comes, is closed
        with lock:
            abandoned = True
            kept = made[:]
            made.clear()
        for value in kept:
            with contextlib.suppress(Exception):
                discard(value)
        raise
    if kept:
        return kept[0]
    if errors:
        raise errors[0]
    raise TimeoutError("the connect (a host name's lookup?) outlasted the time allowed")


#: The longest a chat's text (see chat_text) or a budget's name may be in a store,
#: UTF-8 bytes: both go in one index entry of PostgreSQL (at most about 2,700 bytes).
MAX_KEY_BYTES: Final = 512


def _check_chat(chat_id: object) -> None:
    if isinstance(chat_id, bool) or not isinstance(chat_id, (int, str)):
        raise TypeError(
            f"a shared rate limiter's chat id is an int or a str, not {type(chat_id).__name__}"
        )
    if isinstance(chat_id, int):
        if chat_id.bit_length() > 64:
            raise ValueError("a shared rate limiter's chat id is an int of at most 64 bits")
    elif len(chat_id) > 50 and len(chat_text(chat_id).encode(errors="replace")) > MAX_KEY_BYTES:
        # (50 characters or fewer make at most 10 bytes each in the store: never too long)
        raise ValueError(
            f"a shared rate limiter's chat id is a str of at most {MAX_KEY_BYTES} bytes in "
            f"UTF-8 (as quoted), not one of {len(chat_id)} characters"
        )


def check_name(name: str) -> None:
    """``ValueError`` if a budget's ``name`` is too long for a store's key."""
    if len(name.encode(errors="replace")) > MAX_KEY_BYTES:
        raise ValueError(
            f"name must be at most {MAX_KEY_BYTES} bytes in UTF-8, not {len(name)} characters"
        )


def chat_text(chat_id: Hashable) -> str:
    """A chat's name in the store: the ``repr`` of its plain ``int`` or ``str`` value,
    so that an ``IntEnum`` or ``(str, Enum)`` member and its value, one chat to
    the in-process limiter, are one there too. Pure."""
    if isinstance(chat_id, int):
        return int.__repr__(chat_id)
    if isinstance(chat_id, str):
        return repr(str.__str__(chat_id))
    return repr(chat_id)


def encodes(text: str) -> bool:
    """True if ``text`` encodes to UTF-8 (no lone surrogate): what a store's name must."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _store_offset(gcra: Gcra | None, slack: float = 0.0) -> float | None:
    """How far ahead of a switch the store's state for one bucket may reach.

    After any conforming send at ``t`` the bucket's ``tat`` is at most ``t +
    tolerance + slack + interval``: a fallback floored there, with a stricter
    rate, can only add sends that conform to the limit as well.
    """
    return None if gcra is None else gcra.tolerance + slack + gcra.interval


class StoreClosed(OSError):
    """Raised by a limiter's store once the limiter is closed: it decides
    locally from then on (logged once, as a closed limiter, not an outage)."""


class SharedRateLimiter(BaseRateLimiter):
    """Base of the limiters that keep their state in a shared store.

    ``clock``: ``None`` (the store's clock, the same for every process and
    host) or a function returning seconds (tests; the fallback and the
    health checks then use it too). ``fallback_share``: the fraction of
    every limit this process may spend while the store is unreachable
    (``1 / processes`` is exact for processes that share the load evenly).
    ``retry_interval``: seconds between two tries of a store that failed
    (at most 3600); meanwhile no decision waits for it.

    Thread-safe. A decision waits at most about the subclass's ``timeout``
    for the store, never longer; a decision made locally never waits.
    """

    #: What the store's client raises when the store cannot answer.
    _store_errors: tuple[type[BaseException], ...] = (OSError,)
    #: How the store is named in log messages.
    _store_name = "store"

    def __init__(
        self,
        limits: RateLimits,
        *,
        clock: Callable[[], float] | None = None,
        fallback_share: float = 0.25,
        retry_interval: float = 1.0,
        slack: float = 0.02,
        stale_after: float = 1.0,
        infer_chats: int = 2,
        infer_window: float = 1.0,
    ) -> None:
        if clock is not None and not callable(clock):
            raise TypeError("clock must be callable or None")
        super().__init__(
            limits,
            slack=slack,
            stale_after=stale_after,
            infer_chats=infer_chats,
            infer_window=infer_window,
            tick=clock or time.monotonic,
        )
        if isinstance(fallback_share, bool) or not isinstance(fallback_share, (int, float)):
            raise TypeError("fallback_share must be a number")
        if not 0.0 < fallback_share <= 1.0:
            raise ValueError(f"fallback_share must be in (0, 1], not {fallback_share!r}")
        self._clock: Final = clock
        self._share: Final = float(fallback_share)
        self._retry_interval: Final = _check_setting(
            "retry_interval", retry_interval, positive=True
        )
        try:
            fallback = make_fallback(
                limits,
                fallback_share,
                clock,
                slack=slack,
                stale_after=stale_after,
                infer_chats=infer_chats,
                infer_window=infer_window,
            )
        except ValueError as exc:  # a share so small that a limit's period overflows
            raise ValueError(
                f"fallback_share={fallback_share!r} is too small for these limits ({exc})"
            ) from None
        self._fallback: Final = fallback
        self._offsets: Final = (
            _store_offset(self._chat),
            _store_offset(self._group),
            _store_offset(self._overall, self._slack),
        )
        # Guards _state, _claim, _claims, _trying_until, _down_since, _next_try
        # and _reminded; held for O(1), or for one local decision (so that no
        # local decision slips between the snapshot of a handover and the
        # switch back), never while the store is asked.
        self._health_lock: Final = renewed_after_fork(threading.Lock())
        self._state = _UP
        # self._tick() until which one thread tries a store marked down (-inf:
        # none). A claim, not a flag: one that a Ctrl-C (or any exception of a
        # signal handler) left behind ends once the try it stood for would
        # have timed out, instead of keeping the store untried for good.
        self._trying_until = -math.inf
        # The claim in force (0: none), and the last one made: a try, or a
        # handover, acts on the state only while its claim is the one in force
        # (one taken as abandoned may still be writing when the next begins).
        self._claim = 0
        self._claims = 0
        # How many times the store was found down: the store's answer to a
        # decision asked before a switch to the fallback (even one the store
        # came back from since) is not used (see _decide). Written under
        # _health_lock.
        self._outages = 0
        # self._tick() when the store stopped answering; None while it answers.
        self._down_since: float | None = None
        self._next_try = 0.0
        self._reminded = 0.0
        # self._tick() from which a decision answered by a local ban writes the
        # bans to the store again (see _ban_answered).
        self._next_rewrite = 0.0
        # .active is True in the thread that tries a store marked down (one at a time).
        self._probing = threading.local()
        renewed_after_fork(self)  # see _at_fork_reinit

    def _at_fork_reinit(self) -> None:
        """In a forked child (see :mod:`outbound._fork`): the parent's thread that was
        trying the store, or handing the fallback's state over to it, does not exist
        here. The child was left trying for good (never going back to the store) or
        settling for good (granting nothing); its next decision tries the store
        instead. Runs in the child only, before any other thread exists there."""
        self._trying_until = -math.inf
        self._claim = 0
        if self._state == _HANDOVER:
            self._state = _DOWN
        if self._state == _DOWN:
            self._next_try = 0.0

    # ------------------------------------------------------------ the store

    @abc.abstractmethod
    def _store_decide(
        self, now: float | None, chat_id: Hashable, group: bool, book: bool
    ) -> tuple[float, float, float]:
        """One decision in the store (``now``: None for the store's clock); may raise.

        Returns the wait, and the seconds left of the bot-wide ban and of the
        chat's ban (0.0 when none).
        """

    @abc.abstractmethod
    def _store_record(
        self, now: float | None, chat_id: Hashable, seconds: float, scope: Scope | None
    ) -> Scope:
        """Record a 429 in the store, inferring ``scope`` there if None; may raise."""

    @abc.abstractmethod
    def _store_handover(self, now: float | None, entries: Sequence[Entry]) -> None:
        """Merge ``entries`` into the store, each value the later of the two; may raise.

        With no entries, only checks that the store answers.
        """

    def close(self) -> None:
        """Release the store's connections this limiter opened; later decisions use
        the local share (``fallback_share``), as after an outage, and never reach the
        store again. Idempotent."""

    @property
    @abc.abstractmethod
    def timeout(self) -> float:
        """Seconds one decision may wait for the store, all its calls together."""

    def acquire(self, chat_id: Hashable, *, book: bool = True) -> float:
        """As :meth:`BaseRateLimiter.acquire`; ``chat_id`` is an ``int`` or a ``str``
        (the store keys a chat by its text: ``42`` and ``42.0``, one chat in this
        process, would be two there), else ``TypeError``. Waits for the store at
        most ``timeout`` seconds, whatever the calls it makes."""
        _check_chat(chat_id)
        _decision.deadline = time.monotonic() + self.timeout
        try:
            return super().acquire(chat_id, book=book)
        finally:
            _decision.deadline = None

    def record_429(
        self, chat_id: Hashable, retry_after: float, scope: Scope | None = None
    ) -> Scope:
        """As :meth:`BaseRateLimiter.record_429`; ``chat_id`` as for :meth:`acquire`;
        waits for the store at most ``timeout`` seconds."""
        _check_chat(chat_id)
        _decision.deadline = time.monotonic() + self.timeout
        try:
            return super().record_429(chat_id, retry_after, scope)
        finally:
            _decision.deadline = None

    # ------------------------------------------------------------ decisions

    def _now(self) -> float | None:
        return None if self._clock is None else self._clock()

    def _decide(self, chat_id: Hashable, group: bool, book: bool) -> float:
        fallback = self._fallback
        probing = self._probing
        probing.active = False
        # Read before any look at the state (unlocked): an outage that begins
        # after that look, the store asked all the same, is seen after the answer.
        outages = self._outages
        # Unlocked reads of _state: a stale _UP costs one try of a failing store
        # (bounded by the timeout; a grant it gets after the switch is not used,
        # see below), a stale _DOWN is read again under the lock.
        if self._state != _UP:
            claim = 0
            try:
                with self._health_lock:
                    due = self._state == _DOWN
                    if due:
                        tick = self._tick()
                        due = tick >= self._trying_until and tick >= self._next_try
                    if due:
                        # This thread tries the store; others go on locally.
                        claim = self._claims + 1
                        self._claims = self._claim = claim
                        self._trying_until = tick + self.timeout + _TRY_SLACK
                if claim:  # before the ban check, so that bans reach the store during a ban
                    probing.active = True
                    self._try_store(claim)
            finally:
                if claim:
                    probing.active = False
                    with self._health_lock:
                        if self._claim == claim:  # (not a later try's)
                            self._claim = 0
                            self._trying_until = -math.inf
        banned = fallback._banned(chat_id)
        if banned > 0.0:
            self._ban_answered()
            return banned
        if self._state != _UP:
            with self._health_lock:
                if self._settling_locked():
                    return _SETTLING
                if self._state == _DOWN:
                    return fallback._decide(chat_id, group, book)
        try:
            wait, global_ban, chat_ban = self._store_decide(self._now(), chat_id, group, book)
        except self._store_errors as exc:
            self._store_failed(exc)
            with self._health_lock:
                # (Not once the store is back: a handover that ended meanwhile
                # took a snapshot without this grant, which the store would never
                # learn of. Asked again instead.)
                if self._settling_locked() or self._state != _DOWN:
                    return _SETTLING
                return fallback._decide(chat_id, group, book)
        if global_ban > 0.0:
            fallback._ban(None, global_ban)
        if chat_ban > 0.0:
            fallback._ban(chat_id, chat_ban)
        # Unlocked reads; a switch after them came after this answer.
        if self._state != _UP or self._outages != outages:
            with self._health_lock:
                if self._settling_locked():
                    return _SETTLING
                if self._state == _DOWN:
                    # The store answered after another thread found it down and the
                    # fallback took over, floored for what the store had granted up to
                    # then: a grant (or booking) made since would come on top of the
                    # fallback's. Decided locally instead; the store counts a send
                    # that is not made (the shared budget loses one, never gains).
                    return fallback._decide(chat_id, group, book)
                if self._outages != outages:
                    # Asked before an outage the store came back from: its grant may
                    # have been made there before the fallback's grants were handed
                    # over (the handover keeps the later of two paces, not their
                    # sum), and a local one now would not reach the store. Asked
                    # again after a short wait instead (the store counts a send that
                    # is not made: the shared budget loses one, never gains).
                    return _SETTLING
        return wait

    def _global_ban_left(self) -> float:
        # Every bot-wide ban this process knows is in the fallback: those recorded
        # here, and those the store reported (copied at each decision).
        return self._fallback._global_ban_left()

    def _ban_answered(self) -> None:
        """A decision was answered by a ban this process knows, with no round trip:
        at most once every ``retry_interval``, write its bans to the store again.

        A store that lost them (a Redis restart without persistence) gets
        them back, so the other processes are held by them too, while this
        process still gets calls (a new chat's first send, say); without
        this it would ask the store nothing until every ban it holds ended,
        nor notice the restart. Each value is the later of the two: a store
        that kept them is left as it is. A failure is the store's, as for a
        decision. Unlocked read of _state: a stale one skips a rewrite, or
        tries a store that fails (bounded by the timeout).
        """
        if self._state != _UP:
            return  # handed over when the store answers again
        tick = self._tick()
        with self._health_lock:
            if tick < self._next_rewrite:
                return
            self._next_rewrite = tick + self._retry_interval
        bans = [e for e in self._fallback._export() if e[0] in ("ban", "global_ban")]
        try:
            for start in range(0, len(bans), _HANDOVER_CHUNK):
                self._store_handover(self._now(), bans[start : start + _HANDOVER_CHUNK])
        except self._store_errors as exc:
            self._store_failed(exc)

    def _store_reset(self) -> None:
        """For subclasses: the store answers but lost its state (a restart without
        persistence). Hand what this process holds back to it now, as after an
        outage; if that fails, the store is taken as down."""
        logger.warning(
            "outbound: the rate limiter's %s lost its state (restarted?); handing this "
            "process's bans and pace back to it",
            self._store_name,
        )
        entries = self._fallback._export()
        if entries:
            try:
                for start in range(0, len(entries), _HANDOVER_CHUNK):
                    self._store_handover(self._now(), entries[start : start + _HANDOVER_CHUNK])
            except self._store_errors as exc:
                self._store_failed(exc)

    def _record(self, chat_id: Hashable, seconds: float, scope: Scope | None) -> Scope:
        # Kept locally first (so this process honours it at once), and fed to
        # the local inference, which decides while the store is down.
        local = self._infer(chat_id) if scope is None else scope
        self._fallback._ban(None if local == "global" else chat_id, seconds)
        # Unlocked read: a stale one only skips or adds a try. While the local
        # state is being handed over the store answers: record it there too.
        if self._state == _DOWN:
            return local  # handed to the store when it answers again
        if local == "global":
            # This process saw 429s of enough chats, some the store may never
            # have seen (during an outage, or before it lost its state): the
            # ban it holds is the bot's, everywhere.
            scope = "global"
        try:
            applied = self._store_record(self._now(), chat_id, seconds, scope)
        except self._store_errors as exc:
            self._store_failed(exc, unrecorded=True)
            return local
        if applied != local:
            self._fallback._ban(None if applied == "global" else chat_id, seconds)
        return applied

    def _ban(self, chat_id: Hashable | None, seconds: float) -> None:
        self._record(chat_id, seconds, "global" if chat_id is None else "chat")

    # ----------------------------------------------------------- its health

    def _may_connect(self) -> bool:
        """Whether this thread may open a connection: while the store answers, or to
        try it again. So an outage costs one connect timeout, not one per thread."""
        return self._state == _UP or getattr(self._probing, "active", False)

    def _settling_locked(self) -> bool:
        """Whether a handover back to the store runs (decisions wait for it: they
        answer "a moment"). One whose claim ended (a Ctrl-C, or any exception of a
        signal handler, left it, or it outlasted every write's timeout) is taken as
        abandoned: down, the store to be tried again by the next decision.
        _health_lock held."""
        if self._state != _HANDOVER:
            return False
        if self._tick() < self._trying_until:
            return True
        self._state = _DOWN
        self._next_try = 0.0
        self._claim = 0  # (its thread, still writing, switches nothing)
        self._trying_until = -math.inf
        return False

    def _try_store(self, claim: int) -> None:
        """Try a store marked down; if it answers, hand the fallback's state over and
        go back to it, under ``claim`` (see _claim): while it is the claim in force."""
        try:
            self._store_handover(self._now(), [])  # does it answer at all?
        except self._store_errors as exc:
            self._store_failed(exc)  # others decided locally meanwhile
            return
        # It answers: from the snapshot to the switch, nothing is granted, so the
        # store gets every local decision.
        handed = False
        try:
            with self._health_lock:
                if self._claim != claim or self._state != _DOWN:
                    return  # (its try outlasted its claim, and another began)
                self._state = _HANDOVER
                entries = self._fallback._export()  # reads the clock: may raise
                # The claim covers the handover, each write within the timeout:
                # past it, decisions take the handover as abandoned (see
                # _settling_locked), whatever left it (a Ctrl-C anywhere here).
                chunks = -(-len(entries) // _HANDOVER_CHUNK)
                self._trying_until = self._tick() + (chunks + 1) * self.timeout + _TRY_SLACK
            for start in range(0, len(entries), _HANDOVER_CHUNK):
                self._store_handover(self._now(), entries[start : start + _HANDOVER_CHUNK])
            with self._health_lock:
                # (Not if decisions took it as abandoned meanwhile, and went on
                # locally: the next try hands those over too; nor once that
                # next try began, whose handover it is then.)
                if self._state == _HANDOVER and self._claim == claim:
                    # (Before the switch: a Ctrl-C here leaves the handover to be
                    # taken as abandoned, and tried again, forgetting them then.)
                    self._fallback._forget_bookings()  # (not handed over: see _export)
                    since, self._down_since = self._down_since, None
                    self._state = _UP
                    handed = True
        except self._store_errors as exc:
            self._store_failed(exc)
            return
        finally:
            if not handed:
                # Not the store's error (a Ctrl-C, the clock's): nothing would end
                # the handover, and no decision would be granted again. Down, to be
                # tried again by the next decision.
                with self._health_lock:
                    if self._state == _HANDOVER and self._claim == claim:
                        self._state = _DOWN
                        self._next_try = 0.0
        if not handed:
            return
        logger.warning(
            "outbound: the rate limiter's %s answers again after %.1fs; back to the shared "
            "budget (%d entries of local pace and bans handed over)",
            self._store_name,
            self._tick() - (since if since is not None else self._tick()),
            len(entries),
        )

    def _store_failed(self, exc: BaseException, *, unrecorded: bool = False) -> None:
        """The store failed ``exc``: switch to the fallback if it was up. With
        ``unrecorded`` (a ban that did not reach the store), a handover under way,
        whose snapshot may lack it, is abandoned too. _health_lock not held."""
        tick = self._tick()
        with self._health_lock:
            first = self._state == _UP
            if first:
                # Held back before the switch: the fallback decides from the
                # switch on, and never without its floors (a Ctrl-C between the
                # two left it granting what the store had granted already).
                self._fallback._hold_back(*self._offsets)
                self._outages += 1
                self._state = _DOWN
                self._down_since = tick
                self._reminded = tick
                self._next_try = tick + self._retry_interval
            elif getattr(self._probing, "active", False):
                self._state = _DOWN  # the try failed: wait retry_interval from now
                self._next_try = tick + self._retry_interval
            elif unrecorded and self._state == _HANDOVER:
                # A 429's ban did not reach the store beside the handover, whose
                # snapshot, taken before, may lack it. Abandoned (its thread
                # switches nothing): the next try hands it all over. (Another
                # failure beside it carries nothing the snapshot lacks.)
                self._state = _DOWN
                self._claim = 0
                self._trying_until = -math.inf
                self._next_try = tick + self._retry_interval
            remind = not first and tick - self._reminded >= _REMIND_EVERY
            if remind:
                self._reminded = tick
            down_for = tick - (self._down_since if self._down_since is not None else tick)
        if isinstance(exc, StoreClosed):
            if first:
                logger.warning(
                    "outbound: the rate limiter is closed (%s); sending at a local share of %g "
                    "of every limit from now on",
                    exc,
                    self._share,
                )
        elif first:
            logger.error(
                "outbound: the rate limiter's %s is unreachable (%s: %s); sending at a local "
                "share of %g of every limit until it answers again",
                self._store_name,
                type(exc).__name__,
                exc,
                self._share,
            )
        elif remind:
            logger.error(
                "outbound: the rate limiter's %s is still unreachable after %.0fs (%s); "
                "sending at the local share of %g",
                self._store_name,
                down_for,
                type(exc).__name__,
                self._share,
            )

    @property
    def degraded(self) -> bool:
        """True while the store is unreachable and the local share is in force."""
        return self._state != _UP

    def stats(self) -> RateLimiterStats:
        """The fallback's state: what was decided locally, and every ban this process knows."""
        local = self._fallback.stats()
        return RateLimiterStats(
            chats=local.chats,
            groups=local.groups,
            booked=local.booked,
            banned=local.banned,
            global_ban=local.global_ban,
            store="fallback" if self.degraded else "shared",
        )
