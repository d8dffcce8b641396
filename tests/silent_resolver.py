"""Run a script in a mount namespace whose only nameserver never answers.

The nameserver is a UDP socket on an address of loopback that no other run
takes (the network is shared), bound by the script's prologue
(:data:`PROLOGUE`), which also writes the ``resolv.conf`` mounted over the
real one in that namespace (``unshare -m``). ``queried`` (an event in the
script) is set once a query came.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROLOGUE = r"""
import random, socket, sys, threading

server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(100):
    address = f"127.53.{random.randrange(1, 255)}.{random.randrange(1, 255)}"
    try:
        server.bind((address, 53))
        break
    except OSError:
        continue
with open(sys.argv[1], "w") as conf:
    conf.write(f"nameserver {address}\noptions timeout:3 attempts:1\n")
queried = threading.Event()

def swallow():
    while True:
        server.recvfrom(4096)
        queried.set()

threading.Thread(target=swallow, daemon=True).start()
"""

#: A host name only a resolver could answer for (it never does here).
HOST = "outbound-test-host.invalid-for-tests.example"


def run_with_silent_resolver(body: str, tmp_path: Path, *args: str) -> str:
    """Run :data:`PROLOGUE` then ``body`` (``sys.argv[2:]`` is ``args``) in a mount
    namespace with the silent resolver; return its output, once it exited 0.
    Skips, saying why, without root, ``unshare`` or mount namespaces."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare: a mount namespace with a resolver of its own")
    conf = tmp_path / "resolv.conf"
    conf.write_text("")  # (written by the script, naming its nameserver)
    script = tmp_path / "inner.py"
    script.write_text(PROLOGUE + body)
    shell = f'mount --bind {conf} /etc/resolv.conf && exec "$0" "$@"'
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell, sys.executable, str(script), str(conf), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
