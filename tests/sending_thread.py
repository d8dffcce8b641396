"""A sender's send started in a thread of its own, its outcome kept."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from outbound.messages import Sender, SendRequest, SendResult


def sending(
    sender: Sender, request: SendRequest, trace: Callable[..., Any] | None = None
) -> tuple[threading.Thread, list[BaseException | SendResult]]:
    """``sender.send(request)`` in a new thread (traced by ``trace``, for
    ``sys.settrace``, if given); its result or error goes in the list."""
    outcome: list[BaseException | SendResult] = []

    def send() -> None:
        sys.settrace(trace)
        try:
            outcome.append(sender.send(request))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=send)
    thread.start()
    return thread, outcome
