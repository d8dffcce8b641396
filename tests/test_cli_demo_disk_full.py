"""The demo on a file system that fills up (a small tmpfs, mounted in a mount
namespace of the run's own): the broadcast's commit failing was a traceback
(the driver's error, not the store's); the relay failing to write once the
broadcast was in left the progress lines counting nothing, and nothing on
standard error said why."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

DEMO = ["--chats", "40", "--messages", "20", "--global-rate", "400", "--chat-rate", "20"]


def _demo_on_a_tmpfs(tmp_path: Path, size: str) -> subprocess.Popen[str]:
    """``python -m outbound demo --db <a tmpfs of size>/d.db ...``, running."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare: a small file system of the test's own")
    folder = tmp_path / "small"
    folder.mkdir()
    shell = f'mount -t tmpfs -o size={size} tmpfs {folder} && exec "$0" "$@"'
    argv = [sys.executable, "-m", "outbound", "demo", "--db", str(folder / "d.db"), *DEMO]
    return subprocess.Popen(
        ["unshare", "-m", "sh", "-c", shell, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    ("size", "said"),
    # (116k: the demo's lock file itself cannot be written: an OSError's traceback)
    [("160k", "full"), ("116k", "No space left on device")],
)
def test_a_broadcast_the_disk_cannot_hold_is_one_line(tmp_path: Path, size: str, said: str) -> None:
    demo = _demo_on_a_tmpfs(tmp_path, size)
    try:
        _out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    if demo.returncode != 0 and "unshare failed" in err:
        pytest.skip(f"no mount namespace here: {err.strip()}")
    assert "Traceback" not in err, err
    assert demo.returncode == 1, err
    assert err.strip().splitlines() == [err.strip()], err
    assert said in err


def test_a_relay_that_cannot_write_says_so(tmp_path: Path) -> None:
    demo = _demo_on_a_tmpfs(tmp_path, "300k")
    lines: queue.Queue[str] = queue.Queue()
    stderr = demo.stderr
    assert stderr is not None

    def read() -> None:
        for line in stderr:
            lines.put(line)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        said = ""
        while "full" not in said:
            try:
                said = lines.get(timeout=45)
            except queue.Empty:
                pytest.fail("nothing on standard error while the relay could not write")
            if "unshare failed" in said:
                pytest.skip(f"no mount namespace here: {said.strip()}")
        assert said.startswith("demo: "), said
        demo.send_signal(signal.SIGINT)
        demo.wait(timeout=30)
    finally:
        if demo.poll() is None:
            demo.kill()
        demo.communicate()
        reader.join(10)
