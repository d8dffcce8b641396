"""Helpers shared by the dispatcher's tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT = 10.0


def blocker(
    started: threading.Event, release: threading.Event, value: object = None
) -> Callable[[], object]:
    """A task that says it started, then waits (bounded) to be released."""

    def task() -> object:
        started.set()
        assert release.wait(TIMEOUT), "blocker was never released"
        return value

    return task


def returning(value: T) -> Callable[[], T]:
    """A task that returns ``value``, bound now (as ``lambda i=i: i`` would, but typed)."""
    return lambda: value
