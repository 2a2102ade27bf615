"""`specdec serve SERVICE [flags]`: run one service in this process (`specdec serve target --help`).

Each service's main module exposes HELP, DESCRIPTION, add_arguments(parser) and
run_from_args(args) -> exit code; adding a service is one line in SERVICES. Main modules import
only argparse-level code at the top, so building this parser stays fast.
"""

from __future__ import annotations

import argparse
import importlib

SERVICES = {
    "target": "target_service.main",
    "draft": "draft_service.main",
    "coordinator": "coordinator.main",
}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="run a gRPC service (target, draft, ...)",
        description="Run one gRPC service in the foreground until SIGTERM / Ctrl-C (graceful shutdown).",
    )
    services = parser.add_subparsers(dest="service", metavar="SERVICE", required=True)
    for name, module_name in SERVICES.items():
        module = importlib.import_module(module_name)
        service_parser = services.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(service_parser)
        service_parser.set_defaults(func=_runner(module_name))


def _runner(module_name: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module_name).run_from_args(args)

    return run
