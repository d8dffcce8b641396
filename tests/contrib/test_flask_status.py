"""The status page as a Flask blueprint, behind the app's own authorization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

flask = pytest.importorskip("flask", reason="Flask is not installed: pip install '.[flask]'")

from outbound.contrib.flask import Outbound  # noqa: E402
from outbound.contrib.flask_status import status_blueprint  # noqa: E402
from outbound.outbox import SQLiteStore  # noqa: E402

TIMEOUT = 10.0


def enqueue(store: SQLiteStore, *keys: str) -> None:
    conn = store.connect()
    try:
        for key in keys:
            store.enqueue(conn, key=key, type="greet", payload={})
        conn.commit()
    finally:
        conn.close()


def test_blueprint_serves_the_page_behind_the_apps_authorization(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "outbox.db")
    enqueue(store, "a", "b")
    app = flask.Flask("ops")
    app.secret_key = "test"

    def authorize() -> Any:
        who = flask.request.headers.get("X-User")
        if who is None:
            return flask.redirect("/login")
        return who == "admin"

    app.register_blueprint(
        status_blueprint(store, authorize=authorize, refresh=5), url_prefix="/ops/outbox"
    )
    gone = SQLiteStore(tmp_path / "gone.db")
    (tmp_path / "gone.db").unlink()
    app.register_blueprint(status_blueprint(gone, authorize=None, name="gone"), url_prefix="/gone")
    client = app.test_client()
    assert client.get("/ops/outbox/").status_code == 302  # to the app's login
    assert client.get("/ops/outbox/status.json").status_code == 302
    assert client.get("/ops/outbox/", headers={"X-User": "guest"}).status_code == 403
    page = client.get("/ops/outbox/", headers={"X-User": "admin"})
    assert page.status_code == 200
    assert page.headers["Content-Security-Policy"].startswith("default-src 'none'")
    text = page.get_data(as_text=True)
    assert 'data-count="pending">2<' in text
    assert 'href="/ops/outbox/status.json"' in text
    assert 'data-refresh="5"' in text
    data = json.loads(client.get("/ops/outbox/status.json", headers={"X-User": "admin"}).data)
    assert data["counts"]["pending"] == 2
    assert data["outbox"]["database"] == f"SQLite {store.path}"
    # A database that cannot be read: the page says so (503), the app goes on.
    down = client.get("/gone/")
    assert down.status_code == 503
    assert "The outbox cannot be read" in down.get_data(as_text=True)
    down = client.get("/gone/status.json")
    assert down.status_code == 503
    assert "cannot open" in json.loads(down.data)["error"]


def test_blueprint_arguments_are_checked(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "outbox.db")
    with pytest.raises(TypeError, match="authorize"):
        status_blueprint(store, authorize="admin")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="store"):
        status_blueprint("outbox.db", authorize=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="refresh"):
        status_blueprint(store, authorize=None, refresh=-1)
    with pytest.raises(TypeError):
        status_blueprint(store)  # type: ignore[call-arg]  # authorize is required


def test_the_extensions_blueprint_reads_the_apps_outbox(tmp_path: Path) -> None:
    fsa = pytest.importorskip("flask_sqlalchemy")
    db = fsa.SQLAlchemy()
    app = flask.Flask("shop")
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'app.db'}"
    db.init_app(app)
    ext = Outbound(app)
    app.register_blueprint(ext.status_blueprint(authorize=lambda: True), url_prefix="/outbox")
    try:
        with app.app_context():
            ext.create_outbox()
            ext.enqueue(key="chat-1", type="greet", payload={"text": "hi"})
            db.session.commit()
        client = app.test_client()
        page = client.get("/outbox/")
        assert page.status_code == 200
        assert 'data-count="pending">1<' in page.get_data(as_text=True)
        assert json.loads(client.get("/outbox/status.json").data)["unfinished"] == 1
        with app.app_context():
            db.engine.dispose()
    finally:
        assert ext.shutdown(TIMEOUT, app=app)


@pytest.mark.parametrize(
    ("verdict", "status"),
    [("", 403), ([], 403), (None, 403), (0, 403), (0.0, 403), (1, 200), (2.5, 200)],
)
def test_an_authorize_returning_neither_a_bool_nor_a_response_is_taken_by_its_truth(
    tmp_path: Path, verdict: Any, status: int
) -> None:
    # "" and [] were sent as the (empty) answer, 200; 1 (an integer
    # is_admin column, as the README's `... and current_user.is_admin`
    # returns it) was a 500 even for admins. A false value refuses; a
    # number counts by its truth.
    store = SQLiteStore(tmp_path / "outbox.db")
    enqueue(store, "a")
    app = flask.Flask("ops")
    app.register_blueprint(status_blueprint(store, authorize=lambda: verdict), url_prefix="/ops")
    client = app.test_client()
    for path in ("/ops/", "/ops/status.json"):
        answer = client.get(path)
        assert answer.status_code == status
        assert (b"pending" in answer.data) is (status == 200)
