"""``python -m outbound outbox [--db URL] COMMAND [--db URL]``: look at and repair an outbox.

``--db`` is a SQLite file (a path, ``sqlite:///relative.db`` or
``sqlite:////absolute.db``) or a ``postgresql://`` URL; ``--table`` the
outbox table (default ``outbox``). Both may come before or after the
command. Inspecting never creates anything: a missing file or table is an
error. Exit status: 0 done, 1 it could not be done (the database failed, or
lacks the outbox, or the driver is missing, or some of the ids given to
``retry`` or ``cancel`` were not of a row it applies to), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO, cast

from outbound._log import printable
from outbound._secret import mask_password
from outbound.errors import OutboxError

from ._base import FINISHED, SCHEMA_VERSION, STATUSES, RowInfo, Store
from .postgres import PostgresStore
from .sqlite import SQLiteStore

__all__ = ["add_parser", "database_of", "main", "mask_password", "open_store", "quiet_broken_pipe"]

_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*):")
# A libpq key=value connection string ("host=db dbname=app ..."), not a file.
_KEYWORDS = re.compile(
    r"\s*(host|hostaddr|port|dbname|user|password|sslmode|service|options)\s*=", re.IGNORECASE
)
#: Seconds the command line waits for a PostgreSQL connection.
_CONNECT_TIMEOUT = 5.0

_DB_HELP = (
    "the outbox database: a SQLite file (a path, sqlite:///relative.db, sqlite:////absolute.db) "
    "or a postgresql:// URL; may come before or after the command"
)
_TABLE_HELP = "the outbox table (default: outbox); may come before or after the command"


def quiet_broken_pipe() -> None:
    """Standard output's reader went away (``... | head``): stop writing there, quietly.

    Points the stdout file descriptor at ``os.devnull``, so that the flush
    at interpreter exit does not fail again. Call it from an ``except
    BrokenPipeError`` in the main thread, then exit with status 141 (what a
    shell reports for a process ended by SIGPIPE).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a file (replaced, closed, None)
        pass


#: The exit status after the reader of standard output went away.
BROKEN_PIPE_STATUS = 141


class UsageError(ValueError):
    """A ``--db`` value the command line cannot use."""


def database_of(url: str) -> tuple[str, str]:
    """What a ``--db`` value names: ``("postgresql", url)`` or ``("sqlite", path)``.

    One reading for every command that takes ``--db`` (the demo too), so a
    value one accepts names the same database in the others. Raises
    :class:`UsageError` (a ``ValueError``) for an empty value, an
    unsupported scheme or a libpq key=value string.
    """
    if not isinstance(url, str) or not url.strip():
        raise UsageError("--db must name a SQLite file or a postgresql:// URL")
    match = _SCHEME.match(url)
    # A one-letter "scheme" is a Windows drive ("C:\\x.db").
    scheme = match.group(1).lower() if match and len(match.group(1)) > 1 else None
    if scheme in ("postgresql", "postgres"):
        return "postgresql", url
    if scheme == "sqlite":
        path = url[len("sqlite:") :]
        if path.startswith("///"):
            path = path[3:]
        elif path.startswith("//"):
            raise UsageError(
                f"a SQLite URL is sqlite:///relative/path or sqlite:////absolute/path, not {url!r}"
            )
        return "sqlite", path
    if scheme is None and _KEYWORDS.match(url):
        raise UsageError(
            "--db takes a postgresql:// URL (or a SQLite file), "
            "not a libpq key=value connection string"
        )
    if scheme is not None and url[match.end() if match else 0 :].startswith("//"):
        raise UsageError(
            f"unsupported database URL scheme {scheme!r}: the outbox runs on SQLite "
            "(a file path or sqlite:///path) and PostgreSQL (postgresql://...)"
        )
    return "sqlite", url


def open_store(url: str, table: str = "outbox", **options: Any) -> Store:
    """The store a ``--db`` value names, without creating its schema (or, on SQLite, its file).

    Raises :class:`UsageError` (a ``ValueError``) for an empty value or an
    unsupported scheme, ``ValueError`` for a malformed PostgreSQL URL or
    table name, ``ImportError`` when psycopg is missing.
    """
    kind, where = database_of(url)
    if kind == "postgresql":
        options.setdefault("connect_timeout", _CONNECT_TIMEOUT)
        return PostgresStore(where, table=table, create=False, **options)
    return SQLiteStore(where, table=table, create=False, **options)


def _global_options(parser: argparse.ArgumentParser, *, here: bool) -> None:
    """``--db`` and ``--table``; after the command they only override what was given before."""
    default = None if here else argparse.SUPPRESS
    parser.add_argument("--db", default=default, metavar="URL", help=_DB_HELP)
    parser.add_argument(
        "--table",
        default="outbox" if here else argparse.SUPPRESS,
        metavar="NAME",
        help=_TABLE_HELP,
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``outbox`` command to an ``argparse`` sub-parser collection."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "outbox",
        help="inspect and repair a durable outbox",
        description="Inspect and repair a durable outbox. Exit status: 0 done, 1 it could "
        "not be done (database error, no outbox there, driver missing), 2 bad usage.",
    )
    _global_options(parser, here=True)
    commands = parser.add_subparsers(dest="outbox_command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = commands.add_parser(name, help=help, description=help)
        _global_options(sub, here=False)
        return sub

    command("status", "counts by status, the oldest pending row, relays and their leases")
    listing = command("list", "list rows, newest first")
    listing.add_argument(
        "--status",
        choices=STATUSES,
        default=None,
        help="only rows of this status (default: every status)",
    )
    listing.add_argument("--key", default=None, help="only rows of this key (default: every key)")
    listing.add_argument(
        "--limit", type=int, default=20, metavar="N", help="at most N rows (default: 20)"
    )
    blocked = command(
        "blocked",
        "keys whose next row cannot go out now (backing off, running, or held by a dead "
        "relay), with that row",
    )
    blocked.add_argument(
        "--limit", type=int, default=20, metavar="N", help="at most N keys (default: 20)"
    )
    retry = command("retry", "make dead rows pending again, each at the back of its key")
    retry.add_argument("ids", nargs="*", type=int, metavar="ID", help="row ids (or --all)")
    retry.add_argument("--all", action="store_true", help="every dead row")
    cancel = command(
        "cancel",
        "cancel pending or processing rows so that they are never delivered; the next row of "
        "each key moves up",
    )
    cancel.add_argument("ids", nargs="+", type=int, metavar="ID", help="row ids")
    cancel.add_argument(
        "--dead-letter",
        action="store_true",
        help="mark them dead instead (to inspect, then retry or purge)",
    )
    cancel.add_argument("--reason", default=None, help="recorded as the rows' last error")
    purge = command("purge", "delete finished rows")
    purge.add_argument(
        "--status",
        choices=FINISHED,
        action="append",
        default=None,
        help="status of the rows to delete; repeat for several (default: sent)",
    )
    purge.add_argument(
        "--older-than",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="only rows last updated more than SECONDS ago (default: 0, every one)",
    )
    command("migrate", "create the outbox's tables, or upgrade them to this version's schema")
    serve = command(
        "serve",
        "serve a read-only status page that refreshes itself (its data as JSON at "
        "/status.json) until Ctrl-C",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default: 127.0.0.1; the page has no login, so listen "
        "elsewhere only on a trusted network)",
    )
    serve.add_argument(
        "--port", default="8321", metavar="N", help="the port (default: 8321; 0: any free one)"
    )
    serve.add_argument(
        "--refresh",
        default="2",
        metavar="SECONDS",
        help="seconds between the page's own refreshes (default: 2; 0: never)",
    )
    parser.set_defaults(func=run)
    return parser


def _line(exc: BaseException) -> str:
    """An error message on one line, without a password."""
    return mask_password(" ".join(str(exc).split()))


def _fail(message: str, status: int) -> int:
    print(f"outbox: {mask_password(message)}", file=sys.stderr)
    return status


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a parsed ``outbox`` command; return the exit status.

    When the reader of standard output goes away (``... | head -1``), the
    command stops quietly with status 141, like standard Unix tools.
    """
    if out is not None:
        return _command(args, out)
    stdout = _Output(sys.stdout)
    try:
        status = _command(args, cast(TextIO, stdout))
        stdout.flush()  # a pipe closed early fails here, not at interpreter exit
    except BrokenPipeError:
        quiet_broken_pipe()
        return BROKEN_PIPE_STATUS
    except _CannotWrite as exc:
        # What the command changed stays changed; only its report is lost.
        quiet_broken_pipe()
        return _fail(f"cannot write to standard output: {exc}", 1)
    return status


class _CannotWrite(Exception):
    """Standard output is closed, or failed (a full disk): not an ``OSError``, so
    that no handler of the command's own errors takes it for one of them."""


class _Output:
    """Standard output for a command: ``write`` and ``flush`` raise
    :class:`_CannotWrite` where it is closed (``>&-``: ``sys.stdout`` is
    None) or fails, ``BrokenPipeError`` as it is. Text the output's encoding
    cannot carry (``PYTHONIOENCODING=ascii``, a Latin-1 terminal) is written
    with backslash escapes, as Python's own standard error does. Main thread
    only."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if self._stream is None:
            raise _CannotWrite("it is closed")
        try:
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:  # nothing was written: the text is encoded first
                encoding = getattr(self._stream, "encoding", None) or "ascii"
                return self._stream.write(
                    text.encode(encoding, "backslashreplace").decode(encoding)
                )
        except BrokenPipeError:
            raise
        except Exception as exc:  # closed under us (ValueError), full, not a stream
            raise _CannotWrite(_line(exc) or type(exc).__name__) from exc

    def flush(self) -> None:
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except Exception as exc:
            raise _CannotWrite(_line(exc) or type(exc).__name__) from exc

    def isatty(self) -> bool:
        try:
            return self._stream is not None and bool(self._stream.isatty())
        except Exception:  # closed, or not a file
            return False


def _command(args: argparse.Namespace, out: TextIO) -> int:
    if not args.db:
        return _fail("--db is required: a SQLite file, sqlite:///path or a postgresql:// URL", 2)
    if args.outbox_command == "serve":
        from .web.cli import check_serve_options  # noqa: PLC0415 - only this command needs it

        problem = check_serve_options(args)
        if problem:
            return _fail(problem, 2)
    try:
        store = open_store(args.db, args.table)
    except ImportError:
        return _fail(
            "PostgreSQL needs psycopg 3 and psycopg_pool: "
            "pip install 'outbound-dispatcher[postgres]'",
            1,
        )
    except ValueError as exc:
        return _fail(_line(exc), 2)
    try:
        if args.outbox_command == "migrate":
            return _migrate(store, out)
        if isinstance(store, SQLiteStore) and not os.path.isfile(store.path):
            return _fail(f"no SQLite database file at {store.path!r}", 1)
        store.check_schema()
        if args.outbox_command == "serve":
            from .web.cli import serve  # noqa: PLC0415 - only this command needs it

            return serve(store, args, out)
        return _run(store, args, out)
    except OutboxError as exc:
        return _fail(_line(exc), 1)
    except ValueError as exc:
        return _fail(_line(exc), 2)
    finally:
        store.close()


def _plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _migrate(store: Store, out: TextIO) -> int:
    # What this process found under the schema's lock: of commands run at
    # once, only the one that migrated says so.
    if isinstance(store, (SQLiteStore, PostgresStore)):
        before = store._create_schema()
    else:
        before = store.schema_version()
        store.create_schema()
    if before is None:
        print(f"created outbox {store.table!r} (schema version {SCHEMA_VERSION})", file=out)
    elif before < SCHEMA_VERSION:
        print(
            f"migrated outbox {store.table!r} from schema version {before} to {SCHEMA_VERSION}",
            file=out,
        )
    else:
        print(f"outbox {store.table!r} is at schema version {before}: nothing to do", file=out)
    return 0


def _until(now: float, when: float | None) -> str:
    return "-" if when is None else f"{max(0.0, when - now):.1f}s"


def _row_line(row: RowInfo, now: float) -> str:
    error = f"  {printable(row.last_error)}" if row.last_error else ""
    return (
        f"{row.id:>8}  {row.status:<10} {row.attempts:>3} {now - row.created_at:>7.1f}s"
        f"  {printable(row.key)} / {printable(row.type)}{error}"
    )


def _run(store: Store, args: argparse.Namespace, out: TextIO) -> int:
    command = args.outbox_command
    now = time.time()
    if command == "status":
        status = store.status()
        for name in STATUSES:
            print(f"{name:<11} {status.counts.get(name, 0)}", file=out)
        print(f"unfinished  {status.unfinished} (what max_pending counts)", file=out)
        age = status.oldest_pending_age
        print(f"oldest pending: {'-' if age is None else f'{age:.1f}s ago'}", file=out)
        leases = store.leases()
        if leases:
            print("relays holding rows:", file=out)
        for lease in leases:
            expiry = _until(now, lease.expires_at)
            print(
                f"  {printable(lease.owner)}: {_plural(lease.rows, 'row', 'rows')}, "
                f"{_plural(lease.slots, 'slot', 'slots')}, next lease ends in {expiry}",
                file=out,
            )
    elif command == "list":
        rows = store.rows(status=args.status, key=args.key, limit=args.limit)
        print(f"{'id':>8}  {'status':<10} {'att':>3} {'age':>8}  key / type / last error", file=out)
        for row in rows:
            print(_row_line(row, now), file=out)
    elif command == "blocked":
        blocked = store.blocked(limit=args.limit)
        if not blocked:
            print("no key is blocked", file=out)
        for item in blocked:
            head = item.head
            if head.status == "processing":
                ends = _until(now, head.lease_expires_at)
                why = f"running on {printable(head.lease_owner or '?')}, lease ends in {ends}"
            else:
                why = f"next try in {_until(now, head.available_at)}"
            waits = _plural(item.waiting, "row waits", "rows wait")
            print(
                f"key {printable(item.key)}: {waits} behind row "
                f"{head.id} ({head.status}, attempt {head.attempts}, {why})",
                file=out,
            )
            if head.last_error:
                print(f"    last error: {printable(head.last_error)}", file=out)
    elif command == "retry":
        if bool(args.ids) == bool(args.all):
            print("outbox retry: give row ids or --all (not both)", file=sys.stderr)
            return 2
        count = store.retry_dead(None if args.all else args.ids)
        verb = "is" if count == 1 else "are"
        print(f"{_plural(count, 'dead row', 'dead rows')} {verb} pending again", file=out)
        if args.all:
            # (Left dead: an unfinished row holds its dedupe key; or died since.)
            left = store.status().counts["dead"]
            if left:
                print(
                    f"{_plural(left, 'dead row is', 'dead rows are')} still dead: an "
                    "unfinished row holds its dedupe_key (or it died since)",
                    file=out,
                )
                return 1
            return 0
        skipped = len(set(args.ids)) - count
        if skipped:
            print(
                f"{_plural(skipped, 'id was', 'ids were')} not of a dead row that could be "
                "revived (not dead, not found, or an unfinished row holds its dedupe_key)",
                file=out,
            )
            return 1
    elif command == "cancel":
        if args.dead_letter:
            count = store.dead_letter(args.ids, reason=args.reason)
            done = "dead-lettered"
        else:
            count = store.cancel(args.ids, reason=args.reason)
            done = "cancelled"
        print(f"{_plural(count, 'row', 'rows')} {done}", file=out)
        skipped = len(set(args.ids)) - count
        if skipped:
            print(
                f"{_plural(skipped, 'id was', 'ids were')} not of a pending or processing row",
                file=out,
            )
            return 1
    elif command == "purge":
        count = store.purge(statuses=args.status or ["sent"], older_than=args.older_than)
        print(f"{_plural(count, 'row', 'rows')} deleted", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m outbound outbox ...`` on its own: parse ``argv`` and run."""
    parser = argparse.ArgumentParser(prog="python -m outbound")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))
