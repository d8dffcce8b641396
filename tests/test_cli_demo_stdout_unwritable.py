"""The demo with standard output closed (`>&-`) or failing (`> /dev/full`) ends
in one line on standard error and status 1, as the outbox commands do."""

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from outbound_process import FAST, outbound


def _close_stdout() -> None:
    os.close(1)


@pytest.mark.parametrize("how", ["closed", "full"])
def test_demo_with_stdout_unwritable_is_one_line(tmp_path: Path, how: str) -> None:
    with open("/dev/full", "w") as full:
        options: dict[str, Any] = (
            {"stdout": subprocess.DEVNULL, "preexec_fn": _close_stdout}
            if how == "closed"
            else {"stdout": full}
        )
        rc, _out, err = outbound(
            "demo", "--direct", "--chats", "1", "--messages", "1", *FAST, cwd=tmp_path, **options
        )
    assert "Traceback" not in err, err
    assert rc == 1, (rc, err)
    assert len(err.strip().splitlines()) == 1, err
