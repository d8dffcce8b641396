"""The README's main command: ``python -m outbound demo``, and what a newcomer does next."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest

from outbound import PermanentSendError, SendRequest, SendResult, demo
from outbound import __main__ as cli
from outbound.outbox import PostgresStore, SQLiteStore
from outbound.outbox.cli import mask_password
from outbound.simulator import PlatformSimulator, SimulatorConfig

SMALL = ["--chats", "4", "--messages", "3", "--chat-rate", "50", "--global-rate", "300"]


def run_demo(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    args = cli.build_parser().parse_args(["demo", *argv])
    assert args.func is demo.run
    return demo.run(args, out), out.getvalue()


def throughput(text: str) -> int:
    match = re.search(r"throughput: (\d+)% of the most the platform's limits allow", text)
    assert match, text
    return int(match.group(1))


def test_demo_small_broadcast_keeps_order_and_loses_nothing() -> None:
    status, text = run_demo(
        "--chats", "6", "--messages", "4", "--chat-rate", "50", "--global-rate", "300"
    )
    assert status == 0, text
    assert "sent 24/24" in text
    assert "per-chat order as received: kept" in text
    assert "nothing lost: yes" in text
    assert "the outbox stays" not in text  # a temporary outbox is not kept


def test_demo_direct_path_without_the_outbox() -> None:
    status, text = run_demo("--direct", "--chats", "4", "--messages", "3", "--chat-rate", "50")
    assert status == 0, text
    assert "directly through Outbound.reply" in text
    assert "nothing lost: yes" in text


def test_a_short_run_never_reports_more_than_the_limits_allow() -> None:
    """A short run lives on the platform's first burst: the report counts it in."""
    # 4 chats at 2/s each: the first message of every chat goes at once, so
    # 12 messages take about 1 s, and messages/s alone reads over 8/s.
    status, text = run_demo("--direct", "--chats", "4", "--messages", "3", "--chat-rate", "2")
    assert status == 0, text
    match = re.search(r"sent 12/12 in [\d.]+ s: ([\d.]+) messages/s", text)
    assert match, text
    assert float(match.group(1)) > 8  # over the sustained bound: the burst
    assert 0 < throughput(text) <= 100


def test_most_allowed_counts_burst_rate_and_tolerance() -> None:
    config = SimulatorConfig(global_rate=60, chat_rate=2)
    allowed, rate, burst = demo._most_allowed(config, 40, 5.0)
    assert (rate, burst) == (60, 60)
    assert allowed == pytest.approx(60 + 60 * (5.0 + config.tolerance))
    # Few chats: the per-chat limits bind (3 chats x 2/s, a burst of 2 each).
    allowed, rate, burst = demo._most_allowed(config, 3, 5.0)
    assert (rate, burst) == (6, 6)
    assert allowed == pytest.approx(6 + 6 * (5.0 + config.tolerance))


def test_demo_db_runs_twice_and_the_outbox_command_finds_it(tmp_path: Path) -> None:
    db = str(tmp_path / "demo.db")
    for _ in range(2):
        status, text = run_demo("--db", db, *SMALL)
        assert status == 0, text
        assert f"outbox: table 'outbox' in {db}" in text
        assert f"python -m outbound outbox --db {db} status" in text
    store = SQLiteStore(db, create=False)
    try:
        assert store.status().counts.get("sent") == 2 * 4 * 3
    finally:
        store.close()
    # The command the demo prints, as a newcomer runs it next.
    done = subprocess.run(
        [sys.executable, "-m", "outbound", "outbox", "--db", db, "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"sent\D+24\b", done.stdout), done.stdout


@pytest.mark.parametrize("spelling", ["sqlite:demo.db", "sqlite:///demo.db", "demo.db"])
def test_every_spelling_of_db_is_the_file_the_printed_command_reads(
    spelling: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo reads ``--db`` as ``outbox --db`` does: ``sqlite:demo.db`` made a
    file named ``sqlite:demo.db`` that the printed follow-up never found."""
    monkeypatch.chdir(tmp_path)
    status, text = run_demo("--db", spelling, *SMALL)
    assert status == 0, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.db"]
    follow_up = f"python -m outbound outbox --db {spelling} status"
    assert follow_up in text
    done = subprocess.run(
        [sys.executable, "-m", "outbound", "outbox", "--db", spelling, "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"sent\D+12\b", done.stdout), done.stdout


def test_demo_marks_rows_of_an_interrupted_run_dead(tmp_path: Path) -> None:
    db = str(tmp_path / "demo.db")
    store = SQLiteStore(db)
    conn = store.connect()
    with conn:  # what a run stopped by Ctrl-C leaves: its rows, pending
        for chat in (1000, 1001):
            payload = {"chat_id": chat, "text": "old", "run": uuid.uuid4().hex}
            store.enqueue(conn, key=str(chat), type=demo.DEMO_TYPE, payload=payload)
    conn.close()
    try:
        status, text = run_demo("--db", db, *SMALL)
        assert status == 0, text  # the old rows are not counted as this run's
        assert "sent 12/12" in text
        assert "per-chat order as received: kept" in text  # "old" never reached the platform
        assert "left unfinished: 2, now dead" in text
        assert store.status().counts.get("dead") == 2
    finally:
        store.close()


def test_demo_leaves_a_table_with_other_unfinished_rows_alone(tmp_path: Path) -> None:
    db = str(tmp_path / "app.db")
    store = SQLiteStore(db)
    conn = store.connect()
    with conn:
        store.enqueue(conn, key="order-7", type="order.placed", payload={"id": 7})
    conn.close()
    try:
        status, text = run_demo("--db", db, *SMALL)
        assert status == 1, text
        assert "stand-in platform at" not in text  # refused before anything started
        (row,) = store.rows()  # the demo wrote nothing, and took nothing
        assert (row.type, row.status) == ("order.placed", "pending")
        # Another table in the same file is fine.
        status, text = run_demo("--db", db, "--table", "demo_outbox", *SMALL)
        assert status == 0, text
        assert f"--db {db} --table demo_outbox status" in text
    finally:
        store.close()


def test_demo_on_postgres(postgres_url: str) -> None:
    table = f"demo_{uuid.uuid4().hex[:12]}"
    try:
        status, text = run_demo("--db", postgres_url, "--table", table, *SMALL)
        assert status == 0, text
        assert "nothing lost: yes" in text
    finally:
        PostgresStore(postgres_url, table=table, create=False).drop_schema()


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["demo", "--db", "/no/such/dir/x.db"], 1, "demo: cannot create the SQLite file"),
        (["demo", "--db", "mysql://db/app"], 2, "demo: unsupported database URL scheme 'mysql'"),
        (["demo", "--db", "sqlite://x.db"], 2, "demo: a SQLite URL is sqlite:///relative/path"),
        (["demo", "--db", "host=db dbname=app"], 2, "demo: --db takes a postgresql:// URL"),
        (["demo", "--db", ":memory:"], 2, "demo: path must name a database file"),
        (["demo", "--table", "Bad-Name"], 2, "demo: table must be a lowercase SQL identifier"),
        (["demo", "--direct", "--table", "t"], 2, "demo: --table names the outbox table"),
        (["demo", "--direct", "--db", "x.db"], 2, "argument --db: not allowed with argument"),
        (
            ["demo", "--chats", "many"],
            2,
            "argument --chats: must be a whole number from 1 to 1,000,000",
        ),
        (
            ["demo", "--latency", "nan"],
            2,
            "argument --latency: must be a number of seconds from 0 to 3600",
        ),
        (["simulator", "--port", "99999"], 2, "argument --port: must be a TCP port"),
        (["simulator", "--port", "http"], 2, "argument --port: must be a TCP port"),
    ],
)
def test_user_errors_end_in_one_line_and_a_status(
    argv: list[str], status: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        got = cli.main(argv)
    except SystemExit as exit:  # argparse's usage errors
        got = exit.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert got == status
    lines = captured.err.strip().splitlines()
    assert message in lines[-1], captured.err
    assert "Traceback" not in captured.err
    if not message.startswith("argument"):
        assert len(lines) == 1, captured.err  # not a usage error: nothing but the problem
    assert "stand-in platform at" not in captured.out  # refused before anything started


def test_database_errors_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A server that refuses (psycopg's message has several lines).
    assert cli.main(["demo", "--db", "postgresql://nobody@127.0.0.1:1/x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("demo: cannot use the outbox database postgresql://nobody@")
    assert len(err.strip().splitlines()) == 1, err
    # No psycopg: the error names the extra.
    monkeypatch.setitem(sys.modules, "psycopg", None)
    assert cli.main(["demo", "--db", "postgresql://nobody@127.0.0.1:1/x"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'outbound-dispatcher[postgres]'" in err
    assert len(err.strip().splitlines()) == 1, err


def test_demo_rejects_bad_sizes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "outbound", "demo", "--chats", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--chats" in proc.stderr


@pytest.mark.parametrize("argv", [[], ["demo"], ["simulator"]])
def test_help_is_plain_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        cli.main([*argv, "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    for markup in ("``", ":class:", ":mod:", ":func:", ":meth:", "::"):
        assert markup not in text
    if not argv:
        for command in ("demo", "simulator", "outbox"):
            assert command in text


def test_command_line_lists_its_commands() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "outbound", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for command in ("demo", "simulator", "outbox"):
        assert command in proc.stdout


def test_demo_outbox_path_ends_when_a_row_dies(tmp_path: Path) -> None:
    """A message that fails for good must not leave the demo waiting forever."""

    class RefusesChat2:
        def send(self, request: SendRequest) -> SendResult:
            if request.chat_id == 2:
                raise PermanentSendError("chat 2 blocked the bot")
            return SendResult(message_id=1)

    args = cli.build_parser().parse_args(["demo", "--chats", "3", "--messages", "2"])
    out = io.StringIO()
    result: list[tuple[list[float], int]] = []
    store = SQLiteStore(tmp_path / "outbox.db")
    with PlatformSimulator() as platform:
        worker = threading.Thread(
            target=lambda: result.append(
                demo._broadcast_outbox(
                    store, args, out, RefusesChat2(), [1, 2, 3], ["a", "b"], platform
                )
            )
        )
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the demo kept waiting for a dead row"
    store.close()
    latencies, dead = result[0]
    assert dead == 2  # chat 2's first message died, and its second (same key) after it
    assert len(latencies) == 4


def test_demo_serves_the_status_page_while_it_runs_and_after() -> None:
    """``demo --serve``: the page is up from the start and stays until Ctrl-C."""

    process = subprocess.Popen(
        [sys.executable, "-m", "outbound", "demo", "--serve", *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )

    def status(port: int) -> dict[str, object]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/status.json")
            response = conn.getresponse()
            assert response.status == 200
            return json.loads(response.read())  # type: ignore[no-any-return]
        finally:
            conn.close()

    try:
        assert process.stdout is not None
        lines = []
        port = None
        for line in process.stdout:
            lines.append(line)
            found = re.search(r"status page: http://127\.0\.0\.1:(\d+)/", line)
            if found:
                port = int(found.group(1))
                assert status(port)["outbox"]["table"] == "outbox"  # type: ignore[index]
            if "the status page stays up" in line:
                break
        assert port is not None, "".join(lines)
        assert "nothing lost: yes" in "".join(lines)
        # The page reads the outbox at most once a second.
        deadline = time.monotonic() + 10
        while (after := status(port))["counts"]["sent"] != 12:  # type: ignore[index]
            assert time.monotonic() < deadline, after
            time.sleep(0.1)
        assert sum(after["sent_per_second"]["sent"]) == 12  # type: ignore[index]
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert err == ""


def test_demo_serve_needs_the_outbox(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--direct", "--serve"]) == 2
    assert capsys.readouterr().err == (
        "demo: --serve shows the outbox; --direct sends without an outbox\n"
    )
    with pytest.raises(SystemExit):
        cli.main(["demo", "--serve", "70000"])
    assert "must be a TCP port from 0 to 65535" in capsys.readouterr().err


def _start_demo(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "outbound", "demo", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
    )


def _script_succeeds(script: str, *argv: str) -> None:
    """Run ``python -c script *argv`` (60 s at most); it must exit with status 0."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _read_until(process: subprocess.Popen[str], marker: str) -> str:
    """What the process printed up to the line holding ``marker`` (bounded by the test's
    timeout: a process that ends first ends the loop)."""
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError(f"no {marker!r} in: {''.join(lines)}")


def test_a_second_demo_on_the_same_table_is_refused_and_the_first_keeps_its_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "demo.db")
    # About 2 s at 5 messages/s per chat: long enough to start a second run,
    # which is refused (or not) at once.
    first = _start_demo("--db", db, "--chats", "3", "--messages", "10", "--chat-rate", "5")
    try:
        _read_until(first, "stand-in platform at")
        assert cli.main(["demo", "--db", db, *SMALL]) == 1
        err = capsys.readouterr().err
        assert f"demo: another demo is running on table 'outbox' in {db}" in err, err
        assert f"(process {first.pid})" in err
        # Another table in the same file is another space: it runs.
        status, text = run_demo("--db", db, "--table", "demo_two", *SMALL)
        assert status == 0, text
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, out + err
    assert "nothing lost: yes" in out
    assert "now dead" not in out
    store = SQLiteStore(db, create=False)
    try:
        assert store.status().counts.get("sent") == 30
        assert store.status().unfinished == 0
    finally:
        store.close()
    assert sorted(p.name for p in tmp_path.iterdir() if "lock" in p.name) == []


def test_a_second_demo_on_the_same_postgres_table_is_refused(postgres_url: str) -> None:
    table = f"demo_{uuid.uuid4().hex[:12]}"
    store = PostgresStore(postgres_url, table=table)
    try:
        with contextlib.ExitStack() as stack:
            demo._hold_the_table(store, stack)
            status, text = run_demo("--db", postgres_url, "--table", table, *SMALL)
            assert status == 1
            assert "stand-in platform at" not in text
        # Released with its run: the next run goes ahead.
        status, text = run_demo("--db", postgres_url, "--table", table, *SMALL)
        assert status == 0, text
    finally:
        store.drop_schema()
        store.close()


# SIGHUP (its terminal closed) ended it at once: its temporary outbox left behind.
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP"])
def test_sigterm_stops_the_demo_like_ctrl_c_and_removes_its_temporary_outbox(
    tmp_path: Path, signum: str
) -> None:
    if not hasattr(signal, signum):
        pytest.skip(f"no {signum} here")
    process = _start_demo(
        "--chats", "3", "--messages", "50", "--chat-rate", "2", env={"TMPDIR": str(tmp_path)}
    )
    try:
        _read_until(process, "stand-in platform at")
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("outbound-demo-")]
        process.send_signal(getattr(signal, signum))
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, err
    assert err == "interrupted\n"
    assert list(tmp_path.iterdir()) == []  # the temporary outbox is gone


def _stop_a_kept_demo(
    db: Path, signum: int, *argv: str, code: str | None = None
) -> tuple[int, str, Mapping[str, int]]:
    """Run the demo on the kept outbox ``db`` (``argv`` its options; ``code``: run by
    ``python -c``, else ``-m outbound``), send ``signum`` once its relay claimed rows;
    its exit status, standard error and the table's counts after."""
    command = ["-c", code] if code is not None else ["-m", "outbound"]
    process = subprocess.Popen(
        [sys.executable, *command, "demo", "--db", str(db), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        _read_until(process, "stand-in platform at")
        store = SQLiteStore(db, create=False)
        try:
            deadline = time.monotonic() + 30
            while store.status().counts.get("processing", 0) == 0:
                assert time.monotonic() < deadline, "the demo's relay claimed nothing"
                time.sleep(0.01)
            process.send_signal(signum)
            _, err = process.communicate(timeout=60)
            counts = store.status().counts
        finally:
            store.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, err, counts


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP here")
def test_sighup_stops_a_demo_on_a_kept_outbox_with_no_row_left_claimed(tmp_path: Path) -> None:
    # Its default ended the demo at once: the rows its relay held stayed
    # 'processing' under a relay that was gone, until their leases ran out.
    status, err, counts = _stop_a_kept_demo(
        tmp_path / "kept.db", signal.SIGHUP, "--chats", "20", "--messages", "40", "--chat-rate", "2"
    )
    assert status == 130, err
    assert counts.get("processing", 0) == 0, counts


_SECOND_SIGNAL_IN_STOP = r"""
import os, signal, sys
from outbound.outbox import relay

# (Not a profile function: the first signal's KeyboardInterrupt, raised
# inside one, turns profiling off, and the second never came.)
stop = relay.Relay.stop
fired = []
def second_signal_then_stop(self, *args, **kwargs):
    if not fired:
        fired.append(True)
        sys.stderr.write("second signal\n")
        os.kill(os.getpid(), signal.SIGTERM)
    return stop(self, *args, **kwargs)
relay.Relay.stop = second_signal_then_stop
signal.signal(signal.SIGINT, signal.default_int_handler)
from outbound.__main__ import main
raise SystemExit(main())
"""


def test_a_second_signal_during_the_demos_stop_lets_the_stop_finish(tmp_path: Path) -> None:
    # The first stop signal's KeyboardInterrupt started the relay's bounded
    # stop; a second one (the terminal closing, then the session's SIGTERM)
    # raised inside it: the relay went on running under a closed store, its
    # rows left 'processing', and the exit waited for it.
    status, err, counts = _stop_a_kept_demo(
        tmp_path / "kept.db",
        signal.SIGTERM,
        *("--chats", "20", "--messages", "20", "--latency", "0.5", "--inflight", "16"),
        code=_SECOND_SIGNAL_IN_STOP,
    )
    assert "second signal" in err, "the second signal never landed in the stop"
    assert status == 130, err
    assert err.splitlines()[-1] == "interrupted", err
    assert counts.get("processing", 0) == 0, counts


_LINGER_THEN_SIGTERM_TWICE = textwrap.dedent(r"""
    import io, os, signal, sys, threading, time
    from outbound import demo
    from outbound.outbox.web import _server

    out = io.StringIO()
    sent_second = []
    original_close = _server.StatusServer.close

    def close(self):
        if not sent_second:
            sent_second.append(True)
            os.kill(os.getpid(), signal.SIGTERM)   # the second SIGTERM, as the stop begins
            time.sleep(0.2)                         # (delivered to the main thread here)
        return original_close(self)

    _server.StatusServer.close = close

    def first_sigterm():
        deadline = time.monotonic() + 30
        while "stays up" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)        # ends the linger

    threading.Thread(target=first_sigterm, daemon=True).start()
    parser = __import__("argparse").ArgumentParser()
    demo._add_arguments(parser)
    args = parser.parse_args(["--chats", "2", "--messages", "2", "--serve", "0"])
    try:
        status = demo.run(args, out)
    except KeyboardInterrupt:
        print("RESULT: KeyboardInterrupt escaped run() after the linger's stop", flush=True)
        sys.exit(3)
    print("RESULT: status", status, flush=True)
    sys.exit(0 if status == 0 else 4)
""")


def test_a_second_sigterm_as_the_demo_closes_after_its_linger_changes_nothing() -> None:
    # The --serve linger had a sigterm_stops() of its own inside run()'s: the
    # SIGTERM that ended it was the inner one's, and a second one (a
    # supervisor repeating it) raised into the demo's closing: status 130
    # for a run that sent everything, its cleanup cut.
    _script_succeeds(_LINGER_THEN_SIGTERM_TWICE)


_SIGNAL_AS_RELAY_STARTS = textwrap.dedent(r"""
    import os, signal, sqlite3, sys, threading, time
    from outbound import demo
    fired = []
    def profile(frame, event, arg):
        if (event == "return" and not fired and frame.f_code.co_name == "start"
                and frame.f_code.co_filename.endswith("relay.py") and frame.f_back is not None
                and frame.f_back.f_code.co_name == "_broadcast_outbox"):
            fired.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
    sys.setprofile(profile)
    try:
        demo.main(["--chats", "3", "--messages", "20", "--db", sys.argv[1]])
    except KeyboardInterrupt:
        pass
    sys.setprofile(None)
    assert fired, "the signal was not landed"
    alive = [t.name for t in threading.enumerate() if t.name.startswith("outbound-relay")]
    conn = sqlite3.connect(sys.argv[1])
    processing = conn.execute(
        "SELECT count(*) FROM outbox WHERE status = 'processing'"
    ).fetchone()[0]
    print("relay threads alive after run():", alive, "; rows processing:", processing, flush=True)
    os._exit(0 if not alive and processing == 0 else 3)
""")


def test_a_signal_as_the_demos_relay_starts_stops_it_too(tmp_path: Path) -> None:
    # relay.start() came before the try whose finally stops the relay: a
    # signal as it returned left the relay running after run() returned,
    # under a closed store, its rows 'processing'.
    _script_succeeds(_SIGNAL_AS_RELAY_STARTS, str(tmp_path / "demo.db"))


def test_an_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    if not hasattr(signal, "SIGHUP"):
        pytest.skip("no SIGHUP here")
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
            "from outbound.__main__ import main; raise SystemExit(main())",
            "demo",
            "--chats",
            "2",
            "--messages",
            "6",
            "--chat-rate",
            "50",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(tmp_path)},
    )
    try:
        _read_until(process, "stand-in platform at")
        process.send_signal(signal.SIGHUP)  # (nohup): the run goes on to its end
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err


def test_demo_never_prints_a_database_password() -> None:
    url = "postgresql://nobody:s3cr3t@127.0.0.1:1/x"
    proc = subprocess.run(
        [sys.executable, "-m", "outbound", "demo", "--db", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "s3cr3t" not in proc.stdout + proc.stderr
    assert "postgresql://nobody:***@127.0.0.1:1/x" in proc.stderr


def test_mask_password() -> None:
    assert mask_password("postgresql://u:p@h/db") == "postgresql://u:***@h/db"
    assert mask_password("at postgres://u:p%40ss@h:5/db now") == "at postgres://u:***@h:5/db now"
    assert mask_password("postgresql://u@h/db") == "postgresql://u@h/db"
    assert mask_password("host=h password=x user=u") == "host=h password=*** user=u"
    assert mask_password("password='a b' user=u") == "password=*** user=u"
    assert mask_password("demo.db") == "demo.db"


@pytest.mark.parametrize(
    "digit", ["²", "①", "\u0661"], ids=["superscript", "circled", "arabic-indic"]
)
@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--chats", "{}"],
        ["demo", "--serve", "{}"],
        ["simulator", "--port", "{}"],
        ["outbox", "--db", "unused.db", "serve", "--port", "{}"],
    ],
    ids=["demo-count", "demo-serve", "simulator-port", "outbox-serve-port"],
)
def test_a_number_in_digits_other_than_ascii_is_a_usage_error(
    argv: list[str], digit: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # str.isdigit() takes them and int() refuses some: `outbox serve --port ²`
    # was a ValueError traceback (status 1).
    args = [a.replace("{}", digit).replace("unused.db", str(tmp_path / "o.db")) for a in argv]
    status: object
    try:
        status = cli.main(args)
    except SystemExit as exc:  # argparse's usage error
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert repr(digit) in err
    assert "Traceback" not in err
