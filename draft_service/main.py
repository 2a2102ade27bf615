"""`python -m draft_service` / `specdec serve draft`: host a proposer and serve DraftService.

    --proposer draft-model --model NAME_OR_DIR    a small causal LM with the target's tokenizer
    --proposer ngram [--ngram-max N --ngram-min N] prompt lookup, no weights; pass --tokenizer (the
                                                  target's directory) so GetInfo reports its vocab
                                                  fingerprint and the coordinator can pair them

main() parses flags into one frozen DraftServiceSettings, builds the proposer, and serves until
SIGTERM (graceful). Heavy imports happen in run(), so `--help` stays fast.
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

SERVICE = "draft"
HELP = "serve a proposer (DraftService: StartSession, Propose, Truncate, ...)"
DESCRIPTION = (
    "Serve a draft proposer over gRPC: a draft model or n-gram prompt lookup, per-session state, "
    "accept/rollback and drafting in one Propose call. Health, reflection and Prometheus /metrics "
    "included."
)
PROPOSERS = ("draft-model", "ngram")
DEFAULT_PORT = 50053
DEFAULT_METRICS_PORT = 9103
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class DraftServiceSettings:
    server: ServerSettings
    proposer: str = "draft-model"
    model: str | None = None  # registry name or HF directory (draft-model)
    tokenizer: str | None = None  # where GetInfo's fingerprint comes from (default: the model's)
    backend: str = "native"
    device: str = "cpu"
    dtype: str = "float32"
    num_slots: int = 8
    max_context: int | None = None
    top_m: int = 64
    ngram_max: int = 3
    ngram_min: int = 1
    num_draft_tokens: int = 4
    max_draft_tokens: int = 16
    session_ttl_s: float = 600.0
    ready_file: Path | None = None

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise ConfigError(f"--proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")
        if self.proposer == "draft-model" and not self.model:
            raise ConfigError("--proposer draft-model needs --model NAME_OR_DIR (or use --proposer ngram)")
        if self.num_slots < 1:
            raise ConfigError(f"--num-slots must be >= 1, got {self.num_slots}")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"--max-context must be >= 2 tokens, got {self.max_context}")
        if self.top_m < 0:
            raise ConfigError(f"--top-m must be >= 0 (0 = the full distribution), got {self.top_m}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min}, {self.ngram_max}")
        if not 1 <= self.num_draft_tokens <= self.max_draft_tokens:
            raise ConfigError(
                f"need 1 <= --num-draft-tokens <= --max-draft-tokens, got {self.num_draft_tokens}, "
                f"{self.max_draft_tokens}"
            )
        if not self.session_ttl_s > 0:
            raise ConfigError(f"--session-ttl must be > 0 seconds, got {self.session_ttl_s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = parser.add_argument_group("proposer")
    g.add_argument("--proposer", choices=PROPOSERS, default=env("SPECDEC_DRAFT_PROPOSER", "draft-model"))
    g.add_argument("--model", default=env("SPECDEC_DRAFT_MODEL"),
                   help="draft model: registry name or Hugging Face directory (--proposer draft-model)")
    g.add_argument("--tokenizer", default=env("SPECDEC_DRAFT_TOKENIZER"),
                   help="registry name or directory whose tokenizer GetInfo describes (default: the model's; "
                        "for ngram pass the target's)")
    g.add_argument("--backend", choices=["native", "hf", "auto"], default="native")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    g.add_argument("--num-slots", type=int, default=8, help="draft KV cache slots (idle sessions are evicted)")
    g.add_argument("--max-context", type=int, default=None, help="tokens per session (default: the model's)")
    g.add_argument("--top-m", type=int, default=64,
                   help="entries of each draft distribution kept and sent (0 = all)")
    g.add_argument("--ngram-max", type=int, default=3, help="longest n-gram to match (--proposer ngram)")
    g.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram to match (--proposer ngram)")
    g.add_argument("--num-draft-tokens", type=int, default=4, help="draft length when a request names none")
    g.add_argument("--max-draft-tokens", type=int, default=16, help="most tokens one Propose may draft")
    g.add_argument("--session-ttl", type=float, default=600.0, help="seconds before an idle session expires")
    g.add_argument("--ready-file", type=Path, default=None,
                   help="write the bound ports as JSON here once serving (launchers and tests)")
    add_server_arguments(parser, port=DEFAULT_PORT, metrics_port=DEFAULT_METRICS_PORT)


def settings_from_args(args: argparse.Namespace) -> DraftServiceSettings:
    return DraftServiceSettings(
        server=server_settings_from_args(args, service=SERVICE),
        proposer=args.proposer, model=args.model, tokenizer=args.tokenizer, backend=args.backend,
        device=args.device, dtype=args.dtype, num_slots=args.num_slots, max_context=args.max_context,
        top_m=args.top_m, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
        num_draft_tokens=args.num_draft_tokens, max_draft_tokens=args.max_draft_tokens,
        session_ttl_s=args.session_ttl, ready_file=args.ready_file,
    )


def tokenizer_facts(directory: Path | None) -> tuple[str, tuple[int, ...]]:
    """(vocab fingerprint, eos ids) of the tokenizer in `directory`; empty when there is none."""
    if directory is None or not any((directory / name).is_file() for name in TOKENIZER_FILES):
        log.warning("no tokenizer (%s): GetInfo reports an empty vocab fingerprint", directory)
        return "", ()
    from specdec.models.tokenizer import eos_token_ids, load_tokenizer, vocab_fingerprint

    tokenizer = load_tokenizer(directory)
    return vocab_fingerprint(tokenizer), tuple(sorted(eos_token_ids(tokenizer, directory)))


def build_engine(settings: DraftServiceSettings):
    """The DraftEngine and the servicer's config for the chosen proposer."""
    from draft_service.servicer import DraftServiceConfig
    from specdec.engine.draft import DraftEngine
    from specdec.models.base import ModelInfo
    from specdec.models.registry import resolve_model

    model_dir = resolve_model(settings.model) if settings.model else None
    tokenizer_dir = resolve_model(settings.tokenizer) if settings.tokenizer else model_dir
    fingerprint, eos_ids = tokenizer_facts(tokenizer_dir)
    if settings.proposer == "ngram":
        from specdec.proposers.ngram import NgramProposer

        proposer = NgramProposer(max_ngram=settings.ngram_max, min_ngram=settings.ngram_min)
        # No logits, no context limit: token ids are not range-checked and vocab_size reads 0.
        info = ModelInfo(name="", architecture="", vocab_size=0, max_context=0, dtype="", device="cpu", backend="")
        top_m = None
    else:
        from specdec.models.loader import load_model
        from specdec.proposers.draft_model import DraftModelProposer

        log.info("loading draft model %s from %s", settings.model, model_dir)
        model = load_model(model_dir, backend=settings.backend, device=settings.device, dtype=settings.dtype,
                           num_slots=settings.num_slots, max_context=settings.max_context, name=settings.model)
        proposer = DraftModelProposer(model, top_m=settings.top_m)
        info, top_m = model.info, settings.top_m
    engine = DraftEngine(proposer, idle_ttl_s=settings.session_ttl_s, max_draft_tokens=settings.max_draft_tokens)
    config = DraftServiceConfig(info, fingerprint, eos_ids, settings.num_draft_tokens, top_m, info.max_context)
    return engine, config


def write_ready_file(path: Path, host) -> None:
    """Atomically: a reader never sees half a file."""
    ports = {"pid": os.getpid(), "port": host.port, "health_port": host.health_port,
             "metrics_port": host.metrics_port}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ports))
    tmp.replace(path)


async def serve_draft(settings: DraftServiceSettings, engine, config, tracer_provider=None) -> None:
    """Serve `engine` until SIGTERM / SIGINT; returns after the graceful shutdown."""
    import asyncio

    from draft_service.servicer import DRAFT_SERVICE_NAME, DraftServicer
    from specdec.observability.metrics import DraftMetrics, new_registry
    from specdec.rpc import draft_pb2_grpc
    from specdec.server.bootstrap import ModelExecutor, serve

    registry = new_registry()
    executor = ModelExecutor("draft-model")
    servicer = DraftServicer(engine, executor, DraftMetrics(registry), config)
    tasks: list[asyncio.Task] = []

    def register(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [DRAFT_SERVICE_NAME]

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


def run(settings: DraftServiceSettings) -> int:
    import asyncio

    from specdec.observability.tracing import setup_tracing

    engine, config = build_engine(settings)
    tracing = settings.server.tracing
    provider = setup_tracing(tracing.service_name, tracing.sampling_ratio)
    try:
        asyncio.run(serve_draft(settings, engine, config, provider))
    finally:
        provider.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m draft_service", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"draft service: {exc}", file=sys.stderr)
        return 2
    try:
        return run(settings)
    except SpecDecError as exc:  # an unknown model, incompatible options: say it, no traceback
        print(f"draft service: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_from_args(args)
