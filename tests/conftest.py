"""Shared fixtures: every test must leave no thread behind."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest

POSTGRES_URL = os.environ.get("OUTBOUND_TEST_POSTGRES")


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


class _RaisingLogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("the log is broken")


@pytest.fixture
def broken_log() -> Iterator[None]:
    """The ``outbound`` logger at DEBUG, with a handler whose emit raises."""
    logger = logging.getLogger("outbound")
    handler = _RaisingLogHandler(logging.DEBUG)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
