"""A Ctrl-C while ``python -m outbound`` loaded its commands or read its arguments
printed a ``KeyboardInterrupt`` traceback (both ran before ``main()``'s handler):
it is "interrupted", status 130, as later."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

import pytest

from outbound import __main__ as cli
from outbound import demo


def _interrupted(*args: Any, **kwargs: Any) -> NoReturn:
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["loading the commands", "reading the arguments"])
def test_a_ctrl_c_while_starting_is_interrupted(
    where: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if where == "loading the commands":
        monkeypatch.setattr(demo, "add_parser", _interrupted)
    else:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", _interrupted)
    try:
        status = cli.main(["outbox", "--db", "o.db", "status"])
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C left main() as a KeyboardInterrupt")
    assert status == 130
    assert capsys.readouterr().err == "interrupted\n"
