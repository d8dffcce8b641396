"""PostgreSQL connections that stop answering without being reset (H1).

A small TCP proxy on loopback stands between the store and the server;
``freeze()`` stops forwarding on every connection open at that moment while
keeping its sockets open (a frozen proxy, lost NAT state, a paused VM). New
connections still work. Every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outbound.errors import StoreError
from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, RelayState
from outbound.outbox.postgres import _PostgresSession
from outbound.outbox.web import StatusMonitor, StatusServer

from .conftest import POSTGRES_URL, wait_for

pytestmark = pytest.mark.skipif(
    not POSTGRES_URL, reason="OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test"
)


class FreezingProxy:
    """Forwards 127.0.0.1:port to the PostgreSQL server; can freeze open connections,
    or cut them (a killed backend, a restart: see cut())."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._generation = 0
        self._closed = threading.Event()
        self._lock = threading.Lock()
        # Until then (time.monotonic()), connections are closed once accepted.
        self._refuse_until = 0.0
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if time.monotonic() < self._refuse_until:
                client.close()  # the server is restarting
                continue
            try:
                server = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
                generation = self._generation
            self._spawn(self._pipe, client, server, generation)
            self._spawn(self._pipe, server, client, generation)

    def _pipe(self, src: socket.socket, dst: socket.socket, generation: int) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                break
            if generation != self._generation:
                # Frozen: forward nothing more, keep both sockets open.
                self._closed.wait()
                return
            try:
                dst.sendall(data)
            except OSError:
                return
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def freeze(self) -> None:
        """Stop forwarding on every connection open now; later ones work."""
        with self._lock:
            self._generation += 1

    def cut(self, refuse_for: float = 0.0) -> None:
        """Reset every connection open now; close new ones for ``refuse_for`` seconds."""
        with self._lock:
            self._refuse_until = time.monotonic() + refuse_for
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # ends accept()
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in threads:
            thread.join(5)


@pytest.fixture
def proxy() -> Iterator[FreezingProxy]:
    assert POSTGRES_URL
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

    params = conninfo_to_dict(POSTGRES_URL)
    running = FreezingProxy(
        str(params.get("host", "127.0.0.1")), int(str(params.get("port", 5432)))
    )
    yield running
    running.close()


@pytest.fixture
def stores(proxy: FreezingProxy) -> Iterator[tuple[PostgresStore, PostgresStore]]:
    """(direct, through the proxy) on one fresh table; the proxied one times out fast."""
    assert POSTGRES_URL
    from psycopg.conninfo import make_conninfo  # noqa: PLC0415

    table = f"ofx_h1_{uuid.uuid4().hex[:8]}"
    direct = PostgresStore(POSTGRES_URL, table=table)
    via_url = make_conninfo(POSTGRES_URL, host="127.0.0.1", port=str(proxy.port))
    via = PostgresStore(via_url, table=table, connect_timeout=1.0)
    yield direct, via
    via.close()
    direct.drop_schema()
    direct.close()


def _enqueue(store: PostgresStore, i: int) -> None:
    with store.connect() as conn:
        store.enqueue(conn, key=f"k{i}", type="t", payload={"i": i})
        conn.commit()


def _in_thread(call: Any, timeout: float) -> Any:
    """``call()`` on a thread; its result, or fail if it takes over ``timeout``."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # raised again below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"the call did not return within {timeout}s")
    if errors:
        raise errors[0]
    return out[0]


def test_a_relay_whose_connection_stops_answering_reconnects_and_delivers(
    stores: tuple[PostgresStore, PostgresStore], proxy: FreezingProxy
) -> None:
    direct, via = stores
    got: set[int] = set()
    lock = threading.Lock()

    def handle(message: OutboxMessage) -> None:
        with lock:
            got.add(message.payload["i"])

    bus = EventBus()
    bus.subscribe("t", handle)
    relay = Relay(via, bus, lease=2.0, poll_interval=0.1)
    relay.start()
    try:
        _enqueue(direct, 0)
        # Row 0 delivered and recorded as sent: the freeze then catches the
        # relay between statements, not in the middle of row 0's outcome.
        wait_for(lambda: direct.status().counts["sent"] == 1, timeout=20)
        proxy.freeze()
        for i in (1, 2, 3):
            _enqueue(direct, i)
        wait_for(lambda: {1, 2, 3} <= got, timeout=40)
        wait_for(lambda: direct.status().counts["sent"] == 4, timeout=20)
    finally:
        stopped = _in_thread(lambda: relay.stop(20), 30)
    assert stopped is True


def test_the_listener_replaces_a_connection_that_stops_answering(
    stores: tuple[PostgresStore, PostgresStore], proxy: FreezingProxy
) -> None:
    direct, via = stores
    woken = threading.Event()
    listener = via.listener(woken.set)
    assert listener is not None
    listener.start()
    try:
        assert woken.wait(20)  # woken once LISTEN is in place
        woken.clear()
        _enqueue(direct, 0)
        assert woken.wait(20)
        woken.clear()
        proxy.freeze()
        _enqueue(direct, 1)
        # The frozen connection brings nothing; a new one is listening
        # within about 4 x connect_timeout (and wakes the relay at once).
        assert woken.wait(30)
    finally:
        listener.stop(10)


def test_admin_calls_and_the_status_page_answer_when_the_connection_stops(
    stores: tuple[PostgresStore, PostgresStore], proxy: FreezingProxy
) -> None:
    direct, via = stores
    _enqueue(direct, 1)
    assert via.status().counts["pending"] == 1  # leaves an idle connection in the pool
    proxy.freeze()
    _enqueue(direct, 2)
    assert _in_thread(lambda: via.status().counts["pending"], 30) == 2

    with StatusServer(StatusMonitor(via, min_interval=0, max_load=None), port=0) as server:

        def fetch() -> int:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            try:
                conn.request("GET", "/status.json")
                return int(conn.getresponse().status)
            finally:
                conn.close()

        assert _in_thread(fetch, 40) == 200
        proxy.freeze()
        assert _in_thread(fetch, 40) in (200, 503)
        assert _in_thread(fetch, 40) == 200


def test_a_relay_through_a_proxy_never_names_a_server_process_to_end(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    # A pooler hands a server process it took back from a dropped client to
    # another one: through one, a relay could end a stranger's session. The
    # server took this connection elsewhere than where it was made, so the
    # relay does without (and a direct one names its process).
    direct, via = stores
    for store, named in ((direct, True), (via, False)):
        session = store.session()
        assert isinstance(session, _PostgresSession)
        try:
            session.connect(10.0)
            assert (session._backend is not None) == named
        finally:
            session.close()


def test_the_store_sets_tcp_keepalives_unless_conninfo_does() -> None:
    assert POSTGRES_URL
    table = f"ofx_ka_{uuid.uuid4().hex[:8]}"
    store = PostgresStore(POSTGRES_URL, table=table)
    try:
        with store._get_pool().connection(timeout=10) as conn:
            dsn = conn.info.dsn
        assert "keepalives_idle=30" in dsn
        assert "tcp_user_timeout=60000" in dsn
        sep = "&" if "?" in POSTGRES_URL else "?"
        own = PostgresStore(f"{POSTGRES_URL}{sep}keepalives_idle=7", table=table)
        try:
            with own._get_pool().connection(timeout=10) as conn:
                assert "keepalives_idle=7" in conn.info.dsn
                assert "tcp_user_timeout=60000" in conn.info.dsn
        finally:
            own.close()
    finally:
        store.drop_schema()
        store.close()


def test_a_relay_renews_its_leases_through_a_storm_of_cut_connections(
    stores: tuple[PostgresStore, PostgresStore], proxy: FreezingProxy
) -> None:
    """A relay holds a row (its handler runs) with a 4 s lease while its connections
    are cut again and again, then refused for 0.3 s (a restart). It must go on
    renewing the lease: the row never expires, and is delivered once. Before the
    fix its connections came from a pool, which waited 1 s, then 2 s, then 4 s
    between tries for a connection that passed its check: the relay's loop was
    held there past the lease (the lease expired in each of three runs), and
    another relay would have run the row again."""
    direct, via = stores
    release, started = threading.Event(), threading.Event()
    runs: list[int] = []

    def handle(message: OutboxMessage) -> None:
        runs.append(message.id)
        started.set()
        assert release.wait(60)

    bus = EventBus()
    bus.subscribe("t", handle)
    relay = Relay(via, bus, lease=4.0, poll_interval=0.1, timeout=120.0)
    relay.start()
    watch = direct.connect()
    watch.autocommit = True
    lowest = [math.inf]

    def lease_left() -> float:
        row = watch.execute(
            f"SELECT extract(epoch FROM lease_expires_at - clock_timestamp())::float8 "
            f"FROM {direct.table} WHERE status = 'processing'"
        ).fetchone()
        assert row is not None, "the row is no longer processing"
        left = float(row[0])
        lowest[0] = min(lowest[0], left)
        return left

    try:
        _enqueue(direct, 0)
        assert started.wait(20)
        wait_for(lambda: lease_left() > 0, timeout=10)

        def watch_for(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                assert lease_left() > 0, "the lease expired"
                time.sleep(0.02)

        for i in range(15):
            proxy.cut()
            watch_for(0.05 + 0.3 * (i % 2))
        watch_for(2.0)
        proxy.cut(refuse_for=0.3)
        watch_for(8.0)  # two leases
        release.set()
        wait_for(lambda: direct.status().counts["sent"] == 1, timeout=20)
    finally:
        release.set()
        stopped = _in_thread(lambda: relay.stop(20), 30)
        watch.close()
    assert stopped is True
    assert runs == [runs[0]]
    assert lowest[0] > 0


def test_a_relays_start_has_its_lease_for_each_statement(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    """start()'s first statements (its slots, then the store's clock) ran before
    any carrying the lease, bounded by the default 30 s: a server that did not
    answer there held start() that long. They have the lease (2 s) now."""
    direct, via = stores
    via.create_schema()
    relay = Relay(via, EventBus(), lease=2.0, max_concurrency=2)
    with direct.connect() as blocker:
        blocker.execute(f"LOCK TABLE {direct.table}_slots IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(StoreError, match=r"did not answer within 2s"):
            _in_thread(relay.start, 20)
        blocker.rollback()
    assert relay.state is RelayState.STOPPED
