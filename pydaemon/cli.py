"""The `pagedd` command line."""

from __future__ import annotations

import argparse
import sys

from pydaemon import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedd", description="pagedd inference daemon")
    parser.add_argument("--version", action="version", version=f"pagedd {__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="run the gRPC daemon")
    sub.add_parser("generate", help="stream a completion from a running daemon")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    print(f"pagedd {args.command}: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
