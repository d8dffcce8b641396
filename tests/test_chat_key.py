"""Telegram's usernames are case-blind: ``"@Name"`` and ``"@name"`` are one chat.
One lane, one rate budget and one ban for them (they were keyed by the exact
text: a chat named both ways got past its per-chat limit, and its messages
ran on two lanes, their order not kept)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import pytest

from outbound import Outbound
from outbound.contrib.telebot import TeleBotSender
from outbound.errors import RateLimited
from outbound.messages import ChatId, Sender, SendRequest, SendResult, TextMessage
from outbound.middleware import chain, logging, metrics, rate_limit, retry, timeout
from outbound.ratelimit import Rate, RateLimiter, RateLimits
from outbound.simulator import PlatformSimulator
from outbound.telegram import TelegramSender, chat_key

SPELLINGS = ["@MyChannel", "@mychannel", "@MYCHANNEL", "@myChannel"]


class _Str(str):
    def lower(self) -> str:
        raise SystemExit("a str subclass's own lower() was called")


def test_a_username_is_keyed_in_lower_case_and_an_int_as_it_is() -> None:
    assert {chat_key(name) for name in SPELLINGS} == {"@mychannel"}
    assert chat_key(-1001) == -1001
    assert chat_key(_Str("@MyChannel")) == "@mychannel"
    assert type(chat_key(_Str("@MyChannel"))) is str


def test_the_telegram_senders_and_the_middleware_above_them_give_the_key() -> None:
    telebot = pytest.importorskip("telebot")
    senders: list[Sender] = [
        TelegramSender("123456:" + "A" * 35),
        TeleBotSender(telebot.TeleBot("123456:" + "A" * 35, threaded=False)),
    ]
    for sender in senders:
        wrapped = chain(retry(), rate_limit(RateLimits(per_chat=Rate(1))), timeout())(sender)
        assert {wrapped.chat_key(name) for name in SPELLINGS} == {"@mychannel"}  # type: ignore[attr-defined]


def test_one_lane_for_every_spelling_of_a_username() -> None:
    sender = TelegramSender("123456:" + "A" * 35)
    with Outbound(None, sender) as first, Outbound(first.dispatcher, sender) as later:
        for outbound in (first, later):
            assert len({outbound.lane_key(name) for name in SPELLINGS}) == 1
            assert outbound.lane_key(7) != outbound.lane_key("@mychannel")


def test_a_sender_without_chat_key_keeps_the_id_as_given() -> None:
    class Plain:
        def send(self, request: SendRequest) -> SendResult:
            return SendResult(message_id=1)

    with Outbound(None, Plain()) as outbound:
        assert outbound.lane_key("@MyChannel") == "@MyChannel"
        assert outbound.lane_key("@mychannel") == "@mychannel"
    assert chain(retry())(Plain()).chat_key("@MyChannel") == "@MyChannel"  # type: ignore[attr-defined]


def test_every_spelling_of_a_username_shares_its_rate_budget_and_its_ban() -> None:
    limiter = RateLimiter(RateLimits(per_chat=Rate(1, 60.0)))
    with PlatformSimulator() as sim, TelegramSender(sim.token, base_url=sim.url) as sender:
        limited = rate_limit(limiter)(sender)
        limited.send(SendRequest("@MyChannel", TextMessage("first")))
        # (Outside a task the limiter refuses at once: the chat's budget is spent.)
        with pytest.raises(RateLimited, match="client-side rate limit"):
            limited.send(SendRequest("@mychannel", TextMessage("second")))
        assert [m["text"] for m in sim.received("@MYCHANNEL")] == ["first"]
    banned = RateLimiter(RateLimits(per_chat=Rate(100)))
    banned.record_429(chat_key("@MyChannel"), 30.0, "chat")
    assert banned.acquire(chat_key("@MYCHANNEL"), book=False) > 0.0


def test_replies_to_every_spelling_leave_one_at_a_time_in_order() -> None:
    running = 0
    most = 0
    order: list[str] = []
    lock = threading.Lock()

    class Counting:
        def chat_key(self, chat_id: ChatId) -> Hashable:
            return chat_key(chat_id)

        def send(self, request: SendRequest) -> SendResult:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            try:
                assert isinstance(request.message, TextMessage)
                order.append(request.message.text)
                return SendResult(message_id=len(order))
            finally:
                with lock:
                    running -= 1

    with Outbound(None, Counting(), max_inflight=8, queue_size=64) as outbound:
        futures = [outbound.reply_text(SPELLINGS[i % 4], str(i)) for i in range(60)]
        for future in futures:
            future.result(timeout=30)
    assert order == [str(i) for i in range(60)]
    assert most == 1


def _decorators() -> list[tuple[str, Callable[[], Callable[[Sender], Sender]]]]:
    """Every sender decorator the library makes, by name, each made fresh."""
    found: list[tuple[str, Callable[[], Callable[[Sender], Sender]]]] = [
        ("retry", retry),
        ("rate_limit", lambda: rate_limit(RateLimits(per_chat=Rate(1)))),
        ("timeout", timeout),
        ("metrics", metrics),
        ("logging", logging),
    ]
    try:
        from prometheus_client import CollectorRegistry  # noqa: PLC0415

        from outbound.contrib.prometheus import PrometheusMetrics  # noqa: PLC0415
    except ImportError:
        pass
    else:
        found.append(("prometheus", lambda: PrometheusMetrics(CollectorRegistry()).middleware()))
    return found


@pytest.mark.parametrize(("name", "make"), _decorators(), ids=[n for n, _ in _decorators()])
def test_every_decorator_outermost_gives_the_senders_key(
    name: str, make: Callable[[], Callable[[Sender], Sender]]
) -> None:
    # PrometheusMetrics.middleware() did not pass chat_key on: outermost, as its
    # docs show it, "@Chan" and "@chan" had two lanes, one chat's messages
    # out of order (and a rate_limit above it two budgets).
    wrapped = chain(make(), retry(), timeout())(TelegramSender("123456:" + "A" * 35))
    assert {wrapped.chat_key(n) for n in SPELLINGS} == {"@mychannel"}  # type: ignore[attr-defined]
    with Outbound(None, wrapped) as outbound:
        assert len({outbound.lane_key(n) for n in SPELLINGS}) == 1
