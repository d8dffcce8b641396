"""One bot's budget in Redis: :class:`RedisRateLimiter` (extra ``redis``).

Each decision is one ``EVALSHA`` of a Lua script (redis-py's
``register_script``): bans, per-chat, per-group and overall buckets are
read and updated atomically, on the Redis server's clock, so every
process and host shares one budget and one notion of time. Keys expire
with their buckets, so idle chats cost nothing. All the keys of one
limiter share a hash tag (``{name}``): the script runs on Redis Cluster too.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, Final

from ._core import EARLY
from ._limits import RateLimits
from ._shared import SharedRateLimiter

__all__ = ["RedisRateLimiter"]

# The instant of a decision: ARGV[1], or the server's clock when it is ''.
_NOW: Final = """
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
else
  now = tonumber(ARGV[1])
end
"""

# KEYS: global ban, chat ban, chat tat, group tat, overall tat (sends), overall
# plan (sends and bookings), the chat's booking.
# ARGV: now ('' = server clock), has chat, has group, has overall (each
# '1'/'0'), chat interval, tolerance, group interval, tolerance, overall
# interval, tolerance, hold (seconds a booking outlives its slot), book
# ('1'/'0'), slack, early.
# Returns the wait as a string (%.17g round-trips a double).
# Step by step the same as RateLimiter._decide_locked.
_ACQUIRE: Final = (
    _NOW
    + """
local function fmt(x) return string.format('%.17g', x) end
local function get(k)
  local v = redis.call('GET', k)
  if v then return tonumber(v) end
  return nil
end
-- A key outlives its value by a margin: values are compared with now anyway,
-- and a clock given by the caller (tests) need not run at Redis's pace.
local function put(k, value, extra)
  local ms = math.ceil((value + (extra or 0) - now) * 1000) + 5000
  redis.call('SET', k, fmt(value), 'PX', math.max(5000, ms))
end
local has_chat, has_group, has_overall = ARGV[2] == '1', ARGV[3] == '1', ARGV[4] == '1'
local ci, ct = tonumber(ARGV[5]), tonumber(ARGV[6])
local gi, gt = tonumber(ARGV[7]), tonumber(ARGV[8])
local oi, ot = tonumber(ARGV[9]), tonumber(ARGV[10])
local hold, book = tonumber(ARGV[11]), ARGV[12] == '1'
local slack, early = tonumber(ARGV[13]), tonumber(ARGV[14])
local ban = math.max(get(KEYS[1]) or now, get(KEYS[2]) or now)
if ban > now then return fmt(ban - now) end
local wait = 0
local chat_tat, group_tat = nil, nil
if has_chat then
  chat_tat = get(KEYS[3])
  if chat_tat and chat_tat - ct - now > wait then wait = chat_tat - ct - now end
end
if has_group then
  group_tat = get(KEYS[4])
  if group_tat and group_tat - gt - now > wait then wait = group_tat - gt - now end
end
if wait > 0 then return fmt(wait) end
if has_overall then
  local booked = nil
  if book then booked = get(KEYS[7]) end
  if booked and booked + hold < now then booked = nil end
  if booked and now < booked - early then return fmt(booked - now) end
  if booked then redis.call('DEL', KEYS[7]) end
  local sent, plan = get(KEYS[5]), get(KEYS[6])
  local guard = (not sent) or sent - ot - slack <= now
  if (not booked) and plan and plan - ot > now then guard = false end
  if not guard then
    local avail = now
    if plan and plan - ot > avail then avail = plan - ot end
    if sent and sent - ot - slack > avail then avail = sent - ot - slack end
    if not book then return fmt(avail - now) end
    put(KEYS[6], math.max(plan or avail, avail) + oi)
    put(KEYS[7], avail, hold)
    return fmt(avail - now)
  end
  put(KEYS[5], math.max(sent or now, now) + oi)
  if not booked then put(KEYS[6], math.max(plan or now, now) + oi) end
end
if has_chat then put(KEYS[3], math.max(chat_tat or now, now) + ci) end
if has_group then put(KEYS[4], math.max(group_tat or now, now) + gi) end
return '0'
"""
)

# KEYS: the ban. ARGV: now ('' = server clock), seconds. Never shortens a ban.
_BAN: Final = (
    _NOW
    + """
local seconds = tonumber(ARGV[2])
local untl = now + seconds
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) >= untl then return cur end
local text = string.format('%.17g', untl)
redis.call('SET', KEYS[1], text, 'PX', math.ceil(seconds * 1000) + 5000)
return text
"""
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisRateLimiter(SharedRateLimiter):
    """A :class:`~outbound.ratelimit.RateLimiter` whose state lives in Redis.

    ``redis`` is a synchronous redis-py client (``redis.Redis``, or a
    cluster client), shared by every thread; give it a ``socket_timeout``
    (say 0.5 s) so that a stalled server fails over to the fallback instead
    of holding a sending thread. ``limits`` are the bot's limits, shared by
    every process that uses the same ``name`` (one per bot token) and
    ``prefix``. The keyword options are those of
    :class:`~outbound.ratelimit.SharedRateLimiter` (``clock``,
    ``fallback_share``, ``retry_interval``) and of
    :class:`~outbound.ratelimit.RateLimiter` (``slack``, ``stale_after``,
    ``infer_chats``, ``infer_window``).

    One round trip per :meth:`acquire` and per :meth:`record_429`; when
    Redis is unreachable, decides locally at ``fallback_share`` of every
    limit and logs an error (``outbound.ratelimit``). Thread-safe.
    """

    _store_name = "Redis server"

    def __init__(
        self,
        redis: Any,
        limits: RateLimits,
        *,
        name: str = "default",
        prefix: str = "outbound:ratelimit",
        **options: Any,
    ) -> None:
        try:
            import redis as redis_py  # noqa: PLC0415  (an optional dependency)
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "RedisRateLimiter needs redis-py: pip install 'outbound-dispatcher[redis]'"
            ) from exc
        if not callable(getattr(redis, "register_script", None)):
            raise TypeError(f"redis must be a redis-py client (redis.Redis), not {redis!r}")
        if not isinstance(name, str) or not name or "{" in name or "}" in name:
            raise ValueError(f"name must be a non-empty str without braces, not {name!r}")
        super().__init__(limits, **options)
        self._store_errors = (redis_py.exceptions.RedisError, OSError)
        self._redis: Final = redis
        self._base: Final = f"{prefix}:{{{name}}}:"
        self._acquire_script: Final = redis.register_script(_ACQUIRE)
        self._ban_script: Final = redis.register_script(_BAN)
        self._params: Final = [
            "1" if self._chat is not None else "0",
            "1" if self._group is not None else "0",
            "1" if self._overall is not None else "0",
            *(
                repr(value)
                for g in (self._chat, self._group, self._overall)
                for value in ((0.0, 0.0) if g is None else (g.interval, g.tolerance))
            ),
        ]

    @property
    def key_prefix(self) -> str:
        """The prefix of every key this limiter writes."""
        return self._base

    def _chat_key(self, kind: str, chat_id: Hashable) -> str:
        return f"{self._base}{kind}:{chat_id!r}"

    def _store_decide(self, now: float | None, chat_id: Hashable, group: bool, book: bool) -> float:
        keys = [
            self._base + "ban",
            self._chat_key("ban", chat_id),
            self._chat_key("chat", chat_id),
            self._chat_key("group", chat_id),
            self._base + "overall",
            self._base + "plan",
            self._chat_key("book", chat_id),
        ]
        params = list(self._params)
        params[1] = "1" if group and self._group is not None else "0"
        args = [
            "" if now is None else repr(now),
            *params,
            repr(self._hold),
            "1" if book else "0",
            repr(self._slack),
            repr(EARLY),
        ]
        answer = self._acquire_script(keys=keys, args=args)
        seconds = float(_text(answer))
        if not math.isfinite(seconds) or seconds < 0.0:  # a broken answer: be safe
            raise OSError(f"the rate-limit script answered {answer!r}")
        return seconds

    def _store_ban(self, now: float | None, chat_id: Hashable | None, seconds: float) -> None:
        key = self._base + "ban" if chat_id is None else self._chat_key("ban", chat_id)
        self._ban_script(keys=[key], args=["" if now is None else repr(now), repr(seconds)])

    def __repr__(self) -> str:
        state = "fallback" if self.degraded else "shared"
        return f"<RedisRateLimiter {self._base!r} {self._limits!r} {state}>"
