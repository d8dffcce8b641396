"""The outbox in Django's admin: rows, filters, search, payloads, and three actions.

Registered on the default admin site when ``django.contrib.admin`` is
installed next to ``outbound.contrib.django``:

- The list: id, status, key, type, attempts, age, last change and last
  error; filters by status and type; search by key or dedupe key (exact),
  or by row id. A row's page shows every column and its payload
  pretty-printed.
- Actions: "Retry now" (dead rows pending again, at the back of their
  key), "Cancel" (never delivered) and "Move to dead" (to inspect, then
  retry). Each goes through the store's own fenced operation
  (:meth:`~outbound.outbox.Store.retry_dead`,
  :meth:`~outbound.outbox.Store.cancel`,
  :meth:`~outbound.outbox.Store.dead_letter`), one transaction per row that
  waits for a relay updating it, never a raw ``UPDATE``; cancelling and
  dead-lettering ask for confirmation and a reason. Each change is written
  to the admin's history of the row.
- Permissions: every active staff user may look (``view``); the actions
  need the ``outbound.change_outboxrow`` permission (superusers have it).
  Nothing is ever added, edited or deleted through forms. Set
  ``staff_can_view = False`` on a subclass (and register it instead) to
  require the ``view`` permission too.
- The status page (:mod:`outbound.contrib.django.views`), linked from the
  list, at ``<admin>/outbound/outboxrow/status/``.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar, cast

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.models import LogEntry
from django.contrib.admin.options import get_content_type_for_model
from django.core.exceptions import PermissionDenied
from django.db import router, transaction
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
)
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import formats, timezone
from django.utils.html import format_html

from outbound.errors import OutboxError
from outbound.outbox._base import check_reason
from outbound.outbox.web import format_age

from .conf import get_settings
from .models import OutboxRow
from .outbox import get_store
from .views import status_json_response, status_page_response

__all__ = ["OutboxRowAdmin"]

#: The most rows one action changes (the store writes one transaction per row).
MAX_ACTION_ROWS = 1000
#: The longest reason an operator may give for Cancel or Move to dead (characters).
MAX_REASON = 500
# The confirmation form's one field for every confirmed id (one field per row
# would pass Django's DATA_UPLOAD_MAX_NUMBER_FIELDS, 1000 by default).
_IDS_FIELD = "outbox_ids"

_COLORS = {
    "pending": "#2f6fde",
    "processing": "#c98a04",
    "sent": "#1f9d55",
    "dead": "#d23c3c",
    "cancelled": "#7a8190",
}

# What each operation is called, what it changes, and how the history says it.
_OPERATIONS: dict[str, dict[str, str]] = {
    "retry": {
        "verb": "retry",
        "done": "pending again",
        "from": "dead",
        "log": "Retried: pending again, at the back of its key",
    },
    "cancel": {
        "verb": "cancel",
        "done": "cancelled",
        "from": "pending or processing",
        "log": "Cancelled: it will never be delivered",
    },
    "dead": {
        "verb": "move to dead",
        "done": "dead",
        "from": "pending or processing",
        "log": "Moved to dead",
    },
}


F = TypeVar("F", bound=Callable[..., Any])


def _display(**options: Any) -> Callable[[F], F]:
    """``admin.display``, typed (Django ships no types)."""
    return cast("Callable[[F], F]", admin.display(**options))


def _action(**options: Any) -> Callable[[F], F]:
    """``admin.action``, typed (Django ships no types)."""
    return cast("Callable[[F], F]", admin.action(**options))


def _html(template: str, *args: object) -> str:
    """``format_html``: the arguments escaped, the result marked safe."""
    return cast(str, format_html(template, *args))


def _moment(when: _dt.datetime | None) -> str:
    """A moment in the project's time zone, and how long ago (or from now) it is."""
    if when is None:
        return "-"
    shown = formats.localize(timezone.localtime(when) if settings.USE_TZ else when)
    seconds = when.timestamp() - time.time()
    relative = f"in {format_age(seconds)}" if seconds > 0.05 else f"{format_age(-seconds)} ago"
    return f"{shown} ({relative})"


def _outside_request_transactions(view: F) -> F:
    """Exempt ``view`` from ``ATOMIC_REQUESTS`` on every database.

    The actions write through the store's own connections, one transaction
    per row, which a request's transaction can neither include nor undo: on
    SQLite it could only block them (its write lock) or fail after them (a
    read snapshot they made stale). The history is written after them, in
    a transaction of its own.
    """
    for alias in settings.DATABASES:
        view = cast(F, transaction.non_atomic_requests(using=alias)(view))
    return view


def _row_id(text: str) -> int | None:
    """A row id written in decimal digits (1 to 2**63 - 1), or None."""
    if not text.isdecimal():
        return None
    try:
        value = int(text)
    except ValueError:  # over Python's limit of digits
        return None
    return value if 1 <= value < 2**63 else None


def _names(ids: Sequence[int], limit: int = 20) -> str:
    """``row 5`` or ``rows 1, 2, 3``; the first ``limit``, then how many more."""
    shown = ", ".join(map(str, ids[:limit]))
    more = f" and {len(ids) - limit} more" if len(ids) > limit else ""
    return f"{'row' if len(ids) == 1 else 'rows'} {shown}{more}"


def _short(text: str | None, limit: int = 120) -> str:
    if not text:
        return ""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


@admin.register(OutboxRow)
class OutboxRowAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """The outbox rows; read-only but for the store's fenced operations. Thread-safe."""

    #: Every active staff user may look; False: the ``view`` permission is needed too.
    staff_can_view: ClassVar[bool] = True

    list_display = (
        "id",
        "status_badge",
        "key",
        "type",
        "attempts",
        "age",
        "last_change",
        "error_summary",
    )
    list_display_links = ("id",)
    list_filter = ("status", "type")
    search_fields = ("=key", "=dedupe_key")
    search_help_text = "An exact key or dedupe key, or a row id."
    list_per_page = 100
    # The table may be large: no second count of every row, and no count
    # per filter value (Django 5's facets) unless asked for.
    show_full_result_count = False
    if hasattr(admin, "ShowFacets"):
        show_facets = admin.ShowFacets.NEVER
    ordering = ("-id",)
    actions = ("retry_now", "cancel_rows", "move_to_dead")
    change_list_template = "admin/outbound/outboxrow/change_list.html"
    change_form_template = "admin/outbound/outboxrow/change_form.html"
    fieldsets = (
        (None, {"fields": ("id", "status_badge", "key", "type", "dedupe_key", "attempts")}),
        (
            "Delivery",
            {
                "fields": (
                    "enqueued",
                    "last_changed",
                    "next_try",
                    "next_of_its_key",
                    "lease_owner",
                    "lease_ends",
                    "full_error",
                )
            },
        ),
        ("Payload", {"fields": ("pretty_payload",)}),
    )
    # Every field shown is read-only (no form edits a row).
    readonly_fields = tuple(name for _, part in fieldsets for name in part["fields"])

    # ---------------------------------------------------------- permissions

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        user = request.user
        if not (user.is_active and user.is_staff):
            return False
        if self.staff_can_view:
            return True
        return bool(super().has_view_permission(request, obj))

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # No form ever edits a row: the row page is read-only for everyone.
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """May run the actions: the ``outbound.change_outboxrow`` permission."""
        user = request.user
        perm = f"{self.opts.app_label}.change_{self.opts.model_name}"
        return bool(user.is_active and user.is_staff and user.has_perm(perm))

    # ------------------------------------------------------------- the list

    def get_queryset(self, request: HttpRequest) -> Any:
        return super().get_queryset(request).using(get_settings().using)

    def get_search_results(
        self, request: HttpRequest, queryset: Any, search_term: str
    ) -> tuple[Any, bool]:
        """The rows whose key or dedupe key is ``search_term`` as typed (keys are
        case-sensitive and may hold spaces: not Django's word-by-word, case-blind
        ``=`` search), or whose id it is."""
        if not search_term:
            return queryset, False
        found = queryset.filter(key=search_term) | queryset.filter(dedupe_key=search_term)
        row_id = _row_id(search_term.strip())
        if row_id is not None:
            found = found | queryset.filter(id=row_id)
        return found, False

    @_display(description="status", ordering="status")
    def status_badge(self, row: OutboxRow) -> str:
        color = _COLORS.get(row.status, "#7a8190")
        return _html(
            '<span class="outbox-status" style="background:{};color:#fff;border-radius:9px;'
            'padding:1px 8px;font-size:11px">{}</span>',
            color,
            row.status,
        )

    @_display(description="age", ordering="created_at")
    def age(self, row: OutboxRow) -> str:
        return format_age(time.time() - row.created_at.timestamp())

    @_display(description="last change", ordering="updated_at")
    def last_change(self, row: OutboxRow) -> str:
        return f"{format_age(time.time() - row.updated_at.timestamp())} ago"

    @_display(description="last error")
    def error_summary(self, row: OutboxRow) -> str:
        return _short(row.last_error)

    # -------------------------------------------------------------- a row

    @_display(description="enqueued")
    def enqueued(self, row: OutboxRow) -> str:
        return _moment(row.created_at)

    @_display(description="last change")
    def last_changed(self, row: OutboxRow) -> str:
        return _moment(row.updated_at)

    @_display(description="next try")
    def next_try(self, row: OutboxRow) -> str:
        if row.status != "pending":
            return "-"
        return _moment(row.available_at)

    @_display(description="lease ends")
    def lease_ends(self, row: OutboxRow) -> str:
        return _moment(row.lease_expires_at) if row.status == "processing" else "-"

    @_display(description="last error")
    def full_error(self, row: OutboxRow) -> str:
        if not row.last_error:
            return "-"
        return _html('<pre style="white-space:pre-wrap;margin:0">{}</pre>', row.last_error)

    @_display(description="next of its key", boolean=True)
    def next_of_its_key(self, row: OutboxRow) -> bool:
        return bool(row.head) and row.status in ("pending", "processing")

    @_display(description="payload")
    def pretty_payload(self, row: OutboxRow) -> str:
        text = row.payload or ""
        try:
            pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            pretty = text  # shown as stored
        return _html(
            '<pre class="outbox-payload" style="white-space:pre-wrap;margin:0">{}</pre>', pretty
        )

    def render_change_form(
        self, request: HttpRequest, context: dict[str, Any], *args: Any, **kwargs: Any
    ) -> HttpResponse:
        row = context.get("original")
        operate = self.has_operate_permission(request)
        context["outbox_can_retry"] = operate and row is not None and row.status == "dead"
        context["outbox_can_close"] = (
            operate
            and row is not None
            and row.status
            in (
                "pending",
                "processing",
            )
        )
        return super().render_change_form(request, context, *args, **kwargs)

    # ------------------------------------------------------------ actions

    @_action(
        description="Retry now (dead rows: pending again, at the back of their key)",
        permissions=["operate"],
    )
    def retry_now(self, request: HttpRequest, queryset: Any) -> None:
        self._operate(request, "retry", self._selection(request, queryset))

    @_action(description="Cancel (never delivered)\u2026", permissions=["operate"])
    def cancel_rows(self, request: HttpRequest, queryset: Any) -> HttpResponse | None:
        return self._confirmed(request, queryset, "cancel", "cancel_rows")

    @_action(description="Move to dead (to inspect, then retry)\u2026", permissions=["operate"])
    def move_to_dead(self, request: HttpRequest, queryset: Any) -> HttpResponse | None:
        return self._confirmed(request, queryset, "dead", "move_to_dead")

    def response_action(
        self, request: HttpRequest, queryset: Any, *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        """Django's (whatever else its version passes), but a selection that is not row
        ids is refused with a message."""
        posted = request.POST.getlist(admin.helpers.ACTION_CHECKBOX_NAME)
        if any(_row_id(text.strip()) is None for text in posted):
            self.message_user(
                request, "The selection is not a list of row ids: nothing changed.", messages.ERROR
            )
            return None
        return cast(
            "HttpResponse | None", super().response_action(request, queryset, *args, **kwargs)
        )

    def _selection(
        self, request: HttpRequest, queryset: Any, *, confirmed: bool = False
    ) -> list[int] | None:
        """The ids the operator chose: every row of the list ("select all"), else exactly
        the ids posted (the confirmed ones, or the ticked ones, whatever the list's filter
        shows now). None, with a message, if malformed or over :data:`MAX_ACTION_ROWS`."""
        post = request.POST
        if not confirmed and post.get("select_across") == "1":
            ids = list(queryset.order_by("id").values_list("id", flat=True)[: MAX_ACTION_ROWS + 1])
        else:
            raw = post.get(_IDS_FIELD) if confirmed else None
            texts = raw.split(",") if raw else post.getlist(admin.helpers.ACTION_CHECKBOX_NAME)
            parsed = [_row_id(text.strip()) for text in texts]
            ids = sorted({row_id for row_id in parsed if row_id is not None})
            if None in parsed or not ids:
                self.message_user(
                    request,
                    "The selection is not a list of row ids: nothing changed.",
                    messages.ERROR,
                )
                return None
        if len(ids) > MAX_ACTION_ROWS:
            self.message_user(
                request,
                f"At most {MAX_ACTION_ROWS} rows at a time: select fewer, or use the command "
                "line (python -m outbound outbox retry --all, cancel ID...). Nothing changed.",
                messages.ERROR,
            )
            return None
        return ids

    def _confirmed(
        self, request: HttpRequest, queryset: Any, operation: str, action: str
    ) -> HttpResponse | None:
        confirming = request.POST.get("post") == "yes" and request.POST.get("select_across") != "1"
        ids = self._selection(request, queryset, confirmed=confirming)
        if ids is None:
            return None
        if confirming:
            ok, reason = self._reason(request)
            if ok:
                self._operate(request, operation, ids, reason)
            return None
        return self._confirmation(request, operation, ids, action=action)

    def _reason(self, request: HttpRequest) -> tuple[bool, str | None]:
        """(True, the posted reason as the store keeps it, None if none given), or (False,
        None) with a message if it cannot be kept as it was typed: then write nothing."""
        text = request.POST.get("reason", "").strip()
        problem = ""
        if "\x00" in text:
            problem = "must not contain a NUL character"
        elif len(text) > MAX_REASON:
            problem = f"is {len(text)} characters long, over the limit of {MAX_REASON}"
        if problem:
            self.message_user(request, f"The reason {problem}: nothing changed.", messages.ERROR)
            return False, None
        return True, check_reason(text) if text else None

    def _confirmation(
        self, request: HttpRequest, operation: str, ids: Sequence[int], *, action: str = ""
    ) -> HttpResponse:
        shown = list(ids[:100])
        rows = list(self.get_queryset(request).filter(id__in=shown).order_by("id"))
        context = {
            **self.admin_site.each_context(request),
            "title": f"{_OPERATIONS[operation]['verb'].capitalize()} outbox rows?",
            "opts": self.opts,
            "operation": _OPERATIONS[operation],
            "rows": rows,
            "ids": ",".join(map(str, ids)),
            "first_id": ids[0] if ids else "",
            "ids_field": _IDS_FIELD,
            "more": max(0, len(ids) - len(rows)),
            "max_reason": MAX_REASON,
            "action": action,
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/outbound/outboxrow/confirm.html", context)

    def _operate(
        self,
        request: HttpRequest,
        operation: str,
        ids: Sequence[int] | None,
        reason: str | None = None,
    ) -> int:
        """Run ``operation`` on each row through the store; report and log what changed."""
        if ids is None:
            return 0
        store = get_store()
        run: Callable[[list[int]], int]
        if operation == "retry":
            run = store.retry_dead
        elif operation == "cancel":
            run = lambda ids: store.cancel(ids, reason=reason)  # noqa: E731
        else:
            run = lambda ids: store.dead_letter(ids, reason=reason)  # noqa: E731
        changed: list[int] = []
        tried = 0
        try:
            for row_id in ids:
                tried += 1
                if run([row_id]):
                    changed.append(row_id)
        except OutboxError as exc:
            done = set(changed)
            left = [i for i in ids[: tried - 1] if i not in done]
            text = f"The outbox failed after {len(changed)} of {len(ids)} rows: {exc}"
            if left:
                text += f" {self._left(request, operation, left)}"
            self.message_user(request, text, messages.ERROR)
        else:
            spec = _OPERATIONS[operation]
            text = f"{len(changed)} {'row is' if len(changed) == 1 else 'rows are'} {spec['done']}."
            done = set(changed)
            left = [i for i in ids if i not in done]
            if left:
                text += f" {self._left(request, operation, left)}"
            self.message_user(request, text, messages.SUCCESS if changed else messages.WARNING)
        if changed:
            log = _OPERATIONS[operation]["log"] + (f" ({reason})" if reason else "")
            # Read before the history's transaction: on SQLite a read in it,
            # then a commit by another connection, and its first write fails
            # at once ("database is locked": its snapshot is stale).
            rows = list(self.get_queryset(request).filter(id__in=changed))
            if rows:
                get_content_type_for_model(rows[0])  # (cached: the history reads nothing)
            with transaction.atomic(using=router.db_for_write(LogEntry)):
                for row in rows:
                    self.log_change(request, row, log)
        return len(changed)

    def _left(self, request: HttpRequest, operation: str, left: list[int]) -> str:
        """What became of the rows ``left`` as they were, each named: gone, left dead because
        an unfinished row holds its dedupe key (Retry now), or not in a status it changes."""
        found = {
            row.id: row
            for row in self.get_queryset(request)
            .filter(id__in=left)
            .only("id", "status", "dedupe_key")
        }
        gone = [i for i in left if i not in found]
        held: dict[int, int] = {}
        if operation == "retry":
            keys: dict[str, list[int]] = {}
            for row in found.values():
                if row.status == "dead" and row.dedupe_key:
                    keys.setdefault(row.dedupe_key, []).append(row.id)
            if keys:
                holders = (
                    self.get_queryset(request)
                    .filter(dedupe_key__in=list(keys), status__in=("pending", "processing"))
                    .values_list("dedupe_key", "id")
                )
                held = {dead: holder for key, holder in holders for dead in keys[key]}
        other = [i for i in left if i in found and i not in held]
        parts = []
        if other:
            were = "was" if len(other) == 1 else "were"
            parts.append(
                f"{len(other)} {were} not {_OPERATIONS[operation]['from']} (any more) and "
                f"stayed as {'it was' if len(other) == 1 else 'they were'}: {_names(other)}."
            )
        if held:
            dead = sorted(held)
            holds = ", ".join(f"row {held[i]} holds the dedupe key of row {i}" for i in dead[:10])
            more = f", and {len(dead) - 10} more" if len(dead) > 10 else ""
            parts.append(
                f"{len(dead)} stayed dead because an unfinished row holds the same dedupe key "
                f"({holds}{more}): retry once that row is finished."
            )
        if gone:
            parts.append(
                f"{len(gone)} no longer {'exists' if len(gone) == 1 else 'exist'}: {_names(gone)}."
            )
        return " ".join(parts)

    # --------------------------------------------------------------- views

    def get_urls(self) -> list[URLPattern]:
        info = f"{self.opts.app_label}_{self.opts.model_name}"
        wrap = self.admin_site.admin_view
        return [
            path("status/", wrap(self.status_view), name=f"{info}_status"),
            path("status.json", wrap(self.status_json_view), name=f"{info}_status_json"),
            path("<path:object_id>/retry/", wrap(self.retry_view), name=f"{info}_retry"),
            path("<path:object_id>/cancel/", wrap(self.cancel_view), name=f"{info}_cancel"),
            path("<path:object_id>/dead/", wrap(self.dead_view), name=f"{info}_dead"),
            *super().get_urls(),
        ]

    def _url(self, name: str, *args: Any) -> str:
        info = f"{self.opts.app_label}_{self.opts.model_name}"
        return str(reverse(f"{self.admin_site.name}:{info}_{name}", args=args))

    def status_view(self, request: HttpRequest) -> HttpResponse:
        """The status page, inside the admin."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        return status_page_response(
            json_url=self._url("status_json"),
            links=[
                ("Outbox rows", self._url("changelist")),
                ("Admin", reverse(f"{self.admin_site.name}:index")),
            ],
        )

    def status_json_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return status_json_response()

    def _row_view(self, request: HttpRequest, object_id: str, operation: str) -> HttpResponse:
        if not self.has_operate_permission(request):
            raise PermissionDenied
        row_id = _row_id(object_id)
        if row_id is None or not self.get_queryset(request).filter(id=row_id).exists():
            raise Http404("No outbox row has this id.")
        back = self._url("change", row_id)
        if request.method == "POST" and operation == "retry":
            self._operate(request, operation, [row_id])
            return HttpResponseRedirect(back)
        if request.method == "POST" and request.POST.get("post"):
            ok, reason = self._reason(request)
            if ok:
                self._operate(request, operation, [row_id], reason)
            return HttpResponseRedirect(back)
        if request.method not in ("GET", "HEAD") or operation == "retry":
            return HttpResponseNotAllowed(["POST"] if operation == "retry" else ["GET", "POST"])
        return self._confirmation(request, operation, [row_id])

    @_outside_request_transactions
    def retry_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: revive this dead row."""
        return self._row_view(request, object_id, "retry")

    @_outside_request_transactions
    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET: confirm; POST: cancel this row."""
        return self._row_view(request, object_id, "cancel")

    @_outside_request_transactions
    def dead_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET: confirm; POST: move this row to dead."""
        return self._row_view(request, object_id, "dead")

    @_outside_request_transactions
    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {**(extra_context or {}), "outbox_status_url": self._url("status")}
        return super().changelist_view(request, extra)
