"""A Ctrl-C once a command is done, while the interpreter exits (waiting for
threads), ends the process at once and quietly: it printed the traceback of
``threading._shutdown`` (a second Ctrl-C after ``outbox serve`` stopped)."""

import signal
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import os, runpy, signal, sys, threading, time

def interrupt_the_exit():
    main = threading.main_thread()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main.ident)
        if frame is not None and frame.f_code.co_name == "_shutdown":
            os.kill(os.getpid(), signal.SIGINT)
            break
        time.sleep(0.001)
    threading.Event().wait(10)  # (the interpreter waits for this thread)

threading.Thread(target=interrupt_the_exit).start()
sys.argv = ["outbound", "outbox", "--db", sys.argv[1], "migrate"]
runpy.run_module("outbound", run_name="__main__")
"""


def test_a_ctrl_c_while_the_interpreter_exits_ends_it_without_a_traceback(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "o.db")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "created outbox" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr)
