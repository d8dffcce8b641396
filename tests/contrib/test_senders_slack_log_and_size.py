"""SlackSender: slack_sdk logged at ERROR an answer's body or status line that
quoted the bot token (a gateway's page echoing the request's Authorization
header); an answer declaring a huge Content-Length raised a bare MemoryError
(http.client allocates the declared length at once)."""

from __future__ import annotations

import logging

import pytest
from canned_http import raw_answer_server

from outbound.errors import TransientSendError
from outbound.messages import SendRequest, TextMessage

slack_sdk = pytest.importorskip("slack_sdk")

TOKEN = "xoxb-1234-5678-" + "s3cr3t" * 4

_PAGE = b"Bad gateway (Authorization: Bearer " + TOKEN.encode() + b")"
ECHOING = {
    "not-json-page": (
        b"HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\nContent-Type: text/plain\r\n"
        + f"Content-Length: {len(_PAGE)}\r\n\r\n".encode()
        + _PAGE
    ),
    "bad-status-line": b"HTTP/1.1 2x0 " + TOKEN.encode() + b"\r\n\r\n",
}


def _sender(url: str, **client_options: object) -> object:
    from outbound.contrib.slack import SlackSender  # noqa: PLC0415

    client = slack_sdk.WebClient(token=TOKEN, base_url=url + "/api/", **client_options)
    return SlackSender(client, timeout=5.0)


@pytest.mark.parametrize("answer", list(ECHOING.values()), ids=list(ECHOING))
@pytest.mark.parametrize("own_logger", [False, True], ids=["slack-sdk-logger", "client-logger"])
def test_slack_sdk_logs_no_token_an_answer_echoes(
    answer: bytes, own_logger: bool, caplog: pytest.LogCaptureFixture
) -> None:
    options = {"logger": logging.getLogger("app.slack")} if own_logger else {}
    with raw_answer_server(answer) as url, caplog.at_level(logging.DEBUG):
        sender = _sender(url, **options)
        with pytest.raises(TransientSendError) as info:
            sender.send(SendRequest("C1", TextMessage("hello")))  # type: ignore[attr-defined]
    assert TOKEN not in f"{info.value} {info.value!r}"
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged, "slack_sdk logged nothing at ERROR: the test tests nothing"
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "")
        assert TOKEN not in text, (record.name, text)
        assert "s3cr3t" not in text, (record.name, text)


@pytest.mark.parametrize("status", [b"200 OK", b"502 Bad Gateway"])
def test_slack_an_answer_declaring_a_huge_length_is_a_transient_error(status: bytes) -> None:
    # (An error's body, slack_sdk reads whole itself: a MemoryError too.)
    answer = (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b'Content-Length: 99999999999\r\n\r\n{"ok":true}'
    )
    with raw_answer_server(answer) as url:
        with pytest.raises(TransientSendError, match="99999999999 bytes"):
            _sender(url).send(SendRequest("C1", TextMessage("hello")))  # type: ignore[attr-defined]


@pytest.mark.parametrize("status", [b"200 OK", b"502 Bad Gateway"])
def test_slack_an_answer_running_past_the_most_read_is_a_transient_error(
    monkeypatch: pytest.MonkeyPatch, status: bytes
) -> None:
    """A body with no length (read until the close) is read up to the cap, not whole."""
    import outbound.contrib.slack as slack  # noqa: PLC0415

    monkeypatch.setattr(slack, "_MAX_ANSWER", 1000, raising=False)
    body = b'{"ok":true,"ts":"1.2","pad":"' + b"x" * 5000 + b'"}'
    answer = (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    )
    with raw_answer_server(answer + body) as url:
        with pytest.raises(TransientSendError, match="runs past"):
            _sender(url).send(SendRequest("C1", TextMessage("hello")))  # type: ignore[attr-defined]


def test_a_token_holding_another_senders_token_is_masked_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Masked in the order the senders were made, "xoxb-1" (another sender's) masked
    the start of "xoxb-1234-..." and left the rest of it in the record."""
    answer = ECHOING["not-json-page"]
    with raw_answer_server(answer) as url, caplog.at_level(logging.DEBUG):
        from outbound.contrib.slack import SlackSender  # noqa: PLC0415

        SlackSender(slack_sdk.WebClient(token="xoxb-1", base_url=url + "/api/"))
        with pytest.raises(TransientSendError):
            _sender(url).send(SendRequest("C1", TextMessage("hello")))  # type: ignore[attr-defined]
    assert caplog.records
    for record in caplog.records:
        assert "s3cr3t" not in record.getMessage(), record.getMessage()


def test_the_token_filter_leaves_an_applications_records_without_a_token_as_they_are() -> None:
    """On a logger given to the client (the application's), the filter took every
    record's exception away and put a plainly formatted traceback in its place:
    the application's formatter and error reporters no longer saw it."""
    from outbound.contrib.slack import SlackSender  # noqa: PLC0415

    app_logger = logging.getLogger("app.own")
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep()
    app_logger.addHandler(handler)
    try:
        SlackSender(slack_sdk.WebClient(token=TOKEN, logger=app_logger))
        try:
            raise KeyError("no such order")
        except KeyError:
            app_logger.exception("the app's own failure")
            app_logger.error("echoed %s", TOKEN, exc_info=True)
    finally:
        app_logger.removeHandler(handler)
    plain, echoed = seen
    assert plain.exc_info is not None
    assert plain.exc_info[0] is KeyError
    assert TOKEN not in echoed.getMessage()
