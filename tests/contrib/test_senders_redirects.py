"""Redirects and what logs the URL: SlackSender followed a 301/302/303 as a GET
(the message dropped, the other server's "ok" taken for its post) with the
token in its Authorization header, wherever the Location said; a Location that
is not a URL came out of both client senders as a raw ValueError (bad input,
never retried); urllib3 logged pyTelegramBotAPI's URL, the token in it."""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import urllib.request
from typing import Any

import pytest
from canned_http import raw_server
from canned_senders import SLACK_OK, TG_OK, canned, slack_sender, telebot_sender

from outbound.errors import PermanentSendError, TransientSendError
from outbound.messages import MethodMessage, SendRequest, TextMessage

TOKEN = "123456:ABCdefGHIjklMNOpqrSTUvwxYZ0123456"


@pytest.mark.parametrize(
    "body",
    [b"", b"<p>Moved \xe9</p>"],
    ids=["empty", "a-body-it-cannot-decode"],  # (read, it was a TransientSendError)
)
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("installed", [False, True], ids=["own-opener", "installed-opener"])
@pytest.mark.parametrize(
    "subclass",
    [False, True],
    # (one whose request method calls slack_sdk's: it followed, the token with it)
    ids=["webclient", "subclass-calling-super"],
)
def test_slack_follows_no_redirect(
    status: int, body: bytes, installed: bool, subclass: bool
) -> None:
    pytest.importorskip("slack_sdk")
    if installed:  # (one the application installed is used as it is: it follows them)
        urllib.request.install_opener(urllib.request.build_opener())
    with contextlib.ExitStack() as stack:
        stack.callback(urllib.request.install_opener, None)
        target = stack.enter_context(canned())
        front = stack.enter_context(canned())
        target.answer(200, SLACK_OK)
        front.answer(
            status,
            body,
            [
                # (a gateway's sign-in page, quoting the token in its path)
                ("Location", target.url + "/login/xoxb-1/chat.postMessage?x=1"),
                ("Content-Type", "text/html; charset=bogus"),
            ],
        )
        sender = _subclass_sender(front.url) if subclass else slack_sender(front.url)
        with pytest.raises(PermanentSendError, match="redirect") as info:
            sender.send(SendRequest("C1", TextMessage("hello")))
        assert target.posts == 0
        assert target.authorizations == []
    assert f"'{target.url}'" in str(info.value)  # (neither its path nor its query)
    assert "xoxb-1" not in str(info.value)
    assert "/login" not in str(info.value)


def _subclass_sender(url: str) -> Any:
    """A SlackSender over a WebClient subclass whose request method calls
    slack_sdk's (``super()``)."""
    import slack_sdk  # noqa: PLC0415

    from outbound.contrib.slack import SlackSender  # noqa: PLC0415

    base: Any = slack_sdk.WebClient

    class Client(base):  # type: ignore[misc]
        def _perform_urllib_http_request_internal(self, url: str, req: Any) -> Any:
            return super()._perform_urllib_http_request_internal(url, req)

    return SlackSender(Client(token="xoxb-1", base_url=url + "/api/"))


@pytest.mark.parametrize("location", ["http://[::1/x", "http://" + "a" * 64 + ".example/"])
@pytest.mark.parametrize("kind", ["slack", "slack-subclass", "telebot"])
def test_a_redirect_to_no_url_is_a_send_error(
    kind: str, location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("telebot" if kind == "telebot" else "slack_sdk")
    with canned() as front:
        front.answer(302, b"", [("Location", location)])
        if kind == "slack-subclass":  # (the Location was read before the check: raw)
            sender = _subclass_sender(front.url)
            chat: str | int = "C1"
        elif kind == "slack":
            sender = slack_sender(front.url)
            chat = "C1"
        else:
            sender = telebot_sender(front.url, monkeypatch)
            chat = 1
        with pytest.raises((PermanentSendError, TransientSendError)):
            sender.send(SendRequest(chat, TextMessage("hello")))


def test_urllib3_logs_no_telebot_token(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("telebot")
    with canned() as server, caplog.at_level(logging.DEBUG):
        server.answer(200, TG_OK)
        sender = telebot_sender(server.url, monkeypatch, token=TOKEN)
        sender.send(SendRequest(42, TextMessage("hello")))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("urllib3")]
    assert any("/sendMessage" in line for line in lines), lines  # (it logged the URL)
    assert not any(TOKEN in line or "ABCdefGHI" in line for line in lines), lines


def test_urllib3_logs_no_telebot_token_of_an_answer_it_cannot_parse(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """urllib3 logs "Failed to parse headers (url=...)" at WARNING on its connection
    logger, which the token's mask was not on."""
    pytest.importorskip("telebot")
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\na line with no colon\r\n"
        + f"Content-Length: {len(TG_OK)}\r\n\r\n".encode()
        + TG_OK
    )
    with raw_server(answer) as url, caplog.at_level(logging.DEBUG):
        sender = telebot_sender(url, monkeypatch, token=TOKEN)
        with contextlib.suppress(TransientSendError, PermanentSendError):
            sender.send(SendRequest(42, TextMessage("hello")))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("urllib3")]
    assert any("Failed to parse headers" in line for line in lines), lines
    assert not any(TOKEN in line or "ABCdefGHI" in line for line in lines), lines


def test_urllib3_logs_neither_the_text_nor_the_token_above_debug_in_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same WARNING: its ``url=`` quoted the request's query (the message's text),
    and its traceback the line the server sent (a broken proxy's echo of the
    request line, the token in it), past the mask, which read the message only."""
    pytest.importorskip("telebot")
    echo = f"POST /bot{TOKEN}/sendMessage?chat_id=42&text=private-words HTTP/1.1"
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + echo.encode()
        + b"\r\n"
        + f"Content-Length: {len(TG_OK)}\r\n\r\n".encode()
        + TG_OK
    )
    with raw_server(answer) as url, caplog.at_level(logging.WARNING):
        sender = telebot_sender(url, monkeypatch, token=TOKEN)
        with contextlib.suppress(TransientSendError, PermanentSendError):
            sender.send(SendRequest(42, TextMessage("private-words")))
    records = [r for r in caplog.records if r.name.startswith("urllib3")]
    assert any("Failed to parse headers" in r.getMessage() for r in records)
    shown = [logging.Formatter().format(r) for r in records]
    assert any("Traceback" in line or "HeaderParsingError" in line for line in shown), shown
    for line in shown:
        assert "private-words" not in line
        assert "ABCdefGHI" not in line


def test_slack_goes_through_the_opener_the_application_installed() -> None:
    """slack_sdk opens with urlopen(), the opener install_opener() set (a corporate
    proxy's, say): the sender's own opener went around it."""
    slack_sdk = pytest.importorskip("slack_sdk")
    from outbound.contrib.slack import SlackSender  # noqa: PLC0415

    seen: list[str] = []

    class Seen(urllib.request.BaseHandler):
        def http_request(self, request: urllib.request.Request) -> urllib.request.Request:
            seen.append(request.full_url)
            return request

    with canned() as server:
        server.answer(200, SLACK_OK)
        urllib.request.install_opener(urllib.request.build_opener(Seen()))
        try:
            client = slack_sdk.WebClient(token="xoxb-1", base_url=server.url + "/api/")
            SlackSender(client).send(SendRequest("C1", TextMessage("hello")))
        finally:
            urllib.request.install_opener(None)
    assert seen == [server.url + "/api/chat.postMessage"]


def test_a_client_subclass_keeps_its_own_requests() -> None:
    slack_sdk = pytest.importorskip("slack_sdk")
    from outbound.contrib.slack import SlackSender  # noqa: PLC0415

    calls: list[str] = []

    base: Any = slack_sdk.WebClient

    class Client(base):  # type: ignore[misc]
        def _perform_urllib_http_request_internal(self, url: str, req: Any) -> Any:
            calls.append(url)
            return super()._perform_urllib_http_request_internal(url, req)

    with canned() as server:
        server.answer(200, SLACK_OK)
        client = Client(token="xoxb-1", base_url=server.url + "/api/")
        SlackSender(client).send(SendRequest("C1", TextMessage("hello")))
    assert calls == [server.url + "/api/chat.postMessage"]


def test_a_telebot_parameter_requests_cannot_encode_is_bad_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """send() did not check a MethodMessage's parameters (validate() does): requests
    raised UnicodeEncodeError building the request, taken for the transport's."""
    pytest.importorskip("telebot")
    with canned() as server:
        server.answer(200, TG_OK)
        sender = telebot_sender(server.url, monkeypatch)
        with pytest.raises(ValueError, match="lone surrogate"):
            sender.send(SendRequest(1, MethodMessage("sendPhoto", {"photo": "\udcff"})))
        assert server.posts == 0


def test_urllib3_logs_no_telebot_token_when_a_session_retries(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    telebot = pytest.importorskip("telebot")
    import requests  # noqa: PLC0415
    from requests.adapters import HTTPAdapter  # noqa: PLC0415
    from urllib3.util.retry import Retry  # noqa: PLC0415

    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=Retry(total=1, connect=1, backoff_factor=0)))
    monkeypatch.setattr(telebot.apihelper, "session", session)
    telebot.apihelper._get_req_session(reset=True)  # (the thread's: made by a test before)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # (nothing listens: each connect is refused, and retried)
    try:
        with caplog.at_level(logging.DEBUG):
            sender = telebot_sender(f"http://127.0.0.1:{port}", monkeypatch, token=TOKEN)
            with pytest.raises(TransientSendError):
                sender.send(SendRequest(42, TextMessage("hello")))
    finally:
        telebot.apihelper.session = None
        telebot.apihelper._get_req_session(reset=True)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("urllib3")]
    assert any("Retry" in line for line in lines), lines  # (it logged the retry)
    assert not any("ABCdefGHI" in line for line in lines), lines


def test_slack_takes_an_installed_opener_as_it_is() -> None:
    """install_opener() takes anything with an open() method (a tracing wrapper, an
    OpenerDirector subclass, one with addheaders): it was rebuilt from its
    handlers, and one with none failed every send."""
    slack_sdk = pytest.importorskip("slack_sdk")
    from outbound.contrib.slack import SlackSender  # noqa: PLC0415

    opened: list[str] = []

    class Tracing:
        def __init__(self) -> None:
            self.inner = urllib.request.build_opener()
            self.inner.addheaders = [("X-Gateway", "yes")]

        def open(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            opened.append(request.full_url)
            return self.inner.open(request, *args, **kwargs)

    with canned() as server:
        server.answer(200, SLACK_OK)
        urllib.request.install_opener(Tracing())  # type: ignore[arg-type]
        try:
            client = slack_sdk.WebClient(token="xoxb-1", base_url=server.url + "/api/")
            result = SlackSender(client).send(SendRequest("C1", TextMessage("hello")))
        finally:
            urllib.request.install_opener(None)
    assert result.message_id == "1700000000.000100"
    assert opened == [server.url + "/api/chat.postMessage"]


def test_slack_sends_its_token_to_no_redirect_an_installed_opener_follows() -> None:
    """An installed opener whose redirect handler follows regardless of the loop
    check (no limit of redirects): the token went to the Location's host, and that
    server's answer was taken for the post."""
    pytest.importorskip("slack_sdk")

    class Unlimited(urllib.request.HTTPRedirectHandler):
        max_redirections = math.inf  # type: ignore[assignment]

    urllib.request.install_opener(urllib.request.build_opener(Unlimited()))
    with contextlib.ExitStack() as stack:
        stack.callback(urllib.request.install_opener, None)
        target = stack.enter_context(canned())
        front = stack.enter_context(canned())
        target.answer(200, SLACK_OK)
        front.answer(302, b"", [("Location", target.url + "/api/chat.postMessage")])
        with pytest.raises(PermanentSendError, match="redirect"):
            slack_sender(front.url).send(SendRequest("C1", TextMessage("hello")))
        assert target.authorizations == [None]  # (followed by the application's opener)


@pytest.mark.parametrize("value", ["abc\r\ndef", "a\x00b", "\u65e5\u672c", 1.5])
def test_a_slack_client_header_that_cannot_be_sent_is_named(value: object) -> None:
    """http.client refused it before sending (a line break; a value past Latin-1,
    as a user_agent_prefix of Japanese makes), with a bare ValueError taken for an
    answer's (a TransientSendError: retried, never sent)."""
    slack_sdk = pytest.importorskip("slack_sdk")
    from outbound.contrib.slack import SlackSender  # noqa: PLC0415

    with canned() as server:
        server.answer(200, SLACK_OK)
        client = slack_sdk.WebClient(
            token="xoxb-1", base_url=server.url + "/api/", headers={"X-Trace": value}
        )
        with pytest.raises(ValueError, match="'X-Trace'"):
            SlackSender(client).send(SendRequest("C1", TextMessage("hello")))
        assert server.posts == 0


def test_slack_client_headers_http_client_sends_are_taken() -> None:
    """An int, bytes, a tab, Latin-1: http.client sends them (slack_sdk passes them on)."""
    slack_sdk = pytest.importorskip("slack_sdk")
    from outbound.contrib.slack import SlackSender  # noqa: PLC0415

    headers = {"X-Attempt": 1, "X-Tenant": b"acme", "X-Note": "a\tb \u00e9"}
    with canned() as server:
        server.answer(200, SLACK_OK)
        client = slack_sdk.WebClient(token="xoxb-1", base_url=server.url + "/api/", headers=headers)
        SlackSender(client).send(SendRequest("C1", TextMessage("hello")))
        assert server.posts == 1


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("kind", ["text", "method"])
def test_telebot_follows_no_redirect(
    status: int, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """requests followed a redirect to another host (a 302 as a GET without the
    parameters) and took that host's "ok": true for the send's: the message was
    reported sent and never posted. Refused as SlackSender refuses one."""
    pytest.importorskip("telebot")
    with canned() as target, canned() as front:
        target.answer(200, TG_OK)
        front.answer(status, b"", [("Location", target.url + "/login/x?token=" + TOKEN)])
        sender = telebot_sender(front.url, monkeypatch, token=TOKEN)
        message = (
            TextMessage("hello") if kind == "text" else MethodMessage("sendMessage", {"text": "hi"})
        )
        with pytest.raises(PermanentSendError, match="redirect") as info:
            sender.send(SendRequest(42, message))
        assert front.posts == 1  # (asked once: no loop either)
        assert target.posts == 0  # (nothing went where it pointed)
    assert f"'{target.url}'" in str(info.value)  # (neither its path nor its query)
    assert "ABCdefGHI" not in str(info.value)
    assert info.value.__cause__ is None
    assert info.value.__context__ is None


def test_telebot_leaves_the_sessions_it_sends_through_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session an application set (apihelper.session) still follows redirects for
    its own requests, and is the thread's session again after a send."""
    telebot = pytest.importorskip("telebot")
    import requests  # noqa: PLC0415

    session = requests.Session()
    monkeypatch.setattr(telebot.apihelper, "session", session)
    telebot.apihelper._get_req_session(reset=True)
    try:
        with canned() as target, canned() as front:
            target.answer(200, TG_OK)
            front.answer(302, b"", [("Location", target.url + "/x")])
            sender = telebot_sender(front.url, monkeypatch, token=TOKEN)
            with pytest.raises(PermanentSendError, match="redirect"):
                sender.send(SendRequest(42, TextMessage("hello")))
            assert telebot.apihelper._get_req_session() is session
            assert session.get(front.url + "/y", timeout=10).status_code == 200
            assert target.posts == 1  # (the application's own request, followed)
    finally:
        telebot.apihelper.session = None
        telebot.apihelper._get_req_session(reset=True)


@pytest.mark.parametrize("ttl", [1e-6, -1.0, 3600.0])
def test_telebot_follows_no_redirect_whatever_the_sessions_time_to_live(
    ttl: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a SESSION_TIME_TO_LIVE, pyTelegramBotAPI renewed the session within
    # the send once it ran out (every send, for a short one): the request went
    # through the new session, which followed the 302, and the other host's
    # "ok" was taken for the send's.
    apihelper = pytest.importorskip("telebot.apihelper")
    monkeypatch.setattr(apihelper, "SESSION_TIME_TO_LIVE", ttl)
    with canned() as target, canned() as front:
        target.answer(200, TG_OK)
        front.answer(302, b"", [("Location", target.url + "/elsewhere")])
        sender = telebot_sender(front.url, monkeypatch, TOKEN)
        for _ in range(3):
            with pytest.raises(PermanentSendError, match="redirect"):
                sender.send(SendRequest(42, TextMessage("hello")))
        assert target.posts == 0
        assert front.posts == 3
