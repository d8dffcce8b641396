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
from django.db import connections
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
