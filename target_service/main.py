"""`python -m target_service` / `specdec serve target`: load the target model and serve TargetService.

main() parses flags into one frozen TargetServiceSettings, loads the model, and serves until SIGTERM
(graceful: NOT_SERVING, in-flight calls finish within --grace-period). Heavy imports (torch, the
model code) happen in run(), so building the parser for `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecDecError
from specdec.server.settings import ConfigError, ServerSettings, add_server_arguments, server_settings_from_args

log = logging.getLogger(__name__)

SERVICE = "target"
HELP = "serve a target model (TargetService: StartSession, Verify, Decode, Truncate, ...)"
DESCRIPTION = (
    "Serve the target model over gRPC: session-keyed KV caches, lossless verification of drafted "
    "blocks, plain decoding. Health, reflection and Prometheus /metrics included."
)
DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9102
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class TargetServiceSettings:
    server: ServerSettings
    model: str  # registry name or HF directory
    backend: str = "native"
    device: str = "cpu"
    dtype: str = "float32"
    num_slots: int = 8
    max_context: int | None = None  # None: the model's own limit (capped by the loader)
    session_ttl_s: float = 600.0
    max_draft_tokens: int = 64
    ready_file: Path | None = None

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ConfigError(f"--num-slots must be >= 1, got {self.num_slots}")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"--max-context must be >= 2 tokens, got {self.max_context}")
        if not self.session_ttl_s > 0:
            raise ConfigError(f"--session-ttl must be > 0 seconds, got {self.session_ttl_s}")
        if self.max_draft_tokens < 1:
            raise ConfigError(f"--max-draft-tokens must be >= 1, got {self.max_draft_tokens}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = parser.add_argument_group("target model")
    g.add_argument("--model", default=env("SPECDEC_TARGET_MODEL", "smollm2-135m-instruct"),
                   help="registry name or Hugging Face model directory (default: %(default)s)")
    g.add_argument("--backend", choices=["native", "hf", "auto"], default="native")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    g.add_argument("--num-slots", type=int, default=8, help="sessions whose KV caches fit at once")
    g.add_argument("--max-context", type=int, default=None, help="tokens per session (default: the model's)")
    g.add_argument("--session-ttl", type=float, default=600.0, help="seconds before an idle session expires")
    g.add_argument("--max-draft-tokens", type=int, default=64, help="most draft tokens one Verify may carry")
    g.add_argument("--ready-file", type=Path, default=None,
                   help="write the bound ports as JSON here once serving (launchers and tests)")
    add_server_arguments(parser, port=DEFAULT_PORT, metrics_port=DEFAULT_METRICS_PORT)


def settings_from_args(args: argparse.Namespace) -> TargetServiceSettings:
    return TargetServiceSettings(
        server=server_settings_from_args(args, service=SERVICE),
        model=args.model,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        num_slots=args.num_slots,
        max_context=args.max_context,
        session_ttl_s=args.session_ttl,
        max_draft_tokens=args.max_draft_tokens,
        ready_file=args.ready_file,
    )


def tokenizer_facts(model_dir: Path):
    """Vocab fingerprint and eos ids of the tokenizer in model_dir; empty when it has none."""
    from target_service.servicer import TokenizerFacts

    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        log.warning("%s has no tokenizer: GetInfo reports an empty vocab fingerprint", model_dir)
        return TokenizerFacts()
    from specdec.models.tokenizer import eos_token_ids, load_tokenizer, vocab_fingerprint

    tokenizer = load_tokenizer(model_dir)
    return TokenizerFacts(vocab_fingerprint(tokenizer), tuple(sorted(eos_token_ids(tokenizer, model_dir))))


def write_ready_file(path: Path, host) -> None:
    """Atomically: a reader never sees half a file."""
    ports = {"pid": os.getpid(), "port": host.port, "health_port": host.health_port,
             "metrics_port": host.metrics_port}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ports))
    tmp.replace(path)


async def serve_target(settings: TargetServiceSettings, engine, tokenizer, tracer_provider=None) -> None:
    """Serve `engine` until SIGTERM / SIGINT; returns after the graceful shutdown."""
    import asyncio

    from specdec.observability.metrics import TargetMetrics, new_registry
    from specdec.rpc import target_pb2_grpc
    from specdec.server.bootstrap import ModelExecutor, serve
    from target_service.servicer import TARGET_SERVICE_NAME, TargetServicer

    registry = new_registry()
    executor = ModelExecutor("target-model")
    servicer = TargetServicer(engine, executor, TargetMetrics(registry), tokenizer, settings.max_draft_tokens)
    tasks: list[asyncio.Task] = []

    def register(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return [TARGET_SERVICE_NAME]

    def started(host) -> None:
        interval = min(max(settings.session_ttl_s / 4, 0.25), 30.0)
        tasks.append(asyncio.get_running_loop().create_task(servicer.expire_idle_sessions(interval)))
        if settings.ready_file is not None:
            write_ready_file(settings.ready_file, host)

    def stop_tasks() -> None:
        for task in tasks:
            task.cancel()

    await serve(settings.server, register, on_shutdown=[stop_tasks, executor.aclose],
                tracer_provider=tracer_provider, registry=registry, on_started=started)


def run(settings: TargetServiceSettings) -> int:
    import asyncio

    from specdec.engine.target import TargetEngine
    from specdec.models.loader import load_model
    from specdec.models.registry import resolve_model
    from specdec.observability.tracing import setup_tracing

    model_dir = resolve_model(settings.model)
    log.info("loading target %s from %s (%s, %s, %s)", settings.model, model_dir, settings.backend,
             settings.device, settings.dtype)
    model = load_model(model_dir, backend=settings.backend, device=settings.device, dtype=settings.dtype,
                       num_slots=settings.num_slots, max_context=settings.max_context, name=settings.model)
    engine = TargetEngine(model, idle_ttl_s=settings.session_ttl_s)
    tracing = settings.server.tracing
    provider = setup_tracing(tracing.service_name, tracing.sampling_ratio)
    try:
        asyncio.run(serve_target(settings, engine, tokenizer_facts(model_dir), provider))
    finally:
        provider.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"target service: {exc}", file=sys.stderr)
        return 2
    try:
        return run(settings)
    except SpecDecError as exc:  # an unknown model, a bad backend choice: say it, no traceback
        print(f"target service: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_from_args(args)
