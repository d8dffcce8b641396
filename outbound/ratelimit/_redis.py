"""One bot's budget in Redis: :class:`RedisRateLimiter` (extra ``redis``).

Each decision is one ``EVALSHA`` of a Lua script (redis-py's
``register_script``): bans, per-chat, per-group and overall buckets are
read and updated atomically, on the Redis server's clock, so every
process and host shares one budget and one notion of time. Keys expire
with their buckets, so idle chats cost nothing. All the keys of one
limiter share one hash tag, ``{name}`` (neither ``name`` nor ``prefix``
may hold braces), so the scripts run on Redis Cluster too.

The limiter's calls go through connections of its own, made like the
given client's (same server, database, credentials, TLS), with
``timeout`` as their socket timeouts and no retries: a call that gets no
answer in time fails over to the local share at once, whatever retry
policy the client was built with.
"""

from __future__ import annotations

import inspect
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Hashable, Sequence
from typing import Any, Final

from outbound._fork import renewed_after_fork

from ._core import EARLY, Scope
from ._limits import RateLimits
from ._shared import (
    ConnectGate,
    Entry,
    SharedRateLimiter,
    StoreClosed,
    call_deadline,
    chat_text,
    check_name,
    check_timeout,
    connect_by,
    encodes,
)

__all__ = ["RedisRateLimiter"]

logger = logging.getLogger("outbound.ratelimit")

# The instant of a decision: ARGV[1], or the server's clock when it is ''.
# ``margin``: milliseconds a key outlives its value (values are compared with
# now anyway). Lifetimes run at Redis's pace, which a caller's clock (tests)
# need not keep: with one, keys live a day past their value, so that a
# clock slower than Redis's finds every value it wrote.
_NOW: Final = """
local now
local margin = 5000
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
else
  now = tonumber(ARGV[1])
  margin = 86400000
end
"""

# KEYS: global ban, chat ban, chat tat, group tat, overall tat (sends), overall
# plan (sends and bookings), the chat's booking, the epoch.
# ARGV: now ('' = server clock), has chat, has group, has overall (each
# '1'/'0'), chat interval, tolerance, group interval, tolerance, overall
# interval, tolerance, hold (seconds a booking outlives its slot), book
# ('1'/'0'), slack, early, the epoch to set if there is none.
# Returns {wait, seconds left of the bot-wide ban, of the chat's ban, the epoch}
# as strings (%.17g round-trips a double).
# Step by step the same as RateLimiter._decide_locked.
_ACQUIRE: Final = (
    _NOW
    + """
local function fmt(x) return string.format('%.17g', x) end
-- The store's epoch: a token set when missing, kept while the limiter is in use
-- (a day past its last decision). A limiter that finds another than it saw
-- before knows the store lost its state (a restart without persistence).
local epoch = redis.call('GET', KEYS[8])
if epoch then
  redis.call('PEXPIRE', KEYS[8], 86400000)
else
  epoch = ARGV[15]
  redis.call('SET', KEYS[8], epoch, 'PX', 86400000)
end
local function out(x) return {fmt(x), '0', '0', epoch} end
local function get(k)
  local v = redis.call('GET', k)
  if v then return tonumber(v) end
  return nil
end
-- A key outlives its value by ``margin`` (see _NOW).
-- base + step, never less than step later (see _after in _core.py).
local function after(base, step)
  local t = base + step
  local b = t - base
  -- (t + |t| * (2^-53 + 2^-105) is the next double up, as math.nextafter says)
  if (base - (t - b)) + (step - b) > 0 then t = t + math.abs(t) * (2^-53 + 2^-105) end
  return t
end
local function put(k, value, extra)
  local ms = math.ceil((value + (extra or 0) - now) * 1000) + margin
  redis.call('SET', k, fmt(value), 'PX', math.max(margin, ms))
end
local has_chat, has_group, has_overall = ARGV[2] == '1', ARGV[3] == '1', ARGV[4] == '1'
local ci, ct = tonumber(ARGV[5]), tonumber(ARGV[6])
local gi, gt = tonumber(ARGV[7]), tonumber(ARGV[8])
local oi, ot = tonumber(ARGV[9]), tonumber(ARGV[10])
local hold, book = tonumber(ARGV[11]), ARGV[12] == '1'
local slack, early = tonumber(ARGV[13]), tonumber(ARGV[14])
local gban = math.max((get(KEYS[1]) or now) - now, 0)
local cban = math.max((get(KEYS[2]) or now) - now, 0)
if gban > 0 or cban > 0 then return {fmt(math.max(gban, cban)), fmt(gban), fmt(cban), epoch} end
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
if wait > 0 then return out(wait) end
if has_overall then
  local booked = nil
  if book then booked = get(KEYS[7]) end
  if booked and booked + hold < now then booked = nil end
  if booked and now < booked - early then return out(booked - now) end
  if booked then redis.call('DEL', KEYS[7]) end
  local sent, plan = get(KEYS[5]), get(KEYS[6])
  local guard = (not sent) or sent - ot - slack <= now
  if (not booked) and plan and plan - ot > now then guard = false end
  if not guard then
    local avail = now
    if plan and plan - ot > avail then avail = plan - ot end
    if sent and sent - ot - slack > avail then avail = sent - ot - slack end
    if not book then return out(avail - now) end
    put(KEYS[6], after(math.max(plan or avail, avail), oi))
    put(KEYS[7], avail, hold)
    return out(avail - now)
  end
  put(KEYS[5], after(math.max(sent or now, now), oi))
  if not booked then put(KEYS[6], after(math.max(plan or now, now), oi)) end
end
if has_chat then put(KEYS[3], after(math.max(chat_tat or now, now), ci)) end
if has_group then put(KEYS[4], after(math.max(group_tat or now, now), gi)) end
return out(0)
"""
)

# Each script's first write is to the epoch key, as _ACQUIRE's is: it keeps it
# (PEXPIRE), or makes it when the store lost it (SET: a new epoch, which the
# next decision of every limiter notices). At maxmemory with noeviction Redis
# refuses a script whose first write command could take memory and lets one
# go on once it called a write command (PEXPIRE counts, even on a missing key:
# hence EXISTS first): so all three scripts work (the epoch kept), or none
# (the epoch lost), and processes that share a limit fail over together.
_TOUCH_EPOCH: Final = """
if redis.call('EXISTS', KEYS[{i}]) == 1 then
  redis.call('PEXPIRE', KEYS[{i}], 86400000)
else
  local t = redis.call('TIME')
  redis.call('SET', KEYS[{i}], 'made by a script at ' .. t[1] .. '.' .. t[2], 'PX', 86400000)
end
"""

# KEYS: the bot-wide ban, the chat's ban, the recent 429s of unknown scope (a
# sorted set: chat -> when), the epoch. ARGV: now ('' = server clock), seconds,
# scope ('chat', 'global', or '' to infer it), the chat, infer_chats,
# infer_window. Infers the scope as RateLimiter._infer does, bans, never
# shortens a ban; returns the scope applied.
_RECORD: Final = (
    _NOW
    + _TOUCH_EPOCH.format(i=4)
    + """
local function fmt(x) return string.format('%.17g', x) end
local seconds, scope = tonumber(ARGV[2]), ARGV[3]
if scope == '' then
  local window = tonumber(ARGV[6])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. fmt(now - window))
  redis.call('ZADD', KEYS[3], fmt(now), ARGV[4])
  redis.call('PEXPIRE', KEYS[3], math.ceil(window * 1000) + margin)
  if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[5]) then scope = 'global' else scope = 'chat' end
end
local key = KEYS[2]
if scope == 'global' then key = KEYS[1] end
local untl = now + seconds
local cur = redis.call('GET', key)
if not (cur and tonumber(cur) >= untl) then
  redis.call('SET', key, fmt(untl), 'PX', math.ceil(seconds * 1000) + margin)
end
return scope
"""
)

# KEYS: the epoch, then any bucket or ban keys. ARGV: now ('' = server clock),
# then for each bucket or ban key the seconds from now its value must reach.
# Each value becomes the later of the two; a key lives its value's time plus
# ``margin``, as in _ACQUIRE.
_HANDOVER: Final = (
    _NOW
    + _TOUCH_EPOCH.format(i=1)
    + """
for i = 2, #KEYS do
  local key = KEYS[i]
  local value = now + tonumber(ARGV[i])
  local cur = redis.call('GET', key)
  if not (cur and tonumber(cur) >= value) then
    local ms = math.ceil((value - now) * 1000) + margin
    redis.call('SET', key, string.format('%.17g', value), 'PX', math.max(margin, ms))
  end
end
return #KEYS - 1
"""
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _seconds(value: Any) -> float:
    seconds = float(_text(value))
    if not math.isfinite(seconds) or seconds < 0.0:  # a broken answer: be safe
        raise OSError(f"the rate-limit script answered {value!r}")
    return seconds


def _bounded(client: Any, timeout: float, redis_py: Any) -> Any | None:
    """A client for the limiter's own calls: ``client``'s server, database and
    credentials on a pool of its own, with ``timeout`` as socket and connect
    timeouts and no retries; None when ``client`` is not one this can copy
    (a cluster or Sentinel client, a custom pool)."""
    pool: Any = getattr(client, "connection_pool", None)
    if not isinstance(client, redis_py.Redis) or type(pool) not in (
        redis_py.ConnectionPool,
        redis_py.BlockingConnectionPool,
    ):
        return None
    from redis.backoff import NoBackoff  # noqa: PLC0415  (an optional dependency)
    from redis.retry import Retry  # noqa: PLC0415

    options = dict(pool.connection_kwargs)
    options.update(
        socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )
    own = redis_py.ConnectionPool(
        connection_class=_within_the_decision(pool.connection_class, timeout, redis_py),
        **options,
    )
    return redis_py.Redis(connection_pool=own)


def _within_the_decision(base: type[Any], timeout: float, redis_py: Any) -> type[Any]:
    """``base`` (a redis-py connection class) whose every wait for the server ends by
    the running decision's deadline (see ``call_deadline``; ``timeout`` from each
    wait outside a decision): its connect (TLS handshake included), and each send
    and each read of its socket (see :class:`_DeadlineSocket`), whatever redis-py
    sends on its own (a health check's PING, the handshake's commands, a script
    loaded again). A decision that needs several round trips, or an answer that
    comes a byte at a time, waits ``timeout`` in all."""

    gate = ConnectGate()  # (the limiter's: its connections share it)

    class WithinTheDecision(base):  # type: ignore[misc]
        def _connect(self) -> Any:
            deadline = call_deadline(timeout)
            left = deadline - time.monotonic()
            if left <= 0.0:
                raise TimeoutError("the decision's time for Redis is up")
            self.socket_connect_timeout = self.socket_timeout = left
            try:
                # In a thread of its own: the host name's lookup has no timeout.
                sock = connect_by(super()._connect, deadline, _close_socket, gate)
            finally:
                self.socket_connect_timeout = self.socket_timeout = timeout
            sock.settimeout(timeout)
            return _DeadlineSocket(sock, timeout)

    WithinTheDecision.__name__ = WithinTheDecision.__qualname__ = (
        f"{base.__name__}WithinTheDecision"
    )
    return WithinTheDecision


def _close_socket(sock: Any) -> None:
    """Close a socket a connect made once nobody waited for it any more."""
    sock.close()


class _DeadlineSocket:
    """A connected socket (plain or TLS) whose every send and read waits no longer
    than what is left of the running decision (or ``bound`` outside one): the
    timeout is set before each call, not once per command, so an answer that
    trickles in cannot hold a decision past its deadline. A timeout redis-py asks
    for itself (0 for a poll) is kept, cut to what is left. Used by one thread at
    a time, as redis-py uses a connection."""

    __slots__ = ("_bound", "_requested", "_sock")

    def __init__(self, sock: socket.socket, bound: float) -> None:
        self._sock = sock
        self._bound = bound
        self._requested: float | None = sock.gettimeout()

    def settimeout(self, value: float | None) -> None:
        self._requested = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._requested

    def _arm(self) -> None:
        if self._requested == 0:
            return  # a poll: it does not wait
        left = call_deadline(self._bound) - time.monotonic()
        if left <= 0.0:
            raise TimeoutError("the decision's time for Redis is up")
        self._sock.settimeout(left if self._requested is None else min(self._requested, left))

    def recv(self, *args: Any) -> bytes:
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> int:
        self._arm()
        return self._sock.recv_into(*args)

    def send(self, *args: Any) -> int:
        self._arm()
        return self._sock.send(*args)

    def sendall(self, *args: Any) -> None:
        self._arm()
        self._sock.sendall(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class RedisRateLimiter(SharedRateLimiter):
    """A :class:`~outbound.ratelimit.RateLimiter` whose state lives in Redis.

    ``redis`` is a synchronous redis-py client (``redis.Redis``, or a
    cluster client). ``limits`` are the bot's limits, shared by every
    process that uses the same ``name`` (one per bot token) and ``prefix``
    (neither may hold ``{`` or ``}``: the keys' hash tag is ``{name}``).
    ``timeout``: seconds one call may wait for Redis before this process
    falls back to its local share (default 0.5). The keyword options are
    those of :class:`~outbound.ratelimit.SharedRateLimiter` (``clock``,
    ``fallback_share``, ``retry_interval``) and of
    :class:`~outbound.ratelimit.RateLimiter` (``slack``, ``stale_after``,
    ``infer_chats``, ``infer_window``).

    The calls run on connections of the limiter's own, made like the
    client's (same address, database, credentials and TLS) with ``timeout``
    as socket timeouts and no retries, so none waits past ``timeout``
    whatever retry policy the client has. A cluster or Sentinel client is
    used as it is: build it with ``socket_timeout`` and
    ``socket_connect_timeout`` and ``retry=Retry(NoBackoff(), 0)``.

    One round trip per :meth:`acquire` and per :meth:`record_429` (none for
    a chat under a ban this process knows of); when Redis is unreachable,
    decides locally at ``fallback_share`` of every limit and logs an error
    (``outbound.ratelimit``); after :meth:`close`, it decides locally for good,
    as :class:`~outbound.ratelimit.PostgresRateLimiter` does. Thread-safe.
    """

    _store_name = "Redis server"

    def __init__(
        self,
        redis: Any,
        limits: RateLimits,
        *,
        name: str = "default",
        prefix: str = "outbound:ratelimit",
        timeout: float = 0.5,
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
        if inspect.iscoroutinefunction(getattr(redis, "execute_command", None)):
            # (Its scripts return coroutines: every call would fail, as an outage.)
            raise TypeError(
                "redis must be a synchronous redis-py client (redis.Redis or "
                f"redis.RedisCluster), not an asyncio one: {redis!r}"
            )
        if not isinstance(name, str) or not name or "{" in name or "}" in name:
            raise ValueError(f"name must be a non-empty str without braces, not {name!r}")
        if not encodes(name):
            raise ValueError(f"name must encode as UTF-8 (a key of Redis), not {name!r}")
        check_name(name)
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix or not encodes(prefix):
            raise ValueError(
                f"prefix must be a str without braces (the keys' Redis Cluster hash tag is "
                f"{{name}}) that encodes as UTF-8, not {prefix!r}"
            )
        seconds = check_timeout(timeout)
        super().__init__(limits, **options)
        self._store_errors = (redis_py.exceptions.RedisError, OSError)
        own = _bounded(redis, seconds, redis_py)
        if own is None:
            logger.info(
                "outbound: RedisRateLimiter uses %s as given: its own timeouts and retries "
                "bound each call",
                type(redis).__name__,
            )
        self._own: Final = own
        self._redis: Final = redis if own is None else own
        self._timeout: Final = seconds
        self._base: Final = f"{prefix}:{{{name}}}:"
        # Guards _epoch: the store's epoch this limiter saw last (None: none yet).
        self._epoch_lock: Final = renewed_after_fork(threading.Lock())
        self._epoch: str | None = None
        self._acquire_script: Final = self._redis.register_script(_ACQUIRE)
        self._record_script: Final = self._redis.register_script(_RECORD)
        self._handover_script: Final = self._redis.register_script(_HANDOVER)
        # Set once by close(): every later call raises StoreClosed (decided locally).
        self._closed = False
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

    @property
    def timeout(self) -> float:
        """Seconds one call may wait for Redis."""
        return self._timeout

    def _key(self, kind: str, chat_id: Hashable) -> str:
        return f"{self._base}{kind}:{chat_text(chat_id)}"

    def _entry_key(self, kind: str, chat_id: Hashable) -> str:
        if kind == "global_ban":
            return self._base + "ban"
        if kind in ("overall", "plan"):
            return self._base + kind
        return self._key(kind, chat_id)

    def _store_decide(
        self, now: float | None, chat_id: Hashable, group: bool, book: bool
    ) -> tuple[float, float, float]:
        keys = [
            self._base + "ban",
            self._key("ban", chat_id),
            self._key("chat", chat_id),
            self._key("group", chat_id),
            self._base + "overall",
            self._base + "plan",
            self._key("book", chat_id),
            self._base + "epoch",
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
            uuid.uuid4().hex,
        ]
        answer = self._call(self._acquire_script, keys, args)
        if not isinstance(answer, list) or len(answer) != 4:
            raise OSError(f"the rate-limit script answered {answer!r}")
        wait, global_ban, chat_ban = (_seconds(value) for value in answer[:3])
        epoch = _text(answer[3])
        with self._epoch_lock:
            seen, self._epoch = self._epoch, epoch
        if seen is not None and seen != epoch:
            self._store_reset()
        return wait, global_ban, chat_ban

    def _store_record(
        self, now: float | None, chat_id: Hashable, seconds: float, scope: Scope | None
    ) -> Scope:
        keys = [
            self._base + "ban",
            self._key("ban", chat_id),
            self._base + "recent429",
            self._base + "epoch",
        ]
        args = [
            "" if now is None else repr(now),
            repr(seconds),
            scope or "",
            chat_text(chat_id),
            str(self._infer_chats),
            repr(self._infer_window),
        ]
        applied = _text(self._call(self._record_script, keys, args))
        if applied not in ("chat", "global"):
            raise OSError(f"the rate-limit script answered {applied!r}")
        return "global" if applied == "global" else "chat"

    def _store_handover(self, now: float | None, entries: Sequence[Entry]) -> None:
        keys = [self._base + "epoch", *(self._entry_key(kind, chat) for kind, chat, _ in entries)]
        args = ["" if now is None else repr(now), *(repr(left) for _, _, left in entries)]
        self._call(self._handover_script, keys, args)

    def _call(self, script: Any, keys: list[str], args: list[str]) -> Any:
        """Run one script; ``StoreClosed`` once the limiter is closed."""
        self._check_open()
        try:
            return script(keys=keys, args=args)
        except Exception as exc:
            # close() cut its connection: not an outage. Any error then (the
            # client, its socket gone between its send and its read, raised
            # AttributeError), not only a store's.
            if self._closed:
                raise StoreClosed("this RedisRateLimiter is closed") from exc
            raise
        finally:
            if self._closed and self._own is not None:
                # close() ran during the call, which may have opened a connection
                # after close() disconnected the pool: closed here, not left open.
                self._own.connection_pool.disconnect()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this RedisRateLimiter is closed")

    def close(self) -> None:
        """Close the connections this limiter opened (not the client's); later
        decisions use the local share, as after an outage (logged once), and never
        reach Redis again. Idempotent; never waits for Redis. A call in progress
        closes its connection when it returns."""
        self._closed = True  # (first: a call that checks it after this disconnects)
        if self._own is not None:
            self._own.connection_pool.disconnect()

    def __repr__(self) -> str:
        state = "fallback" if self.degraded else "shared"
        return f"<RedisRateLimiter {self._base!r} {self._limits!r} {state}>"
