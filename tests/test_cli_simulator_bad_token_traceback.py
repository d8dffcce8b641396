"""`python -m outbound simulator --token 'a b'` is one line and status 2, as every
other bad simulator option is."""

from outbound_process import outbound


def test_bad_token_is_one_line_and_usage_status() -> None:
    rc, _out, err = outbound("simulator", "--token", "a b", timeout=20)
    assert "Traceback" not in err, err
    assert rc == 2, (rc, err)
    assert len(err.strip().splitlines()) == 1, err
