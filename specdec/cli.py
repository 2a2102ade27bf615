"""The `specdec` console command. Each subcommand lives in specdec/commands/<name>.py and exposes
`add_parser(subparsers)`, which registers its parser and sets `func(args) -> int` as the default.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from specdec.errors import InvalidArgument

# Subcommand modules, in the order `specdec --help` lists them. A module that fails to import
# (an optional extra missing) is reported when its command is used, not at every start.
SUBCOMMANDS = ("generate", "serve", "launch", "client", "canary", "models", "distill", "bench", "ray")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec",
        description="Distributed speculative decoding: draft and target as gRPC services, lossless.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"specdec.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"specdec.commands.{name}":
                raise
            continue  # not built yet
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except InvalidArgument as exc:
        if args.verbose:
            raise
        # Bad input on the command line: the message names what was wrong and what is allowed, as the
        # services' INVALID_ARGUMENT does; a traceback would only bury it (-v shows one).
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
