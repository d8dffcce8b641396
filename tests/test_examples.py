"""The examples as a newcomer runs them: one command each, and the same command again."""

from __future__ import annotations

import importlib.util
import logging
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from outbound.simulator import PlatformSimulator, SimulatorConfig

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60.0


def run_example(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


def test_the_containers_example_runs_twice_on_one_sqlite_file(tmp_path: Path) -> None:
    db = str(tmp_path / "containers.db")
    for attempt in (1, 2):
        done = run_example(str(ROOT / "examples" / "containers" / "run.py"), "--db", db)
        assert done.returncode == 0, f"run {attempt}: {done.stdout}\n{done.stderr}"
        assert done.stdout.strip().endswith("ok")
        assert "c4 refused, nothing written" in done.stdout
        # Every run starts afresh: three containers, whatever ran before.
        assert done.stdout.count(": pending -> creating -> running") == 3


def _containers_at_once(db: str, runs: int = 2) -> list[tuple[int, str]]:
    """``run.py --db DB`` started ``runs`` times at once; each one's status and output."""
    processes = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "containers" / "run.py"), "--db", db],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(runs)
    ]
    results = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=TIMEOUT)
            results.append((process.returncode, out))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return results


def test_containers_examples_run_at_once_on_one_sqlite_file_never_meet(tmp_path: Path) -> None:
    db = tmp_path / "containers.db"
    for status, out in _containers_at_once(str(db)):
        assert status == 0, out
        assert out.count(": pending -> creating -> running") == 3
    # Each run dropped its own tables at the end.
    with sqlite3.connect(db) as conn:
        names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    assert names <= {"sqlite_sequence"}, names
    conn.close()


def test_containers_examples_run_at_once_on_postgres(postgres_url: str) -> None:
    for status, out in _containers_at_once(postgres_url):
        assert status == 0, out


def test_the_containers_example_keeps_its_tables_when_asked(tmp_path: Path) -> None:
    db = str(tmp_path / "containers.db")
    done = run_example(
        str(ROOT / "examples" / "containers" / "run.py"), "--db", db, "--table", "mine", "--keep"
    )
    assert done.returncode == 0, done.stderr
    assert f"tables kept: python -m outbound outbox --db {db} --table mine status" in done.stdout
    status = run_example("-m", "outbound", "outbox", "--db", db, "--table", "mine", "status")
    assert status.returncode == 0, status.stderr
    assert "sent" in status.stdout


def test_the_containers_example_says_what_is_wrong_with_db(tmp_path: Path) -> None:
    done = run_example(
        str(ROOT / "examples" / "containers" / "run.py"), "--db", str(tmp_path / "no" / "x.db")
    )
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot use the database ")
    assert len(done.stderr.strip().splitlines()) == 1


# -------------------------------------------------------------- flask_bot


@pytest.fixture(scope="module")
def flask_bot() -> ModuleType:
    pytest.importorskip(
        "flask", reason="Flask is not installed: pip install 'outbound-dispatcher[flask]'"
    )
    path = ROOT / "examples" / "flask_bot" / "app.py"
    spec = importlib.util.spec_from_file_location("flask_bot_app", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bot_app(flask_bot: ModuleType, request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """The example's app against a stand-in platform (``SimulatorConfig`` fields given as an
    indirect parameter)."""
    config = SimulatorConfig(**getattr(request, "param", {}))
    with PlatformSimulator(config) as platform:
        app = flask_bot.create_app(
            {
                "OUTBOUND_TELEGRAM_TOKEN": platform.token,
                "OUTBOUND_TELEGRAM_URL": platform.url,
                "OUTBOUND_RATE_LIMITS": None,
                "OUTBOUND_MAX_ATTEMPTS": 1,
            }
        )
        try:
            yield app, platform
        finally:
            with app.app_context():
                flask_bot.outbound.shutdown(TIMEOUT)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("not json", "the body must be a JSON object"),
        ([42, "hi"], "the body must be a JSON object"),
        ({"text": "hi"}, "chat_id is missing"),
        ({"chat_id": 1.5, "text": "hi"}, "chat_id must be a chat's integer id"),
        ({"chat_id": True, "text": "hi"}, "chat_id must be a chat's integer id"),
        ({"chat_id": "abc", "text": "hi"}, "or a public '@channelname', not 'abc'"),
        ({"chat_id": 10**30, "text": "hi"}, "is not a Telegram chat id"),
        ({"chat_id": 42}, "text is missing"),
        ({"chat_id": 42, "text": "  "}, "text must be a non-empty string"),
        ({"chat_id": 42, "text": "x" * 5000}, "text is 5000 characters long"),
        ({"message": {"chat": {}, "text": "hi"}}, "chat_id is missing"),
    ],
)
def test_the_flask_bot_answers_bad_input_with_400_naming_the_problem(
    bot_app: tuple[Any, Any], body: Any, problem: str
) -> None:
    app, platform = bot_app
    client = app.test_client()
    if isinstance(body, str):
        response = client.post("/hook", data=body, content_type="text/plain")
    else:
        response = client.post("/hook", json=body)
    assert response.status_code == 400
    assert response.get_json()["ok"] is False
    assert problem in response.get_json()["error"]
    assert platform.stats().delivered == 0


def test_the_flask_bot_takes_a_telegram_update(bot_app: tuple[Any, Any]) -> None:
    app, platform = bot_app
    update = {"update_id": 1, "message": {"chat": {"id": 42}, "text": "hello"}}
    assert app.test_client().post("/hook", json=update).status_code == 200
    assert platform.wait_received(1, chat_id=42, timeout=TIMEOUT)
    assert [m["text"] for m in platform.received(42)] == ["echo: hello"]


def _wait_for_record(caplog: pytest.LogCaptureFixture, text: str) -> logging.LogRecord:
    deadline = time.monotonic() + TIMEOUT
    while True:
        for record in caplog.records:
            if text in record.getMessage():
                return record
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.02)


@pytest.mark.parametrize("bot_app", [{"error_rate": 1.0}], indirect=True)
def test_a_reply_that_fails_is_logged_with_its_chat(
    bot_app: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = bot_app
    caplog.set_level(logging.WARNING)
    response = app.test_client().post("/hook", json={"chat_id": 42, "text": "hello"})
    assert response.status_code == 200  # queued; the platform fails it later
    record = _wait_for_record(caplog, "reply to chat 42 failed: TransientSendError")
    assert record.levelno == logging.WARNING


def _hook_with_reply_failed(
    flask_bot: ModuleType,
    bot_app: tuple[Any, Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
) -> Any:
    """POST an update to the hook, its reply's future already failed with ``error``;
    warnings go to ``caplog``."""
    app, _ = bot_app
    caplog.set_level(logging.WARNING)
    failed: Future[Any] = Future()
    failed.set_running_or_notify_cancel()
    failed.set_exception(error)
    monkeypatch.setattr(flask_bot.outbound, "reply_text", lambda chat_id, text: failed)
    return app.test_client().post("/hook", json={"chat_id": 42, "text": "hello"})


def test_a_reply_that_failed_at_the_platform_before_the_hook_answered_is_not_refused(
    flask_bot: ModuleType,
    bot_app: tuple[Any, Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The reply went out and failed at the platform before the hook looked
    # at its future (a fast platform, a thread switch): it was queued, so
    # 200 and a logged failure; a 503 would make the platform send the
    # update again, and the reply with it.
    from outbound.errors import TransientSendError  # noqa: PLC0415

    error = TransientSendError("sendMessage: HTTP 502: Bad Gateway")
    response = _hook_with_reply_failed(flask_bot, bot_app, caplog, monkeypatch, error)
    assert response.status_code == 200
    record = _wait_for_record(caplog, "reply to chat 42 failed: TransientSendError")
    assert record.levelno == logging.WARNING
    assert not any("refused" in r.getMessage() for r in caplog.records)


def test_a_reply_refused_for_a_full_queue_asks_the_platform_to_send_again(
    flask_bot: ModuleType,
    bot_app: tuple[Any, Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outbound.errors import QueueFull  # noqa: PLC0415

    response = _hook_with_reply_failed(flask_bot, bot_app, caplog, monkeypatch, QueueFull(42, 100))
    assert response.status_code == 503
    assert response.get_json()["error"].startswith("QueueFull: ")
    assert any("reply to chat 42 refused: QueueFull" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bot_app", [{"latency": 0.5}], indirect=True)
def test_a_reply_dropped_at_stop_is_logged_too(
    flask_bot: ModuleType, bot_app: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = bot_app
    caplog.set_level(logging.WARNING)
    client = app.test_client()
    for text in ("one", "two"):
        assert client.post("/hook", json={"chat_id": 7, "text": text}).status_code == 200
    with app.app_context():
        flask_bot.outbound.dispatcher.force_close()  # "two" waits behind "one": dropped
    _wait_for_record(caplog, "reply to chat 7 not sent: the bot stopped before it went out")
