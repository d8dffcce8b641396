"""One demo at a time per table, however --db reaches the file: a second run through a
symlink to it (or another spelling) is refused while the first runs, and the first
loses nothing (the second would mark its rows in flight dead)."""

import os
import subprocess
import sys
from pathlib import Path

from outbound.outbox import SQLiteStore


def _demo(db: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "outbound", "demo", "--db", db, "--chats", "2",
         "--messages", "20", "--latency", "0.05"],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_a_second_demo_through_a_symlink_is_refused(tmp_path: Path) -> None:
    SQLiteStore(str(tmp_path / "x.db")).close()
    os.symlink("x.db", tmp_path / "link.db")
    first = _demo("x.db", tmp_path)
    try:
        assert first.stdout is not None
        seen = []
        for line in first.stdout:  # relaying once it prints its progress
            seen.append(line)
            if line.startswith("sent "):
                break
        second = _demo(os.path.join(str(tmp_path), "link.db"), tmp_path)
        try:
            out2, _ = second.communicate(timeout=60)
        finally:
            second.kill()
        rest, _ = first.communicate(timeout=60)
    finally:
        first.kill()
    out1 = "".join(seen) + rest
    assert second.returncode == 1, out2
    assert "another demo is running" in out2, out2
    assert first.returncode == 0, out1
    assert "nothing lost: yes" in out1, out1
