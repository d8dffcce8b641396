"""The examples as a newcomer runs them: one command each, and the same command again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60.0


def run_example(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


def test_the_containers_example_runs_twice_on_one_sqlite_file(tmp_path: Path) -> None:
    db = str(tmp_path / "containers.db")
    for attempt in (1, 2):
        done = run_example(str(ROOT / "examples" / "containers" / "run.py"), "--db", db)
        assert done.returncode == 0, f"run {attempt}: {done.stdout}\n{done.stderr}"
        assert done.stdout.strip().endswith("ok")
        assert "c4 refused, nothing written" in done.stdout
        # Every run starts afresh: three containers, whatever ran before.
        assert done.stdout.count(": pending -> creating -> running") == 3


def test_the_containers_example_says_what_is_wrong_with_db(tmp_path: Path) -> None:
    done = run_example(
        str(ROOT / "examples" / "containers" / "run.py"), "--db", str(tmp_path / "no" / "x.db")
    )
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot use the database ")
    assert len(done.stderr.strip().splitlines()) == 1
