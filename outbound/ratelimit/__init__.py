"""Client-side send limits: one budget per bot, honoured in one process or in many.

A limiter paces sends so that the platform rarely has to say "429":
messages per second overall, per chat, and per group (a chat whose id is
a negative int, as on Telegram), each optional (:class:`RateLimits` of
:class:`Rate`). It never sleeps: it answers "go" or "wait this long", and
the :func:`~outbound.middleware.rate_limit` middleware turns a wait into a
:class:`~outbound.Defer`, so that the lane is parked and no thread or
permit is held while it waits. When the platform answers 429 anyway, the
middleware records it in the limiter (:meth:`BaseRateLimiter.record_429`):
the chat, or the whole bot, waits out the platform's ``retry_after`` for
every later message, whatever became of the one that got the 429.

Three limiters answer alike (the same algorithm, described in
:mod:`outbound.ratelimit._core`, and one contract test suite):

- :class:`RateLimiter`: state in this process.
- :class:`RedisRateLimiter`: state in Redis (one Lua call per decision),
  for every process and host of one bot (extra ``redis``).
- :class:`PostgresRateLimiter`: state in PostgreSQL (one function call per
  decision), for deployments whose only shared service is the outbox
  database (extra ``postgres``).

The shared ones fail safe: no decision waits for the store longer than
their ``timeout``; with the store unreachable they decide locally at
``fallback_share`` of every limit, starting as if every chat had just
used its budget, log an error, and hand their local pace and bans to the
store when it answers again; they never send unlimited. Bans are kept in
the process too and honoured first (see :mod:`outbound.ratelimit._shared`).

What the platforms say (checked against their documentation):

- Telegram (Bot FAQ): about 30 messages per second overall, one per second
  per chat ("short bursts" may pass but are not promised), 20 per minute
  per group. A 429 is HTTP 429 with ``{"ok": false, "error_code": 429,
  "description": "Too Many Requests: retry after N", "parameters":
  {"retry_after": N}}``, ``N`` whole seconds; nothing says whose limit it
  was.
- Slack: ``chat.postMessage`` about one message per second per channel,
  plus a workspace-wide limit it does not publish; other methods have
  per-method tiers per workspace (20+, 50+, 100+ per minute). A 429 is HTTP
  429 with a ``Retry-After: N`` header (whole seconds) and ``{"ok": false,
  "error": "ratelimited"}``; again no scope.

So the scope of a real 429 is inferred: 429s for two chats within a
second mean the bot's limit, one alone the chat's
(:class:`RateLimiter`'s ``infer_chats`` and ``infer_window``).
"""

from __future__ import annotations

from ._core import BaseRateLimiter, RateLimiter, RateLimiterStats
from ._limits import SLACK, TELEGRAM, Rate, RateLimits, is_group
from ._postgres import PostgresRateLimiter
from ._redis import RedisRateLimiter
from ._shared import SharedRateLimiter

__all__ = [
    "SLACK",
    "TELEGRAM",
    "BaseRateLimiter",
    "PostgresRateLimiter",
    "Rate",
    "RateLimiter",
    "RateLimiterStats",
    "RateLimits",
    "RedisRateLimiter",
    "SharedRateLimiter",
    "is_group",
]
