"""The status page in a real headless Chromium, against an outbox a relay is delivering.

The page is loaded once and never reloaded by the test: everything that
changes on it changed through its own refreshes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_helpers import TIMEOUT_MS, screenshot
from browser_helpers import browser as _browser

from outbound.errors import PermanentSendError
from outbound.outbox import (
    MAX_KEY_BYTES,
    EventBus,
    OutboxMessage,
    PostgresStore,
    Relay,
    RetryPolicy,
    SQLiteStore,
    Store,
)
from outbound.outbox.web import StatusMonitor, StatusServer

from .conftest import POSTGRES_URL, app_connection, unique_table

pytest.importorskip("playwright", reason="Playwright is not installed: pip install '.[test]'")

from playwright.sync_api import expect

# Longer runs (more rows, a slower relay) when making the README's screenshots.
SCREENSHOTS = bool(os.environ.get("OUTBOUND_SCREENSHOTS"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from _browser()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture(params=["sqlite", "postgres"])
def outbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    store: Store
    if request.param == "postgres":
        if not POSTGRES_URL:
            pytest.skip("OUTBOUND_TEST_POSTGRES is not set: no PostgreSQL server to test against")
        store = PostgresStore(POSTGRES_URL, table=unique_table())
    else:
        store = SQLiteStore(tmp_path / "outbox.db", table="outbox")
    try:
        yield store
    finally:
        store.close()
        if isinstance(store, PostgresStore):
            store.drop_schema()


def count(page: Any, status: str) -> Any:
    return page.locator(f'[data-count="{status}"]')


def test_the_page_follows_an_outbox_being_relayed(page: Any, outbox: Store, tmp_path: Path) -> None:
    release = threading.Event()  # lets the held row finish
    delivered: list[int] = []  # list.append is thread-safe

    def deliver(message: OutboxMessage) -> None:
        payload = message.payload
        if payload.get("hold"):
            release.wait(30)
        elif payload.get("dead"):
            raise PermanentSendError("403 Forbidden: bot was blocked by the user")
        elif payload.get("flaky"):
            raise RuntimeError("502 Bad Gateway from the platform")
        elif SCREENSHOTS:
            release.wait(0.05 + 0.05 * (message.id % 4))  # a rate that moves
        delivered.append(message.id)

    chats = 40 if SCREENSHOTS else 8
    per_chat = 60 if SCREENSHOTS else 5
    messages = [
        {"key": f"chat-{c}", "type": "reply", "payload": {"text": f"hello {n}"}}
        for n in range(per_chat)
        for c in range(chats)
    ]
    messages += [
        {"key": "chat-77", "type": "reply", "payload": {"dead": True}},
        {"key": "chat-502", "type": "reply", "payload": {"flaky": True}},
        {"key": "chat-502", "type": "reply", "payload": {"text": "waits behind"}},
        {"key": "chat-502", "type": "reply", "payload": {"text": "waits too"}},
        {"key": "chat-slow", "type": "reply", "payload": {"hold": True}},
    ]
    conn = app_connection(outbox)
    try:
        outbox.enqueue_many(conn, messages)
        conn.commit()
    finally:
        conn.close()
    total = chats * per_chat
    # A window longer than the test may take (pytest's timeout), so that
    # every row sent during it is in the chart, however slow the machine.
    monitor = StatusMonitor(
        outbox, window=120 if SCREENSHOTS else 300, bucket=2 if SCREENSHOTS else 10, min_interval=0
    )
    bus = EventBus()
    bus.subscribe("reply", deliver)
    relay = Relay(
        outbox,
        bus,
        max_inflight=8,
        max_concurrency=6,
        poll_interval=0.02,
        retry=RetryPolicy(max_attempts=5, base_delay=300.0, max_delay=300.0, max_total=3600.0),
        name="web-test",
    )
    with StatusServer(monitor, port=0, refresh=0.3) as server:
        page.goto(server.url)
        expect(count(page, "pending")).to_have_text(f"{total + 5:,}")
        expect(count(page, "sent")).to_have_text("0")
        expect(page.locator("#sent-chart")).to_contain_text("nothing sent")
        with relay.start():
            try:
                # Everything that can go out goes out, and the page follows.
                expect(count(page, "sent")).to_have_text(
                    f"{total:,}", timeout=TIMEOUT_MS * (8 if SCREENSHOTS else 1)
                )
                expect(count(page, "dead")).to_have_text("1")
                dead = page.locator("#dead tbody tr")
                expect(dead).to_have_count(1)
                expect(dead).to_contain_text("chat-77")
                expect(dead.locator("td.error")).to_have_text(
                    "PermanentSendError: 403 Forbidden: bot was blocked by the user"
                )
                blocked = page.locator('#blocked tr[data-key="chat-502"]')
                expect(blocked).to_contain_text("502 Bad Gateway from the platform")
                expect(blocked.locator("td").nth(1)).to_have_text("2")  # rows waiting
                expect(blocked).to_contain_text("next try in")
                relay_row = page.locator(f'#relays tr[data-owner="{relay.owner}"]')
                expect(relay_row.locator("td").nth(1)).to_have_text("1")  # the held row
                expect(page.locator("#capacity h2")).to_contain_text("1 of 6 in use")
                expect(page.locator("#rate-now")).to_be_visible()
                # The chart: one bar per bucket, their counts adding up to what was sent.
                bars = page.locator("#sent-chart rect.bar")
                expect(bars).to_have_count(60 if SCREENSHOTS else 30)
                # The counts and the chart come from separate queries of one
                # refresh: the chart may show the refresh before the counts'.
                sent_in_bars = (
                    "() => [...document.querySelectorAll('#sent-chart rect.bar')]"
                    ".reduce((n, bar) => n + Number(bar.dataset.sent), 0)"
                )
                page.wait_for_function(f"() => ({sent_in_bars})() === {total}", timeout=TIMEOUT_MS)
                assert page.evaluate(sent_in_bars) == total
                tallest = page.evaluate(
                    "() => Math.max(...[...document.querySelectorAll('#sent-chart rect.bar')]"
                    ".map(bar => bar.getBBox().height))"
                )
                assert tallest > 10  # drawn, in pixels of the chart
                assert len(delivered) == total
                shot = screenshot(page, "status-page.png", tmp_path, full_page=True)
                assert shot.stat().st_size < 400_000
            finally:
                release.set()
        # The page reads counts and leases in separate queries: wait for both.
        expect(relay_row).to_contain_text("holds nothing")
        expect(count(page, "sent")).to_have_text(f"{total + 1:,}")
    # The server is gone: the page says so, and keeps what it showed.
    expect(page.locator("#stale")).to_be_visible()
    expect(page.locator("#stale")).to_contain_text("cannot be reached")
    expect(count(page, "sent")).to_have_text(f"{total + 1:,}")


def test_long_keys_wrap_and_the_page_stays_within_the_window(page: Any, tmp_path: Path) -> None:
    # A key has up to 1024 bytes, often without a space (a URL): in a cell
    # that could not break, the dead and blocked tables grew thousands of
    # pixels wide, past their cards and the window, with the columns saying
    # why (attempt, why, last error) off screen.
    store = SQLiteStore(tmp_path / "outbox.db", table="outbox")
    long_key = "https://example.com/" + "x" * (MAX_KEY_BYTES - 20)
    conn = store.connect()
    try:
        with conn:
            for key in (long_key, "short", long_key, "d" * MAX_KEY_BYTES):
                store.enqueue(conn, key=key, type="t" * 200, payload={})
            conn.execute(
                "UPDATE outbox SET attempts = 1, last_error = 'later', available_at = "
                "strftime('%s', 'now') + 3600 WHERE id = 1"
            )
            conn.execute(
                "UPDATE outbox SET status = 'dead', head = 0, last_error = 'boom' WHERE id = 4"
            )
            conn.execute("UPDATE outbox_counts SET unfinished = unfinished - 1")
    finally:
        conn.close()
    try:
        with StatusServer(StatusMonitor(store, min_interval=0), port=0, refresh=0) as server:
            page.goto(server.url)
            expect(page.locator("#blocked tbody tr")).to_have_count(1)
            expect(page.locator("#dead tbody tr")).to_have_count(1)
            sizes = page.evaluate(
                """() => {
                  const right = (selector) => document.querySelector(selector)
                    .getBoundingClientRect().right;
                  return {
                    page: document.documentElement.scrollWidth,
                    window: document.documentElement.clientWidth,
                    blockedCard: right('#blocked'), blockedTable: right('#blocked table'),
                    blockedError: right('#blocked td.error'),
                    deadCard: right('#dead'), deadTable: right('#dead table'),
                    deadError: right('#dead td.error'),
                  };
                }"""
            )
    finally:
        store.close()
    assert sizes["page"] <= sizes["window"], sizes
    assert sizes["blockedTable"] <= sizes["blockedCard"], sizes
    assert sizes["blockedError"] <= sizes["window"], sizes
    assert sizes["deadTable"] <= sizes["deadCard"], sizes
    assert sizes["deadError"] <= sizes["window"], sizes
