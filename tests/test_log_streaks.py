"""Failures that repeat, logged in full once, then counted (``outbound._log.Streaks``)."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from outbound._log import Streaks

TIMEOUT = 10.0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self.guard:
            self.records.append(record)

    def at(self, level: int) -> list[logging.LogRecord]:
        with self.guard:
            return [r for r in self.records if r.levelno == level]


@pytest.fixture
def log() -> Iterator[_Records]:
    logger = logging.getLogger("outbound")
    handler = _Records()
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _at_once(n: int, body: Callable[[], None]) -> None:
    """Run ``body`` in ``n`` threads started together, at a 10 us switch interval."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    go = threading.Barrier(n)

    def run() -> None:
        go.wait(TIMEOUT)
        body()

    threads = [threading.Thread(target=run) for _ in range(n)]
    try:
        for t in threads:
            t.start()
    finally:
        for t in threads:
            t.join(60.0)
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads)


def _fail(streaks: Streaks, kind: str, error: BaseException, msg: str = "cannot %s") -> None:
    try:
        raise error
    except BaseException:
        streaks.failed(kind, msg, kind)


def test_the_first_failure_is_a_warning_with_its_traceback_the_rest_debug(log: _Records) -> None:
    streaks = Streaks(remind=3600.0)
    for _ in range(5):
        _fail(streaks, "claim", OSError("disk full"))
    (warning,) = log.at(logging.WARNING)
    assert warning.getMessage() == "cannot claim"
    assert warning.exc_info is not None
    assert str(warning.exc_info[1]) == "disk full"
    debug = log.at(logging.DEBUG)
    assert len(debug) == 4
    assert all(r.exc_info is not None for r in debug)  # in full, for who looks
    streaks.ok("claim")
    (info,) = log.at(logging.INFO)
    assert info.getMessage().startswith("cannot claim: works again, after 5 failures in ")
    assert not info.exc_info
    # Once a reminder's time has passed since the warning, a new streak starts over.
    later = Streaks(remind=0.0)
    _fail(later, "claim", OSError("disk full"))
    later.ok("claim")
    _fail(later, "claim", OSError("disk full"))
    assert len(log.at(logging.WARNING)) == 3


def test_a_reminder_counts_the_failures_and_names_the_last_error(log: _Records) -> None:
    streaks = Streaks(remind=0.0)  # every failure after the first reminds
    _fail(streaks, "renew", ValueError("two\nlines\x1b[31m"))
    _fail(streaks, "renew", ValueError("two\nlines\x1b[31m"))
    first, second = log.at(logging.WARNING)
    assert first.exc_info is not None
    assert not second.exc_info  # the traceback was logged once
    text = second.getMessage()
    assert text.startswith("cannot renew: still failing, 2 times in ")
    # one printable line, whatever the error's text holds
    assert text.endswith("(last: ValueError: two lines\\x1b[31m)"), text
    assert not log.at(logging.DEBUG)


def test_a_single_failure_ends_silently_and_kinds_are_apart(log: _Records) -> None:
    streaks = Streaks(remind=3600.0)
    streaks.ok("claim")  # no streak: nothing
    _fail(streaks, "claim", OSError("x"))
    _fail(streaks, "write", OSError("y"))
    _fail(streaks, "write", OSError("y"))
    assert [r.getMessage() for r in log.at(logging.WARNING)] == ["cannot claim", "cannot write"]
    streaks.ok("claim")
    assert not log.at(logging.INFO)  # one failure, already said
    streaks.ok("write")
    (info,) = log.at(logging.INFO)
    assert info.getMessage().startswith("cannot write: works again, after 2 failures")


def test_the_error_given_names_the_last_error_without_a_traceback(log: _Records) -> None:
    streaks = Streaks(remind=0.0)
    for _ in range(2):
        try:
            raise ConnectionError("reset")
        except ConnectionError:  # logged without its traceback, as the listener does
            streaks.failed("listen", "listener error: %s", "reset", exc_info=False)
    first, second = log.at(logging.WARNING)
    assert first.getMessage() == "listener error: reset"
    assert not first.exc_info
    assert second.getMessage().endswith("(last: ConnectionError: reset)")


def test_an_error_of_another_kind_in_a_streak_is_a_warning_in_full(log: _Records) -> None:
    """The server came back and refuses the statement: not hidden among the repeats.
    Each new type or first line is a warning with its traceback, up to eight kinds
    a streak; what repeats stays at debug level."""
    streaks = Streaks(remind=3600.0)
    _fail(streaks, "claim", ConnectionError("server closed the connection\nunexpectedly"))
    _fail(streaks, "claim", ConnectionError("server closed the connection\nat once"))
    _fail(streaks, "claim", PermissionError("permission denied for table outbox"))
    _fail(streaks, "claim", PermissionError("permission denied for table outbox"))
    warnings = log.at(logging.WARNING)
    assert [str(r.exc_info[1]) for r in warnings if r.exc_info] == [
        "server closed the connection\nunexpectedly",
        "permission denied for table outbox",
    ]
    assert len(log.at(logging.DEBUG)) == 2
    for i in range(20):
        _fail(streaks, "claim", OSError(f"error {i}"))
    assert len(log.at(logging.WARNING)) == 8  # then no more kinds are told apart


def test_a_raising_log_handler_changes_nothing(log: _Records) -> None:
    class Raising(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise RuntimeError("broken handler")

    logger = logging.getLogger("outbound")
    raising = Raising(logging.DEBUG)
    logger.addHandler(raising)
    try:
        streaks = Streaks(remind=0.0)
        for _ in range(3):
            _fail(streaks, "claim", OSError("x"))
        streaks.ok("claim")
    finally:
        logger.removeHandler(raising)
    assert len(log.at(logging.WARNING)) == 3
    assert len(log.at(logging.INFO)) == 1


def test_threads_failing_and_succeeding_at_once_lose_no_count(log: _Records) -> None:
    """Threads fail a kind many times, then one success ends the streak: the line
    that ends it counts every failure, and exactly one warning opened it."""
    streaks = Streaks(remind=3600.0)
    n, per = 4, 150

    def worker() -> None:
        for _ in range(per):
            _fail(streaks, "claim", OSError("x"))

    _at_once(n, worker)
    streaks.ok("claim")
    assert len(log.at(logging.WARNING)) == 1
    (info,) = log.at(logging.INFO)
    assert f"after {n * per} failures" in info.getMessage()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_connection_that_flaps_warns_once_a_reminder(log: _Records) -> None:
    """Fails, works, fails, once a second: one warning in full, then one a minute that
    counts failures and recoveries; the successes between are at debug level too.
    Past a reminder's time without a failure, the next one is a warning in full."""
    clock = _Clock()
    streaks = Streaks(remind=60.0, clock=clock)
    start = clock.now
    for second in range(60):
        clock.now = start + second
        _fail(streaks, "claim", ConnectionError("server closed the connection"))
        clock.now += 0.5
        streaks.ok("claim")
    (first,) = log.at(logging.WARNING)
    assert first.exc_info is not None
    assert not log.at(logging.INFO)  # a single failure ended silently; the rest flap
    assert len(log.at(logging.DEBUG)) == 59 + 59  # the failures after the first, and the ends
    clock.now = start + 60
    _fail(streaks, "claim", ConnectionError("server closed the connection"))
    _, reminder = log.at(logging.WARNING)
    assert not reminder.exc_info
    assert reminder.getMessage() == (
        "cannot claim: failing on and off, 61 failures and 60 recoveries in 60 s"
        " (last: ConnectionError: server closed the connection)"
    )
    clock.now += 0.5
    streaks.ok("claim")
    assert len(log.at(logging.WARNING)) == 2
    assert not log.at(logging.INFO)
    # It works for longer than a reminder's time: the next failure is news.
    clock.now += 60.0
    _fail(streaks, "claim", ConnectionError("server closed the connection"))
    third = log.at(logging.WARNING)[2]
    assert third.getMessage() == "cannot claim"
    assert third.exc_info is not None


def test_a_failure_soon_after_an_outage_ended_goes_on_with_its_streak(log: _Records) -> None:
    clock = _Clock()
    streaks = Streaks(remind=60.0, clock=clock)
    for _ in range(5):
        _fail(streaks, "write", OSError("disk full"))
        clock.now += 1.0
    streaks.ok("write")
    (info,) = log.at(logging.INFO)  # the outage's end is told
    assert info.getMessage().startswith("cannot write: works again, after 5 failures in 5.0")
    clock.now += 10.0
    _fail(streaks, "write", OSError("disk full"))  # the same error, within the minute
    _fail(streaks, "write", OSError("disk full"))
    streaks.ok("write")
    assert len(log.at(logging.WARNING)) == 1
    assert len(log.at(logging.INFO)) == 1  # the second end is at debug level
    _fail(streaks, "write", PermissionError("read-only file system"))  # another error: news
    (_, other) = log.at(logging.WARNING)
    assert other.exc_info is not None
    assert str(other.exc_info[1]) == "read-only file system"
    # Kinds flap apart: a claim's first failure is a warning of its own.
    _fail(streaks, "claim", OSError("disk full"))
    assert [r.getMessage() for r in log.at(logging.WARNING)][-1] == "cannot claim"
    # A run of failures that goes on for a reminder's time is an outage: its end is told.
    for _ in range(61):
        clock.now += 1.0
        _fail(streaks, "write", OSError("disk full"))
    streaks.ok("write")
    assert (
        log.at(logging.WARNING)[-1]
        .getMessage()
        .startswith(
            "cannot write: failing on and off, "  # (the reminder of the minute)
        )
    )
    assert (
        log.at(logging.INFO)[-1]
        .getMessage()
        .startswith("cannot write: works again, after 69 failures in 76.0 s")
    )


def test_threads_flapping_at_once_lose_no_count(log: _Records) -> None:
    """Threads fail and succeed a kind at a 10 us switch interval: every failure is
    counted in one streak (one warning opened it), whatever the interleaving."""
    clock = _Clock()
    streaks = Streaks(remind=60.0, clock=clock)
    n, per = 4, 150

    def worker() -> None:
        for _ in range(per):
            _fail(streaks, "claim", OSError("x"))
            streaks.ok("claim")

    _at_once(n, worker)
    assert len(log.at(logging.WARNING)) == 1
    clock.now += 59.0
    _fail(streaks, "claim", OSError("x"))
    clock.now += 1.0
    _fail(streaks, "claim", OSError("x"))
    reminder = log.at(logging.WARNING)[1].getMessage()
    # (a success ends a streak only if one is open: two failures, two successes may end one)
    assert f"failing on and off, {n * per + 2} failures and " in reminder
