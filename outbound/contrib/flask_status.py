"""The outbox status page as a Flask blueprint, behind the app's own login (extra ``flask``).

::

    from flask_login import current_user
    from outbound.contrib.flask import Outbound

    outbound = Outbound()

    def create_app():
        app = Flask(__name__)
        ...
        outbound.init_app(app)
        app.register_blueprint(
            outbound.status_blueprint(authorize=lambda: current_user.is_authenticated
                                      and current_user.is_admin),
            url_prefix="/ops/outbox",
        )

serves the page at ``/ops/outbox/`` and its data at
``/ops/outbox/status.json`` (:mod:`outbound.outbox.web`: counts, sent per
second, dead rows, blocked keys, relays, capacity). :func:`status_blueprint`
does the same for any :class:`~outbound.outbox.Store` (or a function that
returns one), without the extension.

``authorize`` is required, so that no page goes out unguarded by mistake:
it runs before each request of the blueprint, in the request's context,
and returns True to let it through, False to refuse it (403), or a
response to send instead (a redirect to the login page, say); pass
``authorize=None`` only when the app guards the prefix itself.

Each process keeps one :class:`~outbound.outbox.web.StatusMonitor` per
store, shared by every request: any number of open pages cost one reading
of the database per refresh. Given a function rather than a store, it
calls it once per app (and process), in the first request, and keeps the
store it returns. Views block on the database.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

try:
    from flask import Blueprint, Flask, Response, abort, current_app, url_for
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "outbound.contrib.flask_status needs Flask: pip install 'outbound-dispatcher[flask]'"
    ) from exc

from outbound._fork import renewed_after_fork
from outbound.outbox import Store
from outbound.outbox._base import check_seconds
from outbound.outbox.web import SECURITY_HEADERS, StatusMonitor, json_answer, page_answer

__all__ = ["status_blueprint"]

#: ``authorize()``: True to let the request through, False to refuse it
#: (403), or a response to send instead. Any other false value (None, 0,
#: "") refuses too; a number is taken by its truth (an integer column).
Authorize = Callable[[], Any]


def status_blueprint(
    store: Store | Callable[[], Store],
    *,
    authorize: Authorize | None,
    name: str = "outbound_status",
    refresh: float = 2.0,
) -> Blueprint:
    """A blueprint serving the status page of ``store`` at ``/`` and its JSON at
    ``/status.json`` (relative to where it is registered).

    ``store``: a :class:`~outbound.outbox.Store`, or a function that
    returns one, called in the app context of the first request of each app
    (once per app and process: the store it returns serves every later
    request of that app, and is not closed here). ``authorize``: see the
    module's docstring; required. ``refresh``: seconds between the page's
    own refreshes (0: never). Thread-safe; while the function runs, the
    other requests wait for its store.
    """
    if authorize is not None and not callable(authorize):
        raise TypeError("authorize must be a function returning True, False or a response")
    if not isinstance(store, Store) and not callable(store):
        raise TypeError(f"store must be a Store or a function returning one, not {store!r}")
    refresh = check_seconds("refresh", refresh, zero=True, maximum=3600.0)
    blueprint = Blueprint(name, __name__)
    monitor = _Monitors(store).get

    @blueprint.before_request
    def check() -> Any:
        if authorize is None:
            return None
        verdict = authorize()
        if verdict is True:
            return None
        if isinstance(verdict, (int, float)):  # (bool is an int: False here)
            # ``user.is_admin`` of an integer column, as ``and`` returns it:
            # taken by its truth (Flask cannot make a response of it).
            if verdict:
                return None
            abort(403)
        if not verdict:  # None, "" or [] (an empty answer was sent): refused
            abort(403)
        return verdict

    @blueprint.after_request
    def secure(response: Response) -> Response:
        response.headers.update(SECURITY_HEADERS)
        return response

    @blueprint.get("/")
    def page() -> tuple[str, int]:
        status, text = page_answer(monitor(), refresh=refresh, json_url=url_for(".status_json"))
        return text, status

    @blueprint.get("/status.json")
    def status_json() -> Response:
        status, body = json_answer(monitor())
        return Response(body, status=status, mimetype="application/json")

    return blueprint


class _Monitors:
    """The blueprint's monitor: one for a store given, else one per app over the store
    the function returned in that app's first request. Per process (a child of a fork
    starts afresh). Thread-safe; :meth:`get` blocks while the function runs."""

    def __init__(self, store: Store | Callable[[], Store]) -> None:
        self._store = store
        # Guards the rest; held while the function builds a store, so that
        # it runs once per app however many requests come at first.
        self._lock = renewed_after_fork(threading.Lock())
        self._pid = os.getpid()
        self._shared: StatusMonitor | None = None  # over the store given
        self._apps: weakref.WeakKeyDictionary[Flask, StatusMonitor] = weakref.WeakKeyDictionary()

    def get(self) -> StatusMonitor:
        """The monitor of the current app (call it in an app context)."""
        store = self._store
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._shared = None
                self._apps = weakref.WeakKeyDictionary()
            if isinstance(store, Store):
                if self._shared is None:
                    self._shared = StatusMonitor(store)
                return self._shared
            app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
            monitor = self._apps.get(app)
            if monitor is None:
                found = store()
                if not isinstance(found, Store):
                    raise TypeError(
                        f"the status blueprint's store() returned {found!r}, not a Store"
                    )
                monitor = self._apps[app] = StatusMonitor(found)
            return monitor
