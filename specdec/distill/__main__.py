"""`python -m specdec.distill STEP ...`: the `specdec distill` subcommands without the rest of the CLI
(whose other subcommands need packages a bare GPU machine lacks)."""

import argparse
import logging
import sys

from specdec.commands.distill import add_subcommands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.distill")
    add_subcommands(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
