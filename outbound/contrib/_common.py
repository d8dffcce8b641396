"""What the client senders (:class:`~outbound.contrib.telebot.TeleBotSender`,
:class:`~outbound.contrib.slack.SlackSender`) share: a logging filter that masks
their tokens in the records of their client libraries' loggers (those log a
request's URL, or an answer's body or status line, which may quote the token: a
gateway's page echoing the request), and the error of a redirect they refused.
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.parse

from outbound._fork import renewed_after_fork
from outbound._secret import TokenMask
from outbound.errors import PermanentSendError

__all__ = ["TokenFilter", "redirect_error"]


class TokenFilter(logging.Filter):
    """Masks the tokens given to :meth:`add` in the records of the loggers it is on
    (a filter applies to its own logger's records, not to its children's).

    ``cut``: above DEBUG, what it matches in a record's text is replaced by
    its first group and ``?...`` (a request path's query, which holds the
    message's text). Thread-safe; never raises.
    """

    def __init__(self, cut: re.Pattern[str] | None = None) -> None:
        super().__init__()
        # Guards the replacement of _masks by add(). Nobody waits on it long.
        self._lock = renewed_after_fork(threading.Lock())
        self._masks: dict[str, TokenMask] = {}
        self._cut = cut

    def add(self, token: str) -> None:
        with self._lock:
            if token not in self._masks:
                # Longest first: a shorter token that is part of a longer one
                # ("xoxb-1" of "xoxb-1234-...") would mask only its part of it.
                masks = {**self._masks, token: TokenMask(token)}
                self._masks = {t: masks[t] for t in sorted(masks, key=len, reverse=True)}

    def filter(self, record: logging.LogRecord) -> bool:
        masks = self._masks  # (replaced whole, never changed: read unlocked)
        cut = self._cut if record.levelno > logging.DEBUG else None

        def clean(text: str) -> str:
            for mask in masks.values():
                text = mask.text(text)
            return cut.sub(r"\1?...", text) if cut is not None else text

        try:
            text = record.getMessage()
            masked = clean(text)
            if masked != text:
                record.msg, record.args = masked, ()
            if record.exc_info:
                # Its traceback is formatted later, past this filter: the
                # error may quote what the server sent (the request echoed).
                # Only then is it replaced by its masked text (the record's
                # handlers then see no exception: an application's logger,
                # given to the client, keeps its own formatting otherwise).
                exc_text = record.exc_text or logging.Formatter().formatException(record.exc_info)
                masked = clean(exc_text)
                if masked != exc_text:
                    record.exc_info, record.exc_text = None, masked
            elif record.exc_text:
                record.exc_text = clean(record.exc_text)
            if record.stack_info:
                record.stack_info = clean(record.stack_info)
        except Exception:  # (a record whose message cannot be made: left as it is)
            pass
        return True


def redirect_error(method: str, status: int, location: str, setting: str) -> PermanentSendError:
    """The error of a redirect answered to ``method`` (``status`` 0: seen only as an
    answer from elsewhere), naming where it pointed and the ``setting`` of the
    API's address to check. Pure."""
    return PermanentSendError(
        f"{method}: {f'HTTP {status}: ' if status else ''}the API answered with a redirect"
        + (f" to {_shown_location(location)}" if location else "")
        + f", not followed (is {setting} right?)"
    )


def _shown_location(location: str) -> str:
    """A redirect's ``Location`` for a message: its scheme and host only, at most 200
    characters (its path and query may carry anything: a gateway's echo of the
    token, say)."""
    try:
        parts = urllib.parse.urlsplit(location)
        host = parts.netloc.rpartition("@")[2]  # (no user or password)
    except ValueError:
        return "an address that cannot be read"
    if not host:
        return "a path on the same server"
    shown = f"{parts.scheme}://{host}" if parts.scheme else f"//{host}"
    return repr(shown if len(shown) <= 200 else shown[:197] + "...")
