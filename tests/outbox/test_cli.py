"""``python -m outbound outbox ...`` on both stores."""

from __future__ import annotations

import pytest
from conftest import POSTGRES_URL, StoreFactory, app_connection

from outbound.outbox import SQLiteStore, Store
from outbound.outbox._base import Outcome
from outbound.outbox.cli import main


def db_url(store: Store) -> str:
    if isinstance(store, SQLiteStore):
        return f"sqlite:///{store.path}"
    assert POSTGRES_URL
    return POSTGRES_URL


def test_status_list_retry_purge(
    make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    conn = app_connection(store)
    for key in ("a", "b", "c"):
        store.enqueue(conn, key=key, type="greet", payload={"k": key})
    conn.commit()
    conn.close()
    session = store.session()
    claimed = session.claim("me", 2, 30.0, None)
    session.finish(
        "me",
        [
            Outcome(claimed[0].message.id, claimed[0].claims, "a", "dead", error="Boom: no"),
            Outcome(claimed[1].message.id, claimed[1].claims, "b", "sent"),
        ],
    )
    session.close()
    base = ["outbox", "--db", db_url(store), "--table", store.table]

    assert main([*base, "status"]) == 0
    out = capsys.readouterr().out
    for line in ("pending     1", "dead        1", "sent        1", "oldest pending:", "s ago"):
        assert line in out

    assert main([*base, "list", "--status", "dead"]) == 0
    out = capsys.readouterr().out
    assert "Boom: no" in out
    assert "a / greet" in out

    assert main([*base, "retry"]) == 2  # neither ids nor --all
    assert main([*base, "retry", "--all"]) == 0
    assert "1 dead rows are pending again" in capsys.readouterr().out
    assert store.status().counts["pending"] == 2

    assert main([*base, "purge", "--status", "sent"]) == 0
    assert "1 rows deleted" in capsys.readouterr().out
    assert store.status().counts["sent"] == 0


def test_a_missing_table_is_a_clear_error(
    make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    assert main(["outbox", "--db", db_url(store), "--table", "no_such_table", "status"]) == 1
    assert "no_such_table" in capsys.readouterr().err


def test_bad_table_name_is_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    assert main(["outbox", "--db", f"{tmp_path}/x.db", "--table", "Bad-Name", "status"]) == 2
    assert "table" in capsys.readouterr().err
