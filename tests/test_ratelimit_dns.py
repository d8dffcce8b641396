"""A shared limiter's decision waits for its store no longer than its ``timeout``,
the lookup of the store's host name included: a resolver that stopped answering
(here a UDP socket that swallows every query, as the process's only nameserver,
in a mount namespace of its own) held each connect for the resolver's own
timeout (seconds), in the constructor and at every retry of the store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ratelimit_stores import POSTGRES_URL, REDIS_URL

_INNER = r"""
import logging, socket, sys, threading, time
logging.disable(logging.CRITICAL)

def swallow():  # a nameserver that never answers
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.2", 53))
    ready.set()
    while True:
        s.recvfrom(4096)

ready = threading.Event()
threading.Thread(target=swallow, daemon=True).start()
assert ready.wait(10)
import redis
from outbound.ratelimit import TELEGRAM, PostgresRateLimiter, RedisRateLimiter

HOST = "ratelimit-store.invalid-for-tests.example"
TIMEOUT = 0.5
kind = sys.argv[1]
began = time.monotonic()
if kind == "redis":
    limiter = RedisRateLimiter(
        redis.Redis(host=HOST, port=6379), TELEGRAM, name="dns", timeout=TIMEOUT,
        retry_interval=0.2,
    )
else:
    limiter = PostgresRateLimiter(
        f"host={HOST} dbname=test user=postgres connect_timeout=5", TELEGRAM,
        name="dns", table="outbound_rl_dns", timeout=TIMEOUT, retry_interval=0.2,
    )
took = [time.monotonic() - began]
for _ in range(2):  # the first decision, then a retry of the store marked down
    time.sleep(0.3)  # (past retry_interval: the store is tried again)
    began = time.monotonic()
    assert limiter.acquire(42) >= 0.0
    took.append(time.monotonic() - began)
assert limiter.degraded
print("ok" if max(took) < TIMEOUT + 0.4 else f"waited {took} with a timeout of {TIMEOUT}")
"""


@pytest.mark.parametrize("store", ["redis", "postgres"])
def test_a_decision_waits_for_a_silent_resolver_no_longer_than_the_timeout(
    store: str, tmp_path: Path
) -> None:
    if store == "redis" and not REDIS_URL:
        pytest.skip("OUTBOUND_TEST_REDIS is not set: no Redis client to test with")
    if store == "postgres" and not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL client to test with")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare: a mount namespace with a resolver of its own")
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.2\noptions timeout:3 attempts:1\n")
    script = tmp_path / "inner.py"
    script.write_text(_INNER)
    shell = f'mount --bind {conf} /etc/resolv.conf && exec "$0" "$@"'
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell, sys.executable, str(script), store],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok", done.stdout + done.stderr
