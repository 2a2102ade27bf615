"""`specdec models list|fetch|verify|path`: the registry of known models and the local cache."""

from __future__ import annotations

import argparse
import sys

from specdec.errors import SpecDecError
from specdec.models import registry


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list, fetch, verify and locate known models",
        description="Known models and their local copies. Registry models are cached in "
        "$SPECDEC_HOME/models/<name> (default ~/.cache/specdec/models/<name>).",
    )
    actions = parser.add_subparsers(dest="models_command", metavar="ACTION")
    actions.required = True

    listing = actions.add_parser("list", help="known models, whether each is on this machine, and where")
    listing.set_defaults(func=_list)

    fetch = actions.add_parser(
        "fetch", help="download and convert a model into the cache (once; instant when cached)"
    )
    fetch.add_argument("name", nargs="?", default=registry.DEFAULT_TARGET,
                       help=f"registry name (default: {registry.DEFAULT_TARGET})")
    fetch.add_argument("--force", action="store_true", help="fetch and convert again even if cached")
    fetch.set_defaults(func=_fetch)

    verify = actions.add_parser("verify", help="check a cached model's files against its manifest hashes")
    verify.add_argument("name", nargs="?", default=registry.DEFAULT_TARGET,
                        help=f"registry name or model directory (default: {registry.DEFAULT_TARGET})")
    verify.set_defaults(func=_verify)

    path = actions.add_parser(
        "path", help="print the local directory of a model (only the path on stdout, for scripts)"
    )
    path.add_argument("name", nargs="?", default=registry.DEFAULT_TARGET,
                      help=f"registry name, directory or hub id (default: {registry.DEFAULT_TARGET})")
    path.add_argument("--no-fetch", action="store_true", help="fail instead of fetching a missing model")
    path.set_defaults(func=_path)


def _list(args: argparse.Namespace) -> int:
    entries = registry.list_models()
    width = max(len(e.name) for e in entries)
    for entry in entries:
        tags = [t for t, on in (("default target", entry.name == registry.DEFAULT_TARGET),
                                ("default draft", entry.name == registry.DEFAULT_DRAFT)) if on]
        state = "cached" if entry.cached else "not fetched"
        print(f"{entry.name:<{width}}  {state:<11}  {entry.path}")
        print(f"{'':<{width}}  {entry.description}" + (f" [{', '.join(tags)}]" if tags else ""))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    return _guarded(lambda: print(registry.fetch_model(args.name, force=args.force)))


def _verify(args: argparse.Namespace) -> int:
    report = registry.verify_model(args.name)
    print(report.summary())
    return 0 if report.ok else 1


def _path(args: argparse.Namespace) -> int:
    return _guarded(lambda: print(registry.resolve_model(args.name, fetch=not args.no_fetch)))


def _guarded(action) -> int:
    """Run an action; a domain error becomes its message on stderr and exit status 1, no traceback."""
    try:
        action()
    except SpecDecError as exc:
        print(f"specdec models: {exc}", file=sys.stderr)
        return 1
    return 0
