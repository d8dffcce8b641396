"""``purge(older_than=...)`` past any row's age deletes nothing, on every store.

SQLite computed the cut-off in Python floats and deleted nothing; PostgreSQL
computed it in SQL and failed with "timestamp out of range" (1e12 s) or
"interval out of range" (1e300 s): the command line said a database error.
"""

from __future__ import annotations

import pytest

from outbound.outbox import Store

from .conftest import enqueue_keys


@pytest.mark.parametrize("older_than", [1e10, 1e12, 1e300])
def test_purge_older_than_past_any_row_deletes_nothing(store: Store, older_than: float) -> None:
    (row_id,) = enqueue_keys(store, "k")
    store.cancel([row_id])
    assert store.purge(statuses=["cancelled"], older_than=older_than) == 0
    assert [r.id for r in store.rows()] == [row_id]
    assert store.purge(statuses=["cancelled"], older_than=0) == 1
