"""The outbox's read-only status page: counts, sent per second, dead rows, blocked keys,
relays and capacity, as one self-refreshing HTML page and as JSON.

- ``python -m outbound outbox serve --db URL [--host H] [--port N]``:
  :class:`StatusServer`, on the standard library's HTTP server, bound to
  127.0.0.1 unless told otherwise.
- Inside an existing app, behind its own login: the Flask blueprint
  (:meth:`outbound.contrib.flask.FlaskOutbound.status_blueprint`) and the
  Django views (:mod:`outbound.contrib.django.views`, also in the admin).
- Anywhere else: a :class:`StatusMonitor` reads snapshots (shared by every
  viewer, at most one reading at a time); :func:`page_answer` and
  :func:`json_answer` make the page and the JSON of its snapshot, or say
  why the outbox cannot be read (HTTP 503).

The page loads nothing but itself (no framework, no CDN): it works offline.
"""

from __future__ import annotations

from ._monitor import RelaySeen, StatusMonitor, StatusSnapshot, describe_store, snapshot_json
from ._page import (
    format_age,
    json_answer,
    json_body,
    page_answer,
    render_error,
    render_page,
)
from ._server import DEFAULT_PORT, SECURITY_HEADERS, StatusServer

__all__ = [
    "DEFAULT_PORT",
    "SECURITY_HEADERS",
    "RelaySeen",
    "StatusMonitor",
    "StatusServer",
    "StatusSnapshot",
    "describe_store",
    "format_age",
    "json_answer",
    "json_body",
    "page_answer",
    "render_error",
    "render_page",
    "snapshot_json",
]
