"""The README's examples, run from its own code blocks as a newcomer runs them.

- "Sending messages": the script prints the result, and fails loudly (not
  silently) when the platform refuses.
- "Flask": the app serves a reply and writes an outbox row in its request's
  transaction.
- "Django quickstart": ``startproject``, the settings and handler blocks,
  ``check``, ``migrate``, the ``shell -c`` enqueue, and ``outbound_worker``
  delivering to the stand-in platform.
- "The rest of it": with psycopg2 and no psycopg 3, ``check`` and
  ``migrate`` stop with ``outbound.E006`` before any migration runs.

Each test runs what the README shows; only the stand-in platform's address
(``http://127.0.0.1:8081`` in the README) is replaced by a free one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbound.simulator import DEFAULT_TOKEN, PlatformSimulator

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: The stand-in platform's address as the README writes it.
README_API = "http://127.0.0.1:8081"
TIMEOUT = 60.0


def section(heading: str) -> str:
    """The README's text under ``heading`` (a whole line), up to the next heading as high."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = README.splitlines()
    start = lines.index(heading) + 1
    for end in range(start, len(lines)):
        line = lines[end]
        if re.match(rf"#{{1,{level}}} ", line) and not _in_code(lines[start:end]):
            return "\n".join(lines[start:end])
    return "\n".join(lines[start:])


def _in_code(lines: list[str]) -> bool:
    return sum(1 for line in lines if line.startswith("```")) % 2 == 1


def code_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of ``text``: (language, code)."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)


def the_block(text: str, language: str, containing: str) -> str:
    (code,) = [c for lang, c in code_blocks(text) if lang == language and containing in c]
    return code


def shell_commands(code: str) -> Iterator[list[str]]:
    """The commands of a ``sh`` block, split as a shell would (quotes may span lines)."""
    pending = ""
    for line in code.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if words:
            yield words
        pending = ""
    assert not pending, f"unterminated command: {pending!r}"


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO_", "TELEGRAM_", "OUTBOUND_DJANGO_"))
    }
    env.update(extra)
    return env


# ------------------------------------------------------------------ sending


def run_the_sending_script(platform: PlatformSimulator) -> subprocess.CompletedProcess[str]:
    """The README's sending script, pointed at ``platform``, in a process of its own."""
    code = the_block(section("## Sending messages"), "python", "TelegramSender(TOKEN")
    assert f'API = "{README_API}"' in code
    return subprocess.run(
        [sys.executable, "-c", code.replace(README_API, platform.url)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def test_the_sending_example_prints_the_result() -> None:
    with PlatformSimulator() as platform:
        assert platform.token == DEFAULT_TOKEN  # the README's TOKEN
        done = run_the_sending_script(platform)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("SendResult(message_id=1, raw="), done.stdout
        assert [m["text"] for m in platform.received(42)] == ["hello"]


def test_the_sending_example_fails_loudly() -> None:
    """A refused send (here a token the platform does not know) is never silent."""
    with PlatformSimulator(token="654321:another-bot") as platform:
        done = run_the_sending_script(platform)
    assert done.returncode == 1
    assert "ERROR:bot:reply failed: PermanentSendError" in done.stderr  # the done-callback
    assert done.stderr.rstrip().endswith("PermanentSendError: sendMessage: HTTP 401: Unauthorized")


# -------------------------------------------------------------------- Flask


def test_the_flask_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip(
        "flask", reason="Flask is not installed: pip install 'outbound-dispatcher[flask]'"
    )
    pytest.importorskip(
        "flask_sqlalchemy",
        reason="Flask-SQLAlchemy is not installed: "
        "pip install 'outbound-dispatcher[flask-sqlalchemy]'",
    )
    code = the_block(section("### Flask"), "python", "def create_app")
    (tmp_path / "readme_shop.py").write_text(code, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # where `flask --app shop run` runs
    with PlatformSimulator() as platform:
        monkeypatch.setenv("TELEGRAM_TOKEN", platform.token)
        monkeypatch.setenv("TELEGRAM_API", platform.url)
        module = importlib.import_module("readme_shop")
        request.addfinalizer(lambda: sys.modules.pop("readme_shop", None))
        app = module.create_app()
        try:
            client = app.test_client()
            assert client.post("/hook", json={"chat_id": 7}).get_json() == {"ok": True}
            assert platform.wait_received(1, chat_id=7, timeout=TIMEOUT)
            assert [m["text"] for m in platform.received(7)] == ["got it"]
            order = client.post("/orders", json={"chat_id": 7}).get_json()
            with app.app_context():
                (row,) = module.outbound.outbox_store().rows()
                assert (row.key, row.type, row.status) == ("7", "order.placed", "pending")
                assert module.db.session.get(module.Order, order["id"]) is not None
                module.db.engine.dispose()
            # The database is where the README says, not in instance/.
            assert (tmp_path / "shop.db").is_file()
            assert not (tmp_path / "instance").exists()
            # `flask --app shop outbound worker` delivers the row, then stops on SIGTERM.
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "flask",
                    "--app",
                    "readme_shop",
                    "outbound",
                    "worker",
                    "--poll-interval",
                    "0.1",
                ],
                cwd=tmp_path,
                env=clean_env(
                    TELEGRAM_TOKEN=platform.token,
                    TELEGRAM_API=platform.url,
                    PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]),
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                assert platform.wait_received(2, chat_id=7, timeout=TIMEOUT)
                worker.send_signal(signal.SIGTERM)
                out, err = worker.communicate(timeout=TIMEOUT)
            finally:
                if worker.poll() is None:
                    worker.kill()
                    worker.communicate()
            assert worker.returncode == 0, err
            assert "outbound worker: stopped; sent 1, retried 0, dead 0" in out
            assert [m["text"] for m in platform.received(7)][1] == f"order {order['id']} placed"
        finally:
            assert module.outbound.shutdown(TIMEOUT, app=app)


# ------------------------------------------------------------- every command


def test_every_outbound_command_in_the_readme_parses() -> None:
    """Each ``python -m outbound ...`` of the README's shell blocks names real commands
    and options (a renamed option fails here, not in a newcomer's terminal)."""
    from outbound.__main__ import build_parser  # noqa: PLC0415

    seen = 0
    for language, code in code_blocks(README):
        if language != "sh":
            continue
        for words in shell_commands(code):
            for n in range(len(words) - 2):
                if words[n].endswith("python") and words[n + 1 : n + 3] == ["-m", "outbound"]:
                    argv = words[n + 3 :]
                    status: object = 0
                    try:
                        build_parser().parse_args(argv)
                    except SystemExit as exit:  # --help exits 0, a bad option 2
                        status = exit.code
                    assert status == 0, f"python -m outbound {shlex.join(argv)}"
                    seen += 1
    assert seen >= 4  # the demo, the status command, serve (twice)


# ------------------------------------------------------------------- Django


def test_the_django_quickstart(tmp_path: Path) -> None:
    pytest.importorskip(
        "django", reason="Django is not installed: pip install 'outbound-dispatcher[django]'"
    )
    blocks = code_blocks(section("#### Django quickstart"))
    assert [lang for lang, _ in blocks] == ["sh", "python", "python", "sh", "sh"]
    cwd = tmp_path
    with PlatformSimulator() as platform:
        for lang, code in blocks:
            if lang == "python":  # a file: "# path" or "# path (at the end)" on its first line
                first, _, body = code.partition("\n")
                where = re.fullmatch(r"# (\S+)( \(at the end\))?", first)
                assert where, first
                with (cwd / where[1]).open("a" if where[2] else "x", encoding="utf-8") as f:
                    f.write(("\n" if where[2] else "") + body)
                continue
            for words in shell_commands(code.replace(README_API, platform.url)):
                env = clean_env()
                while "=" in words[0]:  # VAR=value before the command
                    name, _, value = words.pop(0).partition("=")
                    env[name] = value
                if words[:2] == ["pip", "install"]:
                    assert words[2:] == ["outbound-dispatcher[django]"]  # installed here already
                elif words[0] == "cd":
                    cwd = cwd / words[1]
                elif words[0] == "django-admin":
                    run([sys.executable, "-m", "django", *words[1:]], cwd, env)
                elif words[:3] == ["python", "manage.py", "outbound_worker"]:
                    assert env["TELEGRAM_TOKEN"] == platform.token
                    deliver_with_the_worker([sys.executable, *words[1:]], cwd, env, platform)
                else:
                    assert words[0] == "python", words
                    out = run([sys.executable, *words[1:]], cwd, env)
                    if words[2] == "check":
                        assert "System check identified no issues" in out
                    if words[2] == "migrate":  # a second time, as a newcomer will
                        assert "No migrations to apply" in run(
                            [sys.executable, *words[1:]], cwd, env
                        )
    # What the README says comes next.
    status = run(
        [sys.executable, "-m", "outbound", "outbox", "--db", "db.sqlite3", "status"],
        cwd,
        clean_env(),
    )
    assert re.search(r"sent\D+1\b", status), status


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done.stdout


def deliver_with_the_worker(
    argv: list[str], cwd: Path, env: dict[str, str], platform: PlatformSimulator
) -> None:
    with (cwd / "worker.out").open("w+") as out:
        worker = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            delivered = platform.wait_received(1, chat_id=42, timeout=TIMEOUT)
            worker.send_signal(signal.SIGTERM)  # what Ctrl-C does, as a supervisor sends it
            status = worker.wait(timeout=TIMEOUT)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=TIMEOUT)
        out.seek(0)
        log = out.read()
    assert delivered, log
    assert status == 0, log
    assert [m["text"] for m in platform.received(42)] == ["Hello, Ada!"]
    assert "outbound_worker: stopped; sent 1, retried 0, dead 0" in log


@pytest.mark.parametrize("command", ["check", "migrate"])
def test_django_on_psycopg2_alone_is_refused_before_migrating(command: str, tmp_path: Path) -> None:
    pytest.importorskip(
        "django", reason="Django is not installed: pip install 'outbound-dispatcher[django]'"
    )
    if importlib.util.find_spec("psycopg2") is None:
        pytest.skip("psycopg2 is not installed: pip install psycopg2-binary")
    (tmp_path / "pg2_settings.py").write_text(
        "SECRET_KEY = 'x'\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'outbound.contrib.django']\n"
        # No server is needed: the refusal comes before any connection.
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql',\n"
        "    'NAME': 'app', 'HOST': '127.0.0.1', 'PORT': '1'}}\n"
        "OUTBOUND = {}\n",
        encoding="utf-8",
    )
    # Django picks psycopg 3 when it can import it: hide it, as in a project
    # that only has psycopg2.
    code = (
        "import sys; sys.modules['psycopg'] = None\n"
        "from django.core.management import execute_from_command_line\n"
        f"execute_from_command_line(['manage.py', {command!r}])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=clean_env(DJANGO_SETTINGS_MODULE="pg2_settings", PYTHONPATH=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "(outbound.E006)" in done.stderr
    assert "PostgreSQL through psycopg2" in done.stderr
    assert "pip install 'outbound-dispatcher[postgres]'" in done.stderr
    assert "Traceback" not in done.stderr
    assert "Applying" not in done.stdout  # no migration ran
