"""``flask outbound worker``: the outbox relay of a Flask app, run as a real subprocess."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "flask_sqlalchemy",
    reason="Flask-SQLAlchemy is not installed: pip install 'outbound-dispatcher[flask-sqlalchemy]'",
)

from ratelimit_stores import wait_until
from relay_crash import LEFT_RUNNING
from worker_process import WorkerProcess

from outbound.outbox import SQLiteStore
from outbound.simulator import PlatformSimulator

APP = """
import os
import threading
import time

import relay_crash  # noqa: F401  (a relay that fails when a test says so)
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from outbound import PermanentSendError
from outbound.contrib.flask import Outbound

db = SQLAlchemy()
outbound = Outbound()


def greet(message):
    outbound.reply_text(message.payload["chat_id"], message.payload["text"]).result(timeout=10)


def stubborn(message):
    greet(message)
    threading.Event().wait(60)  # ignores the relay's cancellation


def impatient(message):
    # waits for its reply less than the platform takes to answer it
    outbound.reply_text(message.payload["chat_id"], message.payload["text"]).result(timeout=0.5)


def held(message):
    # holds its row until the test releases it (a file), for 30 s at most
    folder = os.environ["SHOP_DIR"]
    open(os.path.join(folder, "held"), "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(folder, "release")) and time.monotonic() < deadline:
        threading.Event().wait(0.02)


def fire(message):
    # queues its reply and returns at once: its row is sent
    outbound.reply_text(message.payload["chat_id"], message.payload["text"])


def refused(message):
    tail = message.payload.get("text", "")
    raise PermanentSendError(f"chat {message.payload['chat_id']} blocked the bot{tail}")


def create_app():
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["SHOP_DB"]
    app.config["OUTBOUND_TELEGRAM_TOKEN"] = os.environ.get("SHOP_TOKEN")
    app.config["OUTBOUND_TELEGRAM_URL"] = os.environ["SHOP_API"]
    app.config["OUTBOUND_RATE_LIMITS"] = None
    app.config["OUTBOUND_HANDLERS"] = {
        "greet": greet,
        "stubborn": "shop_app:stubborn",
        "impatient": impatient,
        "fire": fire,
        "held": held,
        "refused": "shop_app.refused",
    }
    db.init_app(app)
    outbound.init_app(app)
    return app
"""


class Worker(WorkerProcess):
    """``flask --app shop_app outbound worker ...`` with its output in files."""

    def __init__(
        self,
        folder: Path,
        platform: PlatformSimulator,
        *args: str,
        crash: Path | None = None,
        stdout: int | None = None,
        ignore_hangup: bool = False,
        token: bool = True,
    ) -> None:
        """``ignore_hangup``: started under ``nohup`` (SIGHUP ignored); not ``token``:
        the variable the app reads its bot token from is not set."""
        env = {
            **{k: v for k, v in os.environ.items() if k != "SHOP_TOKEN"},
            "PYTHONPATH": os.pathsep.join([str(folder), *sys.path]),
            "SHOP_DB": f"sqlite:///{folder / 'shop.db'}",
            "SHOP_API": platform.url,
            "OUTBOUND_TEST_RELAY_CRASH": str(crash) if crash is not None else "",
            "SHOP_DIR": str(folder),
        }
        if token:
            env["SHOP_TOKEN"] = platform.token
        argv = [sys.executable, "-m", "flask", "--app", "shop_app", "outbound", "worker", *args]
        if ignore_hangup:
            argv = ["nohup", *argv]
        super().__init__(argv, env=env, folder=folder, cwd=folder, stdout=stdout)


def run_until(worker: Worker, *lines: str) -> str:
    """Wait for a line matching each of ``lines``, in turn; stop ``worker`` (it
    exits 0); return its output."""
    try:
        for line in lines:
            worker.wait_for(line)
        assert worker.stop(timeout=20) == 0, worker.output()
    finally:
        logs = worker.close()
    return logs


@pytest.fixture
def shop(tmp_path: Path) -> Iterator[tuple[Path, SQLiteStore]]:
    (tmp_path / "shop_app.py").write_text(APP, encoding="utf-8")
    store = SQLiteStore(tmp_path / "shop.db")  # the outbox the app's worker relays
    try:
        yield tmp_path, store
    finally:
        store.close()


def enqueue(store: SQLiteStore, chat: int, type: str, text: str = "hi") -> int:
    conn = store.connect()
    with conn:
        row = store.enqueue(conn, key=str(chat), type=type, payload={"chat_id": chat, "text": text})
    conn.close()
    return row


def test_the_worker_delivers_logs_failures_and_stops_on_sigterm(
    shop: tuple[Path, SQLiteStore],
) -> None:
    folder, store = shop
    enqueue(store, 1, "greet", "first")
    enqueue(store, 1, "greet", "second")
    refused = enqueue(store, 2, "refused", "")
    with PlatformSimulator() as platform:
        worker = Worker(folder, platform, "--poll-interval", "0.1")
        try:
            assert platform.wait_received(2, chat_id=1, timeout=20), worker.output()
            worker.wait_for(
                rf"^outbound worker: outbox row {refused} rejected: .*chat 2 blocked the bot$"
            )
            assert worker.stop(timeout=20) == 0, worker.output()
        finally:
            logs = worker.close()
        assert [m["text"] for m in platform.received(1)] == ["first", "second"]
    assert "outbound worker: relaying table 'outbox' of SQLite" in logs
    assert "outbound worker: stopped; sent 2, retried 0, dead 1" in logs
    assert "Traceback" not in logs
    assert store.status().counts.get("sent") == 2


def test_an_error_text_cannot_forge_a_worker_line_or_drive_the_terminal(
    shop: tuple[Path, SQLiteStore],
) -> None:
    """Each failed delivery is one line: a line break in the error's text, a carriage
    return or an escape sequence is shown escaped."""
    folder, store = shop
    forged = "\noutbound worker: outbox row 999 sent\r\x1b[2K\x1b[31mred\u2028x\x85y"
    refused = enqueue(store, 2, "refused", forged)
    with PlatformSimulator() as platform:
        worker = Worker(folder, platform, "--poll-interval", "0.1")
        logs = run_until(worker, rf"^outbound worker: outbox row {refused} rejected: ")
    escaped = r"blocked the bot\noutbound worker: outbox row 999 sent\r\x1b[2K\x1b[31mred"
    assert escaped + r"\u2028x\x85y" in logs, logs
    assert not any(line.startswith("outbound worker: outbox row 999") for line in logs.splitlines())
    for raw in ("\x1b", "\r", "\u2028", "\x85"):
        assert raw not in logs


def test_the_worker_exits_within_its_drain_timeout(shop: tuple[Path, SQLiteStore]) -> None:
    folder, store = shop
    row = enqueue(store, 3, "stubborn")
    with PlatformSimulator() as platform:
        worker = Worker(folder, platform, "--poll-interval", "0.1", "--drain-timeout", "1")
        try:
            assert platform.wait_received(1, chat_id=3, timeout=20), worker.output()
            status = worker.stop(timeout=8)  # 1 s of drain, 1 s to force the stop
        finally:
            logs = worker.close()
    assert status == 1, logs
    assert "the drain did not finish in 1s" in logs
    (info,) = store.rows()
    assert (info.id, info.status) == (row, "processing")  # left to its lease


def test_the_worker_exits_within_its_drain_timeout_with_a_reply_being_sent(
    shop: tuple[Path, SQLiteStore],
) -> None:
    """A reply a handler queued and stopped waiting for, still being sent when the
    drain ended, was waited for again by the exit hooks (OUTBOUND_SHUTDOWN_TIMEOUT,
    10 s): the worker stopped 12 s after SIGTERM with --drain-timeout 2, status 0."""
    folder, store = shop
    row = enqueue(store, 4, "impatient")
    with PlatformSimulator(slow_rate=1.0, slow_delay=60.0) as platform:
        worker = Worker(folder, platform, "--poll-interval", "0.1", "--drain-timeout", "1")
        try:
            worker.wait_for(rf"^outbound worker: outbox row {row} attempt 1 failed")
            status = worker.stop(timeout=8)  # 1 s of drain; the rest is the exit's own
        finally:
            logs = worker.close()
    assert status == 1, logs
    assert "replies still being sent are given up" in logs
    assert "Traceback" not in logs


def test_a_second_signal_ends_the_wait_for_replies(shop: tuple[Path, SQLiteStore]) -> None:
    """A second SIGTERM while the worker waited for the replies its handlers queued
    was ignored: it waited out the rest of --drain-timeout."""
    folder, store = shop
    enqueue(store, 5, "fire")
    with PlatformSimulator(slow_rate=1.0, slow_delay=60.0) as platform:
        worker = Worker(folder, platform, "--poll-interval", "0.1", "--drain-timeout", "30")
        try:
            assert platform.wait_received(1, chat_id=5, timeout=20), worker.output()
            worker.proc.send_signal(signal.SIGTERM)
            worker.wait_for(r"^outbound worker: waiting for the replies still being sent")
            status = worker.stop(timeout=5)  # the second
        finally:
            logs = worker.close()
    assert status == 1, logs
    assert "replies still being sent are given up" in logs
    # (Not "the drain did not finish in 30s": it was cut short after a moment.)
    assert "a second signal cut the drain short" in logs
    assert "did not finish in 30s" not in logs


@pytest.mark.parametrize("handler", LEFT_RUNNING)
def test_a_relay_that_stops_on_an_error_ends_the_worker_at_once(
    shop: tuple[Path, SQLiteStore], handler: str
) -> None:
    folder, store = shop
    crash = folder / "crash"
    enqueue(store, 6, handler)
    slow: dict[str, Any] = {"slow_rate": 1.0, "slow_delay": 60.0} if handler == "fire" else {}
    with PlatformSimulator(**slow) as platform:
        worker = Worker(folder, platform, "--poll-interval", "0.1", crash=crash)
        try:
            assert platform.wait_received(1, chat_id=6, timeout=20), worker.output()
            crash.touch()
            status = worker.proc.wait(timeout=6)  # at most 1 s to force the stop
        finally:
            logs = worker.close()
    assert status == 1, logs
    assert "the outbox relay stopped on an error" in logs


def test_a_relay_that_stops_on_an_error_during_the_drain_ends_the_worker(
    shop: tuple[Path, SQLiteStore],
) -> None:
    """A failed relay's stop() says False at once, for good: the worker asked it again
    and again, a CPU busy, until --drain-timeout had passed."""
    folder, store = shop
    crash = folder / "crash"
    enqueue(store, 7, "held")
    with PlatformSimulator() as platform:
        worker = Worker(
            folder, platform, "--poll-interval", "0.1", "--drain-timeout", "60", crash=crash
        )
        try:
            assert wait_until((folder / "held").exists, 20), worker.output()
            worker.proc.send_signal(signal.SIGTERM)
            worker.wait_for(r"^outbound worker: stopping, draining")
            crash.touch()
            worker.wait_for(r"relay's loop failed")
            (folder / "release").touch()
            status = worker.proc.wait(timeout=10)  # not the drain's 60 s
        finally:
            logs = worker.close()
    assert status == 1, logs


def test_the_worker_drains_with_its_standard_output_gone(shop: tuple[Path, SQLiteStore]) -> None:
    """The line that says the worker is stopping could not be written (the reader of
    its standard output gone): the error skipped the drain, a reply refused, its
    row left to its lease."""
    folder, store = shop
    enqueue(store, 8, "held")
    read, write = os.pipe()
    with PlatformSimulator() as platform:
        worker = Worker(
            folder, platform, "--poll-interval", "0.1", "--drain-timeout", "30", stdout=write
        )
        os.close(write)
        try:
            assert wait_until((folder / "held").exists, 20), worker.output()
            _read_until(read, b"relaying table")  # (its first line, written after the start)
            os.close(read)  # (its standard output: a pipe with no reader now)
            read = -1
            worker.proc.send_signal(signal.SIGTERM)
            (folder / "release").touch()
            status = worker.proc.wait(timeout=20)
        finally:
            logs = worker.close()
            if read != -1:
                os.close(read)
    assert status == 0, logs
    assert [info.status for info in store.rows()] == ["sent"]


def _read_until(fd: int, text: bytes, timeout: float = 20.0) -> None:
    """Read the pipe ``fd`` until ``text`` has come; fails after ``timeout``."""
    got = b""
    deadline = time.monotonic() + timeout
    while text not in got:
        left = deadline - time.monotonic()
        assert left > 0, got
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, got  # (closed: the worker ended)
            got += chunk


def test_the_worker_warns_as_it_starts_that_no_sender_is_set(
    shop: tuple[Path, SQLiteStore],
) -> None:
    """The bot token read from an environment variable that is not set: the worker
    started, and each row whose handler replied failed until it was dead, with
    no word of it as it started. It says so (on standard error), and runs."""
    folder, _ = shop
    with PlatformSimulator() as platform:
        worker = Worker(folder, platform, "--poll-interval", "0.1", token=False)
        run_until(
            worker,
            r"^outbound worker: relaying table",
            r"^outbound worker: warning: no sender: OUTBOUND_TELEGRAM_TOKEN",
        )
        good = Worker(folder, platform, "--poll-interval", "0.1")
        logs = run_until(good, r"^outbound worker: relaying table")
    assert "no sender" not in logs


def test_the_worker_needs_handlers(tmp_path: Path) -> None:
    (tmp_path / "bare.py").write_text(
        "from flask import Flask\nfrom outbound.contrib.flask import Outbound\n"
        "app = Flask(__name__)\nOutbound(app)\n",
        encoding="utf-8",
    )
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "bare", "outbound", "worker"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "OUTBOUND_HANDLERS is empty: no outbox type to deliver" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--drain-timeout", "nan"),
        ("--drain-timeout", "inf"),
        ("--drain-timeout", "-1"),
        ("--lease", "nan"),
        ("--lease", "1e400"),
        ("--poll-interval", "nan"),
        ("--poll-interval", "0"),
        ("--batch-size", "0"),
        ("--max-inflight", "100000"),
        ("--max-concurrency", "0"),
    ],
)
def test_the_worker_refuses_numbers_the_relay_refuses(option: str, value: str) -> None:
    """``--drain-timeout nan`` was accepted (a drain that never ends on SIGTERM), as
    were ``--lease nan`` and ``--poll-interval nan``; refused at parsing now."""
    from flask import Flask  # noqa: PLC0415

    from outbound.contrib.flask import Outbound  # noqa: PLC0415

    app = Flask(__name__)
    Outbound(app)
    result = app.test_cli_runner().invoke(args=["outbound", "worker", option, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("nohup", [False, True])
def test_a_hangup_drains_the_worker_unless_it_is_ignored(
    shop: tuple[Path, SQLiteStore], nohup: bool
) -> None:
    # SIGHUP (the terminal that started it closed) ended the worker at once,
    # the rows it held left processing until their leases ended. It stops
    # as on SIGTERM now; under nohup (SIGHUP ignored) it goes on.
    folder, store = shop
    enqueue(store, 1, "greet", "first")
    with PlatformSimulator() as platform:
        worker = Worker(folder, platform, "--poll-interval", "0.1", ignore_hangup=nohup)
        try:
            assert platform.wait_received(1, chat_id=1, timeout=20), worker.output()
            worker.wait_for(r"^outbound worker: relaying table")
            worker.proc.send_signal(signal.SIGHUP)
            if nohup:
                enqueue(store, 1, "greet", "second")  # it goes on relaying
                assert platform.wait_received(2, chat_id=1, timeout=20), worker.output()
                assert worker.proc.poll() is None
                assert worker.stop(timeout=20) == 0, worker.output()
            else:
                assert worker.proc.wait(timeout=20) == 0, worker.output()
        finally:
            logs = worker.close()
    assert "outbound worker: stopped; sent" in logs
    assert "Traceback" not in logs
