"""A platform 429 is honoured on every path, end to end over HTTP to the stand-in platform.

The ``retry_after`` is a fact about the chat (or the bot), recorded in the
limiter: later messages wait it out whether the message that got the 429
is retried, given up on (``MessageExpired``), or there is no retry layer
at all. Arrival instants are read at the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from ratelimit_stores import wait_until

from outbound.dispatcher import Dispatcher
from outbound.errors import MessageExpired, RateLimited
from outbound.middleware import SenderDecorator, chain, rate_limit, retry, timeout
from outbound.ratelimit import Rate, RateLimiter, RateLimits
from outbound.reply import Outbound
from outbound.simulator import Fault, PlatformSimulator
from outbound.telegram import TelegramSender

WAIT = 15.0


@contextmanager
def stack(
    decorators: list[SenderDecorator], **sim: Any
) -> Iterator[tuple[PlatformSimulator, Outbound]]:
    with (
        PlatformSimulator(**sim) as simulator,
        TelegramSender(simulator.token, base_url=simulator.url) as telegram,
        Outbound(None, chain(*decorators)(telegram), max_inflight=4) as out,
    ):
        yield simulator, out


def arrivals(sim: PlatformSimulator, chat: int) -> list[float]:
    return [m["time"] for m in sim.received(chat)]


@pytest.mark.parametrize("scope", ["chat", "global"])
def test_without_a_retry_layer_later_messages_wait_out_the_ban(scope: str) -> None:
    limiter = RateLimiter(RateLimits(per_chat=Rate(100)))
    with stack([rate_limit(limiter), timeout()]) as (sim, out):
        sim.inject(Fault("rate_limit", chat_id=1, retry_after=0.5, scope=scope))  # type: ignore[arg-type]
        start = time.monotonic()
        refused = out.reply_text(1, "refused")
        assert isinstance(refused.exception(WAIT), RateLimited)
        after = [out.reply_text(1, f"after {i}") for i in range(2)]
        other = out.reply_text(2, "other chat")
        assert [f.result(WAIT).message_id for f in after] == [1, 2]
        other.result(WAIT)
        assert all(t >= start + 0.5 for t in arrivals(sim, 1))  # the ban was waited out
        if scope == "chat":
            assert arrivals(sim, 2)[0] < start + 0.5  # other chats were not held
        else:
            assert arrivals(sim, 2)[0] >= start + 0.5  # every chat was held
        assert sim.stats().rate_limited == 1  # nothing more went into the ban


@pytest.mark.parametrize("scope", ["chat", "global"])
def test_when_retry_gives_up_nothing_is_sent_into_the_ban(scope: str) -> None:
    # The retry_after (0.5 s) is past max_total (0.3 s): the refused message
    # expires at once; the later ones wait for the ban and, too old by then,
    # expire without a request. Before the fix they went out 1-3 ms later,
    # into the ban, and were refused again.
    decorators: list[SenderDecorator] = [
        retry(max_total=0.3),
        rate_limit(RateLimits(per_chat=Rate(100))),
        timeout(),
    ]
    with stack(decorators) as (sim, out):
        sim.inject(Fault("rate_limit", chat_id=1, retry_after=0.5, scope=scope))  # type: ignore[arg-type]
        refused = out.reply_text(1, "refused")
        error = refused.exception(WAIT)
        assert isinstance(error, MessageExpired)
        assert isinstance(error.__cause__, RateLimited)
        later = [out.reply_text(1, "same chat"), out.reply_text(2, "other chat")]
        outcomes = [f.exception(WAIT) for f in later]
        if scope == "chat":
            assert isinstance(outcomes[0], MessageExpired)
            assert outcomes[1] is None
            assert sim.stats().requests == 2  # the refused one and the other chat's
        else:
            assert all(isinstance(e, MessageExpired) for e in outcomes)
            assert sim.stats().requests == 1
        assert sim.stats().rate_limited == 1


def test_real_429_shapes_are_recognised_as_bot_wide_when_several_chats_get_them() -> None:
    limiter = RateLimiter(RateLimits(per_chat=Rate(100)), infer_chats=2, infer_window=2.0)
    decorators = [rate_limit(limiter), timeout()]
    with stack(decorators, real_429s=True) as (sim, out):
        sim.inject(
            Fault("rate_limit", chat_id=1, retry_after=0.3, scope="global"),
            Fault("rate_limit", chat_id=2, retry_after=0.3, scope="global"),
        )
        start = time.monotonic()
        first = out.reply_text(1, "a").exception(WAIT)
        assert isinstance(first, RateLimited)
        assert (first.scope, first.stated, first.retry_after) == ("chat", False, 1.0)
        second = out.reply_text(2, "b").exception(WAIT)
        assert isinstance(second, RateLimited)
        assert (second.scope, second.stated) == ("global", False)  # two chats: the bot's
        assert isinstance(second.__cause__, RateLimited)
        out.reply_text(3, "c").result(WAIT)  # a third chat waited for the bot-wide ban
        assert arrivals(sim, 3)[0] >= start + 1.0


def test_the_limiter_keeps_to_a_real_platforms_limit_without_429s() -> None:
    # The stand-in enforces Telegram-like limits in real shapes; the client
    # paces to the same numbers and is never refused.
    limits = RateLimits(overall=Rate(60), per_chat=Rate(20))
    decorators: list[SenderDecorator] = [retry(), rate_limit(limits), timeout()]
    with stack(decorators, real_429s=True, global_rate=60.0, chat_rate=20.0) as (sim, out):
        futures = [out.reply_text(chat, f"{i}") for i in range(5) for chat in range(1, 13)]
        assert all(f.exception(WAIT) is None for f in futures)
        assert sim.stats().rate_limited == 0


# --------------------------------------------- too stale: at once, whoever waits


@pytest.mark.parametrize("why", ["ban", "pace"])
def test_a_message_expires_at_once_when_the_limiter_would_hold_it_too_long(why: str) -> None:
    limiter = RateLimiter(RateLimits(per_chat=Rate(1, 8.0)))
    with stack([retry(max_total=1.0), rate_limit(limiter), timeout()]) as (sim, out):
        if why == "ban":
            limiter.record_429(5, 6.0, "chat")  # a 429 an earlier message got
        else:
            out.reply_text(5, "first").result(WAIT)  # the next one may go in 8 s
        held = out.reply_text(5, "held")
        # Not after the wait: the limiter's 6 s (8 s) are past max_total from the start.
        error = held.exception(timeout=2.0)
        assert isinstance(error, MessageExpired)
        assert "max_total" in str(error)
        assert len(sim.received(5)) == (0 if why == "ban" else 1)


# ----------------------------------------------- two bots on one dispatcher


def test_two_bots_on_one_dispatcher_do_not_hold_each_other_up() -> None:
    limiters: list[RateLimiter] = []

    def bot(sim: PlatformSimulator, telegram: TelegramSender) -> Any:
        limiter = RateLimiter(RateLimits(per_chat=Rate(50)))
        limiters.append(limiter)
        return chain(retry(), rate_limit(limiter), timeout())(telegram)

    with (
        PlatformSimulator() as sim_a,
        PlatformSimulator(token="999:other") as sim_b,
        TelegramSender(sim_a.token, base_url=sim_a.url) as tg_a,
        TelegramSender(sim_b.token, base_url=sim_b.url) as tg_b,
        Dispatcher(max_inflight=4) as dispatcher,
    ):
        a, b = Outbound(dispatcher, bot(sim_a, tg_a)), Outbound(dispatcher, bot(sim_b, tg_b))
        assert a.lane_key(1) != b.lane_key(1)  # bot B's chat 1 is another lane
        sim_a.inject(Fault("rate_limit", chat_id=1, retry_after=5.0, scope="global"))
        refused = a.reply_text(1, "A: a bot-wide 429")
        # The platform has answered and bot A's limiter has recorded the ban:
        # only then does another chat of bot A have to wait for it.
        assert wait_until(lambda: sim_a.stats().rate_limited == 1)
        assert wait_until(lambda: limiters[0].stats().global_ban > 0)
        waiting = a.reply_text(2, "A: another chat of bot A")
        # Bot A's bot-wide ban and its chat 1 hold nothing of bot B's, chat 1 included.
        others = [b.reply_text(chat, "B") for chat in (1, 2, 3)]
        assert [f.exception(WAIT) for f in others] == [None] * 3
        assert not refused.done()
        assert not waiting.done()  # bot A's other chats do wait: the ban is the bot's
        assert dispatcher.stats().paused_for == 0.0  # no dispatcher-wide pause
        dispatcher.force_close()
    assert [m["text"] for m in sim_a.all_received()] == []


def test_retry_without_a_rate_limit_below_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    import outbound.middleware as middleware  # noqa: PLC0415

    caplog.set_level(logging.WARNING, logger="outbound.middleware")
    middleware._warned_unlimited = False  # as in a fresh process

    class Quiet:
        def send(self, request: Any) -> Any:  # pragma: no cover - never called
            raise AssertionError

    chain(retry(), rate_limit(RateLimits()), timeout())(Quiet())
    assert not caplog.records
    chain(retry(), timeout())(Quiet())
    chain(retry(), timeout())(Quiet())
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "rate_limit()" in warnings[0]
