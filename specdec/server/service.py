"""A service process from flags to shutdown: what every `python -m <service>` main shares.

    def run_from_args(args):            # specdec serve SERVICE calls this
        return service.run_from_args(args, "target service", settings_from_args, run)

    def run(settings):
        ...load the engine...
        return service.run_traced(settings.server, lambda provider: serve_target(settings, ..., provider))

A model service (target, draft) serves through serve_model_service: one ModelExecutor thread for
the engine, the idle-session reaper, the ready file and the graceful shutdown of specdec.server.
Heavy imports (grpc, the metrics, asyncio's loop) happen inside the functions, so a main module that
imports this one still builds its parser for `--help` quickly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError
from specdec.server.settings import ConfigError, ServerSettings

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Tokens of context whose CUDA-graph step shapes a service captures at startup: most chat turns fit
# (Spec-Bench prompts plus their answers do); longer sessions capture their larger key buckets lazily.
GRAPH_WARMUP_CONTEXT = 1024


def add_model_arguments(group: Any, *, num_slots_help: str) -> None:
    """The flags of a service that hosts a model (target, draft) on `group` (a parser or an argument
    group): where it runs, its KV cache slots and context, idle-session expiry, the ready file.
    model_settings_from_args reads them back."""
    group.add_argument("--backend", choices=["native", "hf", "auto"], default="native")
    group.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    group.add_argument("--cuda-graphs", choices=["on", "off"], default=None,
                       help="replay decode and verify steps as CUDA graphs (native backend; default: on "
                            "for a CUDA device, never elsewhere)")
    group.add_argument("--compile-layers", action="store_true",
                       help="torch.compile the CUDA-graph steps' layers (native backend on a CUDA device; "
                            "15-65 s of compilation per new step shape; specdec/models/compiled_layers.py)")
    group.add_argument("--graph-warmup-context", type=int, default=None, metavar="TOKENS",
                       help="with CUDA graphs: capture every decode and verify shape of up to --num-slots "
                            f"sessions and this many tokens of context at startup (default {GRAPH_WARMUP_CONTEXT}; "
                            "0 with --compile-layers, where each shape compiles for 15-65 s); 0: capture each "
                            "shape on its first use, inside a request")
    group.add_argument("--batch-invariant", action="store_true",
                       help="every session's rows compute exactly what they compute alone, whatever else a "
                            "batched step holds (native backend; fixed-shape products, one attention kernel): "
                            "half-precision output then equals plain decoding token for token, at some cost "
                            "in wide steps (specdec/models/batch_invariant.py)")
    group.add_argument("--batch-invariant-rows", type=int, default=None, metavar="ROWS",
                       help="with --batch-invariant: the rows of every product chunk (default 160 on a GPU, 8 on "
                            "a CPU); more makes wide steps cheaper and one-row steps dearer (docs/DEPLOYMENT.md)")
    group.add_argument("--num-slots", type=int, default=8, help=num_slots_help)
    group.add_argument("--max-context", type=int, default=None, help="tokens per session (default: the model's)")
    group.add_argument("--session-ttl", type=float, default=600.0, help="seconds before an idle session expires")
    group.add_argument("--ready-file", type=Path, default=None,
                       help="write the bound ports as JSON here once serving (launchers and tests)")


def model_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The add_model_arguments flags as keyword arguments of a service's settings."""
    return {"backend": args.backend, "device": args.device, "dtype": args.dtype, "num_slots": args.num_slots,
            "cuda_graphs": cuda_graphs_flag(args.cuda_graphs), "compile_layers": args.compile_layers,
            "batch_invariant": args.batch_invariant, "batch_invariant_rows": args.batch_invariant_rows,
            "graph_warmup_context": graph_warmup_context(args.graph_warmup_context, args.compile_layers),
            "max_context": args.max_context, "session_ttl_s": args.session_ttl, "ready_file": args.ready_file}


@dataclass(frozen=True)
class BatchSettings:
    """Continuous batching of a model service (--max-batch-size, --batch-wait-ms)."""

    max_batch_size: int = 16  # work items (sessions' rows) per batched step
    batch_wait_s: float = 0.0  # hold a non-full batch this long for more work (0: never wait)
    gather: float = 0.25  # wait for the sessions just served, at most this fraction of a step

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.batch_wait_s <= 1:
            raise ConfigError(f"--batch-wait-ms must be in [0, 1000], got {self.batch_wait_s * 1000:g}")
        if not 0 <= self.gather <= 1:
            raise ConfigError(f"--batch-gather must be in [0, 1], got {self.gather}")


def add_batching_arguments(group: Any, *, what: str) -> None:
    group.add_argument("--max-batch-size", type=int, default=16,
                       help=f"most {what} of concurrent sessions run in one batched step (1: no batching)")
    group.add_argument("--batch-wait-ms", type=float, default=0.0,
                       help="hold a non-full batch this long for more work (default 0: a lone request "
                            "starts at once; a request arriving during a step joins the next one anyway)")
    group.add_argument("--batch-gather", type=float, default=0.25,
                       help="hold a step for the sessions of the last step (about to send their next work) "
                            "at most this fraction of a step's duration, so that concurrent sessions share "
                            "one step instead of alternating half-size ones (0: never hold)")


def batch_settings_from_args(args: argparse.Namespace) -> BatchSettings:
    return BatchSettings(args.max_batch_size, args.batch_wait_ms / 1000, args.batch_gather)


def graph_warmup_context(value: int | None, compile_layers: bool) -> int:
    """--graph-warmup-context: the flag's value, or its default (none with --compile-layers)."""
    if value is None:
        return 0 if compile_layers else GRAPH_WARMUP_CONTEXT
    if value < 0:
        raise ConfigError(f"--graph-warmup-context must be >= 0 tokens, got {value}")
    return value


def cuda_graphs_flag(value: str | None) -> bool | None:
    """--cuda-graphs on|off|(not given) -> True | False | None (the loader decides by device)."""
    return None if value is None else value == "on"


def check_batch_invariant_rows(batch_invariant: bool, rows: int | None) -> None:
    """ConfigError for --batch-invariant-rows without the mode, or out of range (also `specdec launch`'s)."""
    if rows is not None and not batch_invariant:
        raise ConfigError("--batch-invariant-rows needs --batch-invariant (it sizes that mode's product chunks)")
    if rows is not None and not 1 <= rows <= 4096:
        raise ConfigError(f"--batch-invariant-rows must be in 1..4096, got {rows}")


def check_model_settings(num_slots: int, max_context: int | None, session_ttl_s: float,
                         batch_invariant: bool = False, compile_layers: bool = False, backend: str = "native",
                         batch_invariant_rows: int | None = None) -> None:
    """ConfigError, naming the flag, for values no model service can run with."""
    check_batch_invariant_rows(batch_invariant, batch_invariant_rows)
    if batch_invariant and compile_layers:
        raise ConfigError("--batch-invariant cannot be combined with --compile-layers: compiled layers pick "
                          "their kernels per step shape, so a row's result would depend on its batch")
    if batch_invariant and backend != "native":
        raise ConfigError(f"--batch-invariant needs --backend native, got {backend!r}")
    if num_slots < 1:
        raise ConfigError(f"--num-slots must be >= 1, got {num_slots}")
    if max_context is not None and max_context < 2:
        raise ConfigError(f"--max-context must be >= 2 tokens, got {max_context}")
    if not session_ttl_s > 0:
        raise ConfigError(f"--session-ttl must be > 0 seconds, got {session_ttl_s}")


def test_delayed(fn: Callable[..., Any], delay_s: float, what: str) -> Callable[..., Any]:
    """TEST ONLY (--test-delay-ms): fn, after sleeping delay_s on the calling (model) thread."""
    log.warning("TEST ONLY: every %s is delayed by %.0f ms (--test-delay-ms)", what, delay_s * 1000)

    def delayed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay_s)
        return fn(*args, **kwargs)
    return delayed


def write_ready_file(path: Path, host) -> None:
    """The bound ports of `host` (a started ServiceHost) as JSON; atomically: a reader never sees
    half a file."""
    ports = {"pid": os.getpid(), "port": host.port, "health_port": host.health_port,
             "metrics_port": host.metrics_port}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ports))
    tmp.replace(path)


def build_parser(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                 **kwargs: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, **kwargs)
    add_arguments(parser)
    return parser


def run_from_args(
    args: argparse.Namespace,
    label: str,
    settings_from_args: Callable[[argparse.Namespace], Any],
    run: Callable[[Any], int],
) -> int:
    """Settings from the flags, then run(settings). A bad flag exits 2 and a domain error (an unknown
    model, incompatible options) exits 1, each with one line on stderr prefixed by `label`, no
    traceback."""
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"{label}: {exc}", file=sys.stderr)
        return 2
    try:
        return run(settings)
    except SpecDecError as exc:
        print(f"{label}: {exc}", file=sys.stderr)
        return 1


def main(parser: argparse.ArgumentParser, run_from_args: Callable[[argparse.Namespace], int],
         argv: list[str] | None = None) -> int:
    args = parser.parse_args(argv)
    # SPECDEC_LOG_LEVEL=DEBUG: e.g. the coordinator's per-turn trace of draft lengths (generation/loop.py)
    level = os.environ.get("SPECDEC_LOG_LEVEL", "INFO").strip().upper()
    if level not in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"):
        print(f"SPECDEC_LOG_LEVEL={level!r} is not a log level; use DEBUG, INFO, WARNING, ERROR or CRITICAL",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format=LOG_FORMAT)
    return run_from_args(args)


def run_traced(settings: ServerSettings, serve: Callable[[Any], Awaitable[None]]) -> int:
    """asyncio.run(serve(tracer_provider)) with tracing set up per `settings`; the provider is shut
    down (batched spans flushed) however serving ends."""
    import asyncio

    from specdec.observability.tracing import setup_tracing
    from specdec.processes import exit_with_parent

    exit_with_parent()  # launched by specdec.processes: not outliving the launcher
    tracing = settings.tracing
    provider = setup_tracing(tracing.service_name, tracing.sampling_ratio)
    try:
        asyncio.run(serve(provider))
    finally:
        provider.shutdown()
    return 0


def expiry_interval(session_ttl_s: float) -> float:
    """How often the reaper looks for idle sessions: a quarter of the TTL, within [0.25 s, 30 s]."""
    return min(max(session_ttl_s / 4, 0.25), 30.0)


async def serve_model_service(
    settings: ServerSettings,
    build_servicer: Callable[[Any, Any], Any],
    add_servicer: Callable[[Any, Any], None],
    service_name: str,
    *,
    executor_name: str,
    session_ttl_s: float,
    ready_file: Path | None = None,
    tracer_provider=None,
) -> None:
    """Serve a model service until SIGTERM / SIGINT; returns after the graceful shutdown.

    `build_servicer(executor, registry)` makes the servicer: its engine calls go through the
    ModelExecutor `executor`, its metrics into the Prometheus `registry` served on /metrics. Once
    serving, `servicer.expire_idle_sessions(interval)` runs until shutdown and the ready file is
    written; as the server stops taking calls, `servicer.message_streams` ends its open streams; at
    shutdown `servicer.aclose()` runs, then the executor finishes its last call and closes.
    """
    import asyncio

    from specdec.observability.metrics import new_registry
    from specdec.server.bootstrap import ModelExecutor, serve

    registry = new_registry()
    executor = ModelExecutor(executor_name)
    servicer = build_servicer(executor, registry)
    tasks: list[asyncio.Task] = []

    def register(server):
        add_servicer(servicer, server)
        return [service_name]

    def started(host) -> None:
        reaper = servicer.expire_idle_sessions(expiry_interval(session_ttl_s))
        tasks.append(asyncio.get_running_loop().create_task(reaper))
        if ready_file is not None:
            write_ready_file(ready_file, host)

    def stop_tasks() -> None:
        for task in tasks:
            task.cancel()

    # A model service calls no one: when its spans go nowhere, tracing its calls only costs time.
    from specdec.observability.tracing import exports_spans

    if exports_spans(tracer_provider):  # the per-cycle streams' messages are traced one by one
        from opentelemetry import trace

        servicer.message_streams.tracer = trace.get_tracer(service_name, tracer_provider=tracer_provider)

    # Open per-cycle message streams end as the server stops taking calls (server/message_streams.py).
    await serve(settings, register, on_shutdown=[stop_tasks, servicer.aclose, executor.aclose],
                on_stopping=[servicer.message_streams.end],
                tracer_provider=tracer_provider, registry=registry, on_started=started,
                trace_calls=exports_spans(tracer_provider))
