"""A platform 429 is honoured on every path, end to end over HTTP to the stand-in platform.

The ``retry_after`` is a fact about the chat (or the bot), recorded in the
limiter: later messages wait it out whether the message that got the 429
is retried, given up on (``MessageExpired``), or there is no retry layer
at all. Arrival instants are read at the server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

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
