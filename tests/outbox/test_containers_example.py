"""The seed's container flow (examples/containers) end to end, on both stores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import StoreFactory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "containers"
sys.path.insert(0, str(EXAMPLE))

from containers import App  # noqa: E402
from run import run_demo  # noqa: E402


def test_every_transition_and_both_limits(make_store: StoreFactory) -> None:
    store = make_store(max_pending=3)
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
