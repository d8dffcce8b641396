"""``python -m outbound outbox status|list|retry|purge --db URL``: look at and repair an outbox.

``--db`` is a SQLite file (a path, ``sqlite:///relative.db`` or
``sqlite:////absolute.db``) or a ``postgresql://`` URL; ``--table`` the
outbox table (default ``outbox``). Exit status: 0 done, 1 database error,
2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from outbound.errors import OutboxError

from ._base import STATUSES, Store
from .postgres import PostgresStore
from .sqlite import SQLiteStore

__all__ = ["add_parser", "main", "open_store"]


def open_store(url: str, table: str = "outbox", **options: Any) -> Store:
    """The store a ``--db`` value names, without creating its schema."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresStore(url, table=table, create=False, **options)
    if url.startswith("sqlite:///"):
        url = url[len("sqlite:///") :]
    elif url.startswith("sqlite:"):
        url = url[len("sqlite:") :]
    return SQLiteStore(url, table=table, create=False, **options)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``outbox`` command to an ``argparse`` sub-parser collection."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "outbox",
        help="inspect and repair a durable outbox",
        description="Inspect and repair a durable outbox.",
    )
    parser.add_argument("--db", required=True, help="SQLite file or postgresql:// URL")
    parser.add_argument("--table", default="outbox", help="outbox table (default: outbox)")
    commands = parser.add_subparsers(dest="outbox_command", required=True, metavar="COMMAND")
    commands.add_parser("status", help="counts by status and the oldest pending row's age")
    listing = commands.add_parser("list", help="list rows, newest first")
    listing.add_argument("--status", choices=STATUSES, default=None)
    listing.add_argument("--limit", type=int, default=20)
    retry = commands.add_parser("retry", help="make dead rows pending again")
    retry.add_argument("ids", nargs="*", type=int, help="row ids (or --all)")
    retry.add_argument("--all", action="store_true", help="every dead row")
    purge = commands.add_parser("purge", help="delete finished rows")
    purge.add_argument("--status", choices=("sent", "dead"), action="append", default=None)
    purge.add_argument(
        "--older-than", type=float, default=0.0, metavar="SECONDS", help="default: 0"
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a parsed ``outbox`` command; return the exit status."""
    out = out if out is not None else sys.stdout
    try:
        store = open_store(args.db, args.table)
    except ValueError as exc:
        print(f"outbox: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(store, args, out)
    except OutboxError as exc:
        print(f"outbox: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"outbox: {exc}", file=sys.stderr)
        return 2
    finally:
        store.close()


def _run(store: Store, args: argparse.Namespace, out: TextIO) -> int:
    command = args.outbox_command
    if command == "status":
        status = store.status()
        for name in STATUSES:
            print(f"{name:<11} {status.counts.get(name, 0)}", file=out)
        age = status.oldest_pending_age
        print(f"oldest pending: {'-' if age is None else f'{age:.1f}s ago'}", file=out)
    elif command == "list":
        now = time.time()
        rows = store.rows(status=args.status, limit=args.limit)
        print(f"{'id':>8}  {'status':<10} {'att':>3} {'age':>8}  key / type / last error", file=out)
        for row in rows:
            error = f"  {row.last_error}" if row.last_error else ""
            print(
                f"{row.id:>8}  {row.status:<10} {row.attempts:>3} {now - row.created_at:>7.1f}s"
                f"  {row.key} / {row.type}{error}",
                file=out,
            )
    elif command == "retry":
        if bool(args.ids) == bool(args.all):
            print("outbox retry: give row ids or --all (not both)", file=sys.stderr)
            return 2
        count = store.retry_dead(None if args.all else args.ids)
        print(f"{count} dead rows are pending again", file=out)
    elif command == "purge":
        count = store.purge(statuses=args.status or ["sent"], older_than=args.older_than)
        print(f"{count} rows deleted", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m outbound outbox ...`` on its own: parse ``argv`` and run."""
    parser = argparse.ArgumentParser(prog="python -m outbound")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))
