"""The Flask extension: config, lazy start, several apps, replies, app contexts, the outbox."""

from __future__ import annotations

import contextvars
import gc
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "flask", reason="Flask is not installed: pip install 'outbound-dispatcher[flask]'"
)

import flask

from outbound import DispatcherClosed, QueueFull
from outbound.contrib import flask as outbound_flask
from outbound.contrib.flask import CONFIG_DEFAULTS, FlaskOutbound, Outbound
from outbound.messages import SendRequest, SendResult
from outbound.ratelimit import TELEGRAM, Rate, RateLimits
from outbound.simulator import PlatformSimulator

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 10.0


@pytest.fixture
def platform() -> Iterator[PlatformSimulator]:
    with PlatformSimulator(latency=0.002) as sim:
        yield sim


AppMaker = Callable[..., flask.Flask]


@pytest.fixture
def make_app(platform: PlatformSimulator) -> Iterator[AppMaker]:
    """Build apps on the stand-in platform; shut each one's outbound down afterwards."""
    made: list[tuple[FlaskOutbound, flask.Flask]] = []

    def make(ext: FlaskOutbound | None = None, name: str = "bot", **config: Any) -> flask.Flask:
        ext = ext if ext is not None else Outbound()
        app = flask.Flask(name)
        app.config.update(
            OUTBOUND_TELEGRAM_TOKEN=platform.token,
            OUTBOUND_TELEGRAM_URL=platform.url,
            OUTBOUND_RATE_LIMITS="none",
        )
        app.config.update(config)
        ext.init_app(app)
        made.append((ext, app))
        return app

    yield make
    for ext, app in made:
        assert ext.shutdown(TIMEOUT, app=app)


def _ext(app: flask.Flask) -> FlaskOutbound:
    ext = app.extensions["outbound"].ext
    assert isinstance(ext, FlaskOutbound)
    return ext


def _add_hook(app: flask.Flask) -> None:
    ext = _ext(app)

    @app.post("/hook")
    def hook() -> Any:
        body = flask.request.get_json()
        future = ext.reply_text(body["chat_id"], body["text"])
        if future.done() and future.exception() is not None:
            return {"error": repr(future.exception())}, 503
        return {"ok": True}


class RecordingSender:
    """A sender that records requests; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: list[SendRequest] = []
        self.closed = False

    def send(self, request: SendRequest) -> SendResult:
        with self.lock:
            self.sent.append(request)
            return SendResult(len(self.sent))

    def close(self) -> None:
        self.closed = True


# --------------------------------------------------------------------- config


def test_init_app_sets_defaults_and_stores_state(make_app: AppMaker) -> None:
    ext = Outbound()
    app = make_app(ext)
    for key, value in CONFIG_DEFAULTS.items():
        assert key in app.config
        if key not in ("OUTBOUND_TELEGRAM_TOKEN", "OUTBOUND_TELEGRAM_URL", "OUTBOUND_RATE_LIMITS"):
            assert app.config[key] == value
    assert app.extensions["outbound"].ext is ext
    assert Outbound is FlaskOutbound
    with app.app_context():
        d = ext.dispatcher
        assert (d.max_inflight, d.queue_size, d.send_timeout) == (32, 64, 30.0)
        assert d.exit_timeout == 10.0


def test_config_values_reach_the_dispatcher(make_app: AppMaker) -> None:
    app = make_app(
        OUTBOUND_MAX_INFLIGHT=3,
        OUTBOUND_QUEUE_SIZE=5,
        OUTBOUND_SEND_TIMEOUT=2.5,
        OUTBOUND_SHUTDOWN_TIMEOUT=None,
    )
    with app.app_context():
        d = _ext(app).dispatcher
        assert (d.max_inflight, d.queue_size, d.send_timeout, d.exit_timeout) == (3, 5, 2.5, None)


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("OUTBOUND_MAX_INFLIGHT", 0, ValueError, "OUTBOUND_MAX_INFLIGHT must be >= 1"),
        ("OUTBOUND_MAX_INFLIGHT", "8", TypeError, "OUTBOUND_MAX_INFLIGHT must be an int"),
        ("OUTBOUND_QUEUE_SIZE", True, TypeError, "OUTBOUND_QUEUE_SIZE must be an int"),
        ("OUTBOUND_MAX_ATTEMPTS", -1, ValueError, "OUTBOUND_MAX_ATTEMPTS must be >= 1"),
        ("OUTBOUND_SEND_TIMEOUT", -1, ValueError, "OUTBOUND_SEND_TIMEOUT must be a finite"),
        ("OUTBOUND_SEND_TIMEOUT", "30", TypeError, "OUTBOUND_SEND_TIMEOUT must be a number"),
        ("OUTBOUND_SHUTDOWN_TIMEOUT", float("nan"), ValueError, "OUTBOUND_SHUTDOWN_TIMEOUT"),
        ("OUTBOUND_PLATFORM", "slack", ValueError, "OUTBOUND_PLATFORM must be one of"),
        ("OUTBOUND_TELEGRAM_TOKEN", "", ValueError, "OUTBOUND_TELEGRAM_TOKEN must be"),
        ("OUTBOUND_TELEGRAM_TOKEN", "a/b", ValueError, "OUTBOUND_TELEGRAM_TOKEN must be"),
        # Each would change the request's URL (a header, a query, a fragment).
        ("OUTBOUND_TELEGRAM_TOKEN", "1:ab c", ValueError, "OUTBOUND_TELEGRAM_TOKEN must be"),
        ("OUTBOUND_TELEGRAM_TOKEN", "1:a\nX-Evil: 1", ValueError, "no space"),
        ("OUTBOUND_TELEGRAM_TOKEN", "1:abc?x=1#", ValueError, "OUTBOUND_TELEGRAM_TOKEN must be"),
        ("OUTBOUND_TELEGRAM_TOKEN", 123, ValueError, "not int"),
        ("OUTBOUND_TELEGRAM_URL", "ftp://x", ValueError, "OUTBOUND_TELEGRAM_URL must be"),
        ("OUTBOUND_RATE_LIMITS", "fast", ValueError, "OUTBOUND_RATE_LIMITS must be one of"),
        ("OUTBOUND_RATE_LIMITS", 30, TypeError, "OUTBOUND_RATE_LIMITS must be a preset"),
        ("OUTBOUND_OUTBOX_TABLE", "Bad-Name", ValueError, "OUTBOUND_OUTBOX_TABLE"),
        ("OUTBOUND_OUTBOX_MAX_PENDING", 0, ValueError, "OUTBOUND_OUTBOX_MAX_PENDING"),
        ("OUTBOUND_MAX_INFLIGTH", 8, ValueError, r"did you mean OUTBOUND_MAX_INFLIGHT\?"),
        ("OUTBOUND_HANDLERS", ["greet"], TypeError, "OUTBOUND_HANDLERS must be a dict"),
        ("OUTBOUND_HANDLERS", {"greet": 3}, TypeError, r"OUTBOUND_HANDLERS\['greet'\] must be"),
        ("OUTBOUND_HANDLERS", {"greet": "os:"}, ValueError, "path of Python names"),
        ("OUTBOUND_HANDLERS", {"greet": "shop handlers:x"}, ValueError, "path of Python names"),
        ("OUTBOUND_HANDLERS", {"greet": "greet"}, ValueError, "path of Python names"),
    ],
)
def test_bad_config_fails_in_init_app(key: str, value: Any, error: type, match: str) -> None:
    app = flask.Flask("bad")
    app.config["OUTBOUND_TELEGRAM_TOKEN"] = "123:abc"
    app.config[key] = value
    ext = Outbound()
    with pytest.raises(error, match=match):
        ext.init_app(app)
    assert "outbound" not in app.extensions
    del app.config[key]
    app.config["OUTBOUND_TELEGRAM_TOKEN"] = "123:abc"
    ext.init_app(app)  # fixed: registers


def test_no_token_registers_and_a_reply_says_what_is_missing() -> None:
    """An app that only uses the outbox, or its own sender, needs no Telegram token."""
    app = flask.Flask("no_token")
    ext = Outbound(app)  # registers: no token is needed to register
    assert app.config["OUTBOUND_TELEGRAM_TOKEN"] is None
    try:
        with app.app_context():
            future = ext.reply_text(1, "hi")  # never raises: the refusal is in the future
            assert future.done()
            with pytest.raises(ValueError, match="OUTBOUND_TELEGRAM_TOKEN is not set"):
                future.result(timeout=0)
            assert not ext.started()
    finally:
        assert ext.shutdown(TIMEOUT, app=app)
    factory_app = flask.Flask("with_factory")
    sender = RecordingSender()
    with_factory = Outbound(factory_app, sender_factory=lambda app: sender)
    try:
        with factory_app.app_context():
            assert with_factory.reply_text(2, "hi").result(timeout=TIMEOUT).message_id == 1
    finally:
        assert with_factory.shutdown(TIMEOUT, app=factory_app)
    assert sender.sent == [SendRequest(2, sender.sent[0].message)]


def test_submit_and_the_dispatcher_need_no_sender() -> None:
    """submit() sends nothing: it ran the sender factory first, and without a token
    raised the token's ValueError (documented: QueueFull or DispatcherClosed only)."""
    app = flask.Flask("submit_only")
    ext = Outbound(app)
    try:
        with app.app_context():
            assert ext.submit("k", lambda: 41 + 1).result(timeout=TIMEOUT) == 42
            dispatcher = ext.dispatcher
            assert ext.started()
            # A reply still says what is missing; the dispatcher stays.
            with pytest.raises(ValueError, match="OUTBOUND_TELEGRAM_TOKEN is not set"):
                ext.reply_text(1, "hi").result(timeout=TIMEOUT)
            assert ext.dispatcher is dispatcher
    finally:
        assert ext.shutdown(TIMEOUT, app=app)
    # With a factory: it runs at the first reply, on the dispatcher submit started.
    made: list[RecordingSender] = []

    def factory(app: flask.Flask) -> RecordingSender:
        made.append(RecordingSender())
        return made[-1]

    other = flask.Flask("submit_then_reply")
    with_factory = Outbound(other, sender_factory=factory)
    try:
        with other.app_context():
            assert with_factory.submit("k", lambda: 1).result(timeout=TIMEOUT) == 1
            dispatcher = with_factory.dispatcher
            assert made == []
            assert with_factory.reply_text(2, "hi").result(timeout=TIMEOUT).message_id == 1
            assert with_factory.reply_text(2, "again").result(timeout=TIMEOUT).message_id == 2
            assert with_factory.dispatcher is dispatcher
            assert len(made) == 1
    finally:
        assert with_factory.shutdown(TIMEOUT, app=other)
    assert made[0].closed


def test_racing_first_replies_never_close_the_one_sender_a_factory_returns() -> None:
    """A factory may return one sender it made once (a module's). Two first replies
    racing each got it; the one whose runtime lost closed it, the sender kept."""
    shared = RecordingSender()
    both = threading.Barrier(2, timeout=TIMEOUT)

    def factory(app: flask.Flask) -> RecordingSender:
        both.wait()  # two requests at once on a fresh worker
        return shared

    app = flask.Flask("shared_sender")
    ext = Outbound(app, sender_factory=factory)
    futures: list[Future[SendResult]] = []

    def reply() -> None:
        with app.app_context():
            futures.append(ext.reply_text(1, "hi"))

    try:
        threads = [threading.Thread(target=reply) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert [f.result(timeout=TIMEOUT).message_id for f in futures] != []
        assert not shared.closed
        with app.app_context():
            assert ext.reply_text(1, "later").result(timeout=TIMEOUT).message_id == 3
    finally:
        assert ext.shutdown(TIMEOUT, app=app)
    assert shared.closed  # by the shutdown, once


def test_an_outbox_only_app_needs_no_token(tmp_path: Path) -> None:
    fsa = pytest.importorskip("flask_sqlalchemy")
    db = fsa.SQLAlchemy()
    app = flask.Flask("outbox_only")
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'app.db'}"
    db.init_app(app)
    ext = Outbound(app)
    try:
        with app.app_context():
            ext.create_outbox()
            ext.enqueue(key="chat-1", type="greet", payload={"text": "hi"})
            db.session.commit()
            assert [row.key for row in ext.outbox_store().rows()] == ["chat-1"]
            db.engine.dispose()
    finally:
        assert ext.shutdown(TIMEOUT, app=app)


def test_rate_limit_presets_and_objects() -> None:
    limits = RateLimits(per_chat=Rate(2))
    for value, expected in [
        ("telegram", TELEGRAM),
        ("TELEGRAM", TELEGRAM),
        ("none", None),
        (None, None),
        (limits, limits),
    ]:
        app = flask.Flask("limits")
        app.config.update(OUTBOUND_TELEGRAM_TOKEN="123:abc", OUTBOUND_RATE_LIMITS=value)
        Outbound(app)
        assert app.extensions["outbound"].settings.rate_limits == expected


def test_misuse_raises_runtime_error(make_app: AppMaker) -> None:
    ext = Outbound()
    app = make_app(ext)
    with pytest.raises(RuntimeError, match="already registered"):
        ext.init_app(app)
    with pytest.raises(RuntimeError, match="application context"):
        ext.reply_text(1, "no app")
    other = flask.Flask("other")
    with other.app_context(), pytest.raises(RuntimeError, match="not registered"):
        ext.reply_text(1, "wrong app")
    with app.app_context(), pytest.raises(RuntimeError, match="another outbound extension"):
        Outbound().reply_text(1, "wrong extension")


# ---------------------------------------------------------- threads and lazy start


def _python(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter (from the project's root); fail if it fails."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        cwd=ROOT,
    )


def test_import_and_init_app_start_no_thread() -> None:
    code = """
import json, threading
before = threading.active_count()
import flask
from outbound.contrib.flask import Outbound
from outbound.messages import SendResult
after_import = threading.active_count()
class Sender:
    def send(self, request):
        return SendResult(1)
ext = Outbound()
apps = [flask.Flask(f"app{i}") for i in range(2)]
for app in apps:
    ext.init_app(app)
after_init = threading.active_count()
with apps[0].app_context():
    ext.dispatcher
    after_dispatcher = threading.active_count()
print(json.dumps([before, after_import, after_init, after_dispatcher]))
"""
    code = code.replace("ext = Outbound()", "ext = Outbound(sender_factory=lambda app: Sender())")
    out = _python(code, timeout=30.0)
    before, after_import, after_init, after_dispatcher = json.loads(out.stdout)
    assert before == after_import == after_init == after_dispatcher == 1


def test_shutdown_all_past_its_timeout_gives_up_and_the_exit_does_not_wait_again() -> None:
    """gunicorn's worker_exit calls shutdown_all(0.75 * graceful_timeout); when that ran
    out, interpreter exit gave the dispatcher its exit_timeout (10 s) on top, and the
    master killed the worker mid-send."""
    code = """
import json, sys, threading, time
import flask
from outbound.contrib.flask import Outbound, shutdown_all
from outbound.messages import SendResult
class Slow:
    def send(self, request):
        threading.Event().wait(0.5)  # a slow platform (time passing, not a sync)
        return SendResult(1)
ext = Outbound(sender_factory=lambda app: Slow())
app = flask.Flask("exiting")
app.config["OUTBOUND_RATE_LIMITS"] = "none"
ext.init_app(app)
with app.app_context():
    futures = [ext.reply_text(1, f"m{i}") for i in range(20)]
done = shutdown_all(1.0)
print(json.dumps([done, sum(f.cancelled() for f in futures)]), flush=True)
print(time.monotonic(), flush=True)
"""
    out = _python(code, timeout=60.0)
    exited = time.monotonic()  # CLOCK_MONOTONIC: one clock for both processes
    status, returned = out.stdout.splitlines()
    done, cancelled = json.loads(status)
    assert done is False
    assert cancelled >= 15  # about two were sent in the second, one was under way
    # From shutdown_all's return to the process's end: not exit_timeout (10 s) more.
    assert exited - float(returned) < 5.0, out.stderr


def test_shutdown_all_with_every_send_ended_is_true_at_once() -> None:
    """gunicorn's worker_exit with nothing left: True at a timeout of 0, though the
    dispatcher's idle threads have yet to leave (no "replies left unsent" warning)."""
    code = """
import json
import flask
from outbound.contrib.flask import Outbound, shutdown_all
from outbound.messages import SendResult
class Sender:
    def send(self, request):
        return SendResult(1)
ext = Outbound(sender_factory=lambda app: Sender())
app = flask.Flask("idle")
app.config["OUTBOUND_RATE_LIMITS"] = "none"
ext.init_app(app)
with app.app_context():
    futures = [ext.reply_text(i, "x") for i in range(4)]
    results = [f.result(timeout=10).message_id for f in futures]
    threads = ext.dispatcher.stats().threads
print(json.dumps([results, threads, shutdown_all(0), shutdown_all(0)]), flush=True)
"""
    out = _python(code, timeout=60.0)
    results, threads, first, again = json.loads(out.stdout)
    assert results == [1, 1, 1, 1]
    assert threads > 0  # idle threads, still there when shutdown_all(0) ran
    assert (first, again) == (True, True)


def test_dispatcher_starts_on_first_reply(make_app: AppMaker, platform: PlatformSimulator) -> None:
    before = threading.active_count()
    ext = Outbound()
    app = make_app(ext)
    assert threading.active_count() == before
    assert not ext.started(app)
    with app.app_context():
        assert not ext.started()
        future = ext.reply_text(7, "first")
        assert ext.started()
        result = future.result(timeout=TIMEOUT)
    assert isinstance(result, SendResult)
    assert result.message_id == 1
    assert [m["text"] for m in platform.received(7)] == ["first"]
    names = [t.name for t in threading.enumerate()]
    assert any(name.startswith("outbound-bot") for name in names)


def test_an_app_shut_down_is_not_kept(platform: PlatformSimulator) -> None:
    """An app factory run again and again (tests, a reloader): each app that
    replied was kept for the process's life, shut down or not (its state,
    dispatcher, sender: 12 to 20 KB each). One shut down and dropped is not;
    one not shut down is kept for shutdown_all()."""
    from outbound.contrib import flask as flask_module  # noqa: PLC0415

    kept: list[weakref.ref[Any]] = []
    for _ in range(3):
        app = flask.Flask("factory")
        app.config.update(
            OUTBOUND_TELEGRAM_TOKEN=platform.token,
            OUTBOUND_TELEGRAM_URL=platform.url,
            OUTBOUND_RATE_LIMITS="none",
        )
        ext = Outbound(app)
        with app.app_context():
            ext.reply_text(7, "hi").result(TIMEOUT)
        state = app.extensions["outbound"]
        assert state in flask_module._running  # (for shutdown_all, until shut down)
        assert ext.shutdown(TIMEOUT, app=app)
        assert state not in flask_module._running
        kept.append(weakref.ref(state))
        del app, ext, state
    gc.collect()
    assert [ref() for ref in kept] == [None, None, None]


def test_two_apps_in_one_process_have_their_own_dispatchers(
    make_app: AppMaker, platform: PlatformSimulator
) -> None:
    ext = Outbound()
    one = make_app(ext, name="one", OUTBOUND_QUEUE_SIZE=4)
    two = make_app(ext, name="two", OUTBOUND_QUEUE_SIZE=8)
    with one.app_context():
        d1 = ext.dispatcher
        f1 = ext.reply_text(1, "from one")
    with two.app_context():
        d2 = ext.dispatcher
        f2 = ext.reply_text(2, "from two")
    assert d1 is not d2
    assert (d1.queue_size, d2.queue_size) == (4, 8)
    assert f1.result(timeout=TIMEOUT).message_id == 1
    assert f2.result(timeout=TIMEOUT).message_id == 1
    assert ext.shutdown(TIMEOUT, app=one)
    with one.app_context():
        assert isinstance(ext.reply_text(1, "late").exception(timeout=0), DispatcherClosed)
    with two.app_context():
        assert ext.reply_text(2, "still open").result(timeout=TIMEOUT).message_id == 2


# A module-level extension, as in an application package.
factory_ext = Outbound()


def create_app(platform: PlatformSimulator, name: str, **config: Any) -> flask.Flask:
    app = flask.Flask(name)
    app.config.update(
        OUTBOUND_TELEGRAM_TOKEN=platform.token,
        OUTBOUND_TELEGRAM_URL=platform.url,
        OUTBOUND_RATE_LIMITS="none",
        **config,
    )
    factory_ext.init_app(app)
    _add_hook(app)
    return app


def test_app_factory(platform: PlatformSimulator) -> None:
    apps = [create_app(platform, f"factory{i}", OUTBOUND_QUEUE_SIZE=1 + i) for i in range(2)]
    try:
        for i, app in enumerate(apps):
            response = app.test_client().post("/hook", json={"chat_id": 50 + i, "text": "hi"})
            assert response.status_code == 200
        assert platform.wait_received(2, timeout=TIMEOUT)
        assert [m["text"] for m in platform.received(50)] == ["hi"]
        assert [m["text"] for m in platform.received(51)] == ["hi"]
        sizes = []
        for app in apps:
            with app.app_context():
                sizes.append(factory_ext.dispatcher.queue_size)
        assert sizes == [1, 2]
    finally:
        assert outbound_flask.shutdown_all(TIMEOUT)


# ------------------------------------------------------------------ sending


def test_replies_from_requests_arrive_in_per_chat_order(
    make_app: AppMaker, platform: PlatformSimulator
) -> None:
    platform.configure(latency=0.003)
    app = make_app(OUTBOUND_MAX_INFLIGHT=4)
    _add_hook(app)
    chats: list[int | str] = [11, 12, 13, -14, "@channel"]
    per_chat = 12
    errors: list[BaseException] = []

    def client(chat: int | str) -> None:
        try:
            test_client = app.test_client()
            for n in range(per_chat):
                response = test_client.post("/hook", json={"chat_id": chat, "text": f"m{n}"})
                assert response.status_code == 200, response.get_json()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=client, args=(chat,)) for chat in chats]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not errors
    assert platform.wait_received(len(chats) * per_chat, timeout=TIMEOUT)
    for chat in chats:
        assert [m["text"] for m in platform.received(chat)] == [f"m{n}" for n in range(per_chat)]


def test_reply_never_raises_and_queue_full_comes_back_in_the_future(
    make_app: AppMaker, platform: PlatformSimulator
) -> None:
    gate = threading.Event()
    app = make_app(OUTBOUND_QUEUE_SIZE=1)
    ext = _ext(app)
    with app.app_context():
        blocker = ext.submit(5, gate.wait, TIMEOUT)
        queued = ext.reply_text(5, "queued")
        refused = ext.reply_text(5, "refused")
        assert isinstance(refused.exception(timeout=0), QueueFull)
        bad = ext.reply_text(5, "")
        assert isinstance(bad.exception(timeout=0), ValueError)
        with pytest.raises(QueueFull):
            ext.submit(5, print)
        gate.set()
        assert blocker.result(timeout=TIMEOUT) is True
        assert queued.result(timeout=TIMEOUT).message_id == 1
    assert [m["text"] for m in platform.received(5)] == ["queued"]


def test_sender_factory_is_used_once_per_process(make_app: AppMaker) -> None:
    built: list[flask.Flask] = []
    sender = RecordingSender()

    def factory(app: flask.Flask) -> RecordingSender:
        built.append(app)
        return sender

    ext = Outbound(sender_factory=factory)
    app = make_app(ext)
    with app.app_context():
        futures = [ext.reply_text("chat", f"t{n}") for n in range(5)]
        assert [f.result(timeout=TIMEOUT).message_id for f in futures] == [1, 2, 3, 4, 5]
    assert built == [app]
    assert [r.message.text for r in sender.sent] == [f"t{n}" for n in range(5)]  # type: ignore[union-attr]
    assert ext.shutdown(TIMEOUT, app=app)
    assert sender.closed


def test_threads_racing_on_first_use_share_one_dispatcher(make_app: AppMaker) -> None:
    senders: list[RecordingSender] = []
    lock = threading.Lock()

    def factory(app: flask.Flask) -> RecordingSender:
        sender = RecordingSender()
        with lock:
            senders.append(sender)
        return sender

    ext = Outbound(sender_factory=factory)
    app = make_app(ext)
    barrier = threading.Barrier(8)
    futures: list[Any] = []
    dispatchers: list[Any] = []

    def first_use(n: int) -> None:
        with app.app_context():
            barrier.wait(TIMEOUT)
            futures.append(ext.reply_text("race", f"t{n}"))
            dispatchers.append(ext.dispatcher)

    threads = [threading.Thread(target=first_use, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert len(futures) == 8
    assert all(f.result(timeout=TIMEOUT) for f in futures)
    assert len({id(d) for d in dispatchers}) == 1
    kept = [sender for sender in senders if sender.sent]
    assert len(kept) == 1
    assert len(kept[0].sent) == 8
    assert all(sender.closed for sender in senders if sender is not kept[0])


def test_a_failing_sender_factory_fails_the_reply(
    make_app: AppMaker, caplog: pytest.LogCaptureFixture
) -> None:
    def factory(app: flask.Flask) -> RecordingSender:
        raise OSError("no credentials")

    ext = Outbound(sender_factory=factory)
    app = make_app(ext)
    with app.app_context():
        future = ext.reply_text(1, "x")
    assert isinstance(future.exception(timeout=0), OSError)
    assert "cannot build the sender" in caplog.text
    assert not ext.started(app)


# ------------------------------------------------------------- app contexts

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")


def test_submit_runs_under_an_app_context_not_the_request(
    make_app: AppMaker, platform: PlatformSimulator
) -> None:
    app = make_app()
    ext = _ext(app)
    seen: dict[str, Any] = {}
    done = threading.Event()

    def in_worker(chat_id: int) -> str:
        seen["app"] = flask.current_app._get_current_object()  # type: ignore[attr-defined]
        seen["has_request"] = flask.has_request_context()
        seen["thread"] = threading.current_thread().name
        seen["request_id"] = request_id.get(None)
        seen["already_sent"] = [m["text"] for m in platform.received(chat_id)]
        flask.g.used = True  # the worker's own app context
        return "ran"

    def after_reply(future: Any) -> None:
        seen["callback_app"] = flask.current_app.name
        done.set()

    @app.post("/work")
    def work() -> Any:
        request_id.set("req-1")
        flask.g.used = False
        reply = ext.reply_text(21, "before the task")
        reply.add_done_callback(ext.with_app_context(after_reply))
        future = ext.submit(21, in_worker, 21)
        return {"result": future.result(timeout=TIMEOUT), "g_used": flask.g.used}

    response = app.test_client().post("/work")
    assert response.get_json() == {"result": "ran", "g_used": False}
    assert done.wait(TIMEOUT)
    assert seen["app"] is app
    assert seen["has_request"] is False
    assert seen["thread"].startswith("outbound-bot")
    assert seen["request_id"] == "req-1"
    assert seen["already_sent"] == ["before the task"]
    assert seen["callback_app"] == "bot"


def test_replies_do_not_carry_the_request_context(make_app: AppMaker) -> None:
    seen: list[bool] = []

    class Sender(RecordingSender):
        def send(self, request: SendRequest) -> SendResult:
            seen.append(flask.has_request_context() or flask.has_app_context())
            return super().send(request)

    ext = Outbound(sender_factory=lambda app: Sender())
    app = make_app(ext)
    with app.test_request_context("/"):
        ext.reply_text(1, "x").result(timeout=TIMEOUT)
    assert seen == [False]


def test_with_app_context_needs_a_registered_app(make_app: AppMaker) -> None:
    app = make_app()
    ext = _ext(app)
    wrapped = ext.with_app_context(lambda: flask.current_app.name, app=app)
    assert wrapped() == "bot"
    with pytest.raises(RuntimeError, match="not registered"):
        ext.with_app_context(print, app=flask.Flask("stranger"))


# --------------------------------------------------------------- lifecycle


def test_shutdown_refuses_then_is_idempotent(make_app: AppMaker) -> None:
    app = make_app()
    ext = _ext(app)
    assert ext.shutdown(TIMEOUT, app=app)  # never started: nothing to wait for
    assert not ext.started(app)
    with app.app_context():
        assert isinstance(ext.reply_text(1, "x").exception(timeout=0), DispatcherClosed)
        with pytest.raises(DispatcherClosed):
            ext.submit(1, print)
    assert ext.shutdown(0, app=app)
    with pytest.raises(ValueError, match="timeout"):
        ext.shutdown(-1, app=app)


def test_shutdown_waits_for_queued_replies(make_app: AppMaker, platform: PlatformSimulator) -> None:
    platform.configure(latency=0.01)
    app = make_app()
    ext = _ext(app)
    with app.app_context():
        futures = [ext.reply_text(chat, f"t{n}") for n in range(5) for chat in (1, 2)]
    assert ext.shutdown(TIMEOUT, app=app)
    assert all(f.done() and f.exception() is None for f in futures)
    assert len(platform.all_received()) == 10


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_builds_its_own_dispatcher(
    make_app: AppMaker, platform: PlatformSimulator
) -> None:
    app = make_app()
    ext = _ext(app)
    with app.app_context():
        assert ext.reply_text(31, "parent").result(timeout=TIMEOUT).message_id == 1
        parent = ext.dispatcher

    def child() -> list[object]:
        with app.app_context():
            result = ext.reply_text(31, "child").result(timeout=TIMEOUT)
            own = ext.dispatcher is not parent
        return [result.message_id, own, ext.shutdown(TIMEOUT, app=app)]

    assert _in_child(child) == [2, True, True]
    assert [m["text"] for m in platform.received(31)] == ["parent", "child"]
    with app.app_context():
        assert ext.dispatcher is parent
        assert ext.reply_text(31, "parent again").result(timeout=TIMEOUT).message_id == 3


def _in_child(run: Callable[[], object]) -> Any:
    """``run()`` in a forked child: its answer, as JSON (the child exits 0 if it
    returned; the test's timeout bounds the wait)."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded fork"
        pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read)
            os.write(write, json.dumps(run()).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(answer)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_a_forked_child_does_not_use_a_connection_its_parent_opened(
    make_app: AppMaker, tmp_path: Path, database: str, request: pytest.FixtureRequest
) -> None:
    """The README's app runs ``db.create_all()`` in ``create_app``: under gunicorn
    ``--preload``, in the master, whose connection stayed in SQLAlchemy's pool and
    went to every worker (one socket for all: statements and transactions mixed,
    outbox rows committed without their orders, or lost)."""
    fsa = pytest.importorskip("flask_sqlalchemy")
    sqlalchemy = pytest.importorskip("sqlalchemy")
    if database == "postgres":
        postgres_url: str = request.getfixturevalue("postgres_url")
        url = postgres_url.replace("postgresql://", "postgresql+psycopg://", 1)
        ask = "SELECT pg_backend_pid()"  # the server's process of the connection
    else:
        url = f"sqlite:///{tmp_path / 'app.db'}"
        ask = "SELECT 1"
    db = fsa.SQLAlchemy()
    app = make_app(SQLALCHEMY_DATABASE_URI=url)
    db.init_app(app)

    def connection() -> list[object]:
        with app.app_context():
            raw = db.session.connection().connection.driver_connection
            said = db.session.execute(sqlalchemy.text(ask)).scalar()
            db.session.rollback()
        return [id(raw), said]

    parent = connection()  # (its connection back in the pool, as create_all() leaves it)
    try:
        child = _in_child(connection)
        assert child[0] != parent[0], "the child took its parent's connection"
        if database == "postgres":
            assert child[1] != parent[1], "the child's statements went to its parent's session"
        assert connection() == parent  # the parent's own is left as it was
    finally:
        with app.app_context():
            db.engine.dispose()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_keeps_an_sqlite_database_in_memory(make_app: AppMaker) -> None:
    """A database in memory is its pool's one connection: the child got a new pool,
    a new and empty database (the parent's tables gone)."""
    fsa = pytest.importorskip("flask_sqlalchemy")
    sqlalchemy = pytest.importorskip("sqlalchemy")
    db = fsa.SQLAlchemy()
    app = make_app(SQLALCHEMY_DATABASE_URI="sqlite://")
    db.init_app(app)
    with app.app_context():
        db.session.execute(sqlalchemy.text("CREATE TABLE kept (word TEXT)"))
        db.session.execute(sqlalchemy.text("INSERT INTO kept VALUES ('made in the parent')"))
        db.session.commit()

    def read() -> list[str]:
        with app.app_context():
            return list(db.session.execute(sqlalchemy.text("SELECT word FROM kept")).scalars())

    try:
        assert _in_child(read) == ["made in the parent"]
    finally:
        with app.app_context():
            db.engine.dispose()


def test_missing_flask_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flask", None)
    monkeypatch.delitem(sys.modules, "outbound.contrib.flask")
    with pytest.raises(ImportError, match=r"pip install 'outbound-dispatcher\[flask\]'"):
        importlib.import_module("outbound.contrib.flask")


# ------------------------------------------------------------------ outbox


@pytest.fixture
def orders_app(make_app: AppMaker, tmp_path: Path) -> Iterator[tuple[flask.Flask, Any]]:
    fsa = pytest.importorskip("flask_sqlalchemy")
    db = fsa.SQLAlchemy()

    class Order(db.Model):  # type: ignore[name-defined,misc]
        id = db.Column(db.Integer, primary_key=True)
        item = db.Column(db.String(50), nullable=False)

    app = make_app(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'app.db'}")
    db.init_app(app)
    ext = _ext(app)

    @app.post("/orders")
    def place_order() -> Any:
        body = flask.request.get_json()
        order = Order(item=body["item"])
        db.session.add(order)
        db.session.flush()
        ext.enqueue(key=f"order-{order.id}", type="OrderPlaced", payload={"item": order.item})
        if body.get("fail"):
            raise RuntimeError("the handler failed after enqueue")
        db.session.commit()
        return {"id": order.id}

    with app.app_context():
        db.create_all()
        ext.create_outbox()
    app.config["Order"] = Order
    yield app, db
    with app.app_context():
        db.engine.dispose()


def _outbox_keys(app: flask.Flask) -> list[str]:
    with app.app_context():
        store = _ext(app).outbox_store()
        return [row.key for row in store.rows()]


def test_outbox_row_commits_with_the_request(orders_app: tuple[flask.Flask, Any]) -> None:
    app, _ = orders_app
    response = app.test_client().post("/orders", json={"item": "tea"})
    assert response.status_code == 200
    assert _outbox_keys(app) == [f"order-{response.get_json()['id']}"]
    with app.app_context():
        (row,) = _ext(app).outbox_store().rows()
        assert (row.type, row.status) == ("OrderPlaced", "pending")


def test_outbox_row_rolls_back_with_the_request(orders_app: tuple[flask.Flask, Any]) -> None:
    app, db = orders_app
    app.config["PROPAGATE_EXCEPTIONS"] = False
    response = app.test_client().post("/orders", json={"item": "tea", "fail": True})
    assert response.status_code == 500
    assert _outbox_keys(app) == []
    with app.app_context():
        assert db.session.query(app.config["Order"]).count() == 0


def test_outbox_explicit_commit_and_rollback(orders_app: tuple[flask.Flask, Any]) -> None:
    app, db = orders_app
    Order = app.config["Order"]
    ext = _ext(app)
    with app.app_context():
        db.session.add(Order(item="kept"))
        ext.enqueue(key="kept", type="T", payload={})
        db.session.commit()
        db.session.add(Order(item="dropped"))
        ext.enqueue(key="dropped", type="T", payload={}, session=db.session)
        db.session.rollback()
        assert [o.item for o in db.session.query(Order).all()] == ["kept"]
    assert _outbox_keys(app) == ["kept"]


def test_outbox_needs_flask_sqlalchemy_and_a_file(
    make_app: AppMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app()
    with app.app_context(), pytest.raises(RuntimeError, match=r"db.init_app\(app\)"):
        _ext(app).enqueue(key="k", type="T", payload={})
    # Not installed at all: the error names the extra that brings it.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    extra = r"pip install 'outbound-dispatcher\[flask-sqlalchemy\]'"
    with app.app_context(), pytest.raises(RuntimeError, match=extra):
        _ext(app).enqueue(key="k", type="T", payload={})
    monkeypatch.undo()
    fsa = pytest.importorskip("flask_sqlalchemy")
    db = fsa.SQLAlchemy()
    memory = make_app(name="memory", SQLALCHEMY_DATABASE_URI="sqlite://")
    db.init_app(memory)
    with memory.app_context():
        with pytest.raises(ValueError, match="database file"):
            _ext(memory).enqueue(key="k", type="T", payload={})
        db.session.rollback()
        db.engine.dispose()


@pytest.mark.postgres
def test_outbox_on_postgres(make_app: AppMaker, postgres_url: str) -> None:
    fsa = pytest.importorskip("flask_sqlalchemy")
    db = fsa.SQLAlchemy()
    url = postgres_url.replace("postgresql://", "postgresql+psycopg://", 1)
    table = f"outbox_flask_{os.getpid()}"
    app = make_app(SQLALCHEMY_DATABASE_URI=url, OUTBOUND_OUTBOX_TABLE=table)
    db.init_app(app)
    ext = _ext(app)
    with app.app_context():
        store = ext.outbox_store()
        try:
            ext.create_outbox()
            ext.enqueue(key="kept", type="T", payload={"n": 1})
            db.session.commit()
            ext.enqueue(key="dropped", type="T", payload={"n": 2})
            db.session.rollback()
            assert [row.key for row in store.rows()] == ["kept"]
        finally:
            db.session.remove()
            store.drop_schema()
            db.engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("first", ["outbox_store", "enqueue"])
def test_outbox_on_postgres_connects_as_the_engine_does(
    make_app: AppMaker, postgres_url: str, first: str
) -> None:
    """The store's connections (the relay's, ``create_outbox``'s) connected by the
    engine's URL alone: with a ``search_path`` in the engine's ``connect_args``,
    ``create_outbox`` made the table where the app's session did not look, and
    ``enqueue`` failed; with the database named there only (or the user, or
    the host), the store was on another database. They take what the engine's
    connections take."""
    import psycopg  # noqa: PLC0415

    fsa = pytest.importorskip("flask_sqlalchemy")
    db = fsa.SQLAlchemy()
    target = psycopg.conninfo.conninfo_to_dict(postgres_url)
    schema = f"flask_schema_{os.getpid()}"
    table = f"outbox_flask_path_{os.getpid()}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    connect_args: dict[str, Any] = {
        "options": f"-c search_path={schema}",
        **{name: target[name] for name in ("host", "port", "dbname", "user") if name in target},
    }
    app = make_app(
        SQLALCHEMY_DATABASE_URI="postgresql+psycopg://",  # (all of it in connect_args)
        SQLALCHEMY_ENGINE_OPTIONS={"connect_args": connect_args},
        OUTBOUND_OUTBOX_TABLE=table,
    )
    db.init_app(app)
    ext = _ext(app)
    try:
        with app.app_context():
            if first == "enqueue":  # (the store made from the session's connection)
                store = ext._state(app).store(db.session.connection())
            else:
                store = ext.outbox_store()
            store.create_schema()
            ext.enqueue(key="kept", type="T", payload={"n": 1})
            db.session.commit()
            assert [row.key for row in store.rows()] == ["kept"]
            db.session.remove()
            db.engine.dispose()
        with psycopg.connect(postgres_url) as conn:
            found = conn.execute(
                "SELECT schemaname FROM pg_tables WHERE tablename = %s", (table,)
            ).fetchall()
        assert found == [(schema,)]
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")
            for suffix in ("", "_slots", "_counts", "_schema", "_look"):  # (made in public)
                admin.execute(f"DROP TABLE IF EXISTS public.{table}{suffix}")


# ------------------------------------------------------------------ example


def test_the_example_bot_runs_its_own_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OUTBOUND_TELEGRAM_TOKEN", raising=False)
    path = ROOT / "examples" / "flask_bot" / "app.py"
    spec = importlib.util.spec_from_file_location("flask_bot_example", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "chat 101: ['echo: hello 0', 'echo: hello 1', 'echo: hello 2']" in out
    assert "in order: yes" in out
