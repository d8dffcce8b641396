"""middleware.logging() logs a run that fails with a BaseException (SystemExit,
KeyboardInterrupt in a worker, GeneratorExit) at WARNING, as metrics() counts it."""

from __future__ import annotations

import logging

import pytest

from outbound import Dispatcher, Outbound
from outbound.messages import SendRequest, SendResult
from outbound.middleware import chain, metrics
from outbound.middleware import logging as log_sends


class Exits:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def send(self, request: SendRequest) -> SendResult:
        raise self.error


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize(
    "error", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()], ids=lambda e: type(e).__name__
)
def test_every_failed_run_is_logged(error: BaseException) -> None:
    lines = Lines()
    log = logging.getLogger("outbound.send.findings")
    log.addHandler(lines)
    log.setLevel(logging.DEBUG)
    metered = metrics()
    try:
        with Dispatcher() as dispatcher:
            out = Outbound(dispatcher, chain(metered, log_sends(logger=log))(Exits(error)))
            failure = out.reply_text(1, "hello").exception(timeout=10)
        assert type(failure) is type(error)  # the future fails with it (guaranteed)
        assert dict(metered.snapshot().failed) == {type(error).__name__: 1}  # metrics saw it
        assert [r for r in lines.records if r.levelno >= logging.WARNING], (
            f"a run that failed with {type(error).__name__} left no log line"
        )
    finally:
        log.removeHandler(lines)
