"""TelegramSender's deadline and close() reach the lookup of its host name:
``getaddrinfo`` has no timeout, and a resolver that stopped answering (here a
UDP socket that swallows every query, as the process's only nameserver, in a
mount namespace of its own) held a send for the resolver's own timeout, past
the send's deadline, and past a close()."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from silent_resolver import HOST, run_with_silent_resolver

from outbound import telegram
from outbound.errors import TransientSendError
from outbound.messages import SendRequest, TextMessage
from outbound.telegram import TelegramSender

_INNER = r"""
import logging, time
logging.disable(logging.CRITICAL)
from outbound.errors import SendTimeout, TransientSendError
from outbound.messages import SendRequest, TextMessage
from outbound.telegram import TelegramSender

TOKEN = "123456:" + "A" * 35
request = SendRequest(1, TextMessage("hi"))
results = {}

def send(sender, name):
    began = time.monotonic()
    try:
        sender.send(request)
        results[name] = ("sent", time.monotonic() - began)
    except BaseException as exc:
        results[name] = (type(exc).__name__, time.monotonic() - began)

if sys.argv[2] == "deadline":
    # The send's time (0.5 s) bounds the lookup too; four threads, one lookup.
    sender = TelegramSender(TOKEN, base_url=f"http://{HOST}:8081", timeout=0.5)
    threads = [threading.Thread(target=send, args=(sender, i)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads), "a send still runs"
    # (The lookup outlives the sends: the resolver's own timeout is 3 s.)
    lookups = sum(1 for t in threading.enumerate() if t.name == "outbound-lookup")
    slow = {n: r for n, r in results.items() if r[0] != "SendTimeout" or r[1] > 1.2}
    print("ok" if not slow and lookups == 1 else f"results {results}, {lookups} lookups")
else:
    # close() ends a send waiting for its lookup (30 s allowed).
    sender = TelegramSender(TOKEN, base_url=f"http://{HOST}:8081", timeout=30)
    thread = threading.Thread(target=send, args=(sender, "send"))
    thread.start()
    assert queried.wait(10), "the lookup never reached the nameserver"
    closed = time.monotonic()
    sender.close()
    thread.join(10)
    assert not thread.is_alive(), "the send still runs after close()"
    kind, _ = results["send"]
    after = time.monotonic() - closed
    ok = kind == "TransientSendError" and after < 1.0
    print("ok" if ok else f"{kind} {after:.2f}s after close()")
"""


@pytest.mark.parametrize("case", ["deadline", "close"])
def test_a_send_waits_for_a_silent_resolver_no_longer_than_its_deadline_or_close(
    case: str, tmp_path: Path
) -> None:
    output = run_with_silent_resolver(f"HOST = {HOST!r}\n" + _INNER, tmp_path, case)
    assert output.strip() == "ok", output


class _ResolverError(OSError):
    """A resolver's error whose ``__init__`` takes other arguments than its ``args``
    (as many libraries' do): it cannot be copied."""

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"cannot resolve {host}: {reason}")
        self.host, self.reason = host, reason


@pytest.mark.parametrize(
    "error",
    [_ResolverError("api.example.test", "SERVFAIL"), RecursionError("deep"), MemoryError()],
    ids=["uncopyable-oserror", "recursion-error", "memory-error"],
)
def test_a_lookup_that_fails_oddly_is_a_transport_error(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup's error was copied for each connect that waited for it: one that
    cannot be copied came out of send() as a TypeError (bad input's, never
    retried); any error not an OSError came out as it was."""

    def listed(host: str, port: int, flags: int = 0) -> Any:
        if flags:  # (the numeric try, in place)
            raise socket.gaierror(socket.EAI_NONAME, "not a numeric host")
        raise error

    monkeypatch.setattr(telegram, "_listed", listed)
    sender = TelegramSender("1:x", base_url="http://api.example.test", timeout=5.0)
    try:
        with pytest.raises(TransientSendError, match=r"api\.example\.test") as info:
            sender.send(SendRequest(1, TextMessage("hi")))
    finally:
        sender.close()
    assert type(error).__name__ in str(info.value)
