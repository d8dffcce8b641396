"""The sending layer end to end: Outbound → middleware → TelegramSender → PlatformSimulator.

Real HTTP over loopback, no mocks. Times are scaled down (tens of
milliseconds) so the whole file runs in a few seconds.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from ratelimit_stores import max_in_window

from outbound import Dispatcher
from outbound.errors import MessageExpired, RateLimited, TransientSendError
from outbound.messages import SendRequest, SendResult, TextMessage
from outbound.middleware import Metrics, SenderDecorator, chain, metrics, rate_limit, retry, timeout
from outbound.middleware import logging as log_sends
from outbound.ratelimit import Rate, RateLimits
from outbound.reply import Outbound
from outbound.simulator import Fault, PlatformSimulator
from outbound.telegram import TelegramSender

WAIT = 15.0


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        pause.wait(0.002)
    return True


@dataclass
class Stack:
    sim: PlatformSimulator
    dispatcher: Dispatcher
    out: Outbound
    metrics: Metrics


@contextmanager
def stack(
    *,
    sim: dict[str, Any] | None = None,
    max_inflight: int = 8,
    send_timeout: float = 5.0,
    retries: dict[str, Any] | None = None,
    limits: RateLimits | None = None,
    seconds: float | None = None,
) -> Iterator[Stack]:
    """A simulator, a Telegram sender in the documented middleware order, and a dispatcher."""
    m = metrics()
    decorators: list[SenderDecorator] = [
        m,
        log_sends(),
        retry(**{"base_delay": 0.01, **(retries or {})}),
    ]
    if limits is not None:
        decorators.append(rate_limit(limits))
    decorators.append(timeout(seconds))
    with (
        PlatformSimulator(**(sim or {})) as simulator,
        TelegramSender(simulator.token, base_url=simulator.url) as telegram,
        Dispatcher(max_inflight=max_inflight, send_timeout=send_timeout) as dispatcher,
    ):
        out = Outbound(dispatcher, chain(*decorators)(telegram))
        yield Stack(simulator, dispatcher, out, m)


def hello(chat: int) -> SendRequest:
    return SendRequest(chat, TextMessage("hello"))


def texts(sim: PlatformSimulator, chat: int | str) -> list[str]:
    return [m["text"] for m in sim.received(chat)]


def resolve_all(futures: list[Future[SendResult]]) -> list[BaseException | None]:
    return [f.exception(WAIT) for f in futures]


def test_per_chat_order_under_concurrency() -> None:
    with stack(sim={"latency": 0.001, "jitter": 0.004, "seed": 1}) as s:
        futures = [
            s.out.reply_text(chat, f"{chat}-{i}") for i in range(15) for chat in range(1, 11)
        ]
        assert resolve_all(futures) == [None] * len(futures)
        for chat in range(1, 11):
            assert texts(s.sim, chat) == [f"{chat}-{i}" for i in range(15)]
        raws = [(f.result().message_id, f.result().raw or {}) for f in futures]
        ids = [mid for mid, raw in raws if raw["result"]["chat"]["id"] == 3]
        assert ids == list(range(1, 16))


def test_a_chat_429_does_not_stall_other_chats() -> None:
    with stack() as s:
        s.sim.inject(Fault("rate_limit", chat_id=1, retry_after=1.5, scope="chat"))
        start = time.monotonic()
        slow = [s.out.reply_text(1, f"a{i}") for i in range(2)]
        others = [s.out.reply_text(chat, "b") for chat in range(2, 8)]
        assert resolve_all(others) == [None] * 6
        assert not slow[0].done()  # the other chats did not wait for its retry_after
        assert resolve_all(slow) == [None, None]
        assert texts(s.sim, 1) == ["a0", "a1"]
        assert s.sim.received(1)[0]["time"] - start >= 1.5
        assert s.metrics.snapshot().rate_limited == 1


def test_a_global_429_pauses_every_chat_then_resumes() -> None:
    with stack(max_inflight=4) as s:
        s.sim.inject(Fault("rate_limit", chat_id=1, retry_after=0.3, scope="global"))
        start = time.monotonic()
        refused = [s.out.reply_text(1, "first"), s.out.reply_text(1, "second")]
        assert wait_until(lambda: s.dispatcher.stats().paused_for > 0)
        rest = [s.out.reply_text(chat, "next") for chat in range(2, 6)]
        assert not any(f.done() for f in rest)
        assert resolve_all([*refused, *rest]) == [None] * 6
        assert texts(s.sim, 1) == ["first", "second"]  # the refused one kept its place
        deliveries = s.sim.all_received()
        assert len(deliveries) == 6
        assert all(m["time"] - start >= 0.3 for m in deliveries)
        assert s.sim.stats().global_limited == 1


def test_transient_errors_are_retried_until_delivered() -> None:
    with stack() as s:
        s.sim.inject(Fault("error", chat_id=1, status=503), Fault("drop", chat_id=1))
        assert s.out.reply_text(1, "hello").result(WAIT).message_id == 1
        assert texts(s.sim, 1) == ["hello"]
        stats = s.sim.stats()
        assert (stats.server_errors, stats.dropped, stats.delivered) == (1, 1, 1)
        assert s.metrics.snapshot().deferred["retry"] == 2


def test_retries_stop_at_max_attempts() -> None:
    with stack(retries={"max_attempts": 3}) as s:
        s.sim.inject(*[Fault("error", chat_id=1, status=502)] * 5)
        with pytest.raises(TransientSendError, match="502"):
            s.out.reply_text(1, "x").result(WAIT)
        assert s.sim.stats().requests == 3
        assert texts(s.sim, 1) == []


def test_retries_stop_at_max_total_age() -> None:
    with stack(retries={"base_delay": 0.5, "max_total": 1.25, "jitter": 0.0}) as s:
        s.sim.inject(*[Fault("error", chat_id=1, status=500)] * 5)
        start = time.monotonic()
        with pytest.raises(MessageExpired) as info:
            s.out.reply_text(1, "x").result(WAIT)
        assert isinstance(info.value.__cause__, TransientSendError)
        # Failed as soon as a retry would end past max_total, not after waiting.
        assert time.monotonic() - start < 1.25
        assert s.sim.stats().requests == 2  # a third try would have ended past max_total


def test_a_slow_send_is_cut_and_the_lane_goes_on() -> None:
    with stack(retries={"max_attempts": 1}, seconds=0.2) as s:
        s.sim.inject(Fault("slow", chat_id=1, delay=3.0))
        start = time.monotonic()
        cut = s.out.reply_text(1, "slow")
        after = s.out.reply_text(1, "after")
        error = cut.exception(WAIT)
        assert isinstance(error, TransientSendError)
        assert isinstance(error, TimeoutError)
        assert after.result(WAIT).message_id == 2
        assert time.monotonic() - start < 1.0


def test_the_task_deadline_also_cuts_a_slow_send() -> None:
    with stack(retries={"max_attempts": 1}, send_timeout=0.2) as s:
        s.sim.inject(Fault("slow", chat_id=1, delay=3.0))
        start = time.monotonic()
        assert isinstance(s.out.reply_text(1, "slow").exception(WAIT), TimeoutError)
        assert time.monotonic() - start < 1.0


def test_every_future_resolves_and_metrics_add_up() -> None:
    faults = {"error_rate": 0.1, "drop_rate": 0.05, "slow_rate": 0.05, "slow_delay": 1.0}
    with stack(
        sim={"latency": 0.001, "seed": 7, **faults},
        retries={"max_attempts": 2, "base_delay": 0.005},
        seconds=0.1,
    ) as s:
        futures = [s.out.reply_text(chat, f"m{i}") for i in range(20) for chat in range(1, 11)]
        outcomes = resolve_all(futures)
        ok = sum(e is None for e in outcomes)
        assert 0 < ok < len(futures)  # faults happened, and most got through
        snap = s.metrics.snapshot()
        assert snap.sent == ok
        assert snap.failed_total == len(futures) - ok
        assert snap.in_flight == 0
        assert snap.calls == snap.sent + snap.failed_total + snap.deferred_total
        assert snap.calls >= s.sim.stats().requests  # a send may fail before its request
        for chat in range(1, 11):  # what arrived, arrived in order
            got = [int(t[1:]) for t in texts(s.sim, chat)]
            assert got == sorted(got)


def test_message_text_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="outbound")
    secret = "very private words 9d2c"
    with stack() as s:
        s.sim.inject(Fault("error", chat_id=1), Fault("rate_limit", chat_id=1, retry_after=0.01))
        s.out.reply_text(1, secret).result(WAIT)
        s.sim.inject(*[Fault("error", chat_id=2)] * 5)
        failed = s.out.reply_text(2, secret)
        with pytest.raises(TransientSendError):  # exhausted: a failure is logged too
            failed.result(WAIT)
    assert any(r.name == "outbound.send" and r.levelno == logging.WARNING for r in caplog.records)
    assert any(r.name == "outbound.send" and "sent" in r.getMessage() for r in caplog.records)
    assert secret not in caplog.text


@pytest.mark.parametrize(
    ("chat_id", "text"),
    [
        (1, ""),
        (1, "  \n "),
        (1, "x" * 4097),
        (1.0, "hi"),
        (None, "hi"),
        ("12345", "hi"),
        (1, None),
    ],
)
def test_bad_input_is_refused_before_any_request(chat_id: object, text: object) -> None:
    with stack() as s:
        future = s.out.reply_text(chat_id, text)  # type: ignore[arg-type]
        assert future.done()
        assert isinstance(future.exception(0), (TypeError, ValueError))
        assert s.sim.stats().requests == 0
        assert s.sim.all_received() == []
        assert s.out.reply_text(1, "x" * 4096).result(WAIT).message_id == 1


def test_rate_limit_defers_without_holding_the_thread() -> None:
    with stack(
        sim={"chat_rate": 1 / 0.3, "chat_burst": 1},
        max_inflight=1,
        limits=RateLimits(per_chat=Rate(1, 0.3)),
    ) as s:
        slow = [s.out.reply_text(1, f"a{i}") for i in range(3)]
        fast = s.out.reply_text(2, "b")
        fast.result(WAIT)
        assert not slow[1].done()
        assert resolve_all(slow) == [None] * 3
        a = s.sim.received(1)
        b = s.sim.received(2)[0]
        assert b["time"] < a[1]["time"]
        # Spaced by the limiter (0.3 s), give or take the jitter of arrival
        # on a loaded machine; unthrottled they would be milliseconds apart.
        assert all(y["time"] - x["time"] >= 0.2 for x, y in itertools.pairwise(a))
        assert s.sim.stats().rate_limited == 0
        assert s.metrics.snapshot().deferred["throttled"] >= 2


def test_client_limits_keep_under_the_platform_limits() -> None:
    with stack(
        sim={"global_rate": 100.0, "chat_rate": 25.0, "latency": 0.002},
        limits=RateLimits(overall=Rate(100), per_chat=Rate(25)),
    ) as s:
        futures = [s.out.reply_text(chat, f"{i}") for i in range(8) for chat in range(1, 11)]
        assert resolve_all(futures) == [None] * len(futures)
        stats = s.sim.stats()
        assert stats.rate_limited == 0
        assert stats.delivered == 80
        # Judged at the server, not on a stopwatch: in no second did more
        # than 100 arrive overall, nor more than 25 to one chat...
        arrivals = s.sim.all_received()
        assert max_in_window([m["time"] for m in arrivals], 1.0) <= 100
        for chat in range(1, 11):
            assert max_in_window([m["time"] for m in s.sim.received(chat)], 1.0) <= 25
            assert texts(s.sim, chat) == [str(i) for i in range(8)]
        # ... and the limiter spaced them: the overall interval between two
        # arrivals, taken over the whole run, is the 10 ms of 100/s.
        span = arrivals[-1]["time"] - arrivals[0]["time"]
        assert span >= 79 * 0.01 * 0.95


def test_outside_a_dispatcher_errors_are_raised_not_slept_on() -> None:
    with PlatformSimulator() as sim, TelegramSender(sim.token, base_url=sim.url) as telegram:
        sender = chain(retry(), rate_limit(RateLimits(per_chat=Rate(1, 10.0))), timeout(1.0))(
            telegram
        )
        sender.send(hello(1))
        start = time.monotonic()
        with pytest.raises(RateLimited):
            sender.send(hello(1))
        sim.inject(Fault("error", chat_id=2))
        with pytest.raises(TransientSendError):
            sender.send(hello(2))
        assert time.monotonic() - start < 1.0
        assert [m["chat_id"] for m in sim.all_received()] == [1]
