"""Ctrl-C of `demo --direct` waits for the sends under way within the demo's stop
bound (5 s), as the outbox path does, not each send to its own 30 s timeout."""

import signal
import subprocess
import sys
import time
from pathlib import Path


def test_direct_demo_stops_within_the_stop_bound(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outbound",
            "demo",
            "--direct",
            "--latency",
            "1000",
            "--chats",
            "2",
            "--messages",
            "2",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # sends are under way once progress is printed
            if line.startswith("sent "):
                break
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("still running 60 s after Ctrl-C")
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == 130
    assert took < 12, f"Ctrl-C took {took:.1f} s to stop the demo"
