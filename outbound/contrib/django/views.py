"""The outbox status page inside a Django project, behind Django's own login.

::

    # urls.py
    urlpatterns = [
        path("ops/outbox/", include("outbound.contrib.django.urls")),
        ...
    ]

serves the page at ``ops/outbox/`` and its data at ``ops/outbox/status.json``
(:mod:`outbound.outbox.web`: counts, sent per second, dead rows, blocked
keys, relays, capacity), for the outbox of ``OUTBOUND["using"]``. Only
active staff users see it: others are sent to ``settings.LOGIN_URL``, or
refused (403) once logged in. With ``django.contrib.admin`` installed the
same page is also in the admin, at ``<admin>/outbound/outboxrow/status/``.

Each process keeps one :class:`~outbound.outbox.web.StatusMonitor` per
store, shared by every request: any number of open pages cost one reading
of the database per refresh. Views block on the database.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from outbound._fork import renewed_after_fork
from outbound.outbox import Store
from outbound.outbox.web import SECURITY_HEADERS, StatusMonitor, json_answer, page_answer

from .outbox import get_store

__all__ = ["monitor", "status_json", "status_json_response", "status_page", "status_page_response"]

#: Seconds between the page's own refreshes.
REFRESH = 2.0

# Guards _monitors: one monitor per store of this process.
_lock = renewed_after_fork(threading.Lock())  # a parent thread may hold it at a fork
_monitors: weakref.WeakKeyDictionary[Store, StatusMonitor] = weakref.WeakKeyDictionary()


def monitor(using: str | None = None) -> StatusMonitor:
    """The status monitor of the outbox of database ``using`` (default ``OUTBOUND["using"]``)."""
    store = get_store(using)
    with _lock:
        found = _monitors.get(store)
        if found is None:
            found = _monitors[store] = StatusMonitor(store)
        return found


def _secured(response: HttpResponse) -> HttpResponse:
    for name, value in SECURITY_HEADERS.items():
        response[name] = value
    return response


def status_page_response(
    *, json_url: str, links: Sequence[tuple[str, str]] = (), using: str | None = None
) -> HttpResponse:
    """The page (HTML) as a response, with no check of who asks: the caller's job."""
    status, text = page_answer(monitor(using), refresh=REFRESH, json_url=json_url, links=links)
    return _secured(HttpResponse(text, status=status, content_type="text/html; charset=utf-8"))


def status_json_response(*, using: str | None = None) -> HttpResponse:
    """``status.json`` as a response, with no check of who asks: the caller's job."""
    status, body = json_answer(monitor(using))
    return _secured(HttpResponse(body, status=status, content_type="application/json"))


F = TypeVar("F", bound=Callable[..., Any])


def _safe_and_uncached(view: F) -> F:
    """GET and HEAD only, never cached (Django's decorators, typed)."""
    return cast(F, never_cache(require_safe(view)))


def _check(request: HttpRequest) -> HttpResponse | None:
    """None if the user may see the page; else a redirect to the login, or PermissionDenied."""
    user = request.user
    if user.is_active and user.is_staff:
        return None
    if not user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    raise PermissionDenied


@_safe_and_uncached
def status_page(request: HttpRequest) -> HttpResponse:
    """The status page, for active staff users."""
    refused = _check(request)
    if refused is not None:
        return refused
    namespace = request.resolver_match.namespace if request.resolver_match else ""
    prefix = f"{namespace}:" if namespace else ""
    return status_page_response(json_url=reverse(f"{prefix}status_json"))


@_safe_and_uncached
def status_json(request: HttpRequest) -> HttpResponse:
    """The status page's data as JSON, for active staff users."""
    refused = _check(request)
    if refused is not None:
        return refused
    return status_json_response()
