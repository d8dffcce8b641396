"""``python -m outbound``: the command line.

- ``demo``: broadcast to a local stand-in platform and report.
- ``simulator``: run the stand-in chat platform in the foreground.
- ``outbox``: inspect and repair a durable outbox.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__, demo, simulator
from .outbox import cli as outbox_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m outbound", description=__doc__)
    parser.add_argument("--version", action="version", version=f"outbound {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    demo.add_parser(subparsers)
    simulator.add_parser(subparsers)
    outbox_cli.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args))


if __name__ == "__main__":
    sys.exit(main())
