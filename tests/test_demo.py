"""The README's main command: ``python -m outbound demo`` on its defaults' shape."""

from __future__ import annotations

import io
import subprocess
import sys
import threading

from outbound import PermanentSendError, SendRequest, SendResult, demo
from outbound import __main__ as cli
from outbound.simulator import PlatformSimulator


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


def test_demo_outbox_path_ends_when_a_row_dies() -> None:
    """A message that fails for good must not leave the demo waiting forever."""

    class RefusesChat2:
        def send(self, request: SendRequest) -> SendResult:
            if request.chat_id == 2:
                raise PermanentSendError("chat 2 blocked the bot")
            return SendResult(message_id=1)

    args = cli.build_parser().parse_args(["demo", "--chats", "3", "--messages", "2"])
    out = io.StringIO()
    result: list[tuple[list[float], int]] = []
    with PlatformSimulator() as platform:
        worker = threading.Thread(
            target=lambda: result.append(
                demo._broadcast_outbox(args, out, RefusesChat2(), [1, 2, 3], ["a", "b"], platform)
            )
        )
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the demo kept waiting for a dead row"
    latencies, dead = result[0]
    assert dead == 2  # chat 2's first message died, and its second (same key) after it
    assert len(latencies) == 4
