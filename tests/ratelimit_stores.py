"""Helpers for the rate-limiter tests: a fake clock, and one limiter factory per store.

Every factory builds a limiter on its own keys (Redis) or its own table
(PostgreSQL) and removes them afterwards, so tests share the servers with
other work safely.
"""

from __future__ import annotations

import os
import queue
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

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
        conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_recent")
        for fn in ("decide", "record", "handover", "ban", "put", "after"):
            conn.execute(f"DROP FUNCTION IF EXISTS {table}_{fn}")


@contextmanager
def limiter_on(store: str, limits: RateLimits, **options: Any) -> Iterator[BaseRateLimiter]:
    """A limiter of kind ``store`` (skipped when its server is not configured).

    A shared limiter gets 30 s per call unless the test sets ``timeout``: on
    a loaded machine a call (or a thread's wait for the PostgreSQL limiter's
    one connection) may take longer than the default, and the limiter would
    fall back to its local share, which these tests do not test.
    """
    if store == "local":
        yield RateLimiter(limits, **options)
        return
    options = {"timeout": 30.0, **options}
    if store == "redis":
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


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        pause.wait(0.002)  # polling a condition, bounded by the deadline
    return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(name="private_redis")
def private_redis_fixture(
    tmp_path: Path,
) -> Iterator[tuple[int, Callable[[], subprocess.Popen[bytes]]]]:
    """``private_redis``: a Redis server of this test's own on a free port, and
    start(), to call (again) at will. Import it into a test module to use it."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed: cannot run a private Redis")
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(tmp_path)]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        if not wait_until(lambda: _accepts(port)):
            raise RuntimeError("the private redis-server did not start")
        return proc

    yield port, start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(10)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


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


class StoreProxy:
    """A TCP proxy on loopback in front of a real store, which a test takes down and back.

    ``down()`` drops every connection with a reset and refuses new ones (a
    server that died); ``stall()`` keeps connections open and accepts new
    ones, but holds what clients send and answers nothing (a server that
    stopped answering: a SIGSTOP, a hung host); ``held`` counts the bytes
    held so far; ``up()`` serves again on the same port and passes on what
    was held; ``slow(seconds)`` passes every answer of the server on that
    late (a server that answers, slowly; ``slow(0)`` ends it);
    ``trickle(seconds)`` passes them on a byte at a time, each that long
    after the one before. Each change is made by the proxy's thread and done
    when the call returns.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._commands: queue.Queue[tuple[str, threading.Event]] = queue.Queue()
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._clients: set[socket.socket] = set()
        self._holding: dict[socket.socket, bytearray] = {}
        self.held = 0
        self._listener: socket.socket | None = None
        self._stalled = False
        self._delay = 0.0
        self._trickle = 0.0
        # Answers passed on late (slow()): (when, client socket, bytes), in order.
        self._late: list[tuple[float, socket.socket, bytes]] = []
        self._closed = False
        self.port = 0
        self._listen()
        self._thread = threading.Thread(target=self._serve, name="store-proxy", daemon=True)
        self._thread.start()

    def __enter__(self) -> StoreProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def down(self) -> None:
        self._command("down")

    def stall(self) -> None:
        self._command("stall")

    def up(self) -> None:
        self._command("up")

    def slow(self, seconds: float) -> None:
        self._command(f"slow {seconds!r}")

    def trickle(self, seconds: float) -> None:
        self._command(f"trickle {seconds!r}")

    def close(self) -> None:
        if not self._closed:
            self._command("close")
            self._thread.join(10)
            self._closed = True

    def _command(self, name: str) -> None:
        done = threading.Event()
        self._commands.put((name, done))
        self._wake_w.send(b"x")
        assert done.wait(10), f"the proxy did not {name}"

    # The proxy's thread only, from here on.

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "listen")

    def _drop_all(self) -> None:
        if self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
        for sock in list(self._pairs):
            self._selector.unregister(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        self._pairs.clear()
        self._clients.clear()
        self._holding.clear()

    def _answer(self, client: socket.socket, chunk: bytes) -> None:
        """Pass on, now or late (slow, trickle), in order after the late ones."""
        if not (self._delay or self._trickle or self._late):
            client.sendall(chunk)
            return
        after = self._late[-1][0] if self._late else 0.0
        if self._trickle:
            start = max(time.monotonic(), after)
            for i in range(len(chunk)):
                self._late.append((start + (i + 1) * self._trickle, client, chunk[i : i + 1]))
        else:
            self._late.append((max(time.monotonic() + self._delay, after), client, chunk))

    def _pass_late(self) -> float | None:
        """Pass on the late answers that are due; seconds until the next, or None."""
        now = time.monotonic()
        while self._late and self._late[0][0] <= now:
            _, client, chunk = self._late.pop(0)
            if client in self._pairs:
                client.sendall(chunk)
        return max(0.0, self._late[0][0] - now) if self._late else None

    def _serve(self) -> None:
        while True:
            for key, _ in self._selector.select(self._pass_late()):
                if key.data == "wake":
                    self._wake_r.recv(64)
                    while not self._commands.empty():
                        name, done = self._commands.get()
                        if name in ("down", "close"):
                            self._drop_all()
                            self._stalled = False
                        elif name == "stall":
                            self._stalled = True
                        elif name.startswith("slow "):
                            self._delay = float(name.split()[1])
                        elif name.startswith("trickle "):
                            self._trickle = float(name.split()[1])
                        elif name == "up":
                            self._stalled = False
                            for sock, data in self._holding.items():
                                if sock in self._pairs:
                                    self._pairs[sock].sendall(data)
                            self._holding.clear()
                            if self._listener is None:
                                self._listen()
                        done.set()
                        if name == "close":
                            self._selector.close()
                            self._wake_r.close()
                            self._wake_w.close()
                            return
                elif key.data == "listen" and self._listener is not None:
                    client, _ = self._listener.accept()
                    upstream = socket.create_connection(self.target, timeout=5)
                    self._pairs[client] = upstream
                    self._pairs[upstream] = client
                    self._clients.add(client)
                    for sock in (client, upstream):
                        self._selector.register(sock, selectors.EVENT_READ, "data")
                elif key.data == "data":
                    sock = cast(socket.socket, key.fileobj)
                    peer = self._pairs.get(sock)
                    if peer is None:
                        continue
                    try:
                        chunk = sock.recv(65536)
                        if chunk and self._stalled and sock in self._clients:
                            self._holding.setdefault(sock, bytearray()).extend(chunk)
                            self.held += len(chunk)
                        elif chunk and sock not in self._clients:  # the server's answer
                            self._answer(peer, chunk)
                        elif chunk:
                            peer.sendall(chunk)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        for end in (sock, peer):
                            self._selector.unregister(end)
                            self._pairs.pop(end, None)
                            self._clients.discard(end)
                            self._holding.pop(end, None)
                            end.close()
