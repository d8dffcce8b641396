"""A Ctrl-C landing right after a call: CPython checks for signals there, so a
signal handler's ``KeyboardInterrupt`` can come out of any call. And a thread
held at one line of a function (a deterministic interleaving at that seam)."""

from __future__ import annotations

import dis
import inspect
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any


def after_calls(code: CodeType) -> list[int]:
    """The offsets of the instructions right after each call in ``code``."""
    instructions = list(dis.get_instructions(code))
    return [
        instructions[i + 1].offset
        for i in range(len(instructions) - 1)
        if instructions[i].opname.startswith("CALL")
        and not instructions[i].opname.startswith("CALL_INTRINSIC")
    ]


def interrupt_at(code: CodeType, offset: int) -> tuple[Callable[..., Any], list[int]]:
    """A trace function (for ``sys.settrace``) raising KeyboardInterrupt once, in
    ``code`` at ``offset``; the list gets the offset once it fired."""
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


def interrupt_after_call(code: CodeType, n: int) -> tuple[Callable[..., Any], list[str]]:
    """A profile function (for ``sys.setprofile``) raising KeyboardInterrupt as the
    ``n``-th call (from 1) made by ``code`` returns, as a signal handler does: the
    error comes out of that call, inside whatever ``try`` holds it. The list gets
    the called function's name once it fired."""
    calls = [0]
    fired: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if fired or event not in ("return", "c_return"):
            return
        caller = frame if event == "c_return" else frame.f_back
        if caller is None or caller.f_code is not code:
            return
        calls[0] += 1
        if calls[0] == n:
            fired.append(
                getattr(arg, "__name__", "") if event == "c_return" else frame.f_code.co_name
            )
            raise KeyboardInterrupt

    return profile, fired


def line_of(function: Callable[..., Any], fragment: str) -> int:
    """The number of the first line of ``function``'s source holding ``fragment``."""
    lines, first = inspect.getsourcelines(function)
    return next(first + i for i, line in enumerate(lines) if fragment in line)


def held_at(
    code: CodeType, line: int, reached: threading.Event, go_on: threading.Event
) -> Callable[..., Any]:
    """A trace function (for ``sys.settrace``) holding its thread at ``line`` of
    ``code`` (the first time it gets there) until ``go_on``; ``reached`` is set then."""

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == line and not reached.is_set():
            reached.set()
            go_on.wait(10)
        return local

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    return trace
