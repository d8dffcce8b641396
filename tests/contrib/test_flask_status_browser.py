"""The Flask status blueprint's page in a real headless Chromium, when the app stops
letting it through: a session that ended (the app redirects to its login page),
rights taken away (403), or an answer that is some other page.

The page swapped in the login page's ``<main>`` as if it were its own (its
counts gone, the stale banner hidden, a login form its own policy would not
let submit); it goes where a redirect sends it now, and says so for the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_helpers import TIMEOUT_MS
from browser_helpers import browser as _browser

from outbound.outbox import SQLiteStore

flask = pytest.importorskip("flask")
pytest.importorskip("playwright", reason="Playwright is not installed: pip install '.[test]'")

from playwright.sync_api import expect  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

from outbound.contrib.flask_status import status_blueprint  # noqa: E402

LOGIN = (
    "<!doctype html><html><head><title>Log in</title></head><body>"
    '<main id="content"><form method="post"><input name="user"></form></main></body></html>'
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from _browser()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The app on a loopback port, and what its ``authorize`` answers ("who")."""
    store = SQLiteStore(tmp_path / "outbox.db")
    conn = store.connect()
    with conn:
        store.enqueue(conn, key="k", type="t", payload={})
    conn.close()
    state: dict[str, Any] = {"who": "admin"}
    app = flask.Flask("ops")

    def authorize() -> Any:
        who = state["who"]
        if who is None:
            return flask.redirect("/login?next=/ops/outbox/")
        if who == "elsewhere":  # a single sign-on's page, on another origin
            port = flask.request.host.rpartition(":")[2]
            return flask.redirect(f"http://localhost:{port}/login?next=/ops/outbox/")
        if who == "other page":
            return flask.Response(LOGIN)  # a proxy's or an app's page, 200
        return who == "admin"

    app.add_url_rule("/login", "login", lambda: LOGIN)

    app.register_blueprint(
        status_blueprint(store, authorize=authorize, refresh=0.3), url_prefix="/ops/outbox"
    )
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/ops/outbox/", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        store.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


def _loaded(page: Any, url: str) -> None:
    page.goto(url)
    expect(page.locator('[data-count="pending"]')).to_have_text("1")


@pytest.mark.parametrize("where", [None, "elsewhere"], ids=["same-origin", "another-origin"])
def test_a_session_that_ended_takes_the_page_to_the_login_page(
    page: Any, served: tuple[str, dict[str, Any]], where: str | None
) -> None:
    # (Another origin's login page: the fetch, which followed the redirect,
    # failed on it, and the page said "cannot be reached" for good.)
    url, state = served
    _loaded(page, url)
    state["who"] = where
    page.wait_for_url(lambda address: "/login?next=" in address, timeout=TIMEOUT_MS)
    if where == "elsewhere":
        assert page.url.startswith("http://localhost:")
    expect(page).to_have_title("Log in")
    expect(page.locator("form input")).to_be_visible()


@pytest.mark.parametrize(("who", "said"), [("guest", "HTTP 403"), ("other page", "not this page")])
def test_an_answer_that_is_not_the_page_keeps_what_it_showed_and_says_so(
    page: Any, served: tuple[str, dict[str, Any]], who: str, said: str
) -> None:
    url, state = served
    _loaded(page, url)
    title = page.title()
    state["who"] = who
    expect(page.locator("#stale")).to_be_visible()
    expect(page.locator("#stale")).to_contain_text(said)
    expect(page.locator('[data-count="pending"]')).to_have_text("1")
    assert page.title() == title
    assert page.locator("form").count() == 0
    state["who"] = "admin"  # let through again: the page goes on
    expect(page.locator("#stale")).to_be_hidden()
