"""The Django app: settings checks, lazy start, the outbox on Django's connection, the worker.

Django is configured in this process once, from ``django_project.settings``
(next to this file), by a module fixture that creates the test databases
with Django's test machinery: ``default`` on PostgreSQL (an SQLite file
without ``OUTBOUND_TEST_POSTGRES``) and ``lite``, an SQLite file. The
worker runs as a real ``python -m django outbound_worker`` subprocess.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "django", reason="Django is not installed: pip install 'outbound-dispatcher[django]'"
)

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.db import connections, transaction
from django.test.utils import override_settings
from ratelimit_stores import wait_until
from relay_crash import LEFT_RUNNING
from worker_process import WorkerProcess

from outbound.contrib import django as ob
from outbound.contrib.django import checks as ob_checks
from outbound.contrib.django import sending
from outbound.errors import StoreError
from outbound.simulator import PlatformSimulator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
POSTGRES_URL = os.environ.get("OUTBOUND_TEST_POSTGRES")
_chats = itertools.count(7_000_000 + (os.getpid() % 1000) * 1000)


class Boom(Exception):
    """Raised to roll an atomic() block back."""


@pytest.fixture(scope="module")
def django_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Configure Django from the test project and create its test databases."""
    import django  # noqa: PLC0415
    from django.test.utils import (  # noqa: PLC0415
        setup_databases,
        setup_test_environment,
        teardown_databases,
        teardown_test_environment,
    )

    directory = tmp_path_factory.mktemp("django")
    if settings.configured:
        if "outbound.contrib.django" not in settings.INSTALLED_APPS:
            pytest.skip("Django was configured by another test module")
    else:
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        os.environ["OUTBOUND_DJANGO_DIR"] = str(directory)
        try:
            from django_project import settings as project  # noqa: PLC0415
        finally:
            del os.environ["OUTBOUND_DJANGO_DIR"]
        settings.configure(
            **{name: getattr(project, name) for name in dir(project) if name.isupper()}
        )
    django.setup()
    setup_test_environment()
    old = setup_databases(verbosity=0, interactive=False)
    try:
        ob.create_schema(using="lite")
        yield directory
    finally:
        ob.shutdown(5.0)
        ob.close_stores()
        teardown_databases(old, verbosity=0)
        teardown_test_environment()


@pytest.fixture
def sim(django_env: Path) -> Iterator[PlatformSimulator]:
    """A stand-in platform; this process's dispatcher and stores are let go afterwards."""
    with PlatformSimulator() as platform:
        try:
            yield platform
        finally:
            assert ob.shutdown(5.0)
            ob.close_stores()


def outbound_conf(sim: PlatformSimulator | None = None, **changes: Any) -> dict[str, Any]:
    conf = dict(settings.OUTBOUND)
    if sim is not None:
        conf["telegram"] = {"token": sim.token, "base_url": sim.url}
    conf.update(changes)
    return conf


def texts(sim: PlatformSimulator, chat: int) -> list[str | None]:
    return [m["text"] for m in sim.received(chat)]


def rows_of(alias: str, chat: int) -> list[str]:
    return [r.status for r in ob.get_store(alias).rows(limit=1000) if r.key == str(chat)]


def order_count(alias: str, chat: int) -> int:
    from django_project.models import Order  # noqa: PLC0415

    count: int = Order.objects.using(alias).filter(chat_id=chat).count()
    return count


def create_order(alias: str, chat: int, text: str) -> None:
    from django_project.models import Order  # noqa: PLC0415

    Order.objects.using(alias).create(chat_id=chat, text=text)


def roll_back(alias: str, chat: int, enqueue: Callable[..., int]) -> None:
    """Write an order and its outbox row in an atomic() block that rolls back."""
    try:
        with transaction.atomic(using=alias):
            create_order(alias, chat, "rolled back")
            enqueue(
                key=chat,
                type="greet",
                payload={"chat_id": chat, "text": "rolled back"},
                using=alias,
            )
            raise Boom
    except Boom:
        pass
    else:
        pytest.fail("the block did not raise")


def project_env(directory: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    env["OUTBOUND_DJANGO_DIR"] = str(directory)
    env.update(extra)
    return env


# ------------------------------------------------------------------ import


def test_import_without_django_names_the_extra() -> None:
    code = "import sys; sys.modules['django'] = None; import outbound.contrib.django"
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=30
    )
    assert done.returncode != 0
    assert "pip install 'outbound-dispatcher[django]'" in done.stderr


# ---------------------------------------------------------- checks, ready


def test_checks_pass_on_good_settings(django_env: Path) -> None:
    assert ob_checks.check_settings() == []
    # (what the dispatcher takes: infinity waits for everything at exit)
    for exit_timeout in (math.inf, 10**400, None, 0.5):
        with override_settings(OUTBOUND={"exit_timeout": exit_timeout}):
            assert ob_checks.check_settings() == []


def test_checks_flag_each_bad_key(django_env: Path) -> None:
    bad = {
        "max_inflight": 0,
        "tabel": "outbox",
        "using": "nope",
        "rate_limits": "fast",
        "telegram": {"token": "a/b"},
        "relay": {"lease": -1, "batch_size": "10"},
        "handlers": {"greet": "django_project.no_such_module.greet", "x": "not a path"},
    }
    with override_settings(OUTBOUND=bad):
        errors = ob_checks.check_settings()
    found = {(e.id, e.msg.split(":")[0]) for e in errors}
    assert found == {
        ("outbound.E003", "OUTBOUND['max_inflight']"),
        ("outbound.E002", "OUTBOUND['tabel']"),
        ("outbound.E004", "OUTBOUND['using']"),
        ("outbound.E003", "OUTBOUND['rate_limits']"),
        ("outbound.E003", "OUTBOUND['telegram']['token']"),
        ("outbound.E003", "OUTBOUND['relay']['lease']"),
        ("outbound.E003", "OUTBOUND['relay']['batch_size']"),
        ("outbound.E005", "OUTBOUND['handlers']['greet']"),
        ("outbound.E003", "OUTBOUND['handlers']['x']"),
    }
    assert all(e.obj == "settings.OUTBOUND" for e in errors)
    with override_settings(OUTBOUND=["not", "a", "dict"]):
        assert [e.id for e in ob_checks.check_settings()] == ["outbound.E001"]


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        # Each passes the types, and the objects built from it refuse it.
        ("max_pending", 2**31),
        # (passed the settings' check, then every reply raised: the dispatcher's is > 0)
        ("exit_timeout", 0),
        ("exit_timeout", 0.0),
        ("exit_timeout", "10"),
        ("relay.batch_size", 100_000),
        ("relay.max_inflight", 100_000),
        ("relay.max_concurrency", 1_000_000),
        ("relay.lease", 1e308),
        ("relay.poll_interval", 86_400.0),
        # (each was compared with the other only when both were given: the
        # worker's retry policy refused them against the other's default)
        ("relay.backoff", 600),
        ("relay.backoff_max", 0.5),
        ("telegram.token", "12 345"),
        ("telegram.token", "1:abc?x=1#"),
        # (passed a looser check of their own, then every reply raised)
        ("telegram.base_url", "http://127.0.0.1:99999"),
        ("telegram.base_url", "http://[::1"),
        ("telegram.base_url", "http://:80"),
        ("telegram.base_url", "http://127.0.0.1:8081/ "),
    ],
)
def test_checks_flag_what_the_worker_or_the_app_would_refuse(
    django_env: Path, setting: str, value: object
) -> None:
    section, _, name = setting.rpartition(".")
    bad: dict[str, Any] = {section: {name: value}} if section else {name: value}
    where = f"OUTBOUND[{section!r}][{name!r}]" if section else f"OUTBOUND[{name!r}]"
    with override_settings(OUTBOUND=bad):
        errors = ob_checks.check_settings()
    assert [(e.id, e.msg.split(":")[0]) for e in errors] == [("outbound.E003", where)]
    if setting == "telegram.token":
        assert str(value) not in errors[0].msg  # the token is a secret


def test_manage_check_fails_on_bad_settings(django_env: Path) -> None:
    with override_settings(OUTBOUND={"queue_size": -1}), pytest.raises(Exception) as caught:
        call_command("check", verbosity=0)
    assert "outbound.E003" in str(caught.value)
    assert "OUTBOUND['queue_size']" in str(caught.value)


@pytest.mark.parametrize("error", ["RuntimeError", "SystemExit", "GeneratorExit"])
def test_a_handler_module_that_fails_at_import_is_a_check_error(
    django_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str
) -> None:
    # (SystemExit at import ended `check`, and so `migrate`, silently with status 0.)
    module = f"broken_handlers_{os.getpid()}_{next(_chats)}"
    (tmp_path / f"{module}.py").write_text(f"raise {error}('no API key in the environment')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    conf = outbound_conf(handlers={"greet": f"{module}.greet"})
    with override_settings(OUTBOUND=conf):
        errors = ob_checks.check_settings()
        assert [(e.id, e.msg.split(":")[0]) for e in errors] == [
            ("outbound.E005", "OUTBOUND['handlers']['greet']")
        ]
        assert f"importing {module!r} raised {error}: no API key" in errors[0].msg
        with pytest.raises(SystemCheckError, match=r"outbound\.E005"):
            call_command("check", verbosity=0)
        # The worker says the same, without a traceback.
        with pytest.raises(CommandError, match=f"{module}.*{error}: no API key"):
            call_command("outbound_worker")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--drain-timeout", "nan"),
        ("--drain-timeout", "inf"),
        ("--drain-timeout", "-1"),
        ("--poll-interval", "nan"),
        ("--poll-interval", "inf"),
        ("--poll-interval", "0"),
        ("--batch-size", "0"),
        ("--max-inflight", "-1"),
        ("--max-concurrency", "0"),
    ],
)
def test_worker_refuses_the_numbers_its_settings_refuse(
    django_env: Path, option: str, value: str
) -> None:
    # No handlers: were the option accepted, the worker would stop on that instead of running.
    with override_settings(OUTBOUND=outbound_conf(handlers={})):
        with pytest.raises(CommandError, match=f"argument {option}: .*not {value}"):
            call_command("outbound_worker", f"{option}={value}")
        # Given as a keyword to call_command(), the argument parser is skipped.
        name = option[2:].replace("-", "_")
        number = float(value) if option in ("--drain-timeout", "--poll-interval") else int(value)
        with pytest.raises(CommandError, match=f"^{option}: .*not {value}"):
            call_command("outbound_worker", **{name: number})


def test_ready_starts_nothing(django_env: Path) -> None:
    ob.shutdown(5.0)
    before = set(threading.enumerate())
    config = apps.get_app_config("outbound")
    config.ready()
    config.ready()  # as under the autoreloader
    # (A subset: a thread of an earlier test may end meanwhile.)
    assert set(threading.enumerate()) <= before
    assert sending._outbound is None


def test_manage_py_check_in_a_fresh_process(django_env: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "django", "check", "--settings=django_project.settings"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=project_env(django_env),
    )
    assert done.returncode == 0, done.stderr
    assert "System check identified no issues" in done.stdout


# ------------------------------------------------------------------- reply


def test_reply_builds_the_dispatcher_on_first_use(sim: PlatformSimulator) -> None:
    chat = next(_chats)
    with override_settings(OUTBOUND=outbound_conf(sim)):
        assert sending._outbound is None
        first = ob.reply_text(chat, "one")
        second = ob.reply_text(chat, "two")
        assert first.result(timeout=10).message_id is not None
        second.result(timeout=10)
        assert ob.get_outbound() is ob.get_outbound()
        assert texts(sim, chat) == ["one", "two"]
    assert sending._outbound is None  # the settings change let it go


def test_reply_without_a_sender_is_improperly_configured(django_env: Path) -> None:
    with override_settings(OUTBOUND={}), pytest.raises(ImproperlyConfigured, match="token"):
        ob.reply_text(1, "hi")


def _failing_sender_factory() -> Any:
    raise RuntimeError("the sender's backend is down")


@pytest.mark.parametrize(
    "factory",
    [
        f"{__name__}._failing_sender_factory",  # raises
        "outbound_no_such_module.make_sender",  # not there
        f"{__name__}._no_such_factory",
    ],
)
def test_a_sender_factory_that_fails_is_improperly_configured(
    django_env: Path, factory: str
) -> None:
    # Its own error went out of reply() (a RuntimeError, an ImportError),
    # documented as ImproperlyConfigured, and a dispatcher was built for nothing.
    with override_settings(OUTBOUND={"sender": factory}):
        for _ in range(2):
            with pytest.raises(ImproperlyConfigured, match=r"OUTBOUND\['sender'\]") as raised:
                ob.reply_text(1, "hi")
            assert factory in str(raised.value)
        assert sending._outbound is None


# ------------------------------------------------------------------ outbox


@pytest.mark.parametrize("alias", ["default", "lite"])
def test_rolled_back_enqueue_is_never_sent_committed_is(alias: str, sim: PlatformSimulator) -> None:
    chat = next(_chats)
    payload = {"chat_id": chat}
    # A long poll: only the commit's wake-up (NOTIFY, or the in-process
    # nudge of enqueue_on_commit on SQLite) delivers within the wait.
    with override_settings(OUTBOUND=outbound_conf(sim)):
        relay = ob.build_relay(using=alias, poll_interval=60.0)
        relay.start()
        try:
            roll_back(alias, chat, ob.enqueue_on_commit)
            with transaction.atomic(using=alias):
                create_order(alias, chat, "committed")
                ob.enqueue_on_commit(
                    key=chat, type="greet", payload={**payload, "text": "committed"}, using=alias
                )
            assert sim.wait_received(1, chat_id=chat, timeout=10)
        finally:
            assert relay.stop(10)
        # Same key, so the rolled-back row, had it existed, would have gone first.
        assert texts(sim, chat) == ["committed"]
        assert order_count(alias, chat) == 1
        assert rows_of(alias, chat) == ["sent"]


@pytest.mark.parametrize("alias", ["default", "lite"])
def test_enqueue_outside_atomic_commits_at_once(alias: str, django_env: Path) -> None:
    chat = next(_chats)
    row_id = ob.enqueue(key=chat, type="greet", payload={"chat_id": chat, "text": "x"}, using=alias)
    assert isinstance(row_id, int)
    assert not connections[alias].in_atomic_block
    assert rows_of(alias, chat) == ["pending"]
    ob.close_stores()


@pytest.mark.parametrize("alias", ["default", "lite"])
def test_enqueue_errors_and_the_atomic_block(alias: str, django_env: Path) -> None:
    chat = next(_chats)
    with transaction.atomic(using=alias):
        with pytest.raises(TypeError):
            ob.enqueue(key=chat, type="greet", payload={"not json": object()}, using=alias)
        assert not transaction.get_rollback(using=alias)  # nothing was written
        with override_settings(OUTBOUND=outbound_conf(table="no_such_outbox")):
            with pytest.raises(StoreError):
                ob.enqueue(key=chat, type="greet", payload={}, using=alias)
        assert transaction.get_rollback(using=alias)  # the database may have aborted it
    assert rows_of(alias, chat) == []
    ob.close_stores()


# ------------------------------------------------------------------ worker


def test_worker_refuses_a_database_that_is_not_in_databases(django_env: Path) -> None:
    # (A mistyped --database ended in a traceback of Django's ConnectionDoesNotExist.)
    with pytest.raises(CommandError, match="'replica' is not a database alias of settings"):
        call_command("outbound_worker", "--database", "replica")
    with pytest.raises(ImproperlyConfigured, match="'replica' is not a database alias"):
        ob.get_store("replica")


def test_worker_without_handlers_refuses_to_start(django_env: Path) -> None:
    with override_settings(OUTBOUND=outbound_conf(handlers={})):
        with pytest.raises(CommandError, match="handlers"):
            call_command("outbound_worker")


class Worker(WorkerProcess):
    """``python -m django outbound_worker`` in a subprocess of the test project; output to files."""

    def __init__(
        self, sim: PlatformSimulator, *args: str, crash: Path | None = None, token: bool = True
    ) -> None:
        """Not ``token``: the bot token is not set."""
        directory = Path(settings.DATABASES["lite"]["TEST"]["NAME"]).parent
        env = project_env(
            directory,
            OUTBOUND_DJANGO_DB=connections["default"].settings_dict["NAME"],
            OUTBOUND_DJANGO_SIM_URL=sim.url,
            OUTBOUND_DJANGO_SIM_TOKEN=sim.token if token else "",
            OUTBOUND_TEST_RELAY_CRASH=str(crash) if crash is not None else "",
        )
        argv = [
            sys.executable,
            "-m",
            "django",
            "outbound_worker",
            "--settings=django_project.settings",
            *args,
        ]
        super().__init__(argv, env=env, folder=directory, name=f"worker-{next(_chats)}")


def needs_postgres() -> None:
    if not POSTGRES_URL:
        pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")


def test_outbound_worker_delivers_then_stops_on_sigterm(sim: PlatformSimulator) -> None:
    needs_postgres()
    chat = next(_chats)
    roll_back("default", chat, ob.enqueue)
    with transaction.atomic():
        create_order("default", chat, "first")
        ob.enqueue(key=chat, type="greet", payload={"chat_id": chat, "text": "first"})
    worker = Worker(sim)
    try:
        assert sim.wait_received(1, chat_id=chat, timeout=20), worker.output()
        # Committed while the worker runs: NOTIFY wakes it.
        with transaction.atomic():
            ob.enqueue_on_commit(
                key=chat, type="greet", payload={"chat_id": chat, "text": "second"}
            )
        assert sim.wait_received(2, chat_id=chat, timeout=20), worker.output()
        assert worker.stop(timeout=20) == 0, worker.output()
    finally:
        logs = worker.close()
    assert texts(sim, chat) == ["first", "second"]
    # Rows other tests left pending on the shared test database count too.
    assert re.search(r"outbound_worker: stopped; sent \d+, retried 0, dead 0", logs), logs
    assert rows_of("default", chat) == ["sent", "sent"]


def test_outbound_worker_warns_as_it_starts_that_no_sender_is_set(sim: PlatformSimulator) -> None:
    """The bot token read from an environment variable that is not set: the worker
    started without a word, and each row whose handler replied failed with
    ImproperlyConfigured until it was dead. It says so (on standard error)."""
    needs_postgres()
    for token in (False, True):
        worker = Worker(sim, token=token)
        try:
            worker.wait_for(r"^outbound_worker: relaying table")
            if not token:
                worker.wait_for(r"^outbound_worker: warning: no sender: neither OUTBOUND")
            assert worker.stop(timeout=20) == 0, worker.output()
        finally:
            logs = worker.close()
        assert ("no sender" in logs) is not token, logs


def test_outbound_worker_drain_is_bounded(sim: PlatformSimulator) -> None:
    needs_postgres()
    chat = next(_chats)
    row = ob.enqueue(key=chat, type="stall", payload={"chat_id": chat})
    worker = Worker(sim, "--drain-timeout", "0.5")
    try:
        assert sim.wait_received(1, chat_id=chat, timeout=20), worker.output()
        started = time.monotonic()
        assert worker.stop(timeout=20) == 1, worker.output()
        assert time.monotonic() - started < 10.0
    finally:
        logs = worker.close()
        # Left processing by the bounded drain: once its lease ran out, the
        # next test's worker would claim it and stall its drain.
        ob.get_store("default").cancel([row], reason="test over")
    assert "the drain did not finish in 0.5s" in logs


@pytest.mark.parametrize(
    "handler",
    [
        # Ignores the relay's cancellation: it held the process 20 s and more.
        "stubborn",
        # Queues a reply and stops waiting for it, still being sent when the drain
        # ends: the exit hooks waited for it again (exit_timeout), and the worker
        # stopped 12 s after SIGTERM with drain_timeout 2, status 0.
        "impatient",
    ],
)
@pytest.mark.parametrize(
    "options",
    # (--traceback: Django raised the error on instead of exiting, and the exit
    # hooks waited all the same)
    [(), ("--traceback",)],
    ids=["", "traceback"],
)
def test_outbound_worker_exits_within_its_drain_timeout(
    sim: PlatformSimulator, handler: str, options: tuple[str, ...]
) -> None:
    """SIGTERM: the process is gone within drain_timeout (and a short grace), although
    what a handler left runs on and the dispatchers' exit hooks would wait for it."""
    needs_postgres()
    chat = next(_chats)
    row = ob.enqueue(key=chat, type=handler, payload={"chat_id": chat})
    worker = Worker(sim, "--drain-timeout", "1", *options)
    try:
        if handler == "stubborn":
            assert sim.wait_received(1, chat_id=chat, timeout=20), worker.output()
        else:
            worker.wait_for(rf"outbox row {row} attempt 1 failed")
        worker.proc.send_signal(signal.SIGTERM)
        # 1 s of drain, at most 1 s to force the stop; the rest is the process's own exit.
        status = worker.proc.wait(timeout=8)
    finally:
        logs = worker.close()
        ob.get_store("default").cancel([row], reason="test over")
    assert status == 1, logs
    assert "the drain did not finish in 1s" in logs
    if handler == "impatient":
        assert "replies still being sent are given up" in logs
    assert ("Traceback" in logs) == bool(options)


def test_outbound_worker_a_second_signal_ends_the_wait_for_replies(
    sim: PlatformSimulator,
) -> None:
    """A second SIGTERM while the worker waited for the replies its handlers queued
    was ignored: it waited out the rest of drain_timeout."""
    needs_postgres()
    chat = next(_chats)
    row = ob.enqueue(key=chat, type="fire", payload={"chat_id": chat})
    worker = Worker(sim, "--drain-timeout", "30")
    try:
        worker.wait_for(r"^outbound_worker: relaying table")
        assert wait_until(lambda: rows_of("default", chat) == ["sent"], 20), worker.output()
        worker.proc.send_signal(signal.SIGTERM)
        worker.wait_for(r"^outbound_worker: waiting for the replies still being sent")
        worker.proc.send_signal(signal.SIGTERM)
        status = worker.proc.wait(timeout=5)
    finally:
        logs = worker.close()
        ob.get_store("default").cancel([row], reason="test over")
    assert status == 1, logs
    assert "replies still being sent are given up" in logs


@pytest.mark.parametrize("handler", LEFT_RUNNING)
def test_outbound_worker_whose_relay_stops_on_an_error_ends_at_once(
    sim: PlatformSimulator, tmp_path: Path, handler: str
) -> None:
    needs_postgres()
    chat = next(_chats)
    crash = tmp_path / "crash"
    row = ob.enqueue(key=chat, type=handler, payload={"chat_id": chat})
    worker = Worker(sim, crash=crash)
    try:
        if handler == "stubborn":
            assert sim.wait_received(1, chat_id=chat, timeout=20), worker.output()
        else:
            assert wait_until(lambda: rows_of("default", chat) == ["sent"], 20), worker.output()
        crash.touch()
        status = worker.proc.wait(timeout=6)  # at most 1 s to force the stop
    finally:
        logs = worker.close()
        ob.get_store("default").cancel([row], reason="test over")
    assert status == 1, logs
    assert "the outbox relay stopped on an error" in logs


def test_outbound_worker_logs_one_line_per_failure(sim: PlatformSimulator) -> None:
    needs_postgres()
    chat = next(_chats)
    flaky = ob.enqueue(key=chat, type="flaky", payload={"chat_id": chat})
    refused = ob.enqueue(key=chat + 1, type="refused", payload={"chat_id": chat + 1})
    worker = Worker(sim)
    retry = re.compile(
        rf"^outbound_worker: outbox row {flaky} attempt 1 failed, retry in [\d.]+s: "
        rf"RuntimeError: the platform is down for chat {chat}$",
        re.M,
    )
    dead = re.compile(
        rf"^outbound_worker: outbox row {refused} rejected: .*chat {chat + 1} blocked the bot$",
        re.M,
    )
    try:
        deadline = time.monotonic() + 20
        while not (retry.search(logs := worker.output()) and dead.search(logs)):
            assert worker.proc.poll() is None, logs
            assert time.monotonic() < deadline, logs
            time.sleep(0.05)
        assert worker.stop(timeout=20) == 0, worker.output()
    finally:
        logs = worker.close()
        ob.get_store("default").cancel([flaky], reason="test over")
    assert "Traceback" not in logs
    assert re.search(r"stopped; sent \d+, retried [1-9]\d*, dead [1-9]", logs), logs
