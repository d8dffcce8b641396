"""Adversarial tests of the PostgreSQL store's watchdog: no database needed.

A socket pair stands in for a connection whose peer stopped answering: a
``recv`` on it returns b"" as soon as the watchdog shuts the socket down.
Many threads arm random short deadlines at once, with the interpreter
switching threads every 10 microseconds, while the watchdog's thread
looks, sleeps, ends and restarts. Faults are injected into private
``_Watchdog`` instances (same class as ``_WATCHDOG``), so that a watchdog
broken by a test does not leave the process's own one broken for the next.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import itertools
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from outbound.outbox import postgres as pg
from outbound.outbox.postgres import _WATCHDOG, _WATCHDOG_IDLE, _Watchdog

from .conftest import wait_for
from .test_watchdog import held_elsewhere

pytestmark = pytest.mark.skipif(not hasattr(socket, "socketpair"), reason="needs socketpair")

NAME = "outbound-pg-watchdog"
LATE = 1.5  # a cut this long after its deadline counts as missed
EPSILON = 1e-6  # float rounding of monotonic() + seconds


# --------------------------------------------------------------------------
# helpers


@dataclass
class Read:
    seconds: float
    elapsed: float  # from before bound() until recv() returned
    cut: bool  # recv() returned b"": the socket was shut down
    dropped: bool  # what dropped() said at the end of the block


@contextlib.contextmanager
def _pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected socket pair, both ends closed on the way out."""
    mine, peer = socket.socketpair()
    try:
        yield mine, peer
    finally:
        mine.close()
        peer.close()


def _silent_read(wd: _Watchdog, seconds: float, patience: float = 5.0) -> Read:
    """A read on a silent socket bounded by ``wd``; waits at most seconds + patience."""
    with _pair() as (mine, _peer):
        mine.settimeout(min(seconds, 10.0) + patience if seconds > 0 else patience)
        started = time.monotonic()
        with wd.bound(mine, seconds) as dropped:
            try:
                data: bytes | None = mine.recv(1)
            except TimeoutError:
                data = None
            elapsed = time.monotonic() - started
            return Read(seconds, elapsed, data == b"", dropped())


def _still_open(mine: socket.socket, peer: socket.socket) -> bool:
    """The socket pair still carries a byte (not shut down by a watchdog)."""
    mine.settimeout(5.0)
    try:
        peer.sendall(b"x")
        return mine.recv(1) == b"x"
    except OSError:
        return False


def _thread_of(wd: _Watchdog) -> threading.Thread | None:
    """``wd``'s current thread (read afresh: no narrowing across calls)."""
    return wd._thread


def _threads_of(wd: _Watchdog) -> list[threading.Thread]:
    """The live threads running ``wd``'s loop."""
    return [
        t
        for t in threading.enumerate()
        if t.name == NAME and getattr(getattr(t, "_target", None), "__self__", None) is wd
    ]


@contextlib.contextmanager
def _watchdog_thread_errors() -> Iterator[list[BaseException]]:
    """Record (and keep from pytest) the exceptions that end a watchdog thread."""
    errors: list[BaseException] = []
    previous = threading.excepthook

    def hook(args: Any) -> None:
        if args.thread is not None and args.thread.name == NAME:
            errors.append(args.exc_value)
        else:
            previous(args)

    threading.excepthook = hook
    try:
        yield errors
    finally:
        threading.excepthook = previous


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """The interpreter switches threads every 10 microseconds during the test."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    with _watchdog_thread_errors() as errors:
        yield errors


def _run_workers(n: int, work: Callable[[int], None], timeout: float) -> None:
    """Run ``work(i)`` in ``n`` threads; re-raise the first error; none left running."""
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,), name=f"adversary-{i}") for i in range(n)]
    for t in threads:
        t.start()
    until = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, until - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"workers still running after {timeout}s: {stuck}"
    if errors:
        raise errors[0]


class Census:
    """Samples ``wd``'s live threads every millisecond, in a thread of its own."""

    def __init__(self, wd: _Watchdog) -> None:
        self.wd = wd
        self.seen: list[threading.Thread] = []
        self.most_alive = 0
        self.longest_overlap = 0.0  # longest stretch with two or more alive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="census")

    def _run(self) -> None:
        overlap_since: float | None = None
        while not self._stop.wait(0.001):
            alive = _threads_of(self.wd)
            now = time.monotonic()
            for t in alive:
                if not any(t is s for s in self.seen):
                    self.seen.append(t)
            self.most_alive = max(self.most_alive, len(alive))
            if len(alive) >= 2:
                overlap_since = now if overlap_since is None else overlap_since
                self.longest_overlap = max(self.longest_overlap, now - overlap_since)
            else:
                overlap_since = None

    def __enter__(self) -> Census:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)


def _count_starts(wd: _Watchdog, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the threads started for ``wd`` from now on."""
    starts = [0]
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if getattr(getattr(thread, "_target", None), "__self__", None) is wd:
            starts[0] += 1
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return starts


def _line_of(function: Callable[..., Any], text: str, occurrence: int) -> int:
    lines, first = inspect.getsourcelines(function)
    found = [first + n for n, line in enumerate(lines) if text in line]
    return found[occurrence]


def _is_at(ident: int | None, code: Any, line: int) -> bool:
    """The thread ``ident`` runs ``code`` at ``line`` (in any frame of its stack)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        if frame.f_code is code and frame.f_lineno == line:
            return True
        frame = frame.f_back
    return False


def _poll(predicate: Callable[[], bool], timeout: float) -> bool:
    until = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > until:
            return False
        time.sleep(0.001)
    return True


BOUND = inspect.unwrap(_Watchdog.bound)
ARM_LINE = _line_of(BOUND, "with self._cond:", 0)  # a statement waits here to arm
DISARM_LINE = _line_of(_Watchdog._disarm, "with self._cond:", 0)  # and here to disarm
END_LINE = _line_of(_Watchdog._watch, "self._thread = None", 0)  # the thread ends here


def _check_reads(reads: list[Read]) -> None:
    """Every read was cut, said so, not before its deadline nor LATE after it."""
    missed = [r for r in reads if not r.cut]
    unsaid = [r for r in reads if r.cut and not r.dropped]
    early = [r for r in reads if r.elapsed < r.seconds - EPSILON]
    late = [r for r in reads if r.cut and r.elapsed > r.seconds + LATE]
    worst = max((r.elapsed - r.seconds for r in reads), default=0.0)
    assert (missed, unsaid, early, late) == ([], [], [], []), (
        f"{len(reads)} reads: {len(missed)} never cut {missed[:3]}, "
        f"{len(unsaid)} cut without dropped() {unsaid[:3]}, "
        f"{len(early)} cut early {early[:3]}, {len(late)} cut late {late[:3]}; "
        f"worst lateness {worst:.3f}s"
    )


# --------------------------------------------------------------------------
# every short deadline is enforced, never early, under stress


def test_sixteen_threads_of_random_short_deadlines_are_all_cut_on_time(
    fast_switching: None, thread_errors: list[BaseException]
) -> None:
    # Every thread arms random deadlines (0.01-0.3 s) on silent sockets; a
    # few also run statements bounded far ahead (the thread then waits on
    # a long _next and must be woken for the short ones).
    reads: list[Read] = []
    lock = threading.Lock()
    until = time.monotonic() + 3.0

    def work(i: int) -> None:
        rnd = random.Random(i)
        with _pair() as (mine, peer):
            while time.monotonic() < until:
                if i % 4 == 0 and rnd.random() < 0.5:
                    with _WATCHDOG.bound(mine, 60.0) as dropped:
                        time.sleep(rnd.uniform(0, 0.02))  # a quick statement
                    assert not dropped()
                    continue
                read = _silent_read(_WATCHDOG, rnd.uniform(0.01, 0.3))
                with lock:
                    reads.append(read)
            assert _still_open(mine, peer)

    with Census(_WATCHDOG) as census:
        _run_workers(16, work, timeout=30.0)
    worst = max(r.elapsed - r.seconds for r in reads)
    print(f"{len(reads)} reads, worst lateness {worst:.3f}s, {len(census.seen)} thread(s)")
    assert len(reads) > 100
    _check_reads(reads)
    assert thread_errors == []
    assert census.longest_overlap < 0.5, census.longest_overlap
    assert _WATCHDOG._armed == {}


def test_deadlines_armed_as_the_thread_ends_and_restarts_are_all_cut(
    fast_switching: None, thread_errors: list[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    # With an idle time of 3 ms the thread decides to end (and a statement
    # starts another) dozens of times a second: rounds of 16 statements
    # arrive at random moments around the moment it decides. The statements
    # arriving while it ends start the next thread.
    monkeypatch.setattr(pg, "_WATCHDOG_IDLE", 0.003)
    wd = _Watchdog()
    starts = _count_starts(wd, monkeypatch)
    reads: list[Read] = []
    lock = threading.Lock()
    until = time.monotonic() + 3.0
    last_round = [False]

    def decide() -> None:
        # Decided once per round, by the barrier: threads that each read the
        # clock after the barrier could disagree, and the ones that went on
        # would wait for the ones that ended.
        last_round[0] = time.monotonic() >= until

    rounds = threading.Barrier(16, action=decide, timeout=20.0)

    def work(i: int) -> None:
        rnd = random.Random(1000 + i)
        with _pair() as (mine, peer):
            for n in itertools.count():
                rounds.wait()
                if last_round[0]:
                    break
                # The round's statements arrive within 3 ms of one another,
                # 0-10 ms after the last round's: around the moment the
                # thread decides to end (3-6 ms after the last statement).
                pause = random.Random(n).uniform(0, 0.010) + rnd.uniform(0, 0.003)
                time.sleep(pause)  # no statement meanwhile
                if rnd.random() < 0.3:
                    with wd.bound(mine, 0.5) as dropped:
                        pass
                    assert not dropped()
                else:
                    read = _silent_read(wd, rnd.uniform(0.01, 0.05))
                    with lock:
                        reads.append(read)
            assert _still_open(mine, peer)

    with Census(wd) as census:
        _run_workers(16, work, timeout=40.0)
    _check_reads(reads)
    assert thread_errors == []
    print(f"{len(reads)} reads, {starts[0]} threads started")
    assert starts[0] > 10, f"the thread restarted only {starts[0]} times"
    assert census.longest_overlap < 0.5, census.longest_overlap
    assert wd._armed == {}


def test_blocks_that_end_before_their_deadline_are_never_cut(
    fast_switching: None, thread_errors: list[BaseException]
) -> None:
    # Half the threads run blocks bounded just above their length; the
    # other half keep the watchdog busy cutting silent reads (each cut is
    # logged with the lock held). A block whose with-statement was left
    # before its deadline must never be dropped, nor its socket cut.
    false_drops: list[tuple[float, float]] = []
    overran = [0, 0]  # blocks left after their deadline: dropped, not dropped
    blocks = [0]
    reads: list[Read] = []
    lock = threading.Lock()
    until = time.monotonic() + 3.0

    def work(i: int) -> None:
        rnd = random.Random(2000 + i)
        mine, peer = socket.socketpair()
        try:
            while time.monotonic() < until:
                if i % 2:
                    read = _silent_read(_WATCHDOG, rnd.uniform(0.005, 0.05))
                    with lock:
                        reads.append(read)
                    continue
                length = rnd.uniform(0, 0.03)
                seconds = length + rnd.uniform(0.0005, 0.02)
                started = time.monotonic()
                with _WATCHDOG.bound(mine, seconds) as dropped:
                    time.sleep(length)  # a statement that takes `length`
                left = time.monotonic() - started
                cut = not _still_open(mine, peer)
                with lock:
                    blocks[0] += 1
                    if left < seconds and (dropped() or cut):
                        false_drops.append((seconds, left))
                    elif left >= seconds:
                        overran[0 if dropped() else 1] += 1
                if cut:  # a new "connection" for the next block
                    mine.close()
                    peer.close()
                    mine, peer = socket.socketpair()
        finally:
            mine.close()
            peer.close()

    _run_workers(16, work, timeout=30.0)
    print(f"{blocks[0]} blocks, overran their deadline (dropped, not): {overran}")
    assert blocks[0] > 100
    assert false_drops == [], f"blocks left before their deadline yet dropped: {false_drops[:5]}"
    _check_reads(reads)
    assert thread_errors == []
    assert _WATCHDOG._armed == {}


# --------------------------------------------------------------------------
# the thread's lifecycle


def test_one_thread_while_statements_run_it_ends_when_they_stop_and_restarts(
    thread_errors: list[BaseException],
) -> None:
    wait_for(lambda: _WATCHDOG._thread is None and not _threads_of(_WATCHDOG), timeout=10)
    with _pair() as (mine, peer):
        with Census(_WATCHDOG) as census:
            until = time.monotonic() + 1.5 * _WATCHDOG_IDLE
            while time.monotonic() < until:
                with _WATCHDOG.bound(mine, 60.0):
                    pass
                time.sleep(0.005)  # the pace of the statements
            last = time.monotonic()
            thread = _WATCHDOG._thread
            assert thread is not None
            thread.join(2 * _WATCHDOG_IDLE + 5.0)
            ended = time.monotonic() - last
        assert not thread.is_alive()
        assert len(census.seen) == 1
        assert census.most_alive == 1
        # It looks at least every _WATCHDOG_IDLE and ends at the first look
        # that follows a whole _WATCHDOG_IDLE without a statement.
        assert ended < 2 * _WATCHDOG_IDLE + 1.0, ended
        assert _WATCHDOG._thread is None
        assert _WATCHDOG._next == math.inf
        # Statements resume: a new thread, which enforces deadlines.
        read = _silent_read(_WATCHDOG, 0.05)
        assert _thread_of(_WATCHDOG) not in (None, thread)
        _check_reads([read])
        assert _still_open(mine, peer)
    assert thread_errors == []


# --------------------------------------------------------------------------
# deadlines at and past every limit


FAR = [threading.TIMEOUT_MAX, math.inf, 1e308, sys.float_info.max, 10.0**18]
NEAR = [0, 0.0, 1e-9, 5e-324, -1.0, -math.inf]


@pytest.mark.parametrize("seconds", FAR, ids=repr)
def test_a_deadline_far_past_every_limit_is_accepted_and_short_ones_still_enforced(
    seconds: float, thread_errors: list[BaseException]
) -> None:
    wd = _Watchdog()
    with _pair() as (mine, peer):
        with wd.bound(mine, seconds) as dropped:
            pass
        assert not dropped()
        with held_elsewhere(wd, seconds):
            wait_for(lambda: wd._next < math.inf, timeout=10)  # the thread waits
            thread = wd._thread
            _check_reads([_silent_read(wd, 0.05)])
            _check_reads([_silent_read(wd, 0.05)])
            assert wd._thread is thread
            assert thread is not None
            assert thread.is_alive()
        assert _still_open(mine, peer)
    assert thread_errors == []
    assert wd._armed == {}


@pytest.mark.parametrize("seconds", NEAR, ids=repr)
def test_a_deadline_at_or_before_now_cuts_at_once_and_later_ones_are_enforced(
    seconds: float, thread_errors: list[BaseException]
) -> None:
    wd = _Watchdog()
    with held_elsewhere(wd, 60.0):  # the thread waits on a long deadline
        wait_for(lambda: wd._next < math.inf, timeout=10)
        read = _silent_read(wd, seconds)
        assert (read.cut, read.dropped) == (True, True), read
        assert read.elapsed < LATE, read
        _check_reads([_silent_read(wd, 0.05)])
    _check_reads([_silent_read(wd, 0.05)])
    assert thread_errors == []
    assert wd._armed == {}


def test_a_nan_or_overflowing_deadline_does_not_disturb_the_others(
    thread_errors: list[BaseException],
) -> None:
    # NaN is accepted and never enforced (no comparison with it is true);
    # an int too large for a float raises in the caller. Neither may leave
    # an entry behind or stop later deadlines being enforced.
    wd = _Watchdog()
    with held_elsewhere(wd, math.nan):
        _check_reads([_silent_read(wd, 0.05)])
    with _pair() as (mine, peer):
        with pytest.raises(OverflowError), wd.bound(mine, 10**400):
            pytest.fail("the block runs")  # pragma: no cover
        assert wd._armed == {}
        assert _still_open(mine, peer)
    _check_reads([_silent_read(wd, 0.05)])
    assert thread_errors == []
    assert wd._armed == {}


# --------------------------------------------------------------------------
# a connection whose fileno() fails when the deadline fires


class FakeConn:
    """A connection whose ``fileno()`` is given."""

    def __init__(self, fileno: Callable[[], Any]) -> None:
        self._fileno = fileno

    def fileno(self) -> Any:
        return self._fileno()


def _raise(exc: BaseException) -> Callable[[], Any]:
    def fileno() -> Any:
        raise exc

    return fileno


def _psycopg_error(message: str) -> Exception:
    try:
        import psycopg  # noqa: PLC0415
    except ImportError:  # pragma: no cover - psycopg is optional
        return RuntimeError(message)
    return psycopg.OperationalError(message)


def _returns(fd: int) -> Callable[[], int]:
    return lambda: fd


def _closed_socket_fd() -> int:
    s = socket.socket()
    fd = s.fileno()
    s.close()
    return fd


def _open_fds() -> list[int] | None:
    try:
        return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - not Linux
        return None


def _fds_of(inode: int) -> list[int]:
    """The open descriptors of the file (or pipe) ``inode``."""
    found = []
    for fd in _open_fds() or []:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == inode:
                found.append(fd)
    return found


FILENOS: dict[str, Callable[[], Callable[[], Any]]] = {
    "raises OSError": lambda: _raise(OSError(errno.EBADF, "closed")),
    "raises ValueError": lambda: _raise(ValueError("I/O operation on closed socket")),
    "raises psycopg's error": lambda: _raise(_psycopg_error("the connection is lost")),
    "returns -1 (closed socket)": lambda: lambda: -1,
    "returns a just-closed descriptor": lambda: _returns(_closed_socket_fd()),
    "returns a descriptor never opened": lambda: lambda: 1_000_000,
    "returns a descriptor out of a C int's range": lambda: lambda: 2**31,
}


@pytest.mark.parametrize("case", list(FILENOS))
def test_a_failing_fileno_when_the_deadline_fires_leaves_the_watchdog_working(
    case: str, thread_errors: list[BaseException]
) -> None:
    wd = _Watchdog()
    conn = FakeConn(FILENOS[case]())
    with wd.bound(conn, 0.02) as dropped:
        wait_for(dropped, timeout=5)  # the deadline fired
    thread = wd._thread
    # The same thread goes on enforcing deadlines.
    read = _silent_read(wd, 0.05, patience=2.0)
    assert (read.cut, read.dropped, thread_errors) == (True, True, []), (
        f"after fileno() {case}: later read {read}; "
        f"watchdog thread alive: {thread is not None and thread.is_alive()}; "
        f"its errors: {thread_errors!r}"
    )
    _check_reads([read])
    assert wd._thread is thread
    assert thread is not None
    assert thread.is_alive()


@pytest.mark.skipif(_open_fds() is None, reason="counts descriptors in /proc/self/fd")
def test_a_fileno_that_is_not_a_socket_is_left_alone_and_not_leaked(
    thread_errors: list[BaseException],
) -> None:
    # A closed descriptor number reused meanwhile by a file or a pipe.
    wd = _Watchdog()
    with held_elsewhere(wd, 60.0):  # the thread runs before and after
        r, w = os.pipe()
        leaked: list[int] = []
        try:
            with wd.bound(FakeConn(lambda: r), 0.02) as dropped:
                wait_for(dropped, timeout=5)
            # The drop is over once the block is left (it runs under the lock).
            leaked = [fd for fd in _fds_of(os.fstat(r).st_ino) if fd not in (r, w)]
            os.write(w, b"x")
            assert os.read(r, 1) == b"x"  # the pipe is untouched
        finally:
            os.close(r)
            os.close(w)
            for fd in leaked:
                os.close(fd)
        assert leaked == [], f"the watchdog leaked descriptor(s) {leaked} of the pipe"
        _check_reads([_silent_read(wd, 0.05)])
    assert thread_errors == []


# --------------------------------------------------------------------------
# logging: the watchdog logs each drop with its lock held


@contextlib.contextmanager
def _handler(handler: logging.Handler) -> Iterator[None]:
    log = logging.getLogger("outbound")
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def test_a_logging_handler_that_raises_does_not_end_enforcement(
    thread_errors: list[BaseException],
) -> None:
    # A handler whose emit() raises (a log shipper that is down, written
    # without handleError) propagates out of logger.warning().
    class Raising(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise ConnectionError("the log shipper is down")

    wd = _Watchdog()
    with _handler(Raising(logging.WARNING)):
        first = _silent_read(wd, 0.02, patience=2.0)
    thread = wd._thread
    second = _silent_read(wd, 0.05, patience=2.0)
    assert (first.cut, second.cut) == (True, True), (
        f"first read {first}; later read {second}; watchdog thread alive: "
        f"{thread is not None and thread.is_alive()}, errors: {thread_errors!r}"
    )
    assert thread_errors == []


def test_a_slow_logging_handler_does_not_delay_other_deadlines(
    thread_errors: list[BaseException],
) -> None:
    # A handler that takes a while (a log shipper on the network that just
    # went unreachable, as the database did) while another statement's
    # deadline passes.
    entered = threading.Event()
    release = threading.Event()

    class Slow(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not entered.is_set():
                entered.set()
                release.wait(2.5)

    wd = _Watchdog()
    first: list[Read] = []
    with _handler(Slow(logging.WARNING)):
        cutter = threading.Thread(target=lambda: first.append(_silent_read(wd, 0.02)), name="first")
        cutter.start()
        try:
            assert entered.wait(10.0)
            second = _silent_read(wd, 0.05, patience=5.0)
        finally:
            release.set()
            cutter.join(10.0)
    _check_reads(first)
    assert thread_errors == []
    _check_reads([second])


def test_a_drop_is_logged_by_its_statements_thread_whose_handler_may_run_statements(
    thread_errors: list[BaseException],
) -> None:
    # A handler that writes the warning to the database through a store of
    # this process: its statement is bounded by the watchdog too. The
    # warning is logged by the statement's own thread once it leaves its
    # block, never by the watchdog's thread (which holds the watchdog's
    # lock while it looks: a bounded statement there would wait for it).
    logged_on: list[str] = []

    class ToTheDatabase(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged_on.append(threading.current_thread().name)
            with _pair() as (mine, _peer):
                with wd.bound(mine, 5.0):
                    pass  # the INSERT of the record

    wd = _Watchdog()
    with _handler(ToTheDatabase(logging.WARNING)):
        read = _silent_read(wd, 0.02)
    _check_reads([read])
    assert logged_on == [threading.current_thread().name]
    assert thread_errors == []
    assert wd._armed == {}


# --------------------------------------------------------------------------
# interruptions


@pytest.mark.skipif(
    not hasattr(signal, "pthread_kill")
    or threading.current_thread() is not threading.main_thread(),
    reason="needs signals delivered to the main thread",
)
def test_ctrl_c_while_leaving_a_block_leaves_nothing_armed(
    thread_errors: list[BaseException],
) -> None:
    # The block is over; leaving it waits for the watchdog's lock (held by
    # a look, or other statements), and Ctrl-C arrives then. Nothing may
    # stay armed: the connection may go back to a pool and be used again.
    wd = _Watchdog()
    main = threading.main_thread().ident
    assert main is not None
    held = threading.Event()
    release = threading.Event()
    sent = threading.Event()

    def hold() -> None:
        with wd._cond:
            held.set()
            release.wait(10.0)

    def interrupt() -> None:
        # Ctrl-C once the main thread waits for the lock to disarm.
        if _poll(lambda: _is_at(main, _Watchdog._disarm.__code__, DISARM_LINE), 10.0):
            signal.pthread_kill(main, signal.SIGUSR1)
            sent.set()
            # The lock is free again a moment later (a look ends): the
            # interrupted disarm takes it then, and raises the Ctrl-C.
            time.sleep(0.05)
            release.set()

    def ctrl_c(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, ctrl_c)
    mine, peer = socket.socketpair()
    holder = threading.Thread(target=hold, name="holder")
    interrupter = threading.Thread(target=interrupt, name="interrupter")
    said: list[Callable[[], bool]] = []

    def block() -> None:
        with wd.bound(mine, 0.3) as dropped:
            said.append(dropped)
            holder.start()
            assert held.wait(10.0)
            interrupter.start()

    try:
        with pytest.raises(KeyboardInterrupt):
            block()
        assert sent.is_set()
        release.set()
        holder.join(10.0)
        interrupter.join(10.0)
        stale = dict(wd._armed)
        # Let the stale deadline pass: is the idle socket then cut?
        wait_for(lambda: not wd._armed, timeout=5)
        cut_later = not _still_open(mine, peer)
    finally:
        release.set()
        holder.join(10.0)
        interrupter.join(10.0)
        signal.signal(signal.SIGUSR1, previous)
        mine.close()
        peer.close()
    (dropped,) = said
    assert (stale, cut_later, dropped()) == ({}, False, False), (
        f"left armed after the block: {stale}; its socket cut after the block "
        f"ended: {cut_later}; dropped() says {dropped()}"
    )
    assert thread_errors == []


def test_an_interrupted_start_leaves_no_second_thread_for_long(
    thread_errors: list[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C arrives in Thread.start() after the thread started (while
    # start() waits for it to run). The statement is interrupted; the
    # program goes on (it catches KeyboardInterrupt to stop gracefully) and
    # its statements continue, one of them always running (a busy relay).
    real_start = threading.Thread.start
    started: list[threading.Thread] = []

    def started_then_interrupted(thread: threading.Thread) -> None:
        real_start(thread)
        if thread.name == NAME:
            monkeypatch.setattr(threading.Thread, "start", real_start)
            started.append(thread)
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", started_then_interrupted)
    wd = _Watchdog()
    with _pair() as (mine, _peer):
        with pytest.raises(KeyboardInterrupt), wd.bound(mine, 60.0):
            pytest.fail("the block runs")  # pragma: no cover
        assert wd._armed == {}
        (orphan,) = started
        with Census(wd) as census, held_elsewhere(wd, 60.0):
            until = time.monotonic() + 2.5 * _WATCHDOG_IDLE
            while time.monotonic() < until:
                with wd.bound(mine, 60.0):
                    pass
                time.sleep(0.01)  # the pace of the statements
            # (The interrupted start's thread may have taken over: then it
            # is the only one.)
            current = wd._thread
            both_alive = (
                orphan.is_alive()
                and current is not None
                and current is not orphan
                and current.is_alive()
            )
            _check_reads([_silent_read(wd, 0.05)])
    # Both end once idle: nothing lingers past the test.
    for t in _threads_of(wd):
        t.join(2 * _WATCHDOG_IDLE + 5.0)
    assert not _threads_of(wd)
    assert thread_errors == []
    assert not both_alive, (
        f"two watchdog threads ran side by side for {census.longest_overlap:.1f}s, "
        f"as long as statements ran: the interrupted start's and the next one's"
    )


# --------------------------------------------------------------------------
# the two moments a statement can meet the thread holding the lock


def test_a_statement_armed_while_the_thread_decides_to_end_is_cut(
    thread_errors: list[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The thread found nothing to do for _WATCHDOG_IDLE and is ending (it
    # holds the lock); a statement with a short deadline arrives just then
    # and waits for the lock. It must start the next thread, and be cut.
    monkeypatch.setattr(pg, "_WATCHDOG_IDLE", 0.05)
    wd = _Watchdog()
    starts = _count_starts(wd, monkeypatch)
    deciding = threading.Event()
    armer_ident: list[int | None] = []
    armer_waits = [False]

    def in_watch(frame: Any, event: str, arg: Any) -> Any:
        # The watchdog's loop, at the line where it ends (holding the lock).
        if event == "line" and frame.f_lineno == END_LINE and not deciding.is_set():
            deciding.set()
            armer_waits[0] = _poll(lambda: bool(armer_ident), 10.0) and _poll(
                lambda: _is_at(armer_ident[0], BOUND.__code__, ARM_LINE), 10.0
            )
        return in_watch

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return in_watch if frame.f_code is _Watchdog._watch.__code__ else None

    mine, peer = socket.socketpair()
    threading.settrace(tracer)  # for the threads started from here on
    try:
        with wd.bound(mine, 60.0):
            pass
    finally:
        threading.settrace(None)
        mine.close()
        peer.close()
    first = wd._thread
    assert first is not None
    assert deciding.wait(10.0)
    reads: list[Read] = []
    armer = threading.Thread(target=lambda: reads.append(_silent_read(wd, 0.05)), name="armer")
    armer.start()
    armer_ident.append(armer.ident)
    armer.join(10.0)
    first.join(10.0)
    assert armer_waits == [True]  # the statement did wait for the ending thread
    _check_reads(reads)
    assert not first.is_alive()
    assert starts[0] == 2
    assert thread_errors == []
    assert wd._armed == {}


def test_a_statement_armed_during_a_look_is_cut(thread_errors: list[BaseException]) -> None:
    # The thread is in the middle of a look (dropping another connection,
    # which takes a moment); a statement with a short deadline arrives and
    # waits for the lock. The look ends and the thread plans its next look
    # without that deadline: the statement must still be cut on time.
    wd = _Watchdog()
    in_look = threading.Event()
    armer_ident: list[int | None] = []
    armer_waited = [False]

    def slow_fileno() -> int:
        in_look.set()
        armer_waited[0] = _poll(lambda: bool(armer_ident), 10.0) and _poll(
            lambda: _is_at(armer_ident[0], BOUND.__code__, ARM_LINE), 10.0
        )
        raise OSError(errno.EBADF, "closed meanwhile")

    def dropped_elsewhere() -> None:
        with wd.bound(FakeConn(slow_fileno), 0.01) as dropped:
            _poll(dropped, 10.0)

    with held_elsewhere(wd, 60.0):  # the thread's next look is far ahead
        other = threading.Thread(target=dropped_elsewhere, name="other")
        other.start()
        try:
            assert in_look.wait(10.0)
            reads: list[Read] = []
            armer = threading.Thread(
                target=lambda: reads.append(_silent_read(wd, 0.05)), name="armer"
            )
            armer.start()
            armer_ident.append(armer.ident)
            armer.join(10.0)
        finally:
            other.join(10.0)
    assert armer_waited == [True]
    _check_reads(reads)
    assert thread_errors == []
    assert wd._armed == {}
