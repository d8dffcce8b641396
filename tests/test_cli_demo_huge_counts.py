"""A huge `--messages` or `--chats` (a typo) is bad usage, one line and status 2,
not a list of that many items built until memory runs out."""

import resource
from pathlib import Path

import pytest
from outbound_process import outbound


def _limit_memory() -> None:
    # 2 GB of address space: the test must not take the machine's memory.
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("flag", ["--messages", "--chats"])
def test_a_huge_count_is_refused_not_allocated(tmp_path: Path, flag: str) -> None:
    rc, _out, err = outbound(
        "demo",
        "--direct",
        flag,
        "99999999999999999999",
        cwd=tmp_path,
        timeout=60,
        preexec_fn=_limit_memory,
    )
    assert "Traceback" not in err, err[-1500:]
    assert rc == 2, (rc, err[-500:])
