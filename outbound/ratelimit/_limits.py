"""What the limits are: :class:`Rate`, :class:`RateLimits`, the platform presets."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final

from outbound.retry import shown_number

__all__ = ["SLACK", "TELEGRAM", "Rate", "RateLimits", "is_group"]

#: The most seconds a :class:`Rate`'s bucket may reach ahead (``burst`` intervals):
#: about 31 years; past it, a period is not a pace any store keeps.
MAX_REACH: Final = 1e9
#: The shortest interval a limiter paces: a clock of Unix time (the stores') moves
#: by 2.4e-7 s steps, below which a bucket would never move ahead (no limit).
MIN_INTERVAL: Final = 1e-6


@dataclass(frozen=True, slots=True)
class Rate:
    """``limit`` sends per ``period`` seconds, evenly spaced, with bursts of ``burst``.

    ``Rate(30)`` is 30 per second; ``Rate(20, 60.0)`` is 20 per minute.
    ``burst`` sends may go back to back after an idle spell; ``1`` (the
    default) spaces every send by ``period / limit``. Whatever happens, no
    window of ``period`` seconds holds more than ``limit + burst - 1``
    sends (:attr:`window_max`). ``ValueError`` for a rate no clock can pace:
    an interval (``period / limit``) under a microsecond (more than a
    million sends a second: a clock of Unix time moves by steps of 0.24 µs),
    or ``burst`` intervals past 1e9 seconds (about 31 years: no store keeps
    a pace that long). Immutable.
    """

    limit: int
    period: float = 1.0
    burst: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise ValueError(f"Rate.limit must be an int >= 1, not {shown_number(self.limit)}")
        if isinstance(self.period, bool) or not isinstance(self.period, (int, float)):
            raise TypeError("Rate.period must be a number of seconds")
        if not (self.period > 0 and (isinstance(self.period, int) or math.isfinite(self.period))):
            raise ValueError(
                f"Rate.period must be a finite number > 0, not {shown_number(self.period)}"
            )
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ValueError(f"Rate.burst must be an int >= 1, not {shown_number(self.burst)}")
        # The limiters pace by the interval and allow (burst - 1) intervals
        # ahead: both must be numbers a clock can hold (an interval below
        # its step would be no limit), and a store can keep (a bucket
        # reaches burst intervals ahead: Redis takes key lifetimes below 1e14 s).
        try:
            interval = self.period / self.limit
            reach = self.burst * interval
            # (each a float too: the limiters divide floats by them)
            float(self.limit), float(self.period)
        except OverflowError:
            interval = reach = math.nan
        if not (interval >= MIN_INTERVAL and reach <= MAX_REACH):
            raise ValueError(
                f"Rate(limit={shown_number(self.limit)}, period={shown_number(self.period)}, "
                f"burst={shown_number(self.burst)}) is out of range: period / limit must be at "
                f"least {MIN_INTERVAL:g} seconds (a million sends a second), burst * period / "
                f"limit at most {MAX_REACH:g} seconds, and limit and period numbers a float holds"
            )

    @property
    def interval(self) -> float:
        """Seconds between two evenly spaced sends."""
        return self.period / self.limit

    @property
    def window_max(self) -> int:
        """The most sends any window of ``period`` seconds may hold: ``limit + burst - 1``."""
        return self.limit + self.burst - 1

    def scaled(self, share: float) -> Rate:
        """This rate times ``share`` (0 < share <= 1): the period stretched, the burst cut.

        ``ValueError`` only if one interval of the stretched period is past the
        reach bound (a share too small for this rate). Pure.
        """
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], not {share!r}")
        period = self.period / share
        burst = max(1, math.floor(self.burst * share))
        # Exactly, the scaled reach is never past this rate's; rounded, a rate at
        # the bound can come out an ulp past it: a burst one shorter then (a
        # couple of steps at most: an interval outweighs a few ulps of the reach).
        interval = period / self.limit
        if not math.isfinite(period):
            raise ValueError(
                f"share {share!r} is too small for {self!r}: the stretched period is not finite"
            )
        if burst * interval > MAX_REACH:
            # (The division first: counting down from a huge burst took minutes.)
            burst = max(1, min(burst, math.floor(MAX_REACH / interval)))
            while burst > 1 and burst * interval > MAX_REACH:
                burst -= 1
        return Rate(self.limit, period, burst)


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Which limits apply; each is optional (``None``: no such limit). Immutable.

    - ``overall``: every send of the bot, whatever the chat.
    - ``per_chat``: sends to any one chat.
    - ``per_group``: sends to any one group (a negative int chat id), on
      top of ``per_chat``.
    """

    overall: Rate | None = None
    per_chat: Rate | None = None
    per_group: Rate | None = None

    def __post_init__(self) -> None:
        for name in ("overall", "per_chat", "per_group"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Rate):
                raise TypeError(f"RateLimits.{name} must be a Rate or None")

    def scaled(self, share: float) -> RateLimits:
        """Every limit times ``share``: what one of ``1 / share`` processes may spend."""
        return RateLimits(
            *(
                None if r is None else r.scaled(share)
                for r in (self.overall, self.per_chat, self.per_group)
            )
        )


#: Telegram's published bot limits (Bot FAQ, "My bot is hitting limits"):
#: "no more than 30 messages per second or so" to many users; "avoid
#: sending more than one message per second" inside one chat; "not more
#: than 20 messages per minute to the same group". The group limit is a
#: count per minute, so a burst is allowed only at the cost of the
#: sustained rate: ``Rate(16, 60.0, burst=5)`` lets 5 replies go at the
#: per-chat pace after a quiet spell, then one every 3.75 s, and no minute
#: ever holds more than 16 + 5 - 1 = 20.
TELEGRAM: Final = RateLimits(overall=Rate(30), per_chat=Rate(1), per_group=Rate(16, 60.0, burst=5))

#: Slack's ``chat.postMessage`` limit: about 1 message per second per
#: channel ("short bursts >1 allowed" but not promised). Slack also keeps a
#: workspace-wide posting limit it does not publish: its 429s are
#: recognised as bot-wide when several channels get them at once.
SLACK: Final = RateLimits(per_chat=Rate(1))


def is_group(chat_id: Hashable) -> bool:
    """True for a group chat: a negative int id (Telegram's convention)."""
    return isinstance(chat_id, int) and not isinstance(chat_id, bool) and chat_id < 0
