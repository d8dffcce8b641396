"""PrometheusMetrics: values after real sends through a dispatcher to the PlatformSimulator.

Each test uses its own ``CollectorRegistry``; skipped when prometheus_client
(extra ``prometheus``) is not installed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbound import Defer, Dispatcher, DispatcherClosed, Hooks, QueueFull
from outbound.errors import (
    MessageExpired,
    PermanentSendError,
    RateLimited,
    SendTimeout,
    TransientSendError,
)
from outbound.messages import SendRequest, SendResult, TextMessage
from outbound.middleware import chain, retry, timeout
from outbound.outbox import SQLiteStore
from outbound.reply import Outbound
from outbound.simulator import Fault, PlatformSimulator
from outbound.telegram import TelegramSender

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="prometheus_client is not installed (extra 'prometheus')"
)

from outbound.contrib.prometheus import PrometheusMetrics  # noqa: E402

WAIT = 10.0
LABELS = {"result", "error", "scope", "outcome", "reason", "le"}


@pytest.fixture
def registry() -> Any:
    return prometheus_client.CollectorRegistry()


@pytest.fixture
def prom(registry: Any) -> Iterator[PrometheusMetrics]:
    metrics = PrometheusMetrics(registry=registry)
    yield metrics
    metrics.unregister()


def value(registry: Any, name: str, **labels: str) -> float | None:
    found: float | None = registry.get_sample_value(name, labels)
    return found


def sent(registry: Any, result: str) -> float | None:
    return value(registry, "outbound_messages_sent_total", result=result)


class Scripted:
    """A sender that raises the scripted errors in turn, then returns a result."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.validated: list[SendRequest] = []

    def validate(self, request: SendRequest) -> None:
        self.validated.append(request)

    def send(self, request: SendRequest) -> SendResult:
        if self.errors:
            raise self.errors.pop(0)
        return SendResult(message_id=1)


def hello(chat: int | str) -> SendRequest:
    return SendRequest(chat, TextMessage("hello"))


# ------------------------------------------------------------------ end to end


def test_metrics_after_sends_through_a_dispatcher(registry: Any, prom: PrometheusMetrics) -> None:
    done: list[Any] = []
    with (
        PlatformSimulator(max_text_length=20) as sim,
        TelegramSender(sim.token, base_url=sim.url) as telegram,
        Dispatcher(max_inflight=4, hooks=prom.hooks(Hooks(on_done=done.append))) as dispatcher,
    ):
        sender = chain(prom.middleware(), retry(base_delay=0.01), timeout())(telegram)
        out = Outbound(dispatcher, sender)
        prom.watch_dispatcher(dispatcher)
        sim.inject(
            Fault("rate_limit", chat_id=1001, retry_after=0.02),
            Fault("error", chat_id=1002, status=502),
        )
        futures = [out.reply_text(chat, f"m{i}") for i in range(3) for chat in (1001, 1002)]
        bad = out.reply_text(1003, "x" * 30)  # the platform refuses: 400
        for future in futures:
            assert future.result(WAIT).message_id is not None
        assert isinstance(bad.exception(WAIT), PermanentSendError)
        assert dispatcher.drain(WAIT)
        assert value(registry, "outbound_queued") == 0
        assert value(registry, "outbound_max_inflight") == 4

    assert sent(registry, "sent") == 6
    assert sent(registry, "rate_limited") == 1
    assert sent(registry, "retried") == 1
    assert sent(registry, "failed") == 1
    assert sent(registry, "throttled") == 0
    assert value(registry, "outbound_send_failures_total", error="permanent") == 1
    assert value(registry, "outbound_rate_limited_total", scope="chat") == 1
    assert value(registry, "outbound_rate_limited_total", scope="global") == 0
    assert value(registry, "outbound_send_duration_seconds_count") == 9
    assert value(registry, "outbound_delivery_seconds_count") == 6
    assert value(registry, "outbound_inflight") == 0
    assert value(registry, "outbound_tasks_submitted_total") == 7
    assert value(registry, "outbound_queue_wait_seconds_count") == 7
    assert value(registry, "outbound_task_duration_seconds_count") == 7
    assert value(registry, "outbound_tasks_total", outcome="ok") == 6
    assert value(registry, "outbound_tasks_total", outcome="error") == 1
    assert len(done) == 7  # the hooks given were kept
    wait_sum = value(registry, "outbound_queue_wait_seconds_sum")
    assert wait_sum is not None
    assert wait_sum > 0.02  # the 429 parked its lane for retry_after
    text = prometheus_client.generate_latest(registry).decode()
    assert 'outbound_messages_sent_total{result="sent"} 6.0' in text


def test_no_per_chat_label_anywhere(registry: Any, prom: PrometheusMetrics) -> None:
    chats = [2001, 2002, 2003]
    with (
        PlatformSimulator() as sim,
        TelegramSender(sim.token, base_url=sim.url) as telegram,
        Dispatcher(hooks=prom.hooks()) as dispatcher,
    ):
        out = Outbound(dispatcher, chain(prom.middleware(), retry(base_delay=0.01))(telegram))
        prom.watch_dispatcher(dispatcher)
        sim.inject(Fault("rate_limit", chat_id=2002, retry_after=0.01))
        for future in [out.reply_text(c, "hi") for c in chats for _ in range(2)]:
            future.result(WAIT)
        assert dispatcher.drain(WAIT)
        families = list(registry.collect())
    names = set()
    for family in families:
        assert family.name.startswith("outbound_")
        for sample in family.samples:
            names.update(sample.labels)
            for label_value in sample.labels.values():
                assert label_value not in {str(c) for c in chats}
    assert names <= LABELS
    assert sent(registry, "sent") == 6


# ------------------------------------------------------------------- registry


def test_registries_are_isolated(registry: Any) -> None:
    other = prometheus_client.CollectorRegistry()
    a = PrometheusMetrics(registry=registry)
    b = PrometheusMetrics(registry=other)
    try:
        wrapped = a.middleware()(Scripted())
        for _ in range(3):
            wrapped.send(hello(1))
        assert sent(registry, "sent") == 3
        assert sent(other, "sent") == 0
        assert prometheus_client.REGISTRY.get_sample_value(
            "outbound_messages_sent_total", {"result": "sent"}
        ) in (None, 0.0)
        assert a.registry is registry
    finally:
        a.unregister()
        b.unregister()


def test_a_second_instance_on_one_registry_is_refused_cleanly(
    registry: Any, prom: PrometheusMetrics
) -> None:
    before = {f.name for f in registry.collect()}
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusMetrics(registry=registry)
    assert {f.name for f in registry.collect()} == before
    prom.unregister()
    prom.unregister()
    assert list(registry.collect()) == []
    again = PrometheusMetrics(registry=registry)
    again.unregister()


def test_namespace(registry: Any) -> None:
    metrics = PrometheusMetrics(registry=registry, namespace="bot")
    try:
        metrics.middleware()(Scripted()).send(hello(1))
        assert value(registry, "bot_messages_sent_total", result="sent") == 1
        assert value(registry, "outbound_messages_sent_total", result="sent") is None
    finally:
        metrics.unregister()
    with pytest.raises(ValueError, match="namespace"):
        PrometheusMetrics(registry=registry, namespace="no-dashes")


# ----------------------------------------------------------------- middleware


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (PermanentSendError("no"), "permanent"),
        (TransientSendError("later"), "transient"),
        (SendTimeout("slow"), "timeout"),
        (MessageExpired("too old"), "expired"),
        (RateLimited(1.0, "global"), "rate_limited"),
        (ValueError("bad"), "invalid"),
        (RuntimeError("?"), "other"),
    ],
)
def test_failures_by_kind(
    registry: Any, prom: PrometheusMetrics, error: Exception, kind: str
) -> None:
    inner = Scripted(error)
    sender = prom.middleware()(inner)
    sender.validate(hello(1))  # type: ignore[attr-defined]  # a Sender may lack validate
    assert inner.validated == [hello(1)]
    with pytest.raises(type(error)):
        sender.send(hello(1))
    assert sent(registry, "failed") == 1
    assert value(registry, "outbound_send_failures_total", error=kind) == 1
    assert value(registry, "outbound_send_duration_seconds_count") == 1
    assert value(registry, "outbound_delivery_seconds_count") == 0  # outside a task
    expected_global = 1 if kind == "rate_limited" else 0
    assert value(registry, "outbound_rate_limited_total", scope="global") == expected_global


def test_a_429_that_makes_the_message_expire_is_counted_once(
    registry: Any, prom: PrometheusMetrics
) -> None:
    """A 429 whose retry_after passes max_total: one failed run of kind ``expired``, and
    the platform's 429 counted; a 429 deferred, then an expiry at the next run's start:
    counted once."""
    inner = Scripted(RateLimited(5.0, "global"))
    with Dispatcher() as dispatcher:
        out = Outbound(dispatcher, chain(prom.middleware(), retry(max_total=1.0))(inner))
        assert isinstance(out.reply_text(1, "x").exception(WAIT), MessageExpired)
    assert sent(registry, "failed") == 1
    assert value(registry, "outbound_send_failures_total", error="expired") == 1
    assert value(registry, "outbound_send_failures_total", error="other") == 0
    assert value(registry, "outbound_rate_limited_total", scope="global") == 1

    d = Dispatcher(max_inflight=1)

    class LimitedThenHeld:
        def send(self, request: SendRequest) -> SendResult:
            # Queued before the re-run is due: it runs first, for longer than
            # max_total (time passing, not a sync), and the re-run starts too late.
            d.submit("blocker", threading.Event().wait, 0.3)
            raise RateLimited(0.001, "chat")

    with d:
        sender = chain(prom.middleware(), retry(max_total=0.2))(LimitedThenHeld())
        assert isinstance(Outbound(d, sender).reply_text(2, "x").exception(WAIT), MessageExpired)
    assert value(registry, "outbound_send_failures_total", error="expired") == 2
    assert value(registry, "outbound_rate_limited_total", scope="chat") == 1


def test_deferrals_by_cause(registry: Any, prom: PrometheusMetrics) -> None:
    def deferred(cause: BaseException | None) -> Defer:
        defer = Defer(0.01)
        defer.__cause__ = cause
        return defer

    inner = Scripted(
        deferred(RateLimited(0.01, "chat")), deferred(TransientSendError("x")), deferred(None)
    )
    with Dispatcher(max_inflight=1) as dispatcher:
        out = Outbound(dispatcher, prom.middleware()(inner))
        assert out.reply_text(1, "x").result(WAIT).message_id == 1
    assert sent(registry, "rate_limited") == 1
    assert sent(registry, "retried") == 1
    assert sent(registry, "throttled") == 1
    assert sent(registry, "sent") == 1
    assert value(registry, "outbound_send_duration_seconds_count") == 3  # not the throttled run
    assert value(registry, "outbound_delivery_seconds_count") == 1


def test_inflight_gauge_counts_running_sends(registry: Any, prom: PrometheusMetrics) -> None:
    entered = threading.Barrier(3, timeout=WAIT)
    release = threading.Event()

    class Blocking:
        def send(self, request: SendRequest) -> SendResult:
            entered.wait()
            assert release.wait(WAIT)
            return SendResult(message_id=1)

    with Dispatcher(max_inflight=2) as dispatcher:
        out = Outbound(dispatcher, prom.middleware()(Blocking()))
        futures = [out.reply_text(chat, "x") for chat in (1, 2)]
        entered.wait()
        assert value(registry, "outbound_inflight") == 2
        release.set()
        for future in futures:
            future.result(WAIT)
    assert value(registry, "outbound_inflight") == 0


# ---------------------------------------------------------------------- hooks


def test_dispatcher_gauges_and_rejections(registry: Any, prom: PrometheusMetrics) -> None:
    started = threading.Event()
    release = threading.Event()

    def block() -> None:
        started.set()
        assert release.wait(WAIT)

    dispatcher = Dispatcher(max_inflight=2, queue_size=2, hooks=prom.hooks())
    prom.watch_dispatcher(dispatcher)
    prom.watch_dispatcher(dispatcher)  # idempotent
    try:
        futures = [dispatcher.submit("a", block)]
        assert started.wait(WAIT)
        futures += [dispatcher.submit("a", lambda: None) for _ in range(2)]
        with pytest.raises(QueueFull):
            dispatcher.submit("a", lambda: None)
        assert value(registry, "outbound_queued") == 2
        assert value(registry, "outbound_running") == 1
        assert value(registry, "outbound_lanes") == 1
        assert value(registry, "outbound_max_inflight") == 2
        assert value(registry, "outbound_tasks_rejected_total", reason="queue_full") == 1
        release.set()
        for future in futures:
            future.result(WAIT)
        assert dispatcher.drain(WAIT)
        assert value(registry, "outbound_queued") == 0
        assert value(registry, "outbound_lanes") == 0
    finally:
        release.set()
        dispatcher.shutdown(WAIT)
    with pytest.raises(DispatcherClosed):
        dispatcher.submit("a", lambda: None)
    assert value(registry, "outbound_tasks_rejected_total", reason="closed") == 1
    assert value(registry, "outbound_tasks_total", outcome="ok") == 3
    prom.unwatch(dispatcher)
    assert value(registry, "outbound_queued") is None


def test_hooks_compose_with_existing_ones(prom: PrometheusMetrics) -> None:
    seen: list[str] = []
    hooks = prom.hooks(
        Hooks(
            on_queued=lambda key, n: seen.append("queued"),
            on_start=lambda key: seen.append("start"),
            on_rejected=lambda key, error: seen.append("rejected"),
        )
    )
    assert hooks.on_start is not None
    assert hooks.on_queued is not None
    hooks.on_queued("k", 1)
    hooks.on_start("k")
    assert seen == ["queued", "start"]
    with pytest.raises(TypeError):
        prom.hooks(object())  # type: ignore[arg-type]


# --------------------------------------------------------------------- outbox


def test_outbox_gauges_from_a_sqlite_store(
    registry: Any, prom: PrometheusMetrics, tmp_path: Path
) -> None:
    store = SQLiteStore(tmp_path / "outbox.db")
    try:
        prom.watch_outbox(store)
        assert value(registry, "outbound_outbox_pending") == 0
        assert value(registry, "outbound_outbox_oldest_pending_age_seconds") is None
        conn = store.connect()
        try:
            with conn:
                for i in range(3):
                    store.enqueue(conn, key="chat-1", type="Reply", payload={"n": i})
        finally:
            conn.close()
        assert value(registry, "outbound_outbox_pending") == 3
        assert value(registry, "outbound_outbox_processing") == 0
        assert value(registry, "outbound_outbox_dead") == 0
        age = value(registry, "outbound_outbox_oldest_pending_age_seconds")
        assert age is not None
        assert age >= 0.0
        prom.unwatch(store)
        assert value(registry, "outbound_outbox_pending") is None
    finally:
        store.close()


def test_a_failing_store_is_left_out_of_the_scrape(
    registry: Any, prom: PrometheusMetrics, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SQLiteStore(tmp_path / "outbox.db")
    prom.watch_outbox(store)
    (tmp_path / "outbox.db").unlink()
    (tmp_path / "outbox.db").mkdir()  # the file is now a directory: every query fails
    assert value(registry, "outbound_outbox_pending") is None
    assert value(registry, "outbound_messages_sent_total", result="sent") == 0
    assert "status() failed" in caplog.text
    store.close()
