"""The README's main command: ``python -m outbound demo`` on its defaults' shape."""

from __future__ import annotations

import io
import subprocess
import sys

from outbound import __main__ as cli
from outbound import demo


def test_demo_small_broadcast_keeps_order_and_loses_nothing() -> None:
    out = io.StringIO()
    args = cli.build_parser().parse_args(
        ["demo", "--chats", "6", "--messages", "4", "--chat-rate", "50", "--global-rate", "300"]
    )
    assert args.func is demo.run
    assert demo.run(args, out) == 0
    text = out.getvalue()
    assert "sent 24/24" in text
    assert "per-chat order as received: kept" in text
    assert "nothing lost: yes" in text


def test_demo_direct_path_without_the_outbox() -> None:
    out = io.StringIO()
    args = cli.build_parser().parse_args(
        ["demo", "--direct", "--chats", "4", "--messages", "3", "--chat-rate", "50"]
    )
    assert demo.run(args, out) == 0
    assert "directly through Outbound.reply" in out.getvalue()
    assert "nothing lost: yes" in out.getvalue()


def test_demo_on_postgres(postgres_url: str) -> None:
    out = io.StringIO()
    args = cli.build_parser().parse_args(
        ["demo", "--db", postgres_url, "--chats", "4", "--messages", "3", "--chat-rate", "50"]
    )
    assert demo.run(args, out) == 0
    assert "nothing lost: yes" in out.getvalue()


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
