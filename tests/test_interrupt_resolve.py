"""A Ctrl-C landing right after each call ``resolve_all`` makes (CPython checks for
signals there): every item is still resolved, and the Ctrl-C is raised after.

``force_close()`` and ``shutdown(cancel_futures=True)`` resolve the futures they
took out of the lanes through it: an item it lost would be a future pending for
good (it copied its list first, and a Ctrl-C after the copy lost them all).
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import pytest

from outbound._future import resolve_all


def _after_calls(code: CodeType) -> list[int]:
    """The offsets of the instructions right after each call in ``code``."""
    instructions = list(dis.get_instructions(code))
    return [
        instructions[i + 1].offset
        for i in range(len(instructions) - 1)
        if instructions[i].opname.startswith("CALL")
        and not instructions[i].opname.startswith("CALL_INTRINSIC")
    ]


def _interrupt_at(code: CodeType, offset: int) -> tuple[Callable[..., Any], list[int]]:
    """A trace function raising KeyboardInterrupt once, in ``code`` at ``offset``."""
    fired: list[int] = []

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and frame.f_lasti == offset and not fired:
            fired.append(offset)
            raise KeyboardInterrupt
        return local

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is code and not fired:
            frame.f_trace_opcodes = True
            return local
        return None

    return trace, fired


@pytest.mark.parametrize("offset", _after_calls(resolve_all.__code__))
def test_a_ctrl_c_after_any_call_of_resolve_all_resolves_every_item(offset: int) -> None:
    resolved: list[int] = []

    def resolve(item: int) -> None:
        if item not in resolved:  # idempotent, as resolve_all requires
            resolved.append(item)

    trace, fired = _interrupt_at(resolve_all.__code__, offset)
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
