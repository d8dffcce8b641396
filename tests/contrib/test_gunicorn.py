"""A real gunicorn (--preload, 2 gthread workers, 4 threads each) serving the example bot.

The bot (``examples/flask_bot/app.py``) answers ``POST /hook`` as soon as its
reply is queued; the replies go to a stand-in platform running in this
process. Each chat's updates come from one client thread on one keep-alive
connection, each sent after the previous one was answered, so the order
the platform records is the order in which the bot accepted them.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from outbound.simulator import PlatformSimulator

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("gunicorn") is None,
        reason="gunicorn is not installed: pip install gunicorn",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("flask") is None,
        reason="Flask is not installed: pip install 'outbound-dispatcher[flask]'",
    ),
    pytest.mark.skipif(os.name != "posix", reason="gunicorn runs on POSIX only"),
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flask_bot"
GRACEFUL_TIMEOUT = 10
CHATS = 8
PER_CHAT = 15


def _has_setting(name: str) -> bool:
    from gunicorn.config import KNOWN_SETTINGS  # noqa: PLC0415 - gunicorn is optional

    return any(setting.name == name for setting in KNOWN_SETTINGS)


def _read_lines(stream: IO[str], lines: queue.Queue[str], log: list[str]) -> None:
    for line in stream:
        log.append(line)
        lines.put(line)


def _wait_for(lines: queue.Queue[str], log: list[str], text: str, count: int) -> None:
    """Wait until ``count`` lines of gunicorn's log contain ``text`` (bounded)."""
    deadline = time.monotonic() + 20.0
    seen = 0
    while seen < count:
        left = deadline - time.monotonic()
        try:
            line = lines.get(timeout=max(0.0, left))
        except queue.Empty:
            pytest.fail(f"gunicorn did not log {text!r} x{count} in 20 s:\n{''.join(log)}")
        seen += text in line


def _chat_client(port: int, chat: int, pids: list[int], errors: list[BaseException]) -> None:
    """Send one chat's updates in order on one keep-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
    try:
        for n in range(PER_CHAT):
            body = json.dumps({"chat_id": chat, "text": f"c{chat} m{n}"})
            conn.request("POST", "/hook", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = json.loads(response.read())
            assert response.status == 200, data
            pids.append(data["pid"])
    except BaseException as error:
        errors.append(error)
    finally:
        conn.close()


def test_gunicorn_preload_workers_keep_order_and_drain_on_sigterm() -> None:
    log: list[str] = []
    lines: queue.Queue[str] = queue.Queue()
    reader: threading.Thread | None = None
    proc: subprocess.Popen[str] | None = None
    with PlatformSimulator(latency=0.25) as platform:
        # gunicorn cannot bind port 0; it takes an already listening socket instead.
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        env = {
            **os.environ,
            "OUTBOUND_TELEGRAM_TOKEN": platform.token,
            "OUTBOUND_TELEGRAM_URL": platform.url,
            "OUTBOUND_RATE_LIMITS": "none",
        }
        command = [
            sys.executable,
            "-m",
            "gunicorn",
            "--config",
            str(EXAMPLE / "gunicorn.conf.py"),
            "--chdir",
            str(EXAMPLE),
            "--bind",
            f"fd://{listener.fileno()}",
            "--preload",
            "--workers",
            "2",
            "--worker-class",
            "gthread",
            "--threads",
            "4",
            "--keep-alive",
            "30",
            "--graceful-timeout",
            str(GRACEFUL_TIMEOUT),
            "--log-level",
            "info",
            "app:create_app()",
        ]
        if _has_setting("control_socket_disable"):
            # gunicorn >= 24 serves a control socket from a thread of the master.
            command[-1:-1] = ["--no-control-socket"]
        try:
            proc = subprocess.Popen(
                command,
                env=env,
                pass_fds=[listener.fileno()],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            listener.close()
            assert proc.stderr is not None
            reader = threading.Thread(target=_read_lines, args=(proc.stderr, lines, log))
            reader.start()
            _wait_for(lines, log, "Booting worker with pid", 2)

            pids: dict[int, list[int]] = {chat: [] for chat in range(1, CHATS + 1)}
            errors: list[BaseException] = []
            clients = [
                threading.Thread(target=_chat_client, args=(port, chat, pids[chat], errors))
                for chat in pids
            ]
            for client in clients:
                client.start()
            for client in clients:
                client.join(30.0)
            assert not any(client.is_alive() for client in clients)
            assert not errors, errors
            total = CHATS * PER_CHAT
            # One connection per chat, so one worker per chat: the dispatcher's
            # per-chat order is the whole order.
            assert all(len(set(p)) == 1 for p in pids.values()), pids
            workers = {p[0] for p in pids.values()}
            assert proc.pid not in workers

            # The master imported the app (--preload) but started no thread.
            tasks = Path(f"/proc/{proc.pid}/task")
            if tasks.is_dir():
                assert len(list(tasks.iterdir())) == 1

            # Every update was accepted; most replies are still queued.
            delivered_before = len(platform.all_received())
            assert delivered_before < total
            platform.configure(latency=0.005)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=GRACEFUL_TIMEOUT + 5)
            elapsed = time.monotonic() - started
            assert code == 0, "".join(log)
            assert elapsed < GRACEFUL_TIMEOUT, elapsed

            # Nothing accepted was lost, and each chat got its replies in order.
            assert len(platform.all_received()) == total, "".join(log)
            for chat in pids:
                texts = [m["text"] for m in platform.received(chat)]
                assert texts == [f"echo: c{chat} m{n}" for n in range(PER_CHAT)]
            assert "left unsent" not in "".join(log)
        finally:
            listener.close()
            if proc is not None:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
                elif proc.returncode != 0:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # orphaned workers, if any
                    except ProcessLookupError:
                        pass
            if reader is not None:
                reader.join(10.0)
            if proc is not None and proc.stderr is not None:
                proc.stderr.close()
