"""After a demo run on --db was killed with rows in flight, the next run on the
same table marks those rows dead at once (it holds the table's demo lock)
instead of waiting out the dead relay's leases on the chats it sends to."""

import signal
import subprocess
import sys
import time
from pathlib import Path


def test_a_run_after_a_killed_run_does_not_wait_for_its_leases(tmp_path: Path) -> None:
    py = sys.executable
    first = subprocess.Popen(
        [py, "-m", "outbound", "demo", "--db", "d.db", "--chats", "20", "--messages", "5"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert first.stdout is not None
        for line in first.stdout:  # rows are claimed and being sent
            if line.startswith("sent "):
                break
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate()
    started = time.monotonic()
    second = subprocess.run(
        [py, "-m", "outbound", "demo", "--db", "d.db", "--chats", "2", "--messages", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    took = time.monotonic() - started
    assert second.returncode == 0, second.stderr
    assert took < 10, f"2 messages took {took:.1f} s:\n{second.stdout}"
