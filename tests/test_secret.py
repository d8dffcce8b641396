"""A password in a malformed connection string never reaches an error message."""

from __future__ import annotations

import pytest

from outbound._secret import driver_error, mask_password

pytest.importorskip("psycopg")

from outbound.outbox import PostgresStore
from outbound.ratelimit import PostgresRateLimiter, RateLimits

MALFORMED = [
    # libpq quotes the piece it cannot read, which is the password here.
    ("postgresql://app:50%off@db/app", "50%off"),
    ("postgresql://app:se cret@db/app", "se cret"),
    ("postgresql://app@db/app?password=50%off", "50%off"),
    ("postgresql://app@db/app?sslmode=require&password=se cret", "se cret"),
    ("host=db password='hunter2x", "hunter2x"),
]


@pytest.mark.parametrize(("conninfo", "password"), MALFORMED)
def test_a_store_refuses_a_malformed_conninfo_without_its_password(
    conninfo: str, password: str
) -> None:
    with pytest.raises(ValueError, match="conninfo is not a valid PostgreSQL") as refused:
        PostgresStore(conninfo)
    assert password not in str(refused.value)


@pytest.mark.parametrize(("conninfo", "password"), MALFORMED)
def test_a_shared_limiter_refuses_a_malformed_conninfo_without_its_password(
    conninfo: str, password: str
) -> None:
    with pytest.raises(ValueError, match="not a PostgreSQL connection string") as refused:
        PostgresRateLimiter(conninfo, RateLimits())
    assert password not in str(refused.value)


def test_what_is_not_a_password_stays_readable() -> None:
    conninfo = "postgresql://app:pw@db/app?sslmode=bogus"
    message = 'invalid sslmode value: "bogus"'
    assert driver_error(message, conninfo) == message
    # A short password is masked where quoted, not wherever its letters are.
    assert driver_error('bad token "pw" in app', conninfo) == 'bad token "***" in app'
    assert driver_error("a password was given", "postgresql://u:a@db/") == "a password was given"


def test_a_quoted_piece_of_a_password_or_one_holding_it_is_masked() -> None:
    conninfo = "postgresql://app:top%zzsecret@db/app"
    assert "zz" not in driver_error('invalid token: "%zz"', conninfo)
    assert "secret" not in driver_error('in "app:top%zzsecret@db"', conninfo)
    assert "top%zzsecret" not in driver_error("unquoted top%zzsecret here", conninfo)


def test_mask_password_covers_urls_and_keywords() -> None:
    assert mask_password("postgresql://u:p4ss@h/db") == "postgresql://u:***@h/db"
    assert mask_password("host=h password='a b' port=1") == "host=h password=*** port=1"


def test_a_password_holding_an_unencoded_at_sign_is_masked_whole() -> None:
    # libpq ends the user part at the first "@", takes the rest of the password
    # for the host, and quotes it: "failed to resolve host '2-SECRET-TAIL@db'".
    conninfo = "postgresql://app:hunter@2-SECRET-TAIL@db/app"
    assert mask_password(conninfo) == "postgresql://app:***@db/app"
    said = driver_error("failed to resolve host '2-SECRET-TAIL@db': unknown", conninfo)
    assert "SECRET" not in said, said
    # Not past the authority, nor into the text around it.
    text = "postgresql://u:p@h/db?x=a@b failed; write to admin@example.com"
    assert mask_password(text) == "postgresql://u:***@h/db?x=a@b failed; write to admin@example.com"
