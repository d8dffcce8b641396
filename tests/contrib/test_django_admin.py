"""The outbox in Django's admin and the status page views, with Django's test client on
both stores, and in a real headless Chromium against a live server and a relay.

Django is configured from ``django_project`` by test_django.py's ``django_env``
fixture (one configuration per process); ``default`` is PostgreSQL when
``OUTBOUND_TEST_POSTGRES`` is set, ``lite`` an SQLite file.
"""

from __future__ import annotations

import html
import itertools
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "django", reason="Django is not installed: pip install 'outbound-dispatcher[django]'"
)

from browser_helpers import TIMEOUT_MS, screenshot
from browser_helpers import browser as _browser
from django.core.management import call_command
from django.db import connections, transaction
from django.test import Client
from django.test.utils import override_settings
from test_django import django_env, outbound_conf  # noqa: F401

from outbound.contrib import django as ob
from outbound.errors import PermanentSendError
from outbound.outbox import EventBus, OutboxMessage, Store
from outbound.outbox._base import Outcome

ALIASES = ["default", "lite"]
CHANGELIST = "/admin/outbound/outboxrow/"
_names = itertools.count()


def emptied_outbox(using: str) -> Iterator[str]:
    """The outbox of database ``using``, emptied before; stores let go after."""
    with override_settings(OUTBOUND=outbound_conf(using=using)):
        store = ob.get_store()
        store.cancel([r.id for r in store.rows(status="pending", limit=10_000)])
        store.purge(statuses=["sent", "dead", "cancelled"])
        try:
            yield using
        finally:
            ob.close_stores()


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest, django_env: Path) -> Iterator[str]:
    yield from emptied_outbox(str(request.param))


def make_user(*, staff: bool = True, change: bool = False, superuser: bool = False) -> Any:
    # Models are imported once Django is set up (by the django_env fixture).
    from django.contrib.auth.models import Permission, User  # noqa: PLC0415

    user = User.objects.create_user(
        f"user{os.getpid()}_{next(_names)}", password="secret", is_staff=staff
    )
    user.is_superuser = superuser
    user.save()
    if change:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="outbound", codename="change_outboxrow")
        )
    return user


@pytest.fixture
def users(django_env: Path) -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for user in made:
        user.delete()


def client_for(users: list[Any], **kind: bool) -> Client:
    user = make_user(**kind)
    users.append(user)
    client = Client()
    client.force_login(user)
    return client


def enqueue(*rows: tuple[str, dict[str, Any]], dedupe: str | None = None) -> list[int]:
    return [
        ob.enqueue(key=key, type="greet", payload=payload, dedupe_key=dedupe)
        for key, payload in rows
    ]


def kill(store: Store, count: int, error: str) -> None:
    """Claim ``count`` rows and write them dead with ``error``, as a relay would."""
    session = store.session()
    try:
        claimed = session.claim("test-relay", count, 30.0, None)
        session.finish(
            "test-relay",
            [Outcome(c.message.id, c.token, c.message.key, "dead", error=error) for c in claimed],
        )
    finally:
        session.close()


def statuses(store: Store) -> dict[int, str]:
    return {row.id: row.status for row in store.rows(limit=1000)}


# ------------------------------------------------------------------- the list


def test_list_filters_search_and_a_row_page(alias: str, users: list[Any]) -> None:
    store = ob.get_store()
    (dead,) = enqueue(("chat-dead", {"chat_id": 1, "text": "<b>bold</b> \u00e9"}))
    kill(store, 1, "403 Forbidden: <bot> was blocked")
    pending = enqueue(("chat-1", {"chat_id": 1}), ("chat-2", {"chat_id": 2}))
    (deduped,) = enqueue(("chat-3", {"chat_id": 3}), dedupe="order-77")
    client = client_for(users)
    page = client.get(CHANGELIST)
    assert page.status_code == 200
    text = page.content.decode()
    for key in ("chat-dead", "chat-1", "chat-2", "chat-3"):
        assert key in text
    assert "403 Forbidden: &lt;bot&gt; was blocked" in text
    assert 'class="outbox-status"' in text
    assert "Status page" in text
    # Filters and search.

    def shown(response: Any) -> set[int]:
        return {int(i) for i in re.findall(r"/outboxrow/(\d+)/change/", response.content.decode())}

    assert shown(client.get(CHANGELIST, {"status__exact": "dead"})) == {dead}
    assert shown(client.get(CHANGELIST, {"status__exact": "pending"})) == {*pending, deduped}
    assert shown(client.get(CHANGELIST, {"type": "greet"})) == {dead, *pending, deduped}
    assert shown(client.get(CHANGELIST, {"q": "chat-2"})) == {pending[1]}
    assert shown(client.get(CHANGELIST, {"q": "order-77"})) == {deduped}
    assert shown(client.get(CHANGELIST, {"q": str(dead)})) == {dead}
    assert shown(client.get(CHANGELIST, {"q": "chat"})) == set()  # exact, not a scan
    # A row's page: every column, the payload pretty-printed and escaped.
    row = client.get(f"{CHANGELIST}{dead}/change/")
    assert row.status_code == 200
    body = row.content.decode()
    payload = re.search(r'<pre class="outbox-payload"[^>]*>(.*?)</pre>', body, re.S)
    assert payload is not None
    assert "&lt;b&gt;bold&lt;/b&gt;" in payload.group(1)  # escaped
    pretty = html.unescape(payload.group(1))
    assert json.loads(pretty) == {"chat_id": 1, "text": "<b>bold</b> \u00e9"}
    assert '\n  "chat_id": 1' in pretty  # indented
    assert "403 Forbidden: &lt;bot&gt; was blocked" in body
    assert 'name="_save"' not in body  # nothing to edit
    assert "Retry now" not in body  # a viewer's page has no actions


def test_permissions(alias: str, users: list[Any]) -> None:
    store = ob.get_store()
    (dead,) = enqueue(("chat-dead", {}))
    kill(store, 1, "boom")
    (pending,) = enqueue(("chat-1", {}))
    anonymous = Client()
    assert anonymous.get(CHANGELIST).status_code == 302
    outsider = client_for(users, staff=False)
    assert outsider.get(CHANGELIST).status_code == 302  # the admin's login
    viewer = client_for(users)
    page = viewer.get(CHANGELIST)
    assert page.status_code == 200
    assert 'value="retry_now"' not in page.content.decode()
    # A viewer's POSTs change nothing.
    refused = viewer.post(
        CHANGELIST, {"action": "retry_now", "_selected_action": [dead], "index": 0}
    )
    assert refused.status_code in (200, 302)
    assert viewer.post(f"{CHANGELIST}{dead}/retry/").status_code == 403
    assert viewer.post(f"{CHANGELIST}{pending}/cancel/", {"post": "yes"}).status_code == 403
    assert statuses(store) == {dead: "dead", pending: "pending"}
    assert viewer.get(f"{CHANGELIST}add/").status_code == 403
    assert viewer.post(f"{CHANGELIST}{dead}/delete/").status_code == 403
    operator = client_for(users, change=True)
    page = operator.get(CHANGELIST)
    for action in ("retry_now", "cancel_rows", "move_to_dead"):
        assert f'value="{action}"' in page.content.decode()
    assert 'value="delete_selected"' not in page.content.decode()
    row = operator.get(f"{CHANGELIST}{dead}/change/").content.decode()
    assert "Retry now" in row
    assert "Cancel&hellip;" not in row  # only for unfinished rows
    row = operator.get(f"{CHANGELIST}{pending}/change/").content.decode()
    assert "Cancel&hellip;" in row
    assert "Move to dead&hellip;" in row


def test_actions_go_through_the_store(alias: str, users: list[Any]) -> None:
    store = ob.get_store()
    dead = enqueue(("a", {}), ("b", {}))
    kill(store, 2, "boom")
    first, second, third = enqueue(("c", {}), ("c", {}), ("d", {}))
    operator = client_for(users, change=True)
    # Retry: dead rows only; the others are left as they are, and said so.
    done = operator.post(
        CHANGELIST,
        {"action": "retry_now", "_selected_action": [*dead, third], "index": 0},
        follow=True,
    )
    assert "2 rows are pending again. 1 was not dead" in done.content.decode()
    assert [statuses(store)[i] for i in dead] == ["pending", "pending"]
    # Cancel asks first, then takes the reason as the last error.
    asked = operator.post(
        CHANGELIST, {"action": "cancel_rows", "_selected_action": [first], "index": 0}
    )
    assert asked.status_code == 200
    assert "Yes, cancel" in asked.content.decode()
    assert statuses(store)[first] == "pending"
    done = operator.post(
        CHANGELIST,
        {
            "action": "cancel_rows",
            "_selected_action": [first],
            "post": "yes",
            "reason": "customer left",
        },
        follow=True,
    )
    assert "1 row is cancelled." in done.content.decode()
    cancelled = store.get(first)
    assert cancelled is not None
    assert (cancelled.status, cancelled.last_error) == ("cancelled", "customer left")
    # Move to dead, from the row's own page.
    confirm = operator.get(f"{CHANGELIST}{second}/dead/")
    assert "Yes, move to dead" in confirm.content.decode()
    operator.post(f"{CHANGELIST}{second}/dead/", {"post": "yes"})
    moved = store.get(second)
    assert moved is not None
    assert (moved.status, moved.last_error) == ("dead", "dead-lettered by an operator")
    # And back, from the row's page too.
    back = operator.post(f"{CHANGELIST}{second}/retry/", follow=True)
    assert "1 row is pending again." in back.content.decode()
    assert statuses(store)[second] == "pending"
    # Each change is in the row's history.
    from django.contrib.admin.models import LogEntry  # noqa: PLC0415

    logged = LogEntry.objects.filter(object_id=str(second)).values_list("change_message", flat=True)
    assert sorted(logged) == ["Moved to dead", "Retried: pending again, at the back of its key"]
    assert operator.get(f"{CHANGELIST}{second}/retry/").status_code == 405


def submit_confirmation(client: Client, url: str, page: Any, reason: str = "") -> Any:
    """Submit the confirmation form of ``page`` to ``url`` as a browser would; follow."""
    assert page.status_code == 200
    found = re.search(r'<form method="post"[^>]*>(.*?)</form>', page.content.decode(), re.S)
    assert found is not None
    data: dict[str, list[str]] = {}
    for tag in re.findall(r"<input [^>]*>", found.group(1)):
        name = re.search(r'name="([^"]*)"', tag)
        if name is None:
            continue  # the submit button
        value = re.search(r'value="([^"]*)"', tag)
        data.setdefault(html.unescape(name.group(1)), []).append(
            html.unescape(value.group(1)) if value else ""
        )
    data["reason"] = [reason]
    return client.post(url, data, follow=True)


def said(response: Any) -> str:
    """The admin's messages on ``response``, one string."""
    return " ".join(str(m) for m in response.context["messages"])


def history(row_id: int) -> list[str]:
    from django.contrib.admin.models import LogEntry  # noqa: PLC0415

    return sorted(
        LogEntry.objects.filter(object_id=str(row_id)).values_list("change_message", flat=True)
    )


@pytest.fixture(params=["deferred", "immediate"])
def atomic_requests(request: pytest.FixtureRequest, alias: str) -> Iterator[str]:
    """``ATOMIC_REQUESTS`` on every database; "immediate": SQLite's ``transaction_mode``
    IMMEDIATE on the outbox's (what Django advises against "database is locked")."""
    immediate = request.param == "immediate"
    connection = connections[alias]
    if immediate and connection.vendor != "sqlite":
        pytest.skip("transaction_mode is an SQLite option")
    every = connections.settings
    saved = {name: every[name]["ATOMIC_REQUESTS"] for name in every}
    options = connection.settings_dict["OPTIONS"]
    for name in every:
        every[name]["ATOMIC_REQUESTS"] = True
    if immediate:
        options["transaction_mode"] = "IMMEDIATE"
        connection.close()  # the next connection begins its transactions IMMEDIATE
    try:
        yield alias
    finally:
        for name, value in saved.items():
            every[name]["ATOMIC_REQUESTS"] = value
        if immediate:
            del options["transaction_mode"]
            connection.close()


def test_actions_under_atomic_requests(atomic_requests: str, users: list[Any]) -> None:
    store = ob.get_store()
    (dead,) = enqueue(("a", {}))
    kill(store, 1, "boom")
    first, second = enqueue(("b", {}), ("c", {}))
    operator = client_for(users, change=True)
    asked = operator.post(
        CHANGELIST, {"action": "cancel_rows", "_selected_action": [first], "index": 0}
    )
    done = submit_confirmation(operator, CHANGELIST, asked, "customer left")
    assert said(done) == "1 row is cancelled."
    moved = operator.post(
        f"{CHANGELIST}{second}/dead/", {"post": "yes", "reason": "to look at"}, follow=True
    )
    assert said(moved) == "1 row is dead."
    done = operator.post(
        CHANGELIST, {"action": "retry_now", "_selected_action": [dead], "index": 0}, follow=True
    )
    assert said(done) == "1 row is pending again."
    assert [statuses(store)[i] for i in (dead, first, second)] == ["pending", "cancelled", "dead"]
    assert history(first) == ["Cancelled: it will never be delivered (customer left)"]
    assert history(second) == ["Moved to dead (to look at)"]
    assert history(dead) == ["Retried: pending again, at the back of its key"]


def test_the_history_transaction_only_writes(alias: str, users: list[Any]) -> None:
    """The history's transaction read the rows it logs first: on SQLite, a commit by
    another connection (a relay, an enqueue) between that read and its first write
    failed the write at once ("database is locked"), an HTTP 500 after the rows had
    changed, with no history. Whatever the vendor, it now only writes."""
    from django.contrib.admin.models import LogEntry  # noqa: PLC0415
    from django.db import router  # noqa: PLC0415

    history_db = connections[router.db_for_write(LogEntry)]
    first, second = enqueue(("a", {}), ("b", {}))
    operator = client_for(users, change=True)
    asked = operator.post(
        CHANGELIST, {"action": "cancel_rows", "_selected_action": [first, second], "index": 0}
    )
    in_transactions: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if history_db.in_atomic_block:
            in_transactions.append(sql.split(None, 1)[0].upper())
        return execute(sql, params, many, context)

    with history_db.execute_wrapper(record):
        done = submit_confirmation(operator, CHANGELIST, asked, "gone")
    assert said(done) == "2 rows are cancelled."
    assert "INSERT" in in_transactions
    assert "SELECT" not in in_transactions, in_transactions
    assert history(first) == ["Cancelled: it will never be delivered (gone)"]


def test_a_confirmation_acts_on_the_rows_confirmed(alias: str, users: list[Any]) -> None:
    store = ob.get_store()
    claimed, finished, waiting = enqueue(("a", {}), ("b", {}), ("c", {}))
    operator = client_for(users, change=True)
    filtered = f"{CHANGELIST}?status__exact=pending"
    asked = operator.post(
        filtered,
        {"action": "cancel_rows", "_selected_action": [claimed, finished, waiting], "index": 0},
    )
    assert [row.id for row in asked.context["rows"]] == [claimed, finished, waiting]
    # Meanwhile a relay claims one (processing: no longer in the filter, still cancellable),
    # and another is finished.
    session = store.session()
    try:
        assert [c.message.id for c in session.claim("test-relay", 1, 30.0, None)] == [claimed]
    finally:
        session.close()
    store.dead_letter([finished])
    done = submit_confirmation(operator, filtered, asked, "stop")
    assert said(done) == (
        "2 rows are cancelled. 1 was not pending or processing (any more) and stayed as it "
        f"was: row {finished}."
    )
    assert [statuses(store)[i] for i in (claimed, finished, waiting)] == [
        "cancelled",
        "dead",
        "cancelled",
    ]


def test_a_thousand_rows_confirm_under_django_default_limits(alias: str, users: list[Any]) -> None:
    from django.conf import settings  # noqa: PLC0415

    assert settings.DATA_UPLOAD_MAX_NUMBER_FIELDS == 1000  # Django's default
    store = ob.get_store()
    with transaction.atomic(using=alias):
        ids = [ob.enqueue(key="bulk", type="greet", payload={}) for _ in range(1001)]
    operator = client_for(users, change=True)
    every = {"action": "move_to_dead", "select_across": "1", "index": 0}
    refused = operator.post(
        f"{CHANGELIST}?q=bulk", {**every, "_selected_action": [ids[0]]}, follow=True
    )
    assert said(refused).startswith("At most 1000 rows at a time")
    assert store.status().counts["pending"] == 1001
    store.cancel([ids[0]])
    listed = f"{CHANGELIST}?q=bulk&status__exact=pending"
    asked = operator.post(listed, {**every, "_selected_action": [ids[1]]})
    done = submit_confirmation(operator, listed, asked, "bulk")
    assert done.status_code == 200
    assert said(done) == "1000 rows are dead."
    counts = store.status().counts
    assert (counts["pending"], counts["cancelled"], counts["dead"]) == (0, 1, 1000)


def test_search_matches_a_key_exactly_case_and_spaces_too(alias: str, users: list[Any]) -> None:
    # Keys are case-sensitive, and may hold spaces: the search matched "alice"
    # to "ALICE" (Django's "=" is iexact), and split "order 42" into words.
    lower, upper, spaced = enqueue(("alice", {}), ("ALICE", {}), ("order 42", {}))
    (deduped,) = enqueue(("chat", {}), dedupe="Order-77")
    client = client_for(users)

    def shown(term: str) -> set[int]:
        page = client.get(CHANGELIST, {"q": term})
        assert page.status_code == 200
        return {int(i) for i in re.findall(r"/outboxrow/(\d+)/change/", page.content.decode())}

    assert shown("alice") == {lower}
    assert shown("ALICE") == {upper}
    assert shown("order 42") == {spaced}
    assert shown("order") == set()
    assert shown("Order-77") == {deduped}
    assert shown("order-77") == set()
    assert shown(f" {spaced} ") == {spaced}  # a row id, spaces around it
    assert shown("") == {lower, upper, spaced, deduped}  # no search: every row


def test_hostile_ids_and_searches(alias: str, users: list[Any]) -> None:
    (row,) = enqueue(("a", {}))
    operator = client_for(users, change=True)
    for term in ("\u00b2", "\U0001d7d9", "0", "-1", "9" * 5000, str(2**63)):
        assert operator.get(CHANGELIST, {"q": term}).status_code == 200
    gone = row + 1_000_000
    for text in ("0", str(2**63), "9" * 30, "\u00b2", str(gone)):
        for operation in ("retry", "cancel", "dead"):
            url = f"{CHANGELIST}{text}/{operation}/"
            assert operator.post(url, {"post": "yes"}).status_code == 404, url
        assert operator.get(f"{CHANGELIST}{text}/cancel/").status_code == 404
    for text in ("\u00b2", str(2**63)):
        done = operator.post(
            CHANGELIST,
            {"action": "cancel_rows", "_selected_action": [text], "index": 0},
            follow=True,
        )
        assert said(done) == "The selection is not a list of row ids: nothing changed."
    assert statuses(ob.get_store()) == {row: "pending"}


def test_a_reason_that_cannot_be_kept_changes_nothing(alias: str, users: list[Any]) -> None:
    store = ob.get_store()
    first, second = enqueue(("a", {}), ("b", {}))
    operator = client_for(users, change=True)
    refused = operator.post(
        f"{CHANGELIST}{first}/cancel/", {"post": "yes", "reason": "bad\x00reason"}, follow=True
    )
    assert said(refused) == "The reason must not contain a NUL character: nothing changed."
    asked = operator.post(
        CHANGELIST, {"action": "move_to_dead", "_selected_action": [second], "index": 0}
    )
    refused = submit_confirmation(operator, CHANGELIST, asked, "x" * 501)
    assert said(refused) == (
        "The reason is 501 characters long, over the limit of 500: nothing changed."
    )
    assert statuses(store) == {first: "pending", second: "pending"}
    assert history(first) == history(second) == []
    # The history says what the row keeps.
    reason = "  " + "y" * 500 + "  "
    operator.post(f"{CHANGELIST}{first}/cancel/", {"post": "yes", "reason": reason})
    kept = store.get(first)
    assert kept is not None
    assert (kept.status, kept.last_error) == ("cancelled", "y" * 500)
    assert history(first) == [f"Cancelled: it will never be delivered ({'y' * 500})"]


def test_retry_says_why_a_row_stayed_dead(alias: str, users: list[Any]) -> None:
    store = ob.get_store()
    (dead,) = enqueue(("a", {}), dedupe="order-1")
    kill(store, 1, "boom")
    (holder,) = enqueue(("b", {}), dedupe="order-1")  # the dead row's key is free
    (pending,) = enqueue(("c", {}))
    operator = client_for(users, change=True)
    done = operator.post(
        CHANGELIST,
        {"action": "retry_now", "_selected_action": [dead, pending], "index": 0},
        follow=True,
    )
    assert said(done) == (
        f"0 rows are pending again. 1 was not dead (any more) and stayed as it was: row "
        f"{pending}. 1 stayed dead because an unfinished row holds the same dedupe key (row "
        f"{holder} holds the dedupe key of row {dead}): retry once that row is finished."
    )
    assert statuses(store) == {dead: "dead", holder: "pending", pending: "pending"}


def test_rows_are_never_saved_by_django(alias: str) -> None:
    from outbound.contrib.django.models import OutboxRow  # noqa: PLC0415

    enqueue(("a", {}))
    row = OutboxRow.objects.using(alias).get()
    assert row.status == "pending"
    assert row.created_at.tzinfo is not None
    with pytest.raises(TypeError, match="never saved"):
        row.save()
    with pytest.raises(TypeError, match="purge"):
        row.delete()


def test_no_migration_is_missing(django_env: Path) -> None:
    call_command("makemigrations", "outbound", "--check", "--dry-run", verbosity=0)
    with override_settings(OUTBOUND=outbound_conf(table="other_outbox")):
        from outbound.contrib.django.models import OutboxRow  # noqa: PLC0415

        assert OutboxRow._meta.db_table == "other_outbox"
    assert OutboxRow._meta.db_table == "outbox"


# ------------------------------------------------------------ the status page


def test_status_page_views(alias: str, users: list[Any]) -> None:
    enqueue(("a", {}), ("b", {}))
    anonymous = Client()
    assert anonymous.get("/ops/outbox/").status_code == 302
    assert anonymous.get("/ops/outbox/status.json").status_code == 302
    outsider = client_for(users, staff=False)
    assert outsider.get("/ops/outbox/").status_code == 403
    staff = client_for(users)
    page = staff.get("/ops/outbox/")
    assert page.status_code == 200
    assert page["Content-Security-Policy"].startswith("default-src 'none'")
    text = page.content.decode()
    assert 'data-count="pending">2<' in text
    assert 'href="/ops/outbox/status.json"' in text
    data = json.loads(staff.get("/ops/outbox/status.json").content)
    assert data["counts"]["pending"] == 2
    assert data["outbox"]["table"] == "outbox"
    # The same page inside the admin.
    inside = staff.get(f"{CHANGELIST}status/")
    assert inside.status_code == 200
    assert f'href="{CHANGELIST}status.json"' in inside.content.decode()
    assert f'href="{CHANGELIST}"' in inside.content.decode()
    assert json.loads(staff.get(f"{CHANGELIST}status.json").content)["unfinished"] == 2
    assert staff.post("/ops/outbox/").status_code == 405


# ---------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from _browser()


@pytest.fixture
def live_server(django_env: Path) -> Iterator[str]:
    from django.contrib.staticfiles.handlers import StaticFilesHandler  # noqa: PLC0415
    from django.test.testcases import LiveServerThread  # noqa: PLC0415

    thread = LiveServerThread("127.0.0.1", StaticFilesHandler)
    thread.daemon = True
    thread.start()
    thread.is_ready.wait(10)
    if thread.error:
        raise thread.error
    try:
        yield f"http://127.0.0.1:{thread.port}"
    finally:
        thread.terminate()


def wait_until(predicate: Any, timeout: float = 15.0) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(0.02)


@pytest.fixture
def default_alias(django_env: Path) -> Iterator[str]:
    """The outbox of the ``default`` database (PostgreSQL when there is one), emptied."""
    yield from emptied_outbox("default")


def test_a_staff_user_retries_a_dead_row_in_a_browser(
    default_alias: str,
    browser: Any,
    live_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Playwright's synchronous API keeps an event loop set on this thread,
    # which Django takes for an async context; the ORM calls here are not.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    attempts: dict[int, int] = {}  # by row id; written by the relay's worker threads

    def greet(message: OutboxMessage) -> None:
        attempts[message.id] = attempts.get(message.id, 0) + 1
        if message.payload["chat_id"] == 42 and attempts[message.id] == 1:
            raise PermanentSendError("403 Forbidden: bot was blocked by the user")

    bus = EventBus()
    bus.subscribe("greet", greet)
    store = ob.get_store()
    (row_id,) = enqueue(("chat-42", {"chat_id": 42, "text": "Your order has shipped"}))
    others = enqueue(*((f"chat-{n}", {"chat_id": n, "text": "hello"}) for n in range(5)))
    operator = make_user(change=True)
    relay = ob.build_relay(bus, using=default_alias, poll_interval=0.05)
    context = browser.new_context(viewport={"width": 1280, "height": 640})
    context.set_default_timeout(TIMEOUT_MS)
    try:
        with relay:
            wait_until(lambda: statuses(store)[row_id] == "dead")
            wait_until(lambda: all(statuses(store)[i] == "sent" for i in others))
            page = context.new_page()
            page.goto(f"{live_server}/admin/login/?next={CHANGELIST}")
            page.fill("#id_username", operator.username)
            page.fill("#id_password", "secret")
            page.click("input[type=submit]")
            page.wait_for_url(f"**{CHANGELIST}")
            page.evaluate("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
            page.reload()
            assert page.locator("#result_list tbody tr").count() == 6
            screenshot(page, "admin-rows.png", tmp_path)
            page.click("#changelist-filter >> text=dead")
            page.wait_for_url("**status__exact=dead**")
            assert page.locator("#result_list tbody tr").count() == 1
            page.click(f'#result_list a[href*="/{row_id}/change/"]')
            payload = page.inner_text(".outbox-payload")
            assert '"text": "Your order has shipped"' in payload
            assert "403 Forbidden: bot was blocked by the user" in page.inner_text(
                ".field-full_error"
            )
            screenshot(page, "admin-row.png", tmp_path, full_page=True)
            page.click("button.outbox-retry")
            page.wait_for_selector("text=1 row is pending again.")
            wait_until(lambda: statuses(store)[row_id] == "sent")
            page.reload()
            assert page.inner_text(".field-status_badge .readonly") == "sent"
    finally:
        context.close()
        operator.delete()
        # Django keeps this test's connections apart from the thread's (it
        # sees Playwright's event loop): close them here, or the test
        # database could not be dropped.
        connections.close_all()
    assert attempts[row_id] == 2
    assert all(attempts[i] == 1 for i in others)
