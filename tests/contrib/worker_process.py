"""A worker command (Flask's or Django's) run in a subprocess, its output in files."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path


class WorkerProcess:
    """``argv`` started at once; stdout and stderr go to ``<name>.out``/``.err`` in ``folder``."""

    def __init__(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        folder: Path,
        name: str = "worker",
        cwd: Path | None = None,
        stdout: int | None = None,
    ) -> None:
        """``stdout``: a descriptor to give it as its standard output instead of a file."""
        self.out = (folder / f"{name}.out").open("w+")
        self.err = (folder / f"{name}.err").open("w+")
        self.proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=self.out if stdout is None else stdout, stderr=self.err
        )

    def output(self) -> str:
        """Its exit status (None while it runs) and everything it wrote so far."""
        text = []
        for f in (self.out, self.err):
            f.flush()
            f.seek(0)
            text.append(f.read())
        return f"worker exit {self.proc.poll()}:\n" + "\n".join(text)

    def wait_for(self, pattern: str, timeout: float = 20.0) -> None:
        """Until ``pattern`` shows in its output; fails if it exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output(), re.M):
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.05)

    def stop(self, timeout: float) -> int:
        """SIGTERM, then wait; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def close(self) -> str:
        """Kill it if it still runs; its output."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        logs = self.output()
        self.out.close()
        self.err.close()
        return logs
