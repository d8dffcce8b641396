"""``python -m outbound outbox ...`` on both stores, and the errors a person can act on."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from outbound.errors import DuplicateMessage
from outbound.outbox import SQLiteStore, Store
from outbound.outbox import sqlite as sqlite_module
from outbound.outbox._base import SCHEMA_VERSION, Outcome
from outbound.outbox.cli import main, open_store

from . import v1_schema
from .conftest import POSTGRES_URL, StoreFactory, app_connection, enqueue_keys, unique_table

COMMANDS = ("status", "list", "blocked", "retry", "cancel", "purge", "migrate")


def db_url(store: Store) -> str:
    if isinstance(store, SQLiteStore):
        return f"sqlite:///{store.path}"
    assert POSTGRES_URL
    return POSTGRES_URL


def greet(store: Store, *keys: str) -> list[int]:
    return enqueue_keys(store, *keys, type="greet")


def cli(*argv: str, timeout: float = 30.0, env: dict[str, str] | None = None) -> Any:
    """Run ``python -m outbound outbox ...`` in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "outbound", "outbox", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
    )


def test_status_list_retry_purge(
    make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    greet(store, "a", "b", "c")
    session = store.session()
    claimed = session.claim("me", 2, 30.0, None)
    session.finish(
        "me",
        [
            Outcome(claimed[0].message.id, claimed[0].token, "a", "dead", error="Boom: no"),
            Outcome(claimed[1].message.id, claimed[1].token, "b", "sent"),
        ],
    )
    session.close()
    base = ["outbox", "--db", db_url(store), "--table", store.table]

    assert main([*base, "status"]) == 0
    out = capsys.readouterr().out
    for line in ("pending     1", "dead        1", "sent        1", "unfinished  1", "s ago"):
        assert line in out

    assert main([*base, "list", "--status", "dead"]) == 0
    out = capsys.readouterr().out
    assert "Boom: no" in out
    assert "a / greet" in out

    assert main([*base, "retry"]) == 2  # neither ids nor --all
    assert main([*base, "retry", "--all"]) == 0
    assert "1 dead row is pending again" in capsys.readouterr().out
    assert store.status().counts["pending"] == 2

    assert main([*base, "purge", "--status", "sent"]) == 0
    assert capsys.readouterr().out == "1 row deleted\n"
    assert main([*base, "purge"]) == 0
    assert capsys.readouterr().out == "0 rows deleted\n"
    assert store.status().counts["sent"] == 0


def test_db_and_table_go_before_or_after_the_command(
    make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    greet(store, "a")
    url, table = db_url(store), store.table
    for argv in (
        ["outbox", "--db", url, "--table", table, "status"],
        ["outbox", "status", "--db", url, "--table", table],
        ["outbox", "--db", url, "status", "--table", table],
        ["outbox", "--table", "wrong", "status", "--db", url, "--table", table],  # after wins
    ):
        assert main(argv) == 0, argv
        assert "pending     1" in capsys.readouterr().out


def test_every_command_says_how_to_name_the_database(capsys: pytest.CaptureFixture[str]) -> None:
    for command in COMMANDS:
        with pytest.raises(SystemExit) as info:
            main(["outbox", command, "--help"])
        assert info.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "--db URL" in out, command
        assert "postgresql://" in out, command
    with pytest.raises(SystemExit):
        main(["outbox", "list", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: every status)" in out
    assert "(default: 20)" in out
    with pytest.raises(SystemExit):
        main(["outbox", "purge", "--help"])
    assert "(default: sent)" in " ".join(capsys.readouterr().out.split())


def test_usage_errors_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["outbox", "status"]) == 2
    assert "--db is required" in capsys.readouterr().err
    assert main(["outbox", "--db", "mysql://u@localhost/app", "status"]) == 2
    err = capsys.readouterr().err
    assert "unsupported database URL scheme 'mysql'" in err
    assert err.count("\n") == 1
    assert main(["outbox", "--db", str(tmp_path / "x.db"), "--table", "Bad-Name", "status"]) == 2
    assert "table" in capsys.readouterr().err


def test_inspecting_never_creates_a_database_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "tpyo.db"
    for db in (str(typo), f"sqlite:///{typo}"):
        for command in ("status", "list", "blocked", "purge"):
            assert main(["outbox", "--db", db, command]) == 1
            assert f"no SQLite database file at '{typo}'" in capsys.readouterr().err
    assert main(["outbox", "--db", str(typo), "cancel", "1"]) == 1
    assert not typo.exists()


def test_a_missing_table_is_a_clear_error(
    make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    assert main(["outbox", "--db", db_url(store), "--table", "no_such_table", "status"]) == 1
    err = capsys.readouterr().err
    assert "'no_such_table' does not exist" in err
    assert "migrate" in err


def test_an_unreachable_postgres_fails_fast_in_one_line() -> None:
    done = cli("--db", "postgresql://postgres@127.0.0.1:1/test", "status", timeout=15.0)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("outbox: cannot connect")
    assert done.stderr.count("\n") == 1
    bad = cli("--db", "postgresql://postgres@127.0.0.1/test?sslmod=require", "status")
    assert bad.returncode == 2
    assert bad.stderr.startswith("outbox: conninfo is not a valid PostgreSQL URL")


def test_postgres_without_psycopg_says_what_to_install(tmp_path: Path) -> None:
    blocker = tmp_path / "psycopg"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('no psycopg here')\n")
    done = cli(
        "--db",
        "postgresql://postgres@127.0.0.1/test",
        "status",
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
    )
    assert done.returncode == 1
    assert done.stderr == (
        "outbox: PostgreSQL needs psycopg 3 and psycopg_pool: "
        "pip install 'outbound-dispatcher[postgres]'\n"
    )


def test_blocked_shows_the_head_and_cancel_clears_it(
    make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    first, _ = greet(store, "k", "k")
    session = store.session()
    try:
        (claimed,) = session.claim("me", 10, 30.0, None)
        session.finish(
            "me", [Outcome(first, claimed.token, "k", "retry", delay=3600.0, error="Boom: 503")]
        )
    finally:
        session.close()
    base = ["outbox", "--db", db_url(store), "--table", store.table]
    assert main([*base, "blocked"]) == 0
    out = capsys.readouterr().out
    assert f"key k: 1 row waits behind row {first} (pending, attempt 1, next try in" in out
    assert "last error: Boom: 503" in out

    assert main([*base, "cancel", str(first), "--dead-letter", "--reason", "poison"]) == 0
    assert capsys.readouterr().out == "1 row dead-lettered\n"
    assert main([*base, "blocked"]) == 0
    assert capsys.readouterr().out == "no key is blocked\n"
    (row,) = store.rows(status="dead")
    assert (row.id, row.last_error) == (first, "poison")

    # Nothing done for some ids: a script can tell from the exit status.
    assert main([*base, "cancel", str(first), "999999"]) == 1
    assert (
        capsys.readouterr().out
        == "0 rows cancelled\n2 ids were not of a pending or processing row\n"
    )
    assert main([*base, "retry", str(first), "999999"]) == 1
    assert capsys.readouterr().out == (
        "1 dead row is pending again\n1 id was not of a dead row that could be revived "
        "(not dead, not found, or an unfinished row holds its dedupe_key)\n"
    )
    assert main([*base, "retry", "--all"]) == 0  # nothing dead: nothing to do, done
    assert capsys.readouterr().out == "0 dead rows are pending again\n"


def test_keys_types_and_errors_cannot_forge_lines_or_drive_the_terminal(
    make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    key = "evil\x1b[31mRED\x1b[0m\n       99  sent  fake"
    (first,) = greet(store, key)
    greet(store, key)
    session = store.session()
    try:
        (claimed,) = session.claim("me", 10, 30.0, None)
        session.finish(
            "me", [Outcome(first, claimed.token, key, "retry", delay=3600.0, error="a\rb\x07")]
        )
    finally:
        session.close()
    base = ["outbox", "--db", db_url(store), "--table", store.table]
    # list: a header and the two rows; blocked: the key's line and its error.
    for command, lines in (("list", 3), ("blocked", 2)):
        assert main([*base, command]) == 0
        out = capsys.readouterr().out
        assert not {"\x1b", "\r", "\x07"} & set(out)
        assert len(out.splitlines()) == lines, out
        assert "evil\\x1b[31mRED\\x1b[0m\\n" in out
        assert "a\\rb\\x07" in out


def test_migrate_upgrades_an_old_outbox(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = unique_table()
    if backend == "sqlite":
        db = str(tmp_path / "old.db")
        v1_schema.create_sqlite(db, table)
    else:
        import psycopg  # noqa: PLC0415

        assert POSTGRES_URL
        db = POSTGRES_URL
        with psycopg.connect(db, autocommit=True) as admin:
            v1_schema.create_postgres(admin, table)
    try:
        assert main(["outbox", "--db", db, "--table", table, "status"]) == 1
        assert "outbox migrate" in capsys.readouterr().err
        assert main(["outbox", "--db", db, "--table", table, "migrate"]) == 0
        assert capsys.readouterr().out == (
            f"migrated outbox {table!r} from schema version 1 to {SCHEMA_VERSION}\n"
        )
        assert main(["outbox", "migrate", "--db", db, "--table", table]) == 0
        assert "nothing to do" in capsys.readouterr().out
        assert main(["outbox", "--db", db, "--table", table, "status"]) == 0
        assert "unfinished  5" in capsys.readouterr().out
    finally:
        store = open_store(db, table)
        store.drop_schema()
        store.close()


def test_of_two_migrations_at_once_only_the_one_that_migrated_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``migrate`` read the version, then migrated: another process migrating in
    between made both print "migrated from version 1"."""
    db = str(tmp_path / "old.db")
    v1_schema.create_sqlite(db, "outbox")
    real_immediate = sqlite_module.immediate
    raced: list[bool] = []

    @contextlib.contextmanager
    def another_process_first(conn: Any) -> Iterator[None]:
        if not raced:  # the other process takes the write lock first and migrates
            raced.append(True)
            other = SQLiteStore(db, create=False)
            try:
                other.create_schema()
            finally:
                other.close()
        with real_immediate(conn):
            yield

    monkeypatch.setattr(sqlite_module, "immediate", another_process_first)
    assert main(["outbox", "--db", db, "migrate"]) == 0
    assert raced == [True]
    assert capsys.readouterr().out == (
        f"outbox 'outbox' is at schema version {SCHEMA_VERSION}: nothing to do\n"
    )
    store = SQLiteStore(db, create=False)
    try:
        assert store.schema_version() == SCHEMA_VERSION
    finally:
        store.close()


def test_piped_into_head_it_stops_quietly(tmp_path: Path) -> None:
    """``outbox list | head -1``: no BrokenPipeError traceback, status 141 like Unix tools."""
    store = SQLiteStore(tmp_path / "o.db")
    try:
        # Far more than a pipe holds (64 KiB), so the writer meets the closed pipe.
        greet(store, *(f"chat-{n}" for n in range(3000)))
    finally:
        store.close()
    argv = ["outbox", "--db", str(tmp_path / "o.db"), "list", "--limit", "3000"]
    process = subprocess.Popen(
        [sys.executable, "-m", "outbound", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert process.stdout is not None
        assert b"status" in process.stdout.readline()  # what head -1 reads
        process.stdout.close()
        assert process.stderr is not None
        err = process.stderr.read().decode()
        assert process.wait(timeout=30) == 141, err
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert err == ""


@pytest.mark.parametrize("stdout", ["closed", "full"])
def test_output_that_cannot_be_written_is_one_line_and_the_change_stays(
    tmp_path: Path, stdout: str
) -> None:
    """``cancel 1 >/dev/full`` printed an 18-line traceback; ``status >&-`` raised
    AttributeError. Now one line and status 1; the row cancelled is cancelled."""
    if stdout == "full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    store = SQLiteStore(tmp_path / "o.db")
    try:
        (row,) = greet(store, "a")
        argv = [sys.executable, "-m", "outbound", "outbox", "--db", str(store.path), "cancel"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        with contextlib.ExitStack() as stack:
            if stdout == "full":
                out: Any = stack.enter_context(open("/dev/full", "w"))
                done = subprocess.run(
                    [*argv, str(row)],
                    stdout=out,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    timeout=30,
                    check=False,
                )
            else:
                # The child's descriptor 1 closed, as ">&-" leaves it.
                done = subprocess.run(
                    ["/bin/sh", "-c", '"$@" >&-', "sh", *argv, str(row)],
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    timeout=30,
                    check=False,
                )
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("outbox: cannot write to standard output: "), done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert store.get(row).status == "cancelled"  # type: ignore[union-attr]
    finally:
        store.close()


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_text_the_output_cannot_encode_is_escaped_not_refused(
    tmp_path: Path, encoding: str
) -> None:
    """Under ``PYTHONIOENCODING=ascii`` a row with a non-ASCII key made ``list``
    fail ("cannot write to standard output"), listing nothing."""
    store = SQLiteStore(tmp_path / "o.db")
    try:
        greet(store, "chat-caf\u00e9-\U0001f600", "plain")
    finally:
        store.close()
    done = subprocess.run(
        [sys.executable, "-m", "outbound", "outbox", "--db", str(tmp_path / "o.db"), "list"],
        capture_output=True,
        timeout=30,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONIOENCODING": encoding},
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == b""
    out = done.stdout.decode(encoding)
    if encoding == "ascii":
        assert "chat-caf\\xe9-\\U0001f600 / greet" in out, out
    else:
        assert "chat-caf\u00e9-\\U0001f600 / greet" in out, out
    assert "plain / greet" in out


class _Refusing:
    """A standard output that refuses to write (an embedding program's own stream)."""

    def write(self, text: str) -> int:
        raise RuntimeError("this stream is read-only")

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("stream", [object(), _Refusing()], ids=["not a stream", "refusing"])
def test_an_output_that_is_no_file_is_one_line_too(
    tmp_path: Path,
    stream: object,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = SQLiteStore(tmp_path / "o.db")
    try:
        greet(store, "a")
    finally:
        store.close()
    monkeypatch.setattr(sys, "stdout", stream)
    assert main(["outbox", "--db", str(tmp_path / "o.db"), "status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("outbox: cannot write to standard output: "), err
    assert err.count("\n") == 1, err


def test_a_password_in_db_is_never_printed() -> None:
    done = cli("--db", "postgresql://nobody:s3cr3t@127.0.0.1:1/x", "status")
    assert done.returncode == 1
    assert "s3cr3t" not in done.stdout + done.stderr
    assert done.stderr.startswith("outbox: ")


def test_a_password_with_an_unencoded_at_sign_is_never_printed() -> None:
    # libpq takes what follows the password's "@" for the host, and quotes it:
    # "failed to resolve host '2-SECRET-TAIL@127.0.0.1'".
    done = cli("--db", "postgresql://app:hunter@2-SECRET-TAIL@127.0.0.1:1/x", "status")
    assert done.returncode == 1
    assert "SECRET" not in done.stdout + done.stderr, done.stderr
    assert done.stderr.startswith("outbox: ")


@pytest.mark.parametrize(
    ("db", "says", "password"),
    [
        ("postgresql://app:50%off@db.example/app", "percent-encoded", "50%off"),
        ("postgresql://app:se cret@db.example/app", "spaces", "se cret"),
        ("postgresql://app@db.example/app?password=50%off", "percent-encoded", "50%off"),
        ("postgresql://app:x%zzsecret@db.example/app", "percent-encoded", "x%zzsecret"),
    ],
)
def test_a_password_in_a_malformed_url_is_never_printed(
    db: str, says: str, password: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # libpq's message quotes the piece it cannot read: here, the password.
    assert main(["outbox", "--db", db, "status"]) == 2
    err = capsys.readouterr().err
    assert password not in err
    assert says in err
    assert "***" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("db", ["host=db password=s3cr3t dbname=app", " dbname=app user=x"])
def test_a_key_value_connection_string_is_refused_without_echoing_it(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # It would otherwise be taken for the name of a SQLite file, and printed.
    assert main(["outbox", "--db", db, "status"]) == 2
    err = capsys.readouterr().err
    assert "key=value connection string" in err
    assert "s3cr3t" not in err
    assert "dbname" not in err


class _Proxy:
    """A TCP forwarder on loopback to the PostgreSQL server; ``down()`` drops every
    connection and refuses new ones, ``up()`` ends the outage."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.is_down = threading.Event()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self._start(self._accept)

    def _start(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.is_down.is_set():
                client.close()
                continue
            server = socket.create_connection(self.target, timeout=10)
            server.settimeout(None)
            with self.lock:
                self.sockets += [client, server]
            self._start(self._pump, client, server)
            self._start(self._pump, server, client)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def down(self) -> None:
        self.is_down.set()
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        self.is_down.clear()

    def close(self) -> None:
        self.down()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()
        for thread in self.threads:
            thread.join(10)


def _get(port: int, path: str = "/status.json") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def _serving(db: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outbound",
            "outbox",
            "--db",
            db,
            *args,
            "serve",
            "--port",
            "0",
            "--refresh",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
    assert found, line + (process.stderr.read() if process.stderr else "")
    return process, int(found.group(1))


def _wait_for_status(port: int, status: int) -> None:
    """Ask until the page answers ``status`` (a reading is served again for a second)."""
    deadline = time.monotonic() + 30
    while _get(port) != status:
        assert time.monotonic() < deadline, f"never {status}"
        time.sleep(0.1)


def _stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    return err


def test_serve_reports_a_sqlite_outage_in_one_line_and_its_end_in_another(
    tmp_path: Path,
) -> None:
    db = tmp_path / "o.db"
    SQLiteStore(db).close()
    process, port = _serving(str(db))
    try:
        assert _get(port) == 200
        db.rename(tmp_path / "away.db")
        _wait_for_status(port, 503)
        assert [_get(port) for _ in range(3)] == [503, 503, 503]  # failures are not kept
        (tmp_path / "away.db").rename(db)
        _wait_for_status(port, 200)
    finally:
        err = _stop(process)
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("outbox: outbox 'outbox' (SQLite ")
    assert "cannot be read" in lines[0]
    assert lines[1].endswith("can be read again")


@pytest.mark.skipif(not POSTGRES_URL, reason="OUTBOUND_TEST_POSTGRES is not set")
def test_serve_reports_a_postgres_outage_in_one_line_without_the_pools_tracebacks() -> None:
    assert POSTGRES_URL
    parts = urlsplit(POSTGRES_URL)
    proxy = _Proxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    db = parts._replace(netloc=f"{parts.username}@127.0.0.1:{proxy.port}").geturl()
    table = unique_table()
    store = open_store(POSTGRES_URL, table)  # straight to the server, not through the proxy
    store.create_schema()
    try:
        process, port = _serving(db, "--table", table)
        try:
            assert _get(port) == 200
            proxy.down()
            _wait_for_status(port, 503)  # each reading waits for the pool's timeout
            proxy.up()
            _wait_for_status(port, 200)  # the pool reconnects with a backoff
        finally:
            err = _stop(process)
    finally:
        proxy.close()
        store.drop_schema()
        store.close()
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert "cannot be read" in lines[0]
    assert lines[1].endswith("can be read again")


class _InterruptedWhileFlushing:
    """Standard output on which a Ctrl-C lands as the status page's address is written."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        if "Ctrl-C to stop" in self.text and "stopped" not in self.text:
            raise KeyboardInterrupt


def test_serve_stopped_by_a_ctrl_c_as_it_starts_stops_as_by_a_later_one(tmp_path: Path) -> None:
    """A Ctrl-C landing as the address was printed, before serving began, came out
    of the command as 'interrupted' (status 130), not as a stop (status 0)."""
    from outbound.outbox.web.cli import serve  # noqa: PLC0415

    out = _InterruptedWhileFlushing()
    args = type("Args", (), {"port": "0", "refresh": "5", "host": "127.0.0.1"})()
    store = SQLiteStore(tmp_path / "o.db")
    try:
        status = serve(store, args, out)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C came out of serve()")
    finally:
        store.close()
    assert status == 0
    assert out.text.endswith("outbox: status page stopped\n")


def test_a_listing_by_a_key_no_row_can_have_names_the_problem(
    make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key with a lone surrogate (a command line's byte that is not UTF-8) came
    out as the encoder's "surrogates not allowed"; an int key was a TypeError
    where enqueue takes it."""
    store = make_store()
    enqueue_keys(store, "7", "b")
    assert [row.key for row in store.rows(key=7)] == ["7"]
    for key, problem in (("\udcff", "lone surrogate"), ("", "empty"), ("a\x00", "NUL")):
        with pytest.raises(ValueError, match=problem):
            store.rows(key=key)
    base = ["outbox", "--db", db_url(store), "--table", store.table]
    assert main([*base, "list", "--key", "\udcff"]) == 2
    assert "key must be valid Unicode text" in capsys.readouterr().err


def test_a_dedupe_key_held_again_is_named(
    make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """enqueue_many refused a batch "a dedupe_key of the batch" is held, naming
    neither the key nor the message; `retry --all` left a dead row whose key an
    unfinished row holds, said nothing and exited 0."""
    store = make_store()
    conn = app_connection(store)
    try:
        (dead,) = [store.enqueue(conn, key="k", type="t", payload={}, dedupe_key="order-7")]
        conn.commit()
    finally:
        conn.close()
    session = store.session()
    try:
        (claimed,) = session.claim("me", 10, 30.0, None)
        session.finish("me", [Outcome(dead, claimed.token, "k", "dead", error="poison")])
    finally:
        session.close()
    conn = app_connection(store)
    try:
        store.enqueue(conn, key="k", type="t", payload={}, dedupe_key="order-7")
        conn.commit()
        batch = [
            {"key": "j", "type": "t", "payload": {}, "dedupe_key": f"order-{i}"} for i in (6, 7)
        ]
        with pytest.raises(DuplicateMessage, match=r"messages\[1\]: .*'order-7'"):
            store.enqueue_many(conn, batch)
        conn.rollback()
    finally:
        conn.close()
    base = ["outbox", "--db", db_url(store), "--table", store.table]
    assert main([*base, "retry", "--all"]) == 1
    assert capsys.readouterr().out == (
        "0 dead rows are pending again\n1 dead row is still dead: an unfinished row holds "
        "its dedupe_key (or it died since)\n"
    )
