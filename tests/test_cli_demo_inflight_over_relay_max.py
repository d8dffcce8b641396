"""`demo --inflight` past the relay's maximum (10,000) is bad usage, one line and
status 2, not a traceback from the relay."""

from pathlib import Path

from outbound_process import FAST, outbound


def test_inflight_above_the_relays_maximum_is_bad_usage_not_a_traceback(tmp_path: Path) -> None:
    rc, _out, err = outbound(
        "demo", "--inflight", "10001", "--chats", "1", "--messages", "1", *FAST, cwd=tmp_path
    )
    assert "Traceback" not in err, err
    assert rc == 2, (rc, err)
