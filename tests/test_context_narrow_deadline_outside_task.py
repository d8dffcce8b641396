"""Outside a dispatcher task, inside ``narrow_deadline`` (documented to work
outside tasks), the middleware believes it runs in a task: ``rate_limit`` raises
``Defer`` instead of ``RateLimited`` and books an overall slot nobody will use,
and ``retry`` turns a transient error into ``Defer`` instead of raising it.

The middleware tells "inside a task" by ``_current.context is not None``
(middleware.py _RetrySender.send, _RateLimitSender.send), but narrow_deadline()
installs a TaskContext outside tasks too (context.py narrow_deadline).
The same happens with chain(timeout(s), retry(), ...) called outside a task.
"""

from __future__ import annotations

import time

import pytest

from outbound import Defer, middleware, narrow_deadline
from outbound.errors import RateLimited, TransientSendError
from outbound.messages import SendRequest, SendResult, TextMessage
from outbound.ratelimit import Rate, RateLimiter, RateLimits


class Ok:
    def send(self, request: SendRequest) -> SendResult:
        return SendResult(1)


class Failing:
    def __init__(self) -> None:
        self.calls = 0

    def send(self, request: SendRequest) -> SendResult:
        self.calls += 1
        raise TransientSendError("503")


def test_rate_limit_outside_a_task_raises_rate_limited_under_narrow_deadline() -> None:
    limiter = RateLimiter(RateLimits(overall=Rate(1, 10.0)))
    sender = middleware.rate_limit(limiter)(Ok())
    sender.send(SendRequest(1, TextMessage("first")))  # takes the only slot
    # middleware.rate_limit: "Outside a dispatcher task it raises RateLimited instead."
    with narrow_deadline(time.monotonic() + 5.0):
        with pytest.raises(RateLimited):
            sender.send(SendRequest(2, TextMessage("second")))
    # acquire(book=False) is for "a caller that may not come back": nothing booked.
    assert limiter.stats().booked == 0


def test_retry_outside_a_task_raises_the_error_under_narrow_deadline() -> None:
    inner = Failing()
    sender = middleware.chain(
        middleware.retry(max_attempts=3), middleware.rate_limit(RateLimiter(RateLimits()))
    )(inner)
    # middleware.retry: "Outside a dispatcher task nothing can be deferred: the send
    # is tried once and its error raised."
    with narrow_deadline(time.monotonic() + 5.0):
        try:
            sender.send(SendRequest(1, TextMessage("x")))
        except Defer as exc:  # what happens now
            pytest.fail(f"a Defer reached a caller that is not a task: {exc!r}")
        except TransientSendError:
            pass
    assert inner.calls == 1
