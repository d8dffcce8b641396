"""``python -m outbound``: the command line (``demo``, ``simulator``, ``outbox``).

Every command ends with an exit status: 0 done, 1 a failure (one line on
standard error), 2 bad usage, 130 interrupted (Ctrl-C). The servers
(``simulator``, ``outbox serve``) run until stopped: their Ctrl-C is the
normal end, status 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from . import __version__

# Plain text: argparse prints it as is, so no reStructuredText markup here.
_DESCRIPTION = (
    "Send things out of synchronous Python programs in order, at the platform's "
    "pace, without losing them."
)
_EPILOG = (
    "Start with 'python -m outbound demo'; 'python -m outbound COMMAND --help' "
    "explains each command."
)


def build_parser() -> argparse.ArgumentParser:
    # (Imported here: a Ctrl-C while they load is main()'s, not a traceback.)
    from . import demo, simulator  # noqa: PLC0415
    from .outbox import cli as outbox_cli  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        prog="python -m outbound", description=_DESCRIPTION, epilog=_EPILOG
    )
    parser.add_argument("--version", action="version", version=f"outbound {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    demo.add_parser(subparsers)
    simulator.add_parser(subparsers)
    outbox_cli.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help(sys.stderr)
            return 2
        return int(func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Ctrl-C stops every command, also when it was started with SIGINT
    # ignored (a background job of a shell script): these are foreground
    # tools, and SIGINT is how a person or a supervisor says "stop".
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = main()
    # Done: a Ctrl-C from here on (the interpreter waiting for threads as it
    # exits) ends the process at once, not with a traceback of that wait.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(status)
