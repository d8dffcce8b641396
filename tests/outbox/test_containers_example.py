"""The seed's container flow (examples/containers) end to end, on both stores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from outbound.errors import OutboxFull
from outbound.outbox import EventBus, Relay

from .conftest import StoreFactory, wait_for

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "containers"
sys.path.insert(0, str(EXAMPLE))

from containers import App, ContainerWorker  # noqa: E402
from run import run_demo  # noqa: E402


def test_every_transition_and_both_limits(make_store: StoreFactory) -> None:
    store = make_store()
    try:
        report = run_demo(store, max_concurrency=2, say=lambda _: None)
    finally:
        App(store).drop_tables()
    # max_pending: the fourth create was refused and wrote nothing.
    assert report.rejected
    assert report.containers_after_reject == 3
    # max_concurrency: someone had to wait, and was retried without losing its place.
    assert report.deferred >= 2
    restarted, deleted, waited = report.roles
    t = report.transitions
    assert t[restarted] == [
        "pending",
        "creating",
        "running",
        "stopped",
        "start_pending",
        "starting",
        "running",
    ]
    assert t[deleted] == ["pending", "creating", "running", "deleted"]
    assert t[waited] == ["pending", "creating", "running"]  # pending -> pending left no trace
    assert len(t) == 3


def test_runs_with_one_command(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "run.py"), "--db", str(tmp_path / "c.db")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
    assert "refused, nothing written" in done.stdout


def test_a_full_outbox_still_takes_the_requests_that_free_capacity(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    app = App(store, max_pending=3)
    worker = ContainerWorker(app, max_concurrency=1)
    bus = EventBus()
    worker.subscribe(bus)
    s = app.status_of
    try:
        with Relay(store, bus, poll_interval=0.02, lease=10.0):
            first = app.create_container("c1")
            wait_for(lambda: s(first) == "running")
            # Its create request counts until the relay records it as sent,
            # just after the handler ran.
            wait_for(lambda: sum(store.status().counts[k] for k in ("pending", "processing")) == 0)
            waiting = [app.create_container(name) for name in ("c2", "c3", "c4")]
            with pytest.raises(OutboxFull):  # three creates wait for the one slot
                app.create_container("c5")
            app.stop_container(first)  # frees the slot: never refused
            wait_for(lambda: s(first) == "stopped")
            wait_for(lambda: [s(c) for c in waiting].count("running") == 1)
            (running,) = (c for c in waiting if s(c) == "running")
            app.delete_container(running)  # frees it again: the next one runs
            wait_for(lambda: s(running) == "deleted")
            wait_for(lambda: [s(c) for c in waiting].count("running") == 1)
            # A handler's effect shows before the relay records its row as
            # sent: the room is there once fewer than three rows of any type
            # are unfinished (the app counts its create requests).
            wait_for(lambda: sum(store.status().counts[k] for k in ("pending", "processing")) < 3)
            app.create_container("c5")  # two creates handled: room for one more
        assert sorted(s(c) for c in waiting) == ["deleted", "pending", "running"]
    finally:
        app.close()
        App(store).drop_tables()
