"""A shared limiter's decision waits for its store no longer than its ``timeout``,
the lookup of the store's host name included: a resolver that stopped answering
(here a UDP socket that swallows every query, as the process's only nameserver,
in a mount namespace of its own) held each connect for the resolver's own
timeout (seconds), in the constructor and at every retry of the store."""

from __future__ import annotations

from pathlib import Path

import pytest
from ratelimit_stores import POSTGRES_URL, REDIS_URL
from silent_resolver import HOST, run_with_silent_resolver

_INNER = r"""
import logging, os, time
logging.disable(logging.CRITICAL)

import redis
from outbound.ratelimit import TELEGRAM, PostgresRateLimiter, RedisRateLimiter

TIMEOUT = 0.5
kind = sys.argv[2]
began = time.monotonic()
if kind == "redis":
    limiter = RedisRateLimiter(
        redis.Redis(host=HOST, port=6379), TELEGRAM, name="dns", timeout=TIMEOUT,
        retry_interval=0.2,
    )
else:
    conninfo = {
        "postgres": f"host={HOST} dbname=test user=postgres connect_timeout=5",
        "postgres, two hosts": f"host={HOST},b.{HOST} dbname=test user=postgres",
        "postgres, PGHOST": "dbname=test user=postgres",
        "postgres, a socket then a name": f"host=/nonexistent,{HOST} dbname=test",
        "postgres, an address then a name": (
            f"host=a.{HOST},{HOST} hostaddr=127.0.0.1, port=9,5432 dbname=test"
        ),
    }[kind]
    if kind == "postgres, PGHOST":
        os.environ["PGHOST"] = HOST
    limiter = PostgresRateLimiter(
        conninfo, TELEGRAM, name="dns", table="outbound_rl_dns", timeout=TIMEOUT,
        retry_interval=0.2,
    )
took = [time.monotonic() - began]
for _ in range(5):  # the first decision, then retries of the store marked down
    time.sleep(0.3)  # (past retry_interval: the store is tried again)
    began = time.monotonic()
    assert limiter.acquire(42) >= 0.0
    took.append(time.monotonic() - began)
assert limiter.degraded
# One lookup in flight at a time (they piled up, one a retry, until no thread
# could start).
threads = sum(1 for t in threading.enumerate() if t.name == "outbound-connect")
# (The resolver answers nothing for 3 s a lookup: a wait of 2 s past the
# timeout is only the machine's load; 0.4 s was seen passed under it.)
if max(took) >= TIMEOUT + 2.0:
    print(f"waited {took} with a timeout of {TIMEOUT}")
elif threads > 1:
    print(f"{threads} lookups in flight")
else:
    print("ok")
"""


@pytest.mark.parametrize(
    "store",
    [
        "redis",
        "postgres",
        "postgres, two hosts",
        "postgres, PGHOST",
        "postgres, a socket then a name",
        "postgres, an address then a name",
    ],
)
def test_a_decision_waits_for_a_silent_resolver_no_longer_than_the_timeout(
    store: str, tmp_path: Path
) -> None:
    if store == "redis" and not REDIS_URL:
        pytest.skip("OUTBOUND_TEST_REDIS is not set: no Redis client to test with")
    if store.startswith("postgres") and not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL client to test with")
    output = run_with_silent_resolver(f"HOST = {HOST!r}\n" + _INNER, tmp_path, store)
    assert output.strip() == "ok", output
