"""narrow_deadline() takes its deadline unchecked: an int too large for a float
(which the rest of the library reads as "longer than any wait", see
context._seconds) makes TaskContext.remaining() and time_allowed() raise
OverflowError instead of returning a number of seconds.

Inside a task with send_timeout=math.inf (documented as "no deadline"),
min(10**400, inf) keeps the int, and remaining() computes
``10**400 - time.monotonic()`` (context.py TaskContext.remaining).
Low severity: input validation / consistency.
"""

from __future__ import annotations

import math

import pytest

from outbound import Dispatcher, current_context, narrow_deadline, time_allowed


def _probe() -> tuple[float, float]:
    with narrow_deadline(10**400):
        ctx = current_context()
        return ctx.remaining(), time_allowed(7.0)


def test_remaining_and_time_allowed_with_a_huge_int_deadline() -> None:
    d = Dispatcher(max_inflight=1, send_timeout=math.inf)
    try:
        future = d.submit("k", _probe)
        # TaskContext.remaining(): "Seconds left before the deadline; 0.0 once it
        # has passed." time_allowed(): "the running task's remaining(), or default
        # ... without a deadline"; it raises only SendTimeout.
        remaining, allowed = future.result(timeout=5)
        assert remaining == math.inf or remaining > 1e300
        assert allowed == 7.0 or allowed > 1e300
    finally:
        assert d.shutdown(5)


def test_outside_a_task_a_huge_int_deadline_is_no_deadline() -> None:
    with narrow_deadline(10**400) as ctx:
        assert ctx.deadline == math.inf
        assert ctx.remaining() == math.inf
        assert time_allowed(7.0) == 7.0
    with narrow_deadline(-(10**400)) as ctx:
        assert ctx.remaining() == 0.0


@pytest.mark.parametrize(
    ("deadline", "error"),
    [
        (math.nan, ValueError),
        (True, TypeError),
        ("5", TypeError),
        (None, TypeError),
        (1j, TypeError),
    ],
)
def test_a_deadline_that_is_not_an_instant_is_refused(deadline: object, error: type) -> None:
    with pytest.raises(error, match="deadline"):
        with narrow_deadline(deadline):  # type: ignore[arg-type]
            pass


def test_any_real_number_is_a_deadline() -> None:
    from fractions import Fraction  # noqa: PLC0415

    with narrow_deadline(Fraction(10**400, 3)) as ctx:  # type: ignore[arg-type]
        assert ctx.deadline == math.inf
    with narrow_deadline(Fraction(1, 3)) as ctx:  # type: ignore[arg-type]
        assert ctx.deadline == 1 / 3
