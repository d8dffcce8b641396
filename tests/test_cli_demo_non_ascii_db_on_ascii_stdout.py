"""The demo writes text its standard output cannot encode (a non-ASCII `--db`
path under PYTHONIOENCODING=ascii) with backslash escapes, as the outbox
commands do, and runs to the end."""

from pathlib import Path

from outbound_process import FAST, outbound


def test_demo_with_a_non_ascii_db_path_on_an_ascii_stdout(tmp_path: Path) -> None:
    rc, out, err = outbound(
        "demo",
        "--db",
        "café.db",
        "--chats",
        "1",
        "--messages",
        "1",
        *FAST,
        cwd=tmp_path,
        env={"PYTHONIOENCODING": "ascii"},
    )
    assert "Traceback" not in err, err
    assert rc == 0, (rc, out, err)
    assert "nothing lost: yes" in out
