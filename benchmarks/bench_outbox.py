"""Benchmark of outbound.outbox: enqueue, max_pending, relays, a stalled relay, latency, backlog.

    python benchmarks/bench_outbox.py [--quick] [--postgres URL] [--no-peer]

PostgreSQL: ``--postgres``, else ``$OUTBOUND_TEST_POSTGRES``, else
``postgresql://postgres@127.0.0.1:5432/test``. Every figure is measured
beside its baseline in the same run (the machine is shared and noisy);
measurements of a pair are interleaved. Prints a summary, then, as its
last line, one JSON object of the headline figures.

- **enqueue** (both stores): one row per transaction, as a web request
  does (``enqueue`` then ``commit``), beside a bare ``INSERT`` then
  ``COMMIT`` into a plain table with the same columns; and 100 rows per
  transaction with ``enqueue_many`` beside a bare ``executemany`` of the
  same rows (and 100 ``enqueue`` calls, for comparison). Targets: one per
  transaction >= 0.7x bare; batched >= 20,000 rows/s on PostgreSQL,
  >= 50,000 on SQLite.
- **max_pending**: the one-per-transaction enqueue rate with 100,000 rows
  pending against 1,000 (``max_pending=200,000``). Target >= 0.8.
- **relays**: 1, 2 and 4 relay processes on one PostgreSQL table, no-op
  handler, rows over 1,000 keys (per-key FIFO holds throughout), from
  ``go`` until the last outcome is written, in interleaved rounds (three;
  one with ``--quick``); SQLite with one relay. Target: 2 processes >= 1.5x
  one. Also prints how busy the machine's CPU was meanwhile (the server
  shares it). Each round also runs one process with two relays that share one
  relay's room (half the batch size and handler threads each): a relay
  runs one statement at a time, two run theirs side by side.
  Each round also runs pgqueuer (asyncpg, batch 100, one worker a
  process) with one and two processes on as many jobs: how far the same
  machine lets a second process go for the peer (not a target).
- **stalled relay**: three relay processes; one is SIGSTOPped for 3 s at a
  random moment (three times, one in quick mode); the others' rate
  during each stop against their rate in the second before it. Target:
  >= 0.5.
- **started first**: one in-process relay that started on an empty table
  (as relays usually do: its statements were prepared, and planned, while
  it delivered 12 rows one at a time) against one started on the rows;
  the rows come in one transaction, timed from its commit. Target >= 0.8.
- **long lines**: one in-process relay on rows over 20 keys in a table
  analyzed first (as autovacuum would) against one not analyzed: the
  plans made on statistics of a few keys must still find each key's next
  row by its key. Target >= 0.8.
- **latency**: commit to handler, with LISTEN/NOTIFY and with polling.
- **backlog**: the relay's rate with many rows pending against 1,000.
- **peer**: one relay process beside pgqueuer (the ``bench`` extra) with one
  worker on the driver its documentation recommends, asyncpg, at batch
  sizes 10 and 100, each with the same messages and batch size as ours,
  measured back to back; and (not with ``--quick``) pgqueuer on psycopg at
  batch 100. pgqueuer
  runs in a schema of its own, so runs on one server do not collide. Its
  jobs have no keys: ours keep per-key FIFO over 1,000 keys, leases and
  fencing. Target: ours >= 1.0x pgqueuer-on-asyncpg at batch 100. Both
  commit with the server's ``synchronous_commit`` (printed): the relay
  sets none of its own.
- **cost per message**: what one message costs each side in the same run,
  one in-process relay against pgqueuer on asyncpg, batch 100: CPU of the
  database server's processes (read from ``/proc``: only when the server
  runs on this host), CPU of the delivering process (every thread), and
  WAL written (``pg_current_wal_lsn()``, after a ``CHECKPOINT`` where the
  role may run one, so that both pay the same full-page images). The
  budget of the README's "What a relay message costs", not a target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from outbound.outbox import EventBus, OutboxMessage, PostgresStore, Relay, SQLiteStore, Store

KEYS = 1000
#: Keys of the backlog comparison: every row but the first of its key waits
#: behind it in both runs, so both do the same work per message.
BACKLOG_KEYS = 100
BATCH = 100


def table_name() -> str:
    return f"bench_{uuid.uuid4().hex[:10]}"


def wait_until(predicate: Callable[[], bool], timeout: float = 300.0, every: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step timed out")
        time.sleep(every)


def messages(start: int, n: int, keys: int = KEYS) -> list[dict[str, Any]]:
    return [
        {"key": f"k{i % keys}", "type": "noop", "payload": {"i": i}}
        for i in range(start, start + n)
    ]


def fill(store: Store, n: int, keys: int = KEYS, chunk: int = 5000) -> None:
    """``n`` pending rows, written with ``enqueue_many`` in chunks."""
    conn: Any = store.connect()  # type: ignore[attr-defined]
    try:
        for start in range(0, n, chunk):
            store.enqueue_many(conn, messages(start, min(chunk, n - start), keys))
            conn.commit()
    finally:
        conn.close()


def unfinished_pg(store: PostgresStore) -> Callable[[], int]:
    """A cheap reader of the table's unfinished counter (one shared connection)."""
    import psycopg  # noqa: PLC0415

    conn = psycopg.connect(store.conninfo, autocommit=True)
    sql = f"SELECT sum(n) FROM {store.table}_counts"

    def read() -> int:
        row = conn.execute(sql).fetchone()
        assert row is not None  # an aggregate without GROUP BY returns one row
        return int(row[0])

    read.close = conn.close  # type: ignore[attr-defined]
    return read


# ------------------------------------------------------------------ enqueue


class Bare:
    """A plain table with the outbox's columns and a primary key only: the baseline."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.table = f"{store.table}_bare"
        self.pg = isinstance(store, PostgresStore)
        if self.pg:
            kind = (
                "id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key text NOT NULL, "
                "type text NOT NULL, payload jsonb NOT NULL, "
                "created_at timestamptz NOT NULL DEFAULT now()"
            )
            self.insert = f"INSERT INTO {self.table} (key, type, payload) VALUES (%s, %s, %s)"
        else:
            kind = (
                "id INTEGER PRIMARY KEY, key TEXT NOT NULL, type TEXT NOT NULL, "
                "payload TEXT NOT NULL, created_at REAL NOT NULL DEFAULT (unixepoch())"
            )
            self.insert = f"INSERT INTO {self.table} (key, type, payload) VALUES (?, ?, ?)"
        conn: Any = store.connect()  # type: ignore[attr-defined]
        conn.execute(f"CREATE TABLE {self.table} ({kind})")
        conn.commit()
        conn.close()

    def drop(self) -> None:
        conn: Any = self.store.connect()  # type: ignore[attr-defined]
        conn.execute(f"DROP TABLE IF EXISTS {self.table}")
        conn.commit()
        conn.close()


def rate_one_per_txn(conn: Any, n: int, write: Callable[[Any, int], object]) -> float:
    start = time.perf_counter()
    for i in range(n):
        write(conn, i)
        conn.commit()
    return n / (time.perf_counter() - start)


def rate_batched(conn: Any, n: int, write: Callable[[Any, int], object]) -> float:
    start = time.perf_counter()
    for i in range(0, n, BATCH):
        write(conn, i)
        conn.commit()
    return n / (time.perf_counter() - start)


def bench_enqueue(
    make: Callable[[], Store], n_one: int, n_batch: int, rounds: int
) -> dict[str, float]:
    """Rows/s of each way to write, medians over interleaved rounds."""
    store = make()
    bare = Bare(store)
    conn: Any = store.connect()  # type: ignore[attr-defined]
    payload = json.dumps({"i": 1})

    def bare_one(c: Any, i: int) -> None:
        c.execute(bare.insert, (f"k{i % KEYS}", "noop", payload))

    def enqueue_one(c: Any, i: int) -> None:
        store.enqueue(c, key=f"k{i % KEYS}", type="noop", payload={"i": 1})

    rows = [(f"k{i % KEYS}", "noop", payload) for i in range(BATCH)]
    batch = messages(0, BATCH)

    def bare_batch(c: Any, i: int) -> None:
        if bare.pg:
            with c.cursor() as cur:
                cur.executemany(bare.insert, rows)
        else:
            c.executemany(bare.insert, rows)

    def many_batch(c: Any, i: int) -> None:
        store.enqueue_many(c, batch)

    def loop_batch(c: Any, i: int) -> None:
        for m in batch:
            store.enqueue(c, **m)

    results: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for name, run, write, n in (
                ("bare_one", rate_one_per_txn, bare_one, n_one),
                ("enqueue_one", rate_one_per_txn, enqueue_one, n_one),
                ("bare_batch", rate_batched, bare_batch, n_batch),
                ("enqueue_many_batch", rate_batched, many_batch, n_batch),
                ("enqueue_loop_batch", rate_batched, loop_batch, n_batch // 4),
            ):
                results.setdefault(name, []).append(run(conn, n, write))
    finally:
        conn.close()
        bare.drop()
        store.close()
        store.drop_schema()
    return {name: statistics.median(rates) for name, rates in results.items()}


def bench_max_pending(make: Callable[..., Store], n: int, rounds: int) -> tuple[float, float]:
    """One-per-transaction enqueue rate with 1,000 and with 100,000 rows pending."""
    small, big = make(max_pending=200_000), make(max_pending=200_000)
    fill(small, 1_000)
    fill(big, 100_000)
    conns: list[Any] = [s.connect() for s in (small, big)]  # type: ignore[attr-defined]
    rates: tuple[list[float], list[float]] = ([], [])
    try:
        for _ in range(rounds):
            for store, conn, out in zip((small, big), conns, rates, strict=True):

                def write(c: Any, i: int, s: Store = store) -> None:
                    s.enqueue(c, key=f"k{i % KEYS}", type="noop", payload={"i": i})

                out.append(rate_one_per_txn(conn, n, write))
    finally:
        for conn in conns:
            conn.close()
        for store in (small, big):
            store.close()
            store.drop_schema()
    return statistics.median(rates[0]), statistics.median(rates[1])


# -------------------------------------------------------------------- relay


def noop_bus() -> EventBus:
    bus = EventBus()
    bus.subscribe("noop", lambda m: None)
    return bus


def bench_relay_sqlite(store: SQLiteStore, n: int) -> float:
    """Rows per second to deliver ``n`` enqueued rows with one in-process relay."""
    fill(store, n)
    relay = Relay(store, noop_bus(), batch_size=BATCH, max_inflight=64, poll_interval=0.05)
    start = time.perf_counter()
    relay.start()
    try:
        wait_until(lambda: relay.stats().sent >= n)
        return n / (time.perf_counter() - start)
    finally:
        relay.stop(60.0)


class Children:
    """Relay processes on one table; each reports how many rows it has sent, with timestamps.

    ``relays``: relays in each process, sharing its room (see child_relay).
    """

    def __init__(
        self, store: PostgresStore, count: int, batch: int = BATCH, relays: int = 1
    ) -> None:
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--child-relay",
                    store.conninfo,
                    store.table,
                    str(batch),
                    str(relays),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(count)
        ]
        # Guards timelines: (monotonic time, sent) per child, appended by readers.
        self.lock = threading.Lock()
        self.timelines: list[list[tuple[float, int]]] = [[] for _ in range(count)]
        for proc in self.procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        self.readers = [
            threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(count)
        ]

    def _read(self, i: int) -> None:
        stdout = self.procs[i].stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith("sent "):
                with self.lock:
                    self.timelines[i].append((time.monotonic(), int(line.split()[1])))

    def tell(self, word: str) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(word + "\n")
            proc.stdin.flush()

    def go(self) -> None:
        for reader in self.readers:
            reader.start()
        self.tell("go")

    def finish(self) -> None:
        for proc in self.procs:
            with_signal(proc, signal.SIGCONT)
        self.tell("stop")
        for proc in self.procs:
            proc.wait(120)
        for reader in self.readers:
            reader.join(10)

    def sent_at(self, i: int, when: float) -> int:
        """How many rows child ``i`` had sent at ``when`` (its last report before it)."""
        with self.lock:
            timeline = list(self.timelines[i])
        before = [n for t, n in timeline if t <= when]
        return before[-1] if before else 0


def with_signal(proc: subprocess.Popen[str], sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)


def child_relay(url: str, table: str, batch: str, relays: str = "1") -> int:
    """A relay process: ``relays`` relays on one store, which share the room of
    one (each gets ``batch`` and 64 handler threads divided among them)."""
    store = PostgresStore(url, table=table, create=False)
    count = int(relays)
    group = [
        Relay(
            store,
            noop_bus(),
            batch_size=max(1, int(batch) // count),
            max_inflight=64 // count,
            poll_interval=0.05,
        )
        for _ in range(count)
    ]
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    for relay in group:
        relay.start()
    done = threading.Event()

    def sent() -> int:
        return sum(relay.stats().sent for relay in group)

    def report() -> None:
        while not done.wait(0.05):
            print(f"sent {sent()}", flush=True)

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        assert sys.stdin.readline().strip() == "stop"
    finally:
        for relay in group:
            relay.stop(60.0)
        done.set()
        reporter.join()
        print(f"sent {sent()}", flush=True)
        store.close()
    return 0


def cpu_times() -> tuple[float, float] | None:
    """Seconds of CPU time of the whole machine so far, (all, idle or waiting
    for I/O), from ``/proc/stat``; None where there is none."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return float(sum(ticks)), float(ticks[3] + ticks[4])


def bench_relay_processes(
    store: PostgresStore,
    n: int,
    procs: int,
    batch: int = BATCH,
    relays: int = 1,
    busy: list[float] | None = None,
) -> float:
    """Messages/s of ``procs`` relay processes delivering ``n`` rows (go to last outcome).

    ``relays``: relays in each process, sharing one relay's room. ``busy``:
    appended with the fraction of the machine's CPU time that was busy
    meanwhile (every process: the relays, the server, this one), if known.
    """
    fill(store, n)
    unfinished = unfinished_pg(store)
    children = Children(store, procs, batch, relays)
    try:
        before = cpu_times()
        start = time.perf_counter()
        children.go()
        wait_until(lambda: unfinished() == 0, every=0.005)
        elapsed = time.perf_counter() - start
        after = cpu_times()
        if busy is not None and before is not None and after is not None:
            total, idle = after[0] - before[0], after[1] - before[1]
            if total > 0:
                busy.append(1.0 - idle / total)
    finally:
        children.finish()
        unfinished.close()  # type: ignore[attr-defined]
    assert store.status().counts["sent"] == n
    return n / elapsed


def bench_relay_in_process(
    store: PostgresStore,
    n: int,
    *,
    rows_first: bool,
    keys: int = KEYS,
    analyze: bool = False,
    meter: Meter | None = None,
) -> float:
    """Messages/s of one in-process relay delivering ``n`` rows over ``keys`` keys.

    ``rows_first``: the rows are there when the relay starts (from its start to
    the last outcome), and the table is analyzed first if ``analyze``.
    Otherwise the relay starts on an empty table, as it usually does, and
    delivers 12 rows one at a time (its statements are prepared, and
    planned, meanwhile); the ``n`` rows then come in one transaction (from
    its commit to the last outcome). ``meter`` (with ``rows_first``): started
    and stopped around the delivery.
    """
    relay = Relay(store, noop_bus(), batch_size=BATCH, max_inflight=64, poll_interval=0.05)

    def sent(count: int) -> Callable[[], bool]:
        return lambda: relay.stats().sent >= count

    if rows_first:
        fill(store, n, keys=keys, chunk=n)
        if analyze:
            import psycopg  # noqa: PLC0415

            with psycopg.connect(store.conninfo, autocommit=True) as admin:
                admin.execute(f"ANALYZE {store.table}")
        if meter is not None:
            meter.start()
        start = time.perf_counter()
        relay.start()
    else:
        relay.start()
        for i in range(1, 13):
            fill(store, 1)
            wait_until(sent(i))
    try:
        if not rows_first:
            conn: Any = store.connect()
            try:
                store.enqueue_many(conn, messages(0, n))
                conn.commit()
                start = time.perf_counter()
            finally:
                conn.close()
            n += 12
        wait_until(sent(n))
        rate = (n - (0 if rows_first else 12)) / (time.perf_counter() - start)
        if meter is not None and rows_first:
            meter.stop(n)
        return rate
    finally:
        relay.stop(60.0)


def bench_stall(store: PostgresStore, n: int, stops: int) -> list[float]:
    """Three relays, one stopped for 3 s at random moments: the others' rate during / before."""
    bulk_fill_pg(store, n, KEYS)  # many rows, fast: the relays must not run dry during a stop
    unfinished = unfinished_pg(store)
    children = Children(store, 3)
    ratios = []
    try:
        children.go()
        for _ in range(stops):
            time.sleep(random.uniform(1.0, 1.5))  # run, then stop at a random moment
            victim = random.randrange(3)
            others = [i for i in range(3) if i != victim]
            t0 = time.monotonic()
            with_signal(children.procs[victim], signal.SIGSTOP)
            time.sleep(3.0)
            t1 = time.monotonic()
            with_signal(children.procs[victim], signal.SIGCONT)
            time.sleep(0.1)  # the reports of the stop window have arrived
            during = sum(children.sent_at(i, t1) - children.sent_at(i, t0) for i in others) / (
                t1 - t0
            )
            before = sum(children.sent_at(i, t0) - children.sent_at(i, t0 - 1.0) for i in others)
            if unfinished() == 0:
                raise RuntimeError("the relays ran out of rows during a stop: use more rows")
            ratios.append(during / max(before, 1.0))
    finally:
        unfinished.close()  # type: ignore[attr-defined]
        children.finish()
    return ratios


def bench_latency(store: Store, samples: int, *, listen: bool) -> tuple[float, float]:
    """Commit-to-handler latency in ms (p50, p99) for one row at a time on an idle relay."""
    got = threading.Event()
    stamp: list[float] = []

    def handler(message: OutboxMessage) -> None:
        stamp.append(time.perf_counter())
        got.set()

    bus = EventBus()
    bus.subscribe("ping", handler)
    relay = Relay(store, bus, poll_interval=5.0 if listen else 0.05, listen=listen)
    relay.start()
    latencies = []
    conn: Any = store.connect()  # type: ignore[attr-defined]
    try:
        for i in range(samples):
            got.clear()
            stamp.clear()
            store.enqueue(conn, key=f"k{i}", type="ping", payload=None)
            conn.commit()
            committed = time.perf_counter()
            if not got.wait(10.0):
                raise TimeoutError("latency sample lost")
            latencies.append((stamp[0] - committed) * 1000.0)
            time.sleep(random.uniform(0.005, 0.06))  # idle again, at a random poll phase
    finally:
        conn.close()
        relay.stop(30.0)
    latencies.sort()
    return statistics.median(latencies), latencies[
        min(len(latencies) - 1, int(0.99 * len(latencies)))
    ]


def bulk_fill_pg(store: PostgresStore, n: int, keys: int = BACKLOG_KEYS) -> None:
    """``n`` rows in one statement, as ``enqueue`` writes them (new, pending), and counted."""
    with store.connect() as conn:
        conn.execute(
            f"INSERT INTO {store.table} (key, type, payload) "
            f"SELECT 'k' || mod(g, {keys}), 'noop', jsonb_build_object('i', g) "
            "FROM generate_series(0, %s - 1) AS g",
            (n,),
        )
        conn.execute(f"UPDATE {store.table}_counts SET n = n + %s WHERE shard = 1", (n,))
        conn.commit()


def sequence_all_pg(store: PostgresStore) -> None:
    """Make every key's first row its head, as a running relay's looks do as rows arrive."""
    session = store.session()
    try:
        session.sequence(10**9)
    finally:
        session.close()
    with store.connect() as conn:
        conn.autocommit = True
        conn.execute(f"VACUUM ANALYZE {store.table}")


def bench_backlog(url: str, pending: int, window: tuple[int, int]) -> float:
    """Delivery rate between ``window`` sent counts with ``pending`` rows queued at start."""
    store = PostgresStore(url, table=table_name())
    try:
        bulk_fill_pg(store, pending)
        sequence_all_pg(store)
        relay = Relay(store, noop_bus(), batch_size=BATCH, max_inflight=64, poll_interval=0.05)
        marks: dict[int, float] = {}
        relay.start()
        try:
            for mark in window:
                wait_until(lambda: relay.stats().sent >= mark, every=0.001)  # noqa: B023
                marks[mark] = time.perf_counter()
        finally:
            relay.force_stop(30.0)
        return (window[1] - window[0]) / (marks[window[1]] - marks[window[0]])
    finally:
        store.close()
        store.drop_schema()


# --------------------------------------------------------------------- peer


def peer_unavailable(driver: str) -> str | None:
    """Why pgqueuer on ``driver`` cannot run here (None: it can)."""
    try:  # the peer is optional: imported only here
        import pgqueuer  # noqa: PLC0415, F401

        if driver == "asyncpg":
            import asyncpg  # noqa: PLC0415, F401
            from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver  # noqa: PLC0415, F401
        else:
            from pgqueuer.adapters.drivers.psycopg import PsycopgDriver  # noqa: PLC0415, F401
    except ImportError as exc:
        return f"{exc} (pip install 'outbound-dispatcher[bench]')"
    return None


def server_cpu() -> float | None:
    """CPU seconds of every PostgreSQL server process on this host, exited
    backends included (the postmaster's reaped children); None if none is seen."""
    tick = os.sysconf("SC_CLK_TCK")
    total, seen = 0, False
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() not in ("postgres", "postmaster"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone, or not ours to read
            continue
        seen = True
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / tick if seen else None


class Meter:
    """What one stretch of work costs: the server's and this process's CPU, and WAL.

    ``start()`` before the work, ``stop(n)`` after it: per-message figures
    for ``n`` messages in ``costs``.
    """

    def __init__(self, url: str) -> None:
        from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

        self.url = url
        self.costs: dict[str, float | None] = {}
        # The server's processes are read only if it runs here.
        host = str(conninfo_to_dict(url).get("host") or "")
        self.local = host in ("", "localhost", "127.0.0.1", "::1") or host.startswith("/")

    def _server(self) -> float | None:
        return server_cpu() if self.local else None

    def _wal(self) -> int:
        import psycopg  # noqa: PLC0415

        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        high, low = str(row[0] if row else "0/0").split("/")
        return (int(high, 16) << 32) + int(low, 16)

    def start(self) -> None:
        import psycopg  # noqa: PLC0415

        try:  # both sides start with the same full-page images to write
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute("CHECKPOINT")
        except psycopg.Error:
            pass
        self.wal = self._wal()
        self.server = self._server()
        self.cpu = time.process_time()
        self.began = time.perf_counter()

    def stop(self, n: int) -> None:
        elapsed = time.perf_counter() - self.began
        cpu = time.process_time() - self.cpu
        server_now, server_before = self._server(), self.server
        server = None
        if server_now is not None and server_before is not None:
            server = 1e6 * (server_now - server_before) / n
        wal = self._wal() - self.wal
        self.costs = {
            "per_s": n / elapsed,
            "client_us": 1e6 * cpu / n,
            "server_us": server,
            "wal_bytes": wal / n,
        }


def bench_pgqueuer(url: str, n: int, batch: int, driver: str, meter: Meter | None = None) -> float:
    """Jobs/s of one pgqueuer worker draining ``n`` no-op jobs, dequeued ``batch`` at a time.

    ``meter``: started and stopped around the drain.

    pgqueuer's tables live in a schema of their own (its objects follow the
    connection's search_path), dropped afterwards.
    """
    import psycopg  # noqa: PLC0415
    from pgqueuer.core.qm import QueueManager  # noqa: PLC0415
    from pgqueuer.queries import Queries  # noqa: PLC0415
    from pgqueuer.types import QueueExecutionMode  # noqa: PLC0415

    schema = f"bench_pgq_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")

    async def run() -> float:
        conn: Any
        if driver == "asyncpg":
            import asyncpg  # noqa: PLC0415
            from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver  # noqa: PLC0415

            conn = await asyncpg.connect(url, server_settings={"search_path": schema})
            queries = Queries(AsyncpgDriver(conn))
        else:
            from pgqueuer.adapters.drivers.psycopg import PsycopgDriver  # noqa: PLC0415

            conn = await psycopg.AsyncConnection.connect(
                url, autocommit=True, options=f"-c search_path={schema}"
            )
            queries = Queries(PsycopgDriver(conn))
        try:
            await queries.install()
            for start in range(0, n, 500):
                count = min(500, n - start)
                await queries.enqueue(["noop"] * count, [None] * count, [0] * count)
            qm = QueueManager(queries)

            @qm.entrypoint("noop")
            async def noop(job: Any) -> None:
                return None

            if meter is not None:
                meter.start()
            begin = time.perf_counter()
            await qm.run(batch_size=batch, mode=QueueExecutionMode.drain)
            rate = n / (time.perf_counter() - begin)
            if meter is not None:
                meter.stop(n)
            return rate
        finally:
            await conn.close()

    try:
        return asyncio.run(run())
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


def child_pgqueuer(url: str, schema: str, batch: str) -> int:
    """A pgqueuer worker process (asyncpg, no-op entrypoint) on ``schema``'s
    queue: ready, then on ``go`` drains it ``batch`` jobs at a time."""
    import asyncpg  # noqa: PLC0415
    from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver  # noqa: PLC0415
    from pgqueuer.core.qm import QueueManager  # noqa: PLC0415
    from pgqueuer.queries import Queries  # noqa: PLC0415
    from pgqueuer.types import QueueExecutionMode  # noqa: PLC0415

    async def run() -> None:
        conn = await asyncpg.connect(url, server_settings={"search_path": schema})
        try:
            qm = QueueManager(Queries(AsyncpgDriver(conn)))

            @qm.entrypoint("noop")
            async def noop(job: Any) -> None:
                return None

            print("ready", flush=True)
            word = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            assert word.strip() == "go"
            await qm.run(batch_size=int(batch), mode=QueueExecutionMode.drain)
        finally:
            await conn.close()

    asyncio.run(run())
    return 0


def bench_pgqueuer_processes(url: str, n: int, procs: int, batch: int = BATCH) -> float:
    """Jobs/s of ``procs`` pgqueuer worker processes (asyncpg) draining ``n``
    no-op jobs: from ``go`` until the queue table is empty, polled as
    :func:`bench_relay_processes` polls ours."""
    import asyncpg  # noqa: PLC0415
    import psycopg  # noqa: PLC0415
    from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver  # noqa: PLC0415
    from pgqueuer.queries import Queries  # noqa: PLC0415

    schema = f"bench_pgq_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")

    async def fill() -> None:
        conn = await asyncpg.connect(url, server_settings={"search_path": schema})
        try:
            queries = Queries(AsyncpgDriver(conn))
            await queries.install()
            for start in range(0, n, 500):
                count = min(500, n - start)
                await queries.enqueue(["noop"] * count, [None] * count, [0] * count)
        finally:
            await conn.close()

    children: list[subprocess.Popen[str]] = []
    try:
        asyncio.run(fill())
        children = [
            subprocess.Popen(
                [sys.executable, __file__, "--child-pgqueuer", url, schema, str(batch)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(procs)
        ]
        for child in children:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
        with psycopg.connect(url, autocommit=True) as conn:

            def left() -> int:
                row = conn.execute(f"SELECT count(*) FROM {schema}.pgqueuer").fetchone()
                return int(row[0]) if row is not None else 0

            start = time.perf_counter()
            for child in children:
                assert child.stdin is not None
                child.stdin.write("go\n")
                child.stdin.flush()
            wait_until(lambda: left() == 0, every=0.005)
            elapsed = time.perf_counter() - start
        for child in children:
            child.wait(60)
            assert child.returncode == 0, child.returncode
        return n / elapsed
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


def bench_peers(
    url: str,
    n: int,
    rounds: int,
    out: dict[str, Any],
    run_pg: Callable[[Callable[[PostgresStore], float]], float],
    *,
    psycopg: bool,
) -> None:
    """One relay process against pgqueuer, batch 10 and 100, back to back in each round.

    With ``psycopg``, pgqueuer on psycopg too (batch 100; slow: full runs only).
    """
    say = print
    say(
        f"== one relay process against pgqueuer (one worker), {n:,} messages, "
        "same batch size (msg/s)"
    )
    import psycopg as pg  # noqa: PLC0415

    with pg.connect(url, autocommit=True) as conn:
        row = conn.execute("SHOW synchronous_commit").fetchone()
    out["synchronous_commit"] = row[0] if row is not None else "?"
    say(f"  both commit with the server's synchronous_commit = {out['synchronous_commit']}")
    why = {driver: peer_unavailable(driver) for driver in ("asyncpg", "psycopg")}
    for driver, reason in why.items():
        if reason is not None:
            say(f"  pgqueuer on {driver} cannot run here: {reason}")

    def peer(batch: int, driver: str) -> float | None:
        if why[driver] is not None:
            return None
        try:
            return bench_pgqueuer(url, n, batch, driver)
        except Exception as exc:  # report, do not fail the run
            say(f"  pgqueuer on {driver} failed: {exc!r}")
            return None

    for batch in (10, 100):
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(rounds):
            ours.append(run_pg(partial(bench_relay_processes, n=n, procs=1, batch=batch)))
            rate = peer(batch, "asyncpg")
            if rate is not None:
                theirs.append(rate)
        mine = statistics.median(ours)
        out[f"peer_batch{batch}_ours_per_s"] = round(mine)
        line = f"  batch {batch:>3}   outbound {mine:>9,.0f}"
        if theirs:
            ratios = sorted(o / t for o, t in zip(ours, theirs, strict=True))
            other = statistics.median(theirs)
            out[f"peer_batch{batch}_pgqueuer_asyncpg_per_s"] = round(other)
            out[f"peer_batch{batch}_asyncpg_ratio"] = round(statistics.median(ratios), 2)
            out[f"peer_batch{batch}_asyncpg_ratios"] = [round(r, 2) for r in ratios]
            line += (
                f"   pgqueuer (asyncpg) {other:>9,.0f}   ratio {statistics.median(ratios):.2f}"
                f"   (each {', '.join(f'{r:.2f}' for r in ratios)})"
            )
        say(line)
    rate = peer(BATCH, "psycopg") if psycopg else None
    if rate is not None:
        out[f"peer_batch{BATCH}_pgqueuer_psycopg_per_s"] = round(rate)
        mine = out[f"peer_batch{BATCH}_ours_per_s"]
        out[f"peer_batch{BATCH}_psycopg_ratio"] = round(mine / rate, 2)
        say(f"  batch {BATCH}   pgqueuer on psycopg {rate:>9,.0f}   ours / it {mine / rate:.2f}")


def bench_costs(
    url: str,
    n: int,
    out: dict[str, Any],
    run_pg: Callable[[Callable[[PostgresStore], float]], float],
    *,
    peer: bool,
) -> None:
    """What one message costs: one in-process relay, then pgqueuer on asyncpg, batch 100."""
    say = print
    say(
        f"== cost per message: one relay in process against pgqueuer on asyncpg, "
        f"batch {BATCH}, {n:,} messages"
    )
    sides: list[tuple[str, Meter]] = []
    ours = Meter(url)
    run_pg(partial(bench_relay_in_process, n=n, rows_first=True, meter=ours))
    sides.append(("outbound", ours))
    reason = peer_unavailable("asyncpg") if peer else "--no-peer"
    if reason is None:
        theirs = Meter(url)
        try:
            bench_pgqueuer(url, n, BATCH, "asyncpg", meter=theirs)
            sides.append(("pgqueuer", theirs))
        except Exception as exc:  # report, do not fail the run
            say(f"  pgqueuer on asyncpg failed: {exc!r}")
    else:
        say(f"  pgqueuer on asyncpg cannot run here: {reason}")
    for name, meter in sides:
        costs = meter.costs
        server = costs["server_us"]
        say(
            f"  {name:<9} server CPU "
            + (f"{server:>5.1f} us" if server is not None else "  n/a (not on this host)")
            + f"   its process's CPU {costs['client_us']:>5.1f} us"
            f"   WAL {costs['wal_bytes']:>6,.0f} bytes   ({costs['per_s']:,.0f}/s)"
        )
        for key, value in costs.items():
            if value is not None:
                out[f"cost_{name}_{key}"] = round(value, 1)


# --------------------------------------------------------------------- main


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (CI)")
    parser.add_argument("--postgres", default=None)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument(
        "--child-pgqueuer", nargs=3, metavar=("URL", "SCHEMA", "BATCH"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--child-relay",
        nargs=4,
        metavar=("URL", "TABLE", "BATCH", "RELAYS"),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args(argv)
    if args.child_relay:
        return child_relay(*args.child_relay)
    if args.child_pgqueuer:
        return child_pgqueuer(*args.child_pgqueuer)
    url = (
        args.postgres
        or os.environ.get("OUTBOUND_TEST_POSTGRES")
        or "postgresql://postgres@127.0.0.1:5432/test"
    )
    quick = args.quick
    n_one = 300 if quick else 1000
    n_batch = 10_000 if quick else 40_000
    rounds = 2 if quick else 3
    n_pending = 300 if quick else 1000
    n_relay = 6000 if quick else 20000
    n_lines = 6000 if quick else 12000
    procs = (1, 2, 4)
    # Enough rows that the others never run low during a stop (the last of
    # three comes about 10 s in; 300,000 ran low at 24,000/s).
    stall_rows, stops = (200_000, 1) if quick else (600_000, 3)
    samples = 20 if quick else 200
    peer_rounds = 1 if quick else 3
    backlog = 20000 if quick else 100000
    window_small = (100, 900)
    window_big = (1000, 5000 if quick else 11000)
    backlog_runs = 2 if quick else 3
    out: dict[str, Any] = {
        "quick": quick,
        "keys": KEYS,
        "backlog_keys": BACKLOG_KEYS,
        "batch_size": BATCH,
        "load_before": load(),
    }
    say = print
    say(f"load average before: {out['load_before']}")

    def pg_store(**options: Any) -> PostgresStore:
        return PostgresStore(url, table=table_name(), **options)

    def run_pg(fn: Callable[[PostgresStore], Any]) -> Any:
        store = pg_store()
        try:
            return fn(store)
        finally:
            store.close()
            store.drop_schema()

    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(1000))

        def sqlite_store(**options: Any) -> SQLiteStore:
            return SQLiteStore(os.path.join(tmp, f"bench{next(counter)}.db"), **options)

        say("== enqueue (rows/s), beside a bare INSERT + COMMIT into a plain table")
        for name, make in (("sqlite", sqlite_store), ("postgres", pg_store)):
            r = bench_enqueue(make, n_one, n_batch, rounds)
            one, many = r["enqueue_one"] / r["bare_one"], r["enqueue_many_batch"] / r["bare_batch"]
            say(
                f"  {name:<8} one per txn   bare {r['bare_one']:>9,.0f}   enqueue "
                f"{r['enqueue_one']:>9,.0f}   ratio {one:.2f}"
            )
            say(
                f"  {name:<8} 100 per txn   bare {r['bare_batch']:>9,.0f}   enqueue_many "
                f"{r['enqueue_many_batch']:>9,.0f}   ratio {many:.2f}   (100 x enqueue "
                f"{r['enqueue_loop_batch']:,.0f})"
            )
            for key, value in r.items():
                out[f"enqueue_{name}_{key}_per_s"] = round(value)
            out[f"enqueue_{name}_one_ratio"] = round(one, 2)
            out[f"enqueue_{name}_batch_ratio"] = round(many, 2)

        say("== enqueue with max_pending=200,000: 100,000 rows pending against 1,000 (rows/s)")
        for name, make in (("sqlite", sqlite_store), ("postgres", pg_store)):
            small, big = bench_max_pending(make, n_pending, rounds)
            out[f"max_pending_{name}_1k_per_s"] = round(small)
            out[f"max_pending_{name}_100k_per_s"] = round(big)
            out[f"max_pending_{name}_ratio"] = round(big / small, 2)
            say(
                f"  {name:<8} 1,000 {small:>9,.0f}   100,000 {big:>9,.0f}   ratio {big / small:.2f}"
            )

        say("== relay throughput, no-op handler (msg/s)")
        rate = bench_relay_sqlite(sqlite_store(), n_relay)
        out["relay_sqlite_1proc_per_s"] = round(rate)
        say(f"  sqlite   1 relay (in process)  {rate:>9,.0f}")
    # Rounds of 1, 2, 4 processes, interleaved; the ratios are taken in each
    # round (a change of the machine's load hits all three), then the median.
    # Each round also runs one process with two relays that share one
    # relay's room (half the batch and handler threads each).
    runs: dict[int, list[float]] = {count: [] for count in procs}
    # The fraction of the machine's CPU busy in each run: two processes on
    # a machine of two cores find it nearly full (the server shares it).
    busy: dict[int, list[float]] = {count: [] for count in procs}
    paired: list[float] = []
    # pgqueuer's own workers, one and two processes, in the same rounds: how
    # far the machine lets a second process go for the peer too.
    peer_why = "--no-peer" if args.no_peer else peer_unavailable("asyncpg")
    peer_runs: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(peer_rounds):
        for count in procs:
            runs[count].append(
                run_pg(partial(bench_relay_processes, n=n_relay, procs=count, busy=busy[count]))
            )
        paired.append(run_pg(partial(bench_relay_processes, n=n_relay, procs=1, relays=2)))
        if peer_why is None:
            for count, rates_of in peer_runs.items():
                try:
                    rates_of.append(bench_pgqueuer_processes(url, n_relay, count))
                except Exception as exc:  # report, do not fail the run
                    peer_why = f"it failed: {exc!r}"
                    break
    rates = {count: statistics.median(r) for count, r in runs.items()}
    for count in procs:
        out[f"relay_postgres_{count}proc_per_s"] = round(rates[count])
        scaling = sorted(a / b for a, b in zip(runs[count], runs[1], strict=True))
        cpu = (
            f"   CPU {statistics.median(busy[count]):.0%} busy of {os.cpu_count()} cores"
            if busy[count]
            else ""
        )
        if busy[count]:
            out[f"relay_postgres_{count}proc_cpu_busy"] = round(statistics.median(busy[count]), 2)
        say(
            f"  postgres {count} relay process(es) {rates[count]:>9,.0f}   "
            f"x{statistics.median(scaling):.2f} of one"
            + (f"   (each {', '.join(f'{r:.2f}' for r in scaling)})" if count > 1 else "")
            + cpu
        )
        if count > 1:
            out[f"relay_postgres_{count}proc_scaling"] = round(statistics.median(scaling), 2)
            out[f"relay_postgres_{count}proc_scalings"] = [round(r, 2) for r in scaling]
    scaling = sorted(a / b for a, b in zip(paired, runs[1], strict=True))
    out["relay_postgres_2relays_per_s"] = round(statistics.median(paired))
    out["relay_postgres_2relays_scaling"] = round(statistics.median(scaling), 2)
    say(
        f"  postgres 1 process, 2 relays  {statistics.median(paired):>9,.0f}   "
        f"x{statistics.median(scaling):.2f} of one relay   (each "
        f"{', '.join(f'{r:.2f}' for r in scaling)}; they share one relay's room)"
    )
    if peer_why is None:
        peer_rates = {count: statistics.median(r) for count, r in peer_runs.items()}
        scaling = sorted(a / b for a, b in zip(peer_runs[2], peer_runs[1], strict=True))
        out["peer_pgqueuer_1proc_per_s"] = round(peer_rates[1])
        out["peer_pgqueuer_2proc_per_s"] = round(peer_rates[2])
        out["peer_pgqueuer_2proc_scaling"] = round(statistics.median(scaling), 2)
        say(
            f"  pgqueuer (asyncpg, batch {BATCH}) 1 process {peer_rates[1]:>9,.0f}   "
            f"2 processes {peer_rates[2]:>9,.0f}   x{statistics.median(scaling):.2f} of one"
            f"   (each {', '.join(f'{r:.2f}' for r in scaling)})"
        )
    else:
        say(f"  pgqueuer in processes: not run ({peer_why})")

    def against(
        base: Callable[[PostgresStore], float],
        measured: Callable[[PostgresStore], float],
        names: tuple[str, str],
        keys: tuple[str, str, str],
    ) -> None:
        """``measured`` against ``base``, in interleaved rounds; print and record both."""
        bases: list[float] = []
        runs: list[float] = []
        for _ in range(peer_rounds):
            bases.append(run_pg(base))
            runs.append(run_pg(measured))
        ratios = sorted(m / b for m, b in zip(runs, bases, strict=True))
        out[keys[0]] = round(statistics.median(runs))
        out[keys[1]] = round(statistics.median(bases))
        out[keys[2]] = round(statistics.median(ratios), 2)
        say(
            f"  postgres in process   {names[0]} {statistics.median(runs):>9,.0f}   {names[1]} "
            f"{statistics.median(bases):>9,.0f}   ratio {statistics.median(ratios):.2f}"
            f"   (each {', '.join(f'{r:.2f}' for r in ratios)})"
        )

    say("== a relay started before its rows, against one started after them (msg/s)")
    against(
        partial(bench_relay_in_process, n=n_relay, rows_first=True),
        partial(bench_relay_in_process, n=n_relay, rows_first=False),
        ("before", "after"),
        ("relay_started_first_per_s", "relay_started_after_per_s", "relay_started_first_ratio"),
    )

    say("== long lines (20 keys): a relay on a table analyzed first, against one not (msg/s)")
    lines = partial(bench_relay_in_process, n=n_lines, rows_first=True, keys=20)
    against(
        lines,
        partial(lines, analyze=True),
        ("analyzed", "not"),
        ("relay_lines_analyzed_per_s", "relay_lines_per_s", "relay_lines_analyzed_ratio"),
    )

    if not args.no_peer:
        bench_peers(url, n_relay, peer_rounds, out, run_pg, psycopg=not quick)
    bench_costs(url, n_relay, out, run_pg, peer=not args.no_peer)

    say("== stalled relay: one of three SIGSTOPped for 3 s (others' rate, during / before)")
    ratios = run_pg(lambda s: bench_stall(s, stall_rows, stops))
    out["stall_others_ratio"] = round(min(ratios), 2)
    out["stall_others_ratios"] = [round(r, 2) for r in ratios]
    say(f"  worst {min(ratios):.2f}   each {', '.join(f'{r:.2f}' for r in ratios)}")

    say("== commit-to-handler latency on PostgreSQL (ms)")
    p50, p99 = run_pg(lambda s: bench_latency(s, samples, listen=True))
    out["latency_notify_p50_ms"], out["latency_notify_p99_ms"] = round(p50, 2), round(p99, 2)
    say(f"  NOTIFY                 p50 {p50:7.2f}   p99 {p99:7.2f}")
    p50, p99 = run_pg(lambda s: bench_latency(s, samples, listen=False))
    out["latency_poll50ms_p50_ms"], out["latency_poll50ms_p99_ms"] = round(p50, 2), round(p99, 2)
    say(f"  polling every 50 ms    p50 {p50:7.2f}   p99 {p99:7.2f}")

    say("== backlog: PostgreSQL relay rate with many rows pending (msg/s)")
    # Both sizes are measured several times, interleaved so that a change in
    # the machine's load hits both, and the medians are compared.
    smalls, bigs = [], []
    for _ in range(backlog_runs):
        smalls.append(bench_backlog(url, 1000, window_small))
        bigs.append(bench_backlog(url, backlog, window_big))
    small, big = statistics.median(smalls), statistics.median(bigs)
    pairs = sorted(b / s for s, b in zip(smalls, bigs, strict=True))
    out["backlog_1k_per_s"] = round(small)
    out[f"backlog_{backlog // 1000}k_per_s"] = round(big)
    out["backlog_ratio"] = round(big / small, 2)
    out["backlog_ratio_runs"] = [round(r, 2) for r in pairs]
    ratio = big / small
    say(f"  1,000 pending {small:>9,.0f}   {backlog:,} pending {big:>9,.0f}   ratio {ratio:.2f}")

    out["load_after"] = load()
    say(f"load average after: {out['load_after']}")
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
