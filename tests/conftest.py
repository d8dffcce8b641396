"""Shared fixtures: every test must leave no thread behind; no test may hang the run."""

from __future__ import annotations

import faulthandler
import hashlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from dispatch_helpers import raising_log

POSTGRES_URL = os.environ.get("OUTBOUND_TEST_POSTGRES")

#: How long past pytest-timeout's limit a test may still run before the
#: backstop below ends its process. pytest-timeout's limit raises in the
#: test's main thread, and code that outlasts an exception (a wait that
#: catches ``BaseException`` and waits again, a C call that retries on
#: ``EINTR``) can swallow it; the run would then wait for that test until CI
#: gives up, printing nothing. The backstop is ``faulthandler``'s own
#: thread, which needs no GIL: it prints every thread's stack and exits the
#: process; pytest-xdist reports the test as crashed and goes on with a new
#: worker, which fails the test at once instead of running it again.
BACKSTOP_GRACE = 60.0

_HUNG = "OUTBOUND_TEST_HUNG_DIR"

#: The running test's limit, for the children it forks (0: none).
_CHILD_LIMIT = [0.0]


def _end_hung_child() -> None:
    """In a child a test forked (``os.fork``, no exec): end it at its test's limit.

    Such a child holds every descriptor of the worker, the pipes to the
    pytest-xdist controller too. Were the worker ended (the backstop
    above), a hung child would keep those pipes open: the controller would
    never see the worker's end, and the run would wait for good, the
    backstop notwithstanding. ``faulthandler`` cannot end it (re-arming it
    in a child waits for the parent's watchdog thread, which is not there);
    ``SIGALRM``'s default action ends the process in the kernel, GIL or not.
    """
    limit = _CHILD_LIMIT[0]
    if limit > 0:
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # pytest-timeout's handler raises
            signal.setitimer(signal.ITIMER_REAL, limit)
        except (ValueError, OSError):  # pragma: no cover - not the main thread
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_end_hung_child)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and _HUNG not in os.environ:
        # Made before pytest-xdist starts its workers, which inherit it.
        os.environ[_HUNG] = tempfile.mkdtemp(prefix="outbound-hung-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(_HUNG), ignore_errors=True))


def _limit(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    configured = item.config.getoption("timeout", None)  # --timeout, else the ini file's
    if configured is None:
        configured = item.config.getini("timeout")
    return float(configured) if configured else 0.0


def _hung_mark(item: pytest.Item) -> Path | None:
    folder = os.environ.get(_HUNG)
    if not folder:
        return None
    return Path(folder) / hashlib.sha256(item.nodeid.encode()).hexdigest()


_HUNG_BEFORE = pytest.StashKey[str | None]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    stacks = item.stash.get(_HUNG_BEFORE, None)
    if stacks is not None:
        pytest.fail(
            f"hung past its timeout (+{BACKSTOP_GRACE:g} s) in an earlier worker, which was"
            f" ended; not run again. Its threads then:\n{stacks}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    limit = _limit(item)
    mark = _hung_mark(item)
    hung_before = mark is not None and mark.exists()
    item.stash[_HUNG_BEFORE] = (
        mark.read_text(errors="replace") if mark is not None and hung_before else None
    )
    if limit <= 0 or mark is None or hung_before:
        yield
        return
    # The stacks go to the mark itself: the test's own standard error is
    # captured into a file that dies with the worker.
    with mark.open("w") as stacks:
        faulthandler.dump_traceback_later(limit + BACKSTOP_GRACE, exit=True, file=stacks)
        _CHILD_LIMIT[0] = limit
        try:
            yield
        finally:
            _CHILD_LIMIT[0] = 0.0
            faulthandler.cancel_dump_traceback_later()
    mark.unlink(missing_ok=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish() -> None:
    # A process that cannot exit (a thread that is not a daemon and never
    # ends, an exit handler that waits) would hang the run the same way.
    faulthandler.dump_traceback_later(120.0, exit=True)


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a thread running (after a short grace to exit).

    The PostgreSQL store's watchdog is one thread per process, not per
    store: it ends by itself a moment after the last statement, so it is
    not waited for here.
    """
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    leaked: list[threading.Thread] = []
    for thread in set(threading.enumerate()) - before:
        if thread.name == "outbound-pg-watchdog":
            continue
        while True:
            try:
                thread.join(max(0.0, deadline - time.monotonic()))
            except RuntimeError:  # listed, not yet started: its start is under way
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                leaked.append(thread)  # listed for good: a start that never finished
                break
            if thread.is_alive():
                leaked.append(thread)
            break
    assert not leaked, f"threads leaked by the test: {[t.name for t in leaked]}"


@pytest.fixture
def postgres_url() -> str:
    """The PostgreSQL URL from OUTBOUND_TEST_POSTGRES; the test is skipped without it."""
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
    return POSTGRES_URL


@pytest.fixture(params=[RuntimeError, SystemExit], ids=["error", "exit"])
def broken_log(request: pytest.FixtureRequest) -> Iterator[None]:
    """The ``outbound`` logger at DEBUG, with a handler whose emit raises (an
    ``Exception``, or ``SystemExit``: what a hook raises changes nothing, nor what a
    logging handler raises)."""
    with raising_log(request.param):
        yield
