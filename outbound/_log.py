"""The library's log lines, which a logging handler that raises cannot stop."""

from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger("outbound")


def printable(text: str) -> str:
    """``text`` with control and other unprintable characters escaped (``\\n``, ``\\x1b``).

    Keys, types and errors often come from users: in a line meant for a
    terminal, a newline must not forge a line, nor an escape sequence
    recolour the operator's terminal. Thread-safe.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


#: What ``exc_info`` may be: True for the exception being handled, or one.
_ExcInfo = bool | BaseException


class QuietLog:
    """``logger``'s methods, except that a logging handler that raises (an
    ``Exception``) does not stop the caller: what follows a log line (a
    hook's error swallowed, a failed delivery's outcome recorded, a stuck
    row given up, a write tried again) must happen whatever the
    application's logging does. A line that could not be logged is dropped.
    Where a failure must not go unsaid (a relay's loop that failed), log
    with ``logger`` itself. Thread-safe; blocks only as the handlers do.
    """

    def debug(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.DEBUG, msg, args, exc_info)

    def info(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.INFO, msg, args, exc_info)

    def warning(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.WARNING, msg, args, exc_info)

    def error(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.ERROR, msg, args, exc_info)

    def critical(self, msg: str, *args: object, exc_info: _ExcInfo = False) -> None:
        self._log(logging.CRITICAL, msg, args, exc_info)

    def exception(self, msg: str, *args: object) -> None:
        self._log(logging.ERROR, msg, args, True)

    @staticmethod
    def _log(level: int, msg: str, args: tuple[object, ...], exc_info: _ExcInfo) -> None:
        with contextlib.suppress(Exception):
            # stacklevel 3: the line that called info(), warning(), ...
            logger.log(level, msg, *args, exc_info=exc_info, stacklevel=3)


#: The log of the dispatcher, its timer, futures and hooks, and the outbox relay
#: and PostgreSQL store.
quiet = QuietLog()
