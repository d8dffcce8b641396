"""Fork safety: a forked child gets a fresh, empty dispatcher; the parent loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dispatch_helpers import returning

from outbound import Dispatcher, Outbound, State, middleware
from outbound._fair import FairLock
from outbound._fork import renewed_after_fork
from outbound.messages import Sender, SendRequest, SendResult
from outbound.outbox import EventBus, Relay, SQLiteStore
from outbound.ratelimit import Rate, RateLimiter, RateLimits

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _fork() -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded fork"
        return os.fork()


def _child_exit(check: bool) -> None:
    os._exit(0 if check else 1)


def _wait_child(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_child_starts_empty_and_sends_on_its_own_threads() -> None:
    gate = threading.Event()
    with Dispatcher(max_inflight=2, queue_size=8) as d:
        blocked = d.submit("chat", gate.wait, 10)
        queued = [d.submit("chat", returning(i)) for i in range(3)]
        assert d.stats().lanes == 1
        pid = _fork()
        if pid == 0:  # the child
            ok = False
            try:
                s = d.stats()
                ok = s.lanes == 0 and s.queued == 0 and s.threads == 0
                ok = ok and d.state is State.OPEN
                ok = ok and d.submit("chat", lambda: "child").result(timeout=10) == "child"
                ok = ok and d.shutdown(timeout=10)
            finally:
                _child_exit(ok)
        assert _wait_child(pid) == 0
        gate.set()
        assert blocked.result(timeout=10) is True
        assert [f.result(timeout=10) for f in queued] == [0, 1, 2]


def test_pid_check_rebuilds_when_fork_hooks_did_not_run() -> None:
    d = Dispatcher(max_inflight=2)
    try:
        # As if this object came from a fork that skipped the hooks (before
        # any thread started here: a real child has none of the parent's).
        old_lock = d._lock
        d._pid = -1
        assert d.submit(1, lambda: 2).result(timeout=10) == 2
        assert d._lock is not old_lock
        assert d._pid == os.getpid()
    finally:
        assert d.shutdown(timeout=10)


_ENTRIES: dict[str, Callable[[Dispatcher], object]] = {
    "submit": lambda d: d.submit(1, lambda: 2).result(timeout=10),
    "pause": lambda d: d.pause(0.0),
    "close": lambda d: d.close(),
    "drain": lambda d: d.drain(1.0),
    "shutdown": lambda d: d.shutdown(1.0),
    "force_close": lambda d: d.force_close(),
    "state": lambda d: d.state,
    "stats": lambda d: d.stats(),
    "repr": repr,
    "with": lambda d: d.__exit__(None, None, None),
}


@pytest.mark.parametrize("entry", sorted(_ENTRIES))
def test_every_public_entry_rebuilds_before_it_takes_a_lock(entry: str) -> None:
    """A fork that skipped the hooks, while a parent thread held the dispatcher's lock
    (the child has none of that thread: the lock stays held there for good). Every
    public entry checks the process first, so none waits for that lock."""
    d = Dispatcher(max_inflight=2)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with d._lock:
            holding.set()
            release.wait(30.0)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10.0)
        d._pid = -1  # as in the child of a fork that ran no hook
        outcome: list[object] = []
        caller = threading.Thread(target=lambda: outcome.append(_ENTRIES[entry](d)), daemon=True)
        caller.start()
        caller.join(10.0)
        assert not caller.is_alive(), f"{entry} waited for the lock of the parent's thread"
        assert len(outcome) == 1
    finally:
        release.set()
        holder.join(10.0)
    assert d.shutdown(timeout=10)


_HOOKLESS_FORK = """
import ctypes, os, signal, threading, time
from outbound import Dispatcher

d = Dispatcher(max_inflight=2)
assert d.submit(1, lambda: 1).result(timeout=10) == 1
holding, release = threading.Event(), threading.Event()

def hold():
    with d._lock:
        holding.set()
        release.wait(30)

threading.Thread(target=hold, daemon=True).start()
assert holding.wait(10)
pid = ctypes.PyDLL(None).fork()  # fork(2) itself: no os.register_at_fork hook runs
if pid == 0:
    os._exit(0 if d.shutdown(timeout=5.0) and d.stats().threads == 0 else 1)
release.set()
deadline = time.monotonic() + 20
while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
    time.sleep(0.01)
if not done[0]:
    os.kill(pid, signal.SIGKILL)
    done = os.waitpid(pid, 0)
    print("child hung", flush=True)
print("child", os.waitstatus_to_exitcode(done[1]), flush=True)
assert d.shutdown(timeout=10)
"""


def test_a_child_of_a_hookless_fork_shuts_down_though_a_parent_thread_held_the_lock() -> None:
    # fork(2) called from C (an extension, a server's own fork) runs no at-fork hook:
    # the process-id check at each public entry is what rebuilds the dispatcher.
    proc = subprocess.run(
        [sys.executable, "-c", _HOOKLESS_FORK],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.splitlines() == ["child 0"], proc.stdout + proc.stderr


def test_closed_dispatcher_stays_closed_in_the_child() -> None:
    d = Dispatcher(max_inflight=1)
    d.close()
    pid = _fork()
    if pid == 0:
        ok = False
        try:
            ok = d.state in (State.CLOSED, State.CLOSING)
            try:
                d.submit(1, lambda: None)
            except RuntimeError:
                ok = ok and True
            else:
                ok = False
        finally:
            _child_exit(ok)
    assert _wait_child(pid) == 0
    assert d.shutdown(timeout=10)


class _Sent:
    """A sender that answers at once (no lock of its own: the chain's are tested)."""

    def send(self, request: SendRequest) -> SendResult:
        return SendResult(1, {"ok": True})


def _chain_and_locks() -> tuple[Sender, dict[str, Any]]:
    """The README's chain over a stand-in, and each lock a sending thread takes in it."""
    limiter = RateLimiter(RateLimits(overall=Rate(1000), per_chat=Rate(1000)))
    metrics = middleware.metrics()
    sender = middleware.chain(
        metrics, middleware.retry(), middleware.rate_limit(limiter), middleware.timeout()
    )(_Sent())
    locks = {"limiter state": limiter._state_lock, "metrics": metrics._lock}
    return sender, locks


def _fork_while_held(acquire: Callable[[], object], release: Callable[[], object]) -> int:
    """Fork while another thread holds a lock (taken with ``acquire``); the child's pid,
    or 0 in the child. The parent's holder lets go after the fork."""
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        acquire()
        holding.set()
        assert done.wait(10)
        release()

    holder = threading.Thread(target=hold)
    holder.start()
    pid = -1
    try:
        assert holding.wait(10)
        pid = _fork()
        if pid == 0:
            return 0
    finally:
        if pid != 0:
            done.set()
            holder.join(10)
    return pid


@pytest.mark.parametrize("held", ["limiter state", "metrics"])
def test_a_child_sends_through_the_chain_whatever_lock_a_parent_thread_held(held: str) -> None:
    # gunicorn --preload forks a parent that may be sending: a lock another
    # thread held at the fork stayed held in the child, where that thread
    # does not exist, and the child's first send waited on it for good.
    sender, locks = _chain_and_locks()
    with Outbound(None, sender) as ob:
        assert ob.reply_text(1, "parent").result(timeout=10).message_id == 1
        lock = locks[held]
        pid = _fork_while_held(lock.acquire, lock.release)
        if pid == 0:  # the child
            ok = False
            try:
                ok = ob.reply_text(2, "child").result(timeout=5).message_id == 1
            finally:
                _child_exit(ok)
        assert _wait_child(pid) == 0
        assert ob.reply_text(3, "parent again").result(timeout=10).message_id == 1


@pytest.mark.parametrize("held", ["event bus", "relay", "relay's log streaks"])
def test_a_child_relays_whatever_outbox_lock_a_parent_thread_held(
    held: str, tmp_path: Path
) -> None:
    # A relay built before the fork and started in the child (the README's
    # pre-fork servers): a lock of the outbox's that a parent thread held at
    # the fork (the bus's is taken for each row a parent relay delivers)
    # stayed held in the child, and its relay, subscribe and publish hung.
    store = SQLiteStore(str(tmp_path / "outbox.db"))
    bus = EventBus()
    delivered = threading.Event()
    bus.subscribe("note", lambda message: delivered.set())
    relay = Relay(store, bus, poll_interval=0.05)
    lock = {
        "event bus": bus._lock,
        "relay": relay._lock,
        "relay's log streaks": relay._streaks._lock,
    }[held]
    pid = _fork_while_held(lock.acquire, lock.release)
    if pid == 0:  # the child
        signal.alarm(30)  # a hung child dies, and the parent's wait ends
        ok = False
        try:
            bus.subscribe("other", print)
            relay._streaks.failed("test", "a failure in the child", exc_info=False)
            conn = store.connect()
            store.enqueue(conn, key="chat", type="note", payload={})
            conn.commit()
            conn.close()
            relay.start()
            ok = delivered.wait(10)
            ok = relay.stop(10) and ok
        finally:
            _child_exit(ok)
    assert _wait_child(pid) == 0
    store.close()


def test_a_fair_lock_a_parent_thread_held_is_free_in_the_child() -> None:
    # (PostgresRateLimiter's connection lock: each decision takes it.)
    lock = renewed_after_fork(FairLock())
    pid = _fork_while_held(lambda: lock.acquire(10), lock.release)
    if pid == 0:  # the child
        ok = False
        try:
            ok = lock.acquire(2)
            lock.release()
            ok = ok and lock.acquire(2)
        finally:
            _child_exit(ok)
    assert _wait_child(pid) == 0
    assert lock.acquire(10)
    lock.release()


def test_the_codec_a_connect_imports_is_imported_with_outbound() -> None:
    """socket.getaddrinfo imports the idna codec on the first connect to a host name:
    a fork while a sending thread did so left that import's lock held in the child,
    and the child's every send hung (7 of 8 forks 0 to 30 ms into a first send)."""
    code = "import sys, outbound; print('encodings.idna' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "True", done.stderr


def test_a_task_that_forks_leaves_the_child_its_own_pool() -> None:
    """A task forks: in the child, the thread that forked went on serving the rebuilt
    dispatcher without being counted (two tasks at once under max_inflight=1), and
    ran the parent's next task of its key."""
    read_end, write_end = os.pipe()
    ran_behind: list[int] = []

    def child_checks(forker: threading.Thread) -> None:
        ok = False
        try:
            forker.join(5.0)
            ok = not forker.is_alive()  # it left: the pool is the child's own
            running = [0, 0]  # now, most at once
            lock = threading.Lock()

            def task() -> None:
                with lock:
                    running[0] += 1
                    running[1] = max(running)
                time.sleep(0.02)  # the work of a send
                with lock:
                    running[0] -= 1

            futures = [d.submit(i, task) for i in range(4)]
            for future in futures:
                future.result(timeout=10)
            ok = ok and running[1] == 1 and ran_behind == [] and d.shutdown(10)
        finally:
            os.write(write_end, b"ok" if ok else b"no")
            os._exit(0)

    def forks() -> int:
        pid = _fork()
        if pid == 0:
            threading.Thread(target=child_checks, args=(threading.current_thread(),)).start()
        return pid

    d = Dispatcher(max_inflight=1)
    try:
        pid_future = d.submit("k", forks)
        behind = d.submit("k", lambda: ran_behind.append(1))
        pid = pid_future.result(timeout=10)
        assert pid != 0
        assert _wait_child(pid) == 0
        os.close(write_end)
        assert os.read(read_end, 16) == b"ok"
        behind.result(timeout=10)
        assert ran_behind == [1]
    finally:
        os.close(read_end)
        assert d.shutdown(10)
