"""Sender middleware (outbound.middleware) with an in-process sender and a real Dispatcher."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import pytest
from ratelimit_stores import STORES, FakeClock, limiter_on

from outbound import Defer, Dispatcher, current_context
from outbound.errors import MessageExpired, PermanentSendError, RateLimited, TransientSendError
from outbound.messages import Sender, SendRequest, SendResult, TextMessage
from outbound.middleware import (
    HistogramSnapshot,
    RetryPolicy,
    chain,
    metrics,
    rate_limit,
    retry,
    timeout,
)
from outbound.middleware import logging as log_sends
from outbound.ratelimit import Rate, RateLimits

WAIT = 10.0  # seconds any test waits for a future at most

Outcome = BaseException | Callable[[], object] | None


class Call:
    def __init__(self, request: SendRequest) -> None:
        self.request = request
        self.time = time.monotonic()
        try:
            ctx = current_context()
        except RuntimeError:
            self.attempt = 0
            self.remaining: float | None = None
        else:
            self.attempt = ctx.attempt
            self.remaining = ctx.remaining()


class FakeSender:
    """Records calls; per chat, plays a script of outcomes (an error to raise,
    a callable to run, or None for success), then succeeds."""

    def __init__(self, **scripts: list[Outcome]) -> None:
        self.lock = threading.Lock()
        self.calls: list[Call] = []
        self.scripts = {chat: deque(script) for chat, script in scripts.items()}
        self.ids = 0

    def send(self, request: SendRequest) -> SendResult:
        call = Call(request)
        with self.lock:
            self.calls.append(call)
            script = self.scripts.get(str(request.chat_id))
            outcome = script.popleft() if script else None
            self.ids += 1
            message_id = self.ids
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is not None:
            outcome()
        return SendResult(message_id, {"ok": True})

    def validate(self, request: SendRequest) -> None:
        if isinstance(request.message, TextMessage) and request.message.text == "invalid":
            raise ValueError("invalid text")

    def calls_for(self, chat: object) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.request.chat_id == chat]


def req(chat: int | str = "c", text: str = "hello") -> SendRequest:
    return SendRequest(chat, TextMessage(text))


def run(dispatcher: Dispatcher, sender: Sender, request: SendRequest) -> Future[SendResult]:
    return dispatcher.submit(request.chat_id, sender.send, request)


# -------------------------------------------------------------------- chain


def test_chain_applies_the_first_decorator_outermost() -> None:
    order: list[str] = []

    def tag(name: str) -> Callable[[Sender], Sender]:
        def decorate(inner: Sender) -> Sender:
            class Tagged:
                def send(self, request: SendRequest) -> SendResult:
                    order.append(name)
                    return inner.send(request)

            return Tagged()

        return decorate

    fake = FakeSender()
    chain(tag("a"), tag("b"), tag("c"))(fake).send(req())
    assert order == ["a", "b", "c"]
    assert len(fake.calls) == 1
    assert chain()(fake) is fake
    with pytest.raises(TypeError):
        chain(42)  # type: ignore[arg-type]


def test_every_decorator_forwards_validate() -> None:
    fake = FakeSender()
    sender = chain(
        metrics(), log_sends(), retry(), rate_limit(RateLimits(per_chat=Rate(1))), timeout(1.0)
    )(fake)
    validate = sender.validate  # type: ignore[attr-defined]
    validate(req())
    with pytest.raises(ValueError, match="invalid text"):
        validate(req(text="invalid"))

    class NoValidate:
        def send(self, request: SendRequest) -> SendResult:
            return SendResult(1)

    chain(metrics(), timeout())(NoValidate()).validate(req(text="invalid"))  # type: ignore[attr-defined]
    assert fake.calls == []
    with pytest.raises(TypeError):
        metrics()(object())  # type: ignore[arg-type]


# -------------------------------------------------------------------- retry


def test_retry_policy_backoff() -> None:
    policy = RetryPolicy(base_delay=0.5, max_delay=3.0, jitter=0.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.delay(10_000) == 3.0
    half = RetryPolicy(base_delay=1.0, jitter=1.0, rng=lambda: 0.5)
    assert half.delay(1) == 0.5
    assert dataclasses.replace(half, jitter=0.2).delay(2) == pytest.approx(1.8)
    for bad in (
        {"max_attempts": 0},
        {"base_delay": -1.0},
        {"base_delay": 2.0, "max_delay": 1.0},
        {"max_total": 0.0},
        {"jitter": 1.5},
    ):
        with pytest.raises(ValueError):
            retry(**bad)


def test_retry_sends_again_after_transient_errors() -> None:
    fake = FakeSender(c=[TransientSendError("503"), TransientSendError("503"), None])
    m = metrics()
    sender = chain(m, retry(base_delay=0.01, jitter=0.0))(fake)
    with Dispatcher(max_inflight=2) as d:
        result = run(d, sender, req()).result(WAIT)
    assert result.message_id == 3
    assert [c.attempt for c in fake.calls] == [1, 2, 3]
    assert fake.calls[1].time - fake.calls[0].time >= 0.01
    assert fake.calls[2].time - fake.calls[1].time >= 0.02
    snap = m.snapshot()
    assert (snap.calls, snap.sent, dict(snap.deferred)) == (3, 1, {"retry": 2})


def test_retry_gives_up_after_max_attempts() -> None:
    fake = FakeSender(c=[TransientSendError(str(n)) for n in range(10)])
    sender = retry(max_attempts=3, base_delay=0.001, jitter=0.0)(fake)
    with Dispatcher() as d:
        future = run(d, sender, req())
        with pytest.raises(TransientSendError, match="2"):
            future.result(WAIT)
    assert len(fake.calls) == 3


def test_429s_do_not_spend_attempts() -> None:
    # Three 429s and two transient errors with max_attempts=3: delivered,
    # since only the transient errors are failures of the message.
    fake = FakeSender(
        c=[
            RateLimited(0.001),
            TransientSendError("x"),
            RateLimited(0.001),
            RateLimited(0.001),
            TransientSendError("y"),
            None,
        ]
    )
    sender = retry(max_attempts=3, base_delay=0.001)(fake)
    with Dispatcher() as d:
        assert run(d, sender, req()).result(WAIT).message_id == 6
    assert len(fake.calls) == 6


def test_a_third_transient_failure_still_gives_up_between_429s() -> None:
    fake = FakeSender(
        c=[TransientSendError("1"), RateLimited(0.001), TransientSendError("2"), None]
    )
    sender = retry(max_attempts=2, base_delay=0.001)(fake)
    with Dispatcher() as d, pytest.raises(TransientSendError, match="2"):
        run(d, sender, req()).result(WAIT)
    assert len(fake.calls) == 3


def test_retry_does_not_retry_permanent_errors() -> None:
    fake = FakeSender(c=[PermanentSendError("400"), None])
    sender = retry(base_delay=0.001)(fake)
    with Dispatcher() as d, pytest.raises(PermanentSendError):
        run(d, sender, req()).result(WAIT)
    assert len(fake.calls) == 1


@pytest.mark.parametrize(
    "error", [TransientSendError("503"), RateLimited(3.0, "chat"), RateLimited(3.0, "global")]
)
def test_too_stale_is_always_message_expired(error: Exception) -> None:
    fake = FakeSender(c=[error, None])
    sender = retry(base_delay=3.0, max_total=0.5, jitter=0.0)(fake)
    start = time.monotonic()
    with Dispatcher() as d:
        future = run(d, sender, req())
        with pytest.raises(MessageExpired, match="max_total") as info:
            future.result(WAIT)
    assert time.monotonic() - start < 2.0  # failed at once, not after the 3 s delay
    assert info.value.__cause__ is error
    assert isinstance(info.value, TimeoutError)
    assert len(fake.calls) == 1


def test_retry_fails_a_message_that_is_already_too_old() -> None:
    fake = FakeSender()
    sender = retry(max_total=0.05)(fake)
    aged = threading.Event()
    with Dispatcher() as d:
        # The lane is busy for longer than max_total (time passing, not a sync).
        d.submit("c", lambda: aged.wait(0.1))
        future = run(d, sender, req())
        with pytest.raises(MessageExpired, match="max_total"):
            future.result(WAIT)
    assert fake.calls == []


@pytest.mark.parametrize("error", [TransientSendError("503"), RateLimited(0.001, "chat")])
def test_a_message_that_expires_as_a_later_run_starts_is_chained_to_its_last_error(
    error: Exception,
) -> None:
    """The run after the error starts too late (the only thread was busy): MessageExpired
    at its start, chained to the error of the run before."""
    d = Dispatcher(max_inflight=1)

    def error_and_block_the_only_thread() -> None:
        # Queued before the re-run is due: it runs first, for longer than max_total
        # (time passing, not a sync).
        d.submit("blocker", threading.Event().wait, 0.3)
        raise error

    fake = FakeSender(c=[error_and_block_the_only_thread, None])
    m = metrics()
    sender = chain(m, retry(base_delay=0.001, jitter=0.0, max_total=0.2))(fake)
    with d:
        future = run(d, sender, req())
        with pytest.raises(MessageExpired, match="old, past max_total") as info:
            future.result(WAIT)
    assert info.value.__cause__ is error
    assert len(fake.calls) == 1
    snap = m.snapshot()
    # The 429 was counted once, as its run was deferred; not again at the expiry.
    assert snap.rate_limited == (1 if isinstance(error, RateLimited) else 0)
    assert snap.failed == {"MessageExpired": 1}


def test_a_message_the_rate_limiter_holds_past_max_total_is_chained_to_its_429() -> None:
    """A 429, then the limiter's own wait (the chat's pace) would pass max_total: the
    expiry is chained to the 429, and the 429 is counted once."""
    fake = FakeSender(c=[RateLimited(0.01, "chat"), None])
    m = metrics()
    limits = RateLimits(per_chat=Rate(1, 5.0))  # the first send books the chat for 5 s
    sender = chain(m, retry(max_total=1.0), rate_limit(limits))(fake)
    with Dispatcher() as d:
        future = run(d, sender, req())
        with pytest.raises(MessageExpired, match=r"\(the rate limiter\)") as info:
            future.result(WAIT)
    assert isinstance(info.value.__cause__, RateLimited)
    assert len(fake.calls) == 1
    snap = m.snapshot()
    assert snap.rate_limited == 1
    assert snap.deferred == {"rate_limited": 1}


@pytest.mark.parametrize("stated", [True, False])
def test_a_429_that_makes_the_message_expire_is_counted(stated: bool) -> None:
    fake = FakeSender(c=[RateLimited(5.0, "chat", stated=stated), None])
    m = metrics()
    sender = chain(m, retry(max_total=1.0))(fake)
    with Dispatcher() as d:
        future = run(d, sender, req())
        with pytest.raises(MessageExpired):
            future.result(WAIT)
    snap = m.snapshot()
    assert snap.rate_limited == 1
    assert snap.failed == {"MessageExpired": 1}
    assert snap.deferred == {}


class _Raising(logging.Handler):
    """A handler whose handle() raises: logging's own handleError never sees it."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def handle(self, record: logging.LogRecord) -> bool:
        raise self.error


@pytest.mark.parametrize("raised", [RuntimeError("the log is broken"), SystemExit(3)])
@pytest.mark.parametrize("outcome", [None, TransientSendError("503"), RateLimited(0.01)])
def test_a_raising_logging_handler_changes_no_outcome(
    outcome: Outcome, raised: BaseException
) -> None:
    """A message the platform took came back failed with the handler's error (and
    would be sent again); a failure came back as the handler's error. Whatever it
    raises, SystemExit too, as for a hook."""
    log = logging.getLogger(f"test.raising.{id(outcome)}")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    handler = _Raising(raised)
    log.addHandler(handler)
    try:
        fake = FakeSender(c=[outcome, None])
        with Dispatcher() as d:
            future = run(d, chain(log_sends(logger=log), retry(base_delay=0.001))(fake), req())
            assert future.result(WAIT).message_id is not None
        assert len(fake.calls) == (1 if outcome is None else 2)
        sender = log_sends(logger=log)(FakeSender(c=[PermanentSendError("400")]))
        with pytest.raises(PermanentSendError):
            sender.send(req())
    finally:
        log.removeHandler(handler)


def test_the_client_side_limiters_refusal_is_no_429_in_metrics() -> None:
    """Outside a task, rate_limit refuses with its own RateLimited: the platform
    answered no 429, and rate_limited counted one."""
    m = metrics()
    sender = chain(m, rate_limit(RateLimits(per_chat=Rate(1, 10.0))))(FakeSender())
    sender.send(req())
    with pytest.raises(RateLimited, match="client-side"):
        sender.send(req())
    snap = m.snapshot()
    assert snap.failed == {"RateLimited": 1}
    assert snap.rate_limited == 0


def test_retry_honours_retry_after_for_one_chat() -> None:
    fake = FakeSender(c=[RateLimited(0.1, "chat"), None])
    m = metrics()
    sender = chain(m, retry(base_delay=5.0))(fake)
    with Dispatcher() as d:
        future = run(d, sender, req())
        other = run(d, sender, req("other"))
        assert other.result(WAIT).message_id is not None
        assert not future.done()  # the 429 parked its lane only
        future.result(WAIT)
    first, second = fake.calls_for("c")
    assert second.time - first.time >= 0.1
    snap = m.snapshot()
    assert snap.rate_limited == 1
    assert snap.deferred == {"rate_limited": 1}


def test_a_global_429_pauses_every_lane_and_keeps_the_head() -> None:
    fake = FakeSender(a=[RateLimited(0.2, "global"), None])
    sender = retry()(fake)
    with Dispatcher(max_inflight=1) as d:
        fa = run(d, sender, req("a"))
        fb = run(d, sender, req("b"))
        fb.result(WAIT)
        fa.result(WAIT)
    calls = [(c.request.chat_id, c.time) for c in fake.calls]
    assert [chat for chat, _ in calls] == ["a", "a", "b"]
    assert calls[1][1] - calls[0][1] >= 0.2
    assert calls[2][1] - calls[0][1] >= 0.2


def test_retry_outside_a_task_tries_once_and_raises() -> None:
    fake = FakeSender(c=[TransientSendError("503"), None])
    sender = retry(base_delay=5.0)(fake)
    start = time.monotonic()
    with pytest.raises(TransientSendError):
        sender.send(req())
    assert time.monotonic() - start < 1.0
    assert sender.send(req()).message_id == 2


def test_throttling_does_not_spend_retry_attempts() -> None:
    fake = FakeSender(c=[TransientSendError("1"), None] * 3)
    m = metrics()
    sender = chain(
        m,
        retry(max_attempts=2, base_delay=0.001, jitter=0.0),
        rate_limit(RateLimits(per_chat=Rate(50))),
    )(fake)
    with Dispatcher() as d:
        futures = [run(d, sender, req()) for _ in range(3)]
        results = [f.result(WAIT) for f in futures]
    assert [r.message_id for r in results] == [2, 4, 6]
    assert max(c.attempt for c in fake.calls) > 2  # runs include throttled ones
    snap = m.snapshot()
    assert snap.deferred["retry"] == 3
    assert snap.deferred["throttled"] >= 1


def test_a_nested_task_does_not_inherit_the_failure_count() -> None:
    inner: list[Future[SendResult]] = []

    def spawn() -> None:  # runs inside the outer task's second run, after one failure
        inner.append(run(d, sender, req("inner")))

    fake = FakeSender(outer=[TransientSendError("1"), spawn], inner=[TransientSendError("2"), None])
    sender = retry(max_attempts=2, base_delay=0.001)(fake)
    with Dispatcher() as d:
        run(d, sender, req("outer")).result(WAIT)
        assert inner[0].result(WAIT).message_id == 4
    assert [c.attempt for c in fake.calls_for("inner")] == [1, 2]


# --------------------------------------------------------------- rate_limit


def test_rate_limit_defers_without_holding_the_thread() -> None:
    fake = FakeSender()
    sender = rate_limit(RateLimits(per_chat=Rate(2)))(fake)
    with Dispatcher(max_inflight=1) as d:
        slow = [run(d, sender, req("a", f"a{i}")) for i in range(3)]
        fast = run(d, sender, req("b"))
        fast.result(WAIT)
        assert not slow[1].done()
        for f in slow:
            f.result(WAIT)
    assert [c.request.message.text for c in fake.calls_for("a")] == ["a0", "a1", "a2"]  # type: ignore[union-attr]
    a = fake.calls_for("a")
    b = fake.calls_for("b")[0]
    assert b.time < a[1].time
    assert a[1].time - a[0].time >= 0.5 - 0.002
    assert a[2].time - a[1].time >= 0.5 - 0.002


def test_rate_limit_outside_a_task_raises_instead_of_sleeping() -> None:
    fake = FakeSender()
    sender = rate_limit(RateLimits(per_chat=Rate(1, 10.0)))(fake)
    sender.send(req())
    with pytest.raises(RateLimited) as info:
        sender.send(req())
    assert 9.0 < info.value.retry_after <= 10.02  # (+ slack)
    assert len(fake.calls) == 1
    sender.send(req("other"))


@pytest.mark.parametrize("store", STORES)
def test_rate_limit_outside_a_task_says_a_bot_wide_ban_is_global(store: str) -> None:
    """Under a bot-wide ban every chat waits: a send to another chat was refused
    with scope "chat", as if only that chat had to wait."""
    clock = FakeClock()
    with limiter_on(store, RateLimits(per_chat=Rate(1)), clock=clock) as limiter:
        sender = rate_limit(limiter)(FakeSender())
        sender.send(req("1"))
        with pytest.raises(RateLimited) as paced:
            sender.send(req("1"))
        assert paced.value.scope == "chat"  # that chat's own pace
        limiter.record_429("1", 30.0, "global")
        with pytest.raises(RateLimited) as banned:
            sender.send(req("2"))
        assert banned.value.scope == "global"
        assert banned.value.retry_after == pytest.approx(30.0)
        clock.advance(31.0)
        sender.send(req("2"))


def test_rate_limit_raises_defer_in_a_task() -> None:
    fake = FakeSender()
    sender = rate_limit(RateLimits(per_chat=Rate(1, 60.0)))(fake)
    raised: list[BaseException] = []

    def task() -> None:
        sender.send(req())
        try:
            sender.send(req())
        except Defer as defer:
            raised.append(defer)

    with Dispatcher() as d:
        d.submit("c", task).result(WAIT)
    assert len(raised) == 1
    assert isinstance(raised[0], Defer)
    assert 59.0 < raised[0].delay <= 60.02  # (+ slack)


# ------------------------------------------------------------------ timeout


def test_timeout_narrows_the_deadline_the_sender_sees() -> None:
    fake = FakeSender()
    seen_after: list[float] = []

    class Outer:
        def __init__(self, inner: Sender) -> None:
            self.inner = inner

        def send(self, request: SendRequest) -> SendResult:
            result = self.inner.send(request)
            seen_after.append(current_context().remaining())
            return result

    with Dispatcher(send_timeout=30.0) as d:
        run(d, Outer(timeout(0.5)(fake)), req()).result(WAIT)
        run(d, timeout()(fake), req()).result(WAIT)
        run(d, timeout(60.0)(fake), req()).result(WAIT)
    narrowed, plain, wider = (c.remaining for c in fake.calls)
    assert narrowed is not None
    assert 0.0 < narrowed <= 0.5
    assert plain is not None
    assert 29.0 < plain <= 30.0
    assert wider is not None
    assert 29.0 < wider <= 30.0
    assert 29.0 < seen_after[0] <= 30.0  # restored after the call


def test_timeout_outside_a_task() -> None:
    fake = FakeSender()
    timeout(0.5)(fake).send(req())
    first = fake.calls[0].remaining
    assert first is not None
    assert 0.0 < first <= 0.5
    timeout()(fake).send(req())
    assert fake.calls[1].remaining is None
    with pytest.raises(RuntimeError):
        current_context()  # nothing left behind
    with pytest.raises(ValueError):
        timeout(0)


@pytest.mark.parametrize("seconds", [math.inf, 10**400], ids=["inf", "int-past-a-float"])
def test_timeout_of_inf_is_no_bound_of_its_own(seconds: float) -> None:
    # As every other timeout of the library: inf (or an int past a float)
    # bounds nothing, where it was refused as "not finite" and 1e300 passed.
    fake = FakeSender()
    timeout(seconds)(fake).send(req())
    assert fake.calls[0].remaining is None
    with Dispatcher(send_timeout=5.0) as d:
        run(d, timeout(seconds)(fake), req()).result(WAIT)
    remaining = fake.calls[1].remaining
    assert remaining is not None
    assert 0.0 < remaining <= 5.0  # the task's own deadline only


@pytest.mark.parametrize("seconds", [-1, math.nan, True, "1"])
def test_timeout_refuses_what_is_not_a_duration(seconds: object) -> None:
    with pytest.raises((TypeError, ValueError), match="seconds"):
        timeout(seconds)  # type: ignore[arg-type]


def test_timeout_fails_fast_when_no_time_is_left() -> None:
    fake = FakeSender()

    class Burn:
        def __init__(self, inner: Sender) -> None:
            self.inner = inner

        def send(self, request: SendRequest) -> SendResult:
            ctx = current_context()
            ctx.wait_cancelled(ctx.remaining() + 0.01)  # spend the task's time
            return self.inner.send(request)

    with Dispatcher(send_timeout=0.05) as d:
        future = run(d, Burn(timeout()(fake)), req())
        with pytest.raises(TransientSendError, match="deadline"):
            future.result(WAIT)
    assert fake.calls == []


# ------------------------------------------------------------------ metrics


def test_metrics_counts_add_up() -> None:
    fake = FakeSender(
        ok=[None],
        bad=[PermanentSendError("400")],
        flaky=[TransientSendError("503"), None],
        limited=[RateLimited(0.01), None],
        dead=[TransientSendError("503")] * 5,
    )
    m = metrics()
    sender = chain(
        m,
        retry(max_attempts=2, base_delay=0.01, jitter=0.0),
        # Sends to one chat 0.25 s apart: far longer than a send takes here,
        # even on a loaded machine, so the second and third "ok" must wait.
        rate_limit(RateLimits(per_chat=Rate(4))),
    )(fake)
    chats = ["ok", "bad", "flaky", "limited", "dead", "ok", "ok"]
    with Dispatcher(max_inflight=3) as d:
        futures = [run(d, sender, req(chat)) for chat in chats]
        for f in futures:
            f.exception(WAIT)
    snap = m.snapshot()
    assert snap.sent == 5
    assert dict(snap.failed) == {"PermanentSendError": 1, "TransientSendError": 1}
    assert snap.deferred["retry"] == 2
    assert snap.deferred["rate_limited"] == 1
    assert snap.deferred.get("throttled", 0) >= 2  # the second and third "ok"
    assert snap.rate_limited == 1
    assert snap.in_flight == 0
    assert snap.calls == snap.sent + snap.failed_total + snap.deferred_total
    assert snap.calls == len(fake.calls) + snap.deferred.get("throttled", 0)
    assert snap.send_seconds.count == snap.sent + snap.failed_total
    assert snap.total_seconds.count == snap.sent
    assert sum(snap.send_seconds.counts) == snap.send_seconds.count
    with pytest.raises(TypeError):
        snap.failed["x"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.sent = 0  # type: ignore[misc]
    assert "sent=5" in repr(m)


def test_metrics_is_thread_safe() -> None:
    fake = FakeSender()
    m = metrics()
    sender = m(fake)
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait(timeout=WAIT)
        for _ in range(500):
            sender.send(req())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    snap = m.snapshot()
    assert snap.calls == snap.sent == snap.send_seconds.count == 4000


def test_histogram_snapshot() -> None:
    m = metrics(buckets=(0.1, 1.0))
    h = m.snapshot().send_seconds
    assert (h.count, h.mean, h.quantile(0.5)) == (0, 0.0, 0.0)
    h = HistogramSnapshot((0.1, 1.0), (2, 1, 1), 4, 12.3)
    assert h.quantile(0.5) == 0.1
    assert h.quantile(0.75) == 1.0
    assert h.quantile(1.0) == float("inf")
    assert h.mean == pytest.approx(12.3 / 4)
    with pytest.raises(ValueError):
        metrics(buckets=(1.0, 0.5))


# ------------------------------------------------------------------ logging


SECRET = "the secret text 7f3a"


def test_logging_never_logs_the_text_by_default(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="outbound")
    fake = FakeSender(c=[TransientSendError("503"), None], bad=[PermanentSendError("400")])
    sender = chain(log_sends(), retry(base_delay=0.001))(fake)
    with Dispatcher() as d:
        run(d, sender, req("c", SECRET)).result(WAIT)
        run(d, sender, req("bad", SECRET)).exception(WAIT)
    sender.send(req("outside", SECRET))
    records = [r for r in caplog.records if r.name == "outbound.send"]
    messages = [r.getMessage() for r in records]
    assert any(m.startswith("sent chat='c'") for m in messages)
    assert any(m.startswith("send deferred chat='c'") for m in messages)
    failures = [r for r in records if r.levelno == logging.WARNING]
    assert len(failures) == 1
    assert "PermanentSendError" in failures[0].getMessage()
    assert SECRET not in caplog.text
    assert all(SECRET not in m for m in messages)


def test_logging_can_include_the_text(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="outbound.send")
    log_sends(include_text=True)(FakeSender()).send(req("c", SECRET))
    assert SECRET in caplog.text
    with pytest.raises(TypeError):
        log_sends(logger=42)  # type: ignore[arg-type]


def test_a_logging_handler_raising_ctrl_c_in_the_main_thread_goes_on() -> None:
    # As for a hook: Ctrl-C still stops a program.
    log = logging.getLogger("test.raising.ctrl_c")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    handler = _Raising(KeyboardInterrupt())
    log.addHandler(handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            log_sends(logger=log)(FakeSender()).send(req())
    finally:
        log.removeHandler(handler)


@pytest.mark.parametrize(
    "buckets",
    [
        [0.1, math.nan, 1.0],
        [math.nan],
        [1.0, 1.0],
        [],
        [math.inf],
        [0.1, math.inf, 1.0],
        [-math.inf, 1.0],
        [0.1, 10**400],  # an int past a float: was a bare OverflowError
        [-(10**400), 0.1],
    ],
)
def test_metrics_refuses_buckets_that_do_not_increase(buckets: list[float]) -> None:
    with pytest.raises(ValueError, match="buckets must be a non-empty, strictly increasing"):
        metrics(buckets=buckets)


@pytest.mark.parametrize("buckets", [["0.1"], [True, 2.0], [None]])
def test_metrics_refuses_buckets_that_are_not_numbers(buckets: list[object]) -> None:
    with pytest.raises(TypeError, match="buckets must hold numbers"):
        metrics(buckets=buckets)  # type: ignore[arg-type]


def test_metrics_takes_a_last_inf_bucket_as_the_one_always_there() -> None:
    # As prometheus_client does: a last +Inf bound is the +Inf bucket, not a second one.
    assert metrics(buckets=[0.1, 1, math.inf]).snapshot() == metrics(buckets=[0.1, 1.0]).snapshot()


class _AlwaysLimited:
    """A sender whose every send is a 429 asking for ``retry_after`` (a server answering
    "Too Many Requests" with 0, or a past Retry-After date)."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        self.calls = 0
        self.lock = threading.Lock()

    def validate(self, request: SendRequest) -> None:
        pass

    def chat_key(self, chat_id: object) -> object:
        return chat_id

    def send(self, request: SendRequest) -> SendResult:
        with self.lock:
            self.calls += 1
        raise RateLimited(self.retry_after, "chat")


@pytest.mark.parametrize(("base_delay", "floor"), [(0.5, 0.5), (0.0, 0.05)])
def test_a_429_asking_for_no_wait_is_retried_after_a_floor_not_in_a_tight_loop(
    base_delay: float, floor: float
) -> None:
    """A 429 spends no attempt: one of retry_after 0 was deferred by 0 and sent again at
    once, thousands of times a second, until max_total."""
    fake = _AlwaysLimited(0.0)
    max_total = 1.0
    sender = retry(base_delay=base_delay, max_delay=30.0, jitter=0.0, max_total=max_total)(fake)
    with Dispatcher(max_inflight=1) as d:
        future = d.submit(1, sender.send, SendRequest(1, TextMessage("hello")))
        with pytest.raises(MessageExpired):
            future.result(WAIT)
    # A try at 0, then one each floor seconds until max_total (one more for slack).
    assert 1 <= fake.calls <= max_total / floor + 2, fake.calls


def test_rate_limited_delay_is_retry_after_with_a_floor() -> None:
    policy = RetryPolicy(base_delay=0.5)
    assert policy.rate_limited_delay(0.0) == 0.5
    assert policy.rate_limited_delay(0.2) == 0.5
    assert policy.rate_limited_delay(3.0) == 3.0  # (a real wait: as asked)
    assert policy.rate_limited_delay(math.nan) == 0.5
    bare = RetryPolicy(base_delay=0.0)
    assert bare.rate_limited_delay(0.0) == RetryPolicy.MIN_RATE_LIMITED_DELAY > 0
