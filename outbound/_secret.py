"""Keeping secrets out of what the library prints, logs and raises: database
passwords, and what a platform's server sent back (it may echo a message's text).

Pure functions; thread-safe.
"""

from __future__ import annotations

import http.client
import re
from collections.abc import Iterator
from types import TracebackType
from typing import Literal

__all__ = [
    "TokenMask",
    "context_dropped",
    "driver_error",
    "mask_password",
    "transport_error",
    "wrapped",
]

# The password of a URL (``scheme://user:PASSWORD@host``: up to the authority's
# last "@", a password may hold one unencoded) and of a libpq keyword/value
# string (``password=PASSWORD``).
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)[^/?#\s]*(?=@)")
_KEYWORD_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'|\S+)")
_SCHEME = re.compile(r"\s*[a-zA-Z][a-zA-Z0-9+.-]*://")
# A value a driver's message quotes ("..." or '...').
_QUOTED = re.compile(r"\"([^\"]*)\"|'([^']*)'")
# Shorter passwords are masked where quoted, not wherever their letters occur.
_SHORTEST_REPLACED = 4


class TokenMask:
    """Masks a bot token (``123456:ABC...``) as ``<token>`` in what a server sends
    back or a client library says: written as it is, or percent-encoded (a
    proxy's "Not Found: /bot123456%3AABC.../sendMessage", a hex digit of
    either case), and its secret part (after the first ``:``) on its own
    once it is long enough not to occur by chance. Immutable; thread-safe.
    """

    # A shorter secret part (a test's "1:x") is masked only within the token.
    SHORTEST_SECRET = 16

    def __init__(self, token: str) -> None:
        secret = token.partition(":")[2]
        parts = [token] + ([secret] if len(secret) >= self.SHORTEST_SECRET else [])
        pattern = "|".join("".join(_either(c) for c in part) for part in parts)
        self._text = re.compile(pattern)
        self._data = re.compile(pattern.encode("utf-8", "surrogatepass"))
        self._plain = tuple(parts)

    def text(self, text: str) -> str:
        """``text`` with the token masked. Pure."""
        if "%" not in text:  # (the common case, without the expression)
            for part in self._plain:
                text = text.replace(part, "<token>")
            return text
        return self._text.sub("<token>", text)

    def data(self, data: bytes) -> bytes:
        """``data`` with the token masked (bytes as sent back). Pure."""
        if b"%" not in data:
            for part in self._plain:
                data = data.replace(part.encode("utf-8", "surrogatepass"), b"<token>")
            return data
        return self._data.sub(b"<token>", data)

    def found(self, text: str) -> bool:
        """Whether ``text`` holds the token in a form :meth:`text` masks. Pure."""
        return self._text.search(text) is not None


class context_dropped:  # (named as a function: ``with context_dropped():``)
    """A block out of which an error raised ``from None`` leaves without its context.

    ``raise error from None`` in an ``except`` clause only hides the error it
    handled from a printed traceback: it stays the raised error's
    ``__context__``, reachable by anything that walks the chain (an error
    reporter, a pickled chain), and its text may quote what the sender keeps
    out (a token in a URL, a message's text in an answer's body). Every other
    error leaves the block as it is. Reusable; thread-safe.
    """

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        if error is not None and error.__cause__ is None and error.__suppress_context__:
            error.__context__ = None
        return False


def _either(char: str) -> str:
    """A pattern of ``char`` as it is or percent-encoded, the bytes of its UTF-8
    each as ``%3A`` or ``%3a`` (a client library takes a token it does not
    check: one with an en dash pasted in goes out as ``%E2%80%93``)."""
    codes = "".join(
        "%" + "".join(f"[{h.lower()}{h.upper()}]" if h.isalpha() else h for h in f"{byte:02x}")
        for byte in char.encode("utf-8", "surrogatepass")
    )
    return f"(?:{re.escape(char)}|{codes})"


def mask_password(text: str) -> str:
    """``text`` with every database password in it (of a URL or ``password=``) as ``***``.

    For anything printed or logged that may hold a connection string.
    """
    text = _URL_PASSWORD.sub(r"\g<head>***", text)
    return _KEYWORD_PASSWORD.sub(r"\g<head>***", text)


def _passwords(conninfo: str) -> list[str]:
    """What may be a password in ``conninfo``, read leniently: it may be malformed
    (which is when a driver's message quotes a piece of it)."""
    found: list[str] = []
    scheme = _SCHEME.match(conninfo)
    if scheme is not None:
        rest = conninfo[scheme.end() :]
        at = rest.rfind("@")
        if at >= 0:
            _, colon, password = rest[:at].partition(":")
            if colon:
                found.append(password)
        for part in rest.partition("?")[2].split("&"):
            name, equals, value = part.partition("=")
            if equals and name.strip().lower() == "password":
                found.append(value)
    for match in _KEYWORD_PASSWORD.finditer(conninfo):
        value = match.group(0)[len(match.group("head")) :]
        found.append(value)
        if len(value) >= 2 and value[0] == value[-1] == "'":
            found.append(value[1:-1])
    # A password with an unencoded "@": libpq takes what follows it for the
    # host, and quotes that as one.
    found += [piece for password in found for piece in password.split("@")[1:]]
    return [password for password in found if password]


def driver_error(message: str, conninfo: str) -> str:
    """A driver's ``message`` about ``conninfo`` without its password.

    libpq quotes the piece of a connection string it cannot read (``invalid
    percent-encoded token: "50%off"``), which may be the password: a quoted
    value that is part of a password, or holds one, becomes ``"***"``, and
    so does any other occurrence of a password of 4 characters or more.
    """
    passwords = _passwords(conninfo)

    def quoted(match: re.Match[str]) -> str:
        inner = match.group(1) if match.group(1) is not None else match.group(2)
        if inner and any(inner in password or password in inner for password in passwords):
            return '"***"'
        return match.group(0)

    message = _QUOTED.sub(quoted, message)
    for password in sorted(passwords, key=len, reverse=True):
        if len(password) >= _SHORTEST_REPLACED:
            message = message.replace(password, "***")
    return mask_password(message)


#: Errors of http.client (and of the libraries built on it) that quote what the
#: server sent: a status line that is not one, a protocol name, the bytes of a
#: body cut short (urllib3's InvalidChunkLength is an IncompleteRead).
_QUOTING = (http.client.BadStatusLine, http.client.IncompleteRead, http.client.UnknownProtocol)


def transport_error(exc: BaseException) -> tuple[str, BaseException | None]:
    """``Type: message`` of an error of the HTTP transport, without what the server
    sent, and the error to chain it to (``None``: chain nothing).

    An answer that is not HTTP puts its first line in ``BadStatusLine`` (the
    Bot API's JSON echoing a message's text, for one, from a proxy that lost
    the status line); a body cut short, or a chunk size that is not one, puts
    its bytes in ``IncompleteRead``; client libraries nest these in their own
    errors. Such an error is described by its types alone and not chained
    (a logged traceback would print it): senders' errors reach log lines,
    which never carry a message's text.
    """
    for error in wrapped(exc):
        if isinstance(error, _QUOTING) and not isinstance(error, http.client.RemoteDisconnected):
            return (
                f"{type(exc).__name__}: the answer could not be read ({type(error).__name__})",
                None,
            )
    return f"{type(exc).__name__}: {exc}", exc


def wrapped(exc: BaseException, *, reasons: bool = False) -> Iterator[BaseException]:
    """``exc``, then the errors it wraps at any depth (its arguments, cause and context;
    with ``reasons``, urllib3's ``reason`` too), each once, without recursion."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        error = stack.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        stack.extend(arg for arg in error.args if isinstance(arg, BaseException))
        stack.extend(e for e in (error.__cause__, error.__context__) if e is not None)
        reason = getattr(error, "reason", None) if reasons else None
        if isinstance(reason, BaseException):
            stack.append(reason)
