"""Helpers for the rate-limiter tests: a fake clock, and one limiter factory per store.

Every factory builds a limiter on its own keys (Redis) or its own table
(PostgreSQL) and removes them afterwards, so tests share the servers with
other work safely.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from outbound.ratelimit import (
    BaseRateLimiter,
    PostgresRateLimiter,
    RateLimiter,
    RateLimits,
    RedisRateLimiter,
)

REDIS_URL = os.environ.get("OUTBOUND_TEST_REDIS")
POSTGRES_URL = os.environ.get("OUTBOUND_TEST_POSTGRES")
STORES = ("local", "redis", "postgres")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def redis_client(url: str | None = None, **options: Any) -> Any:
    import redis  # noqa: PLC0415

    return redis.Redis.from_url(url or REDIS_URL or "", socket_timeout=2.0, **options)


def drop_redis_keys(client: Any, prefix: str) -> None:
    for key in client.scan_iter(match=prefix + "*", count=1000):
        client.delete(key)


def drop_postgres_table(url: str, table: str) -> None:
    import psycopg  # noqa: PLC0415

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        for fn in ("acquire", "ban", "put"):
            conn.execute(f"DROP FUNCTION IF EXISTS {table}_{fn}")


@contextmanager
def limiter_on(store: str, limits: RateLimits, **options: Any) -> Iterator[BaseRateLimiter]:
    """A limiter of kind ``store`` (skipped when its server is not configured)."""
    if store == "local":
        yield RateLimiter(limits, **options)
    elif store == "redis":
        if not REDIS_URL:
            pytest.skip("OUTBOUND_TEST_REDIS is not set: no Redis server to test against")
        client = redis_client()
        prefix = f"outbound-test:{uuid.uuid4().hex}"
        limiter: RedisRateLimiter | PostgresRateLimiter = RedisRateLimiter(
            client, limits, prefix=prefix, **options
        )
        try:
            yield limiter
        finally:
            limiter.close()
            drop_redis_keys(client, prefix)
            client.close()
    elif store == "postgres":
        if not POSTGRES_URL:
            pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
        table = f"outbound_rl_{uuid.uuid4().hex[:12]}"
        limiter = PostgresRateLimiter(POSTGRES_URL, limits, table=table, **options)
        try:
            yield limiter
        finally:
            limiter.close()
            drop_postgres_table(POSTGRES_URL, table)
    else:  # pragma: no cover
        raise ValueError(store)


LimiterFactory = Callable[..., Any]


def max_in_window(times: list[float], period: float) -> int:
    """The most of ``times`` in any half-open window ``[t, t + period)`` (to within 1 µs)."""
    times = sorted(times)
    best = 0
    j = 0
    for i, start in enumerate(times):
        while j < len(times) and times[j] < start + period - 1e-6:
            j += 1
        best = max(best, j - i)
    return best
