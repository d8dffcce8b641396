"""An operator command over many rows that fails at one says how far it got.

``cancel``, ``dead_letter`` and ``retry_dead`` write one transaction per row
and stop at the first row that fails; the rows before it stay changed. The
error named neither the row nor how many were done, so a second run reported
those rows as "not of a pending or processing row".
"""

from __future__ import annotations

import psycopg
import pytest

from outbound.errors import StoreError
from outbound.outbox import PostgresStore, postgres

from .conftest import POSTGRES_URL, enqueue_keys, unique_table

pytestmark = pytest.mark.skipif(not POSTGRES_URL, reason="OUTBOUND_TEST_POSTGRES is not set")


@pytest.mark.parametrize("dead_letter", [False, True], ids=["cancel", "dead_letter"])
def test_a_failure_names_the_row_and_what_was_done(
    monkeypatch: pytest.MonkeyPatch, dead_letter: bool
) -> None:
    assert POSTGRES_URL
    monkeypatch.setattr(postgres, "_ADMIN_LOCK_TIMEOUT", 0.2)
    store = PostgresStore(POSTGRES_URL, table=unique_table())
    try:
        first, second, third = enqueue_keys(store, "a", "b", "c")
        with psycopg.connect(POSTGRES_URL) as holder:  # a transaction holding the second row
            holder.execute(f"SELECT 1 FROM {store.table} WHERE id = %s FOR UPDATE", (second,))
            close = store.dead_letter if dead_letter else store.cancel
            with pytest.raises(StoreError) as caught:
                close([first, second, third])
            holder.rollback()
        verb = "dead-lettered" if dead_letter else "cancelled"
        message = str(caught.value)
        assert message.startswith(f"row {second}: "), message
        assert f"(1 of the 1 rows before it {verb}; 1 after it not tried)" in message
        status = {r.id: r.status for r in store.rows()}
        assert status == {
            first: "dead" if dead_letter else "cancelled",
            second: "pending",
            third: "pending",
        }
    finally:
        store.close()
        store.drop_schema()
