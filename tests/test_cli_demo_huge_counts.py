"""A huge `--messages` or `--chats` (a typo) is bad usage, one line and status 2,
not a list of that many items built until memory runs out."""

import resource
from pathlib import Path

from outbound_process import outbound


def _limit_memory() -> None:
    # 2 GB of address space: the test must not take the machine's memory.
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_huge_message_count_is_refused_not_allocated(tmp_path: Path) -> None:
    rc, _out, err = outbound(
        "demo",
        "--direct",
        "--messages",
        "99999999999999999999",
        cwd=tmp_path,
        timeout=60,
        preexec_fn=_limit_memory,
    )
    assert "Traceback" not in err, err[-1500:]
    assert rc == 2, (rc, err[-500:])


def test_huge_chat_count_is_refused_not_allocated(tmp_path: Path) -> None:
    rc, _out, err = outbound(
        "demo",
        "--direct",
        "--chats",
        "99999999999999999999",
        cwd=tmp_path,
        timeout=60,
        preexec_fn=_limit_memory,
    )
    assert "Traceback" not in err, err[-1500:]
    assert rc == 2, (rc, err[-500:])
