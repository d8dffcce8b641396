"""A Ctrl-C landing right after each call ``resolve_all`` makes (CPython checks for
signals there): every item is still resolved, and the Ctrl-C is raised after.

``force_close()`` and ``shutdown(cancel_futures=True)`` resolve the futures they
took out of the lanes through it: an item it lost would be a future pending for
good (it copied its list first, and a Ctrl-C after the copy lost them all).
"""

from __future__ import annotations

import dis
import functools
import inspect
import sys
import threading
import time
from concurrent.futures import ALL_COMPLETED, wait
from typing import Any

import pytest
from interrupts import after_calls, interrupt_at

from outbound._future import LazyFuture, cancel_future, new_future, resolve_all


@pytest.mark.parametrize("offset", after_calls(resolve_all.__code__))
def test_a_ctrl_c_after_any_call_of_resolve_all_resolves_every_item(offset: int) -> None:
    resolved: list[int] = []

    def resolve(item: int) -> None:
        if item not in resolved:  # idempotent, as resolve_all requires
            resolved.append(item)

    trace, fired = interrupt_at(resolve_all.__code__, offset)
    raised = False
    sys.settrace(trace)
    try:
        resolve_all([1, 2, 3], resolve)
    except KeyboardInterrupt:
        raised = True
    finally:
        sys.settrace(None)
    assert raised == bool(fired)  # (a call on the path of a second error is not reached)
    assert resolved == [1, 2, 3]


def _record(calls: list[int], value: int, _future: object) -> None:
    calls.append(value)


#: The functions a cancellation runs, and the lines of each where a waiter or a
#: callback was taken and not yet told (each is told at most once: a Ctrl-C
#: there loses that one; see LazyFuture._cancel_now).
_TELLING: dict[str, tuple[Any, tuple[str, ...]]] = {
    "_cancel_now": (LazyFuture._cancel_now, ("untold.pop().add_cancelled",)),
    "_invoke_callbacks": (
        LazyFuture._invoke_callbacks,
        ("with cond:", "self._done_callbacks.pop(0)", "_call_callback("),
    ),
}


def _taken_not_told(name: str, offset: int) -> bool:
    """Whether ``offset`` of ``name`` (see _TELLING) falls where one was taken, not told."""
    function, marks = _TELLING[name]
    first = function.__code__.co_firstlineno
    lines = {
        first + i
        for i, text in enumerate(inspect.getsource(function).splitlines())
        if any(mark in text for mark in marks)
    }
    line = None
    for start, number in dis.findlinestarts(function.__code__):
        if start <= offset and number is not None:
            line = number
    return line in lines


@pytest.mark.parametrize(
    ("name", "offset"),
    [(name, offset) for name, (f, _) in _TELLING.items() for offset in after_calls(f.__code__)],
)
def test_a_ctrl_c_after_any_call_of_a_cancellation_tells_every_waiter_and_callback(
    name: str, offset: int
) -> None:
    """force_close resolves its futures through resolve_all and cancel_future: a
    Ctrl-C landing after any call that cancellation makes (between the state
    change and the callbacks, say) must leave no waiter untold and no callback
    unrun, nor run one twice: the next try finishes what the first began. Before
    the fix a Ctrl-C after the state changed lost the callbacks (with random
    Ctrl-Cs during a force_close of 2,000 futures, in 23 runs of 60)."""
    futures = [new_future() for _ in range(3)]
    calls: list[int] = []
    for i, f in enumerate(futures):
        f.add_done_callback(functools.partial(_record, calls, i))
        f.add_done_callback(functools.partial(_record, calls, 10 + i))
    waited: list[bool] = []
    waiter_ready = threading.Event()

    def waiter() -> None:
        waiter_ready.set()
        _done, not_done = wait(futures, timeout=3, return_when=ALL_COMPLETED)
        waited.append(not not_done)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiter_ready.wait(10)
    # (the waiter is installed once every future has its condition and waiter list)
    deadline = time.monotonic() + 10
    while any(not f._waiters for f in futures):
        assert time.monotonic() < deadline, "the waiter never waited"
        time.sleep(0.001)
    trace, fired = interrupt_at(_TELLING[name][0].__code__, offset)
    raised = False
    sys.settrace(trace)
    try:
        resolve_all(futures, cancel_future)
    except KeyboardInterrupt:
        raised = True
    finally:
        sys.settrace(None)
    thread.join(10)
    assert raised == bool(fired)
    assert all(f.cancelled() for f in futures)
    assert len(calls) == len(set(calls))  # never twice
    if _taken_not_told(name, offset):
        assert len(calls) >= 5  # at most the one taken is lost
    else:
        assert sorted(calls) == [0, 1, 2, 10, 11, 12]
        assert waited == [True]
