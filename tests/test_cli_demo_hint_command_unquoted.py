"""The demo's closing hint is a command to copy: with `--db "my demo.db"` it is
quoted, and running it as printed works."""

import shlex
import subprocess
import sys
from pathlib import Path

from outbound_process import FAST, outbound


def test_the_printed_status_command_runs(tmp_path: Path) -> None:
    rc, out, err = outbound(
        "demo", "--db", "my demo.db", "--chats", "1", "--messages", "1", *FAST, cwd=tmp_path
    )
    assert rc == 0, (rc, err)
    hint = [line for line in out.splitlines() if line.startswith("the outbox stays in")][-1]
    command = hint.split(": ", 1)[1]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "outbound"], argv
    done = subprocess.run(
        [sys.executable, *argv[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, (command, done.stderr)
