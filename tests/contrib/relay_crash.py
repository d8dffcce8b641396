"""Fault injection for the worker commands' tests: a relay whose loop fails.

Imported by a worker's code (the Flask app, the Django project's handlers):
when ``OUTBOUND_TEST_RELAY_CRASH`` names a file, the relay's loop raises once
that file exists (nothing a test can do from outside stops a relay on an
error). Does nothing otherwise.
"""

from __future__ import annotations

import os
from typing import Any

from outbound.outbox import relay

#: The handlers of the tests' apps that leave something running when the relay
#: stops on an error: one that never returns (the relay's exit hook waited for
#: it, 10 s), one whose send is still under way (the dispatcher's exit hook
#: waited for it; with no exit timeout, for good).
LEFT_RUNNING = ["stubborn", "fire"]


def _install() -> None:
    path = os.environ.get("OUTBOUND_TEST_RELAY_CRASH")
    if not path:
        return
    checked = relay.Relay._check_parked

    def failing(self: Any, session: Any) -> None:
        if os.path.exists(path):
            raise RuntimeError("the relay's loop failed")
        checked(self, session)

    relay.Relay._check_parked = failing  # type: ignore[method-assign]


_install()
