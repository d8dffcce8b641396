"""The library's log lines, which a logging handler that raises cannot stop."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ._fork import renewed_after_fork

logger = logging.getLogger("outbound")


def printable(text: str) -> str:
    """``text`` with control and other unprintable characters escaped (``\\n``, ``\\x1b``).

    Keys, types and errors often come from users: in a line meant for a
    terminal, a newline must not forge a line, nor an escape sequence
    recolour the operator's terminal. Thread-safe.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


#: What ``exc_info`` may be: True for the exception being handled, or one.
_ExcInfo = bool | BaseException


class QuietLog:
    """``logger``'s methods, except that a logging handler that raises (even
    ``SystemExit``; see :func:`log_dropping`) does not stop the caller: what follows a log line (a
    hook's error swallowed, a failed delivery's outcome recorded, a stuck
    row given up, a write tried again) must happen whatever the
    application's logging does. A line that could not be logged is dropped.
    Where a failure must not go unsaid (a relay's loop that failed), log
    with ``logger`` itself. Thread-safe; blocks only as the handlers do.
    """

    def debug(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.DEBUG, msg, args, exc_info)

    def info(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.INFO, msg, args, exc_info)

    def warning(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.WARNING, msg, args, exc_info)

    def error(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.ERROR, msg, args, exc_info)

    def critical(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.CRITICAL, msg, args, exc_info)

    def exception(self, msg: str, *args: object) -> None:
        self._log(logging.ERROR, msg, args, True)

    @staticmethod
    def _log(level: int, msg: str, args: tuple[object, ...], exc_info: _ExcInfo) -> None:
        # stacklevel 4: the line that called info(), warning(), ...
        log_dropping(logger, level, msg, args, exc_info=exc_info, stacklevel=4)


def log_dropping(
    log: logging.Logger,
    level: int,
    msg: str,
    args: tuple[object, ...],
    *,
    exc_info: _ExcInfo = False,
    stacklevel: int = 2,
) -> None:
    """``log.log(...)``; a line a handler or filter cannot log is dropped, whatever it
    raises (``SystemExit`` too), as a hook's error is: only a ``KeyboardInterrupt``
    in the main thread goes on, so that Ctrl-C still stops a program. ``stacklevel``
    counts from the caller of this function. Thread-safe; blocks as the handlers do."""
    try:
        log.log(level, msg, *args, exc_info=exc_info, stacklevel=stacklevel)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) and (
            threading.current_thread() is threading.main_thread()
        ):
            raise


#: The log of the dispatcher, its timer, futures and hooks, and the outbox relay
#: and PostgreSQL store.
quiet = QuietLog()


#: Kinds of error a streak tells apart (each new one is a warning in full).
_KINDS_KEPT = 8


class _Streak:
    __slots__ = ("errors", "failures", "line", "recoveries", "since", "warned", "went_on")

    def __init__(self, line: str, now: float, error: str) -> None:
        self.failures = 1
        self.recoveries = 0  # successes that ended it, a failure went on with (it flaps)
        self.line = line  # the first failure's message, on one line
        self.since = self.warned = self.went_on = now  # went_on: its first failure since a success
        self.errors = {error}  # the kinds of error seen (see _kind_of)


class Streaks:
    """Failures that repeat while a database is away, logged without a flood.

    The first failure of a kind (``"claim"``, ``"renew"``, ...) is logged
    in full, as a warning with its traceback; the ones after it in the
    same streak at debug level, but for one warning each ``remind``
    seconds that counts them and names the last error. A failure with an
    error of another type or first line than those of the streak so far
    (the server came back and refuses the statement, say) is a warning in
    full too. The first success of the kind after a streak ends it with
    one info line. A relay that polls once a second thus logs a few lines
    a minute through an outage (or a full disk), not a traceback per poll.

    A failure within ``remind`` seconds of the success that ended a
    streak goes on with that streak (a connection that flaps: fails,
    works, fails): at debug level, with the reminder counting failures
    and recoveries. Its next success is at debug level too, unless it
    ends a run of failures that lasted ``remind`` seconds or more (an
    outage). ``clock``: seconds, monotonic.

    Thread-safe; blocks only as the log handlers do.
    """

    def __init__(
        self, remind: float = 60.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._remind = remind
        self._clock = clock
        self._lock = renewed_after_fork(threading.Lock())  # (see outbound._fork)
        self._open: dict[str, _Streak] = {}  # guarded, by kind
        # guarded: by kind, the last streak a success ended, and when
        self._ended: dict[str, tuple[_Streak, float]] = {}

    def failed(self, kind: str, msg: str, *args: object, exc_info: _ExcInfo = True) -> None:
        """Log a failure of ``kind`` (``msg % args``) as its streak allows (see the class)."""
        now = self._clock()
        # (the error being handled, if the caller logs one without its traceback)
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        signature = _kind_of(error)
        level = logging.DEBUG
        remind: tuple[object, ...] | None = None
        with self._lock:
            streak = self._open.get(kind)
            if streak is None:
                ended = self._ended.pop(kind, None)
                if ended is not None and now - ended[1] < self._remind:
                    self._open[kind] = streak = ended[0]  # it flaps: the same streak goes on
                    streak.went_on = now
            if streak is None:
                line = _one_line(msg % args if args else msg)
                self._open[kind] = _Streak(line, now, signature)
                level = logging.WARNING
            else:
                streak.failures += 1
                if signature not in streak.errors and len(streak.errors) < _KINDS_KEPT:
                    streak.errors.add(signature)
                    level = logging.WARNING
                elif now - streak.warned >= self._remind:
                    streak.warned = now
                    if streak.recoveries:
                        line = "%s: failing on and off, %d failures and %d recoveries in %.0f s"
                        remind = (streak.line, streak.failures, streak.recoveries)
                    else:
                        line = "%s: still failing, %d times in %.0f s"
                        remind = (streak.line, streak.failures)
                    remind = (*remind, now - streak.since, _one_line(error))
        if remind is None:
            quiet._log(level, msg, args, exc_info)
        else:
            quiet._log(logging.WARNING, line + " (last: %s)", remind, False)

    def ok(self, kind: str) -> None:
        """A step of ``kind`` succeeded: end its streak, if one is open."""
        if not self._open:  # unlocked read: a streak opened meanwhile ends at a later success
            return
        now = self._clock()
        with self._lock:
            streak = self._open.pop(kind, None)
            if streak is None:
                return
            self._ended[kind] = (streak, now)
            flaps = streak.recoveries > 0 and now - streak.went_on < self._remind
            streak.recoveries += 1
        if streak.failures > 1:
            line = "%s: works again, after %d failures in %.1f s"
            args = (streak.line, streak.failures, now - streak.since)
            quiet._log(logging.DEBUG if flaps else logging.INFO, line, args, False)


def _kind_of(error: BaseException | None) -> str:
    """An error's type and the first line of its text: what tells two failures apart."""
    if error is None:
        return ""
    text = str(error).strip().partition("\n")[0]
    return f"{type(error).__qualname__}: {text}"


def _one_line(error: object) -> str:
    """An error as one printable line."""
    if error is None:
        return "no error"
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    return printable(" ".join(text.split()))


class _OneLine(logging.Formatter):
    """``<prefix>: <message>``; an exception as its type and message, on the same line.

    Control characters are escaped (an error's text may come from anywhere:
    a newline in it must not forge a line, nor an escape sequence drive the
    terminal); whitespace in the exception's message is collapsed first.
    """

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if message.startswith("outbound: "):
            message = message[len("outbound: ") :]
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            message = f"{message}: {type(error).__name__}: {' '.join(str(error).split())}"
        return f"{self.prefix}: {printable(message)}"


class _RelayRecords(logging.Filter):
    """INFO from the relay itself (retries); WARNING and above from every ``outbound`` logger
    (so that the sending layer's per-send INFO records stay out)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name == "outbound"


def _configured(logger: logging.Logger) -> bool:
    """True if records of ``logger`` reach a handler other than a NullHandler."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


@contextmanager
def log_failures(prefix: str, verbosity: int = 1) -> Iterator[None]:
    """Failures (retries, dead rows, database errors) as one line each on stderr, unless
    logging is configured for ``outbound`` already. ``verbosity`` 0: no retries. Not
    thread-safe (the command's main thread only)."""
    logger = logging.getLogger("outbound")
    if _configured(logger):
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(prefix))
    handler.addFilter(_RelayRecords())
    level = logger.level
    logger.setLevel(logging.INFO if verbosity >= 1 else logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
