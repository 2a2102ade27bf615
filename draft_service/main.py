"""`python -m draft_service` / `specdec serve draft`: host a proposer and serve DraftService.

    --proposer draft-model [--model NAME_OR_DIR]  a small causal LM with the target's tokenizer (default:
                                                  smollm2-135m-draft, the default target's draft)
    --proposer ngram [--ngram-max N --ngram-min N] prompt lookup, no weights; pass --tokenizer (the
                                                  target's directory) so GetInfo reports its vocab
                                                  fingerprint and the coordinator can pair them

main() parses flags into one frozen DraftServiceSettings, builds the proposer, and serves until
SIGTERM (graceful). Heavy imports happen in run(), so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from specdec.models.reduced_head import parse_head_vocab
from specdec.models.registry import DEFAULT_DRAFT
from specdec.server import service
from specdec.server.settings import ConfigError, ServerSettings, add_server_arguments, server_settings_from_args
from specdec.server.tokenizer_info import tokenizer_facts

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


@dataclass(frozen=True)
class DraftServiceSettings:
    server: ServerSettings
    proposer: str = "draft-model"
    model: str | None = None  # registry name or HF directory (draft-model)
    tokenizer: str | None = None  # where GetInfo's fingerprint comes from (default: the model's)
    backend: str = "native"
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool | None = None  # None: on for a CUDA device
    compile_layers: bool = False  # torch.compile the CUDA-graph layers (specdec.models.compiled_layers)
    batch_invariant: bool = False  # every row computes what it computes alone (specdec.models.batch_invariant)
    batch_invariant_rows: int | None = None  # its product chunk; None: the device's default
    graph_warmup_context: int = service.GRAPH_WARMUP_CONTEXT  # CUDA-graph shapes captured at startup
    num_slots: int = 8
    max_context: int | None = None
    top_m: int = 64
    copy_below: float = 0.5  # copy from the session's text where the draft is this unsure (copy_guess.py)
    # Reduced output head: "auto" (the checkpoint's recommendation, on CPU), None (full) or N rows.
    head_vocab: int | str | None = "auto"
    ngram_max: int = 3
    ngram_min: int = 1
    num_draft_tokens: int = 4
    max_draft_tokens: int = 16
    session_ttl_s: float = 600.0
    evict_after_s: float = 1.0  # --evict-after: a session that drafted this recently keeps its KV slot
    ready_file: Path | None = None
    test_delay_ms: int = 0  # TEST ONLY: every Propose sleeps this long (a slow draft, docs/CANARY.md)
    batching: service.BatchSettings = service.BatchSettings()

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise ConfigError(f"--proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")
        if self.proposer == "draft-model" and not self.model:
            raise ConfigError("--proposer draft-model needs --model NAME_OR_DIR (or use --proposer ngram)")
        service.check_model_settings(self.num_slots, self.max_context, self.session_ttl_s,
                                     self.batch_invariant, self.compile_layers, self.backend,
                                     self.batch_invariant_rows)
        if self.top_m < 0:
            raise ConfigError(f"--top-m must be >= 0 (0 = the full distribution), got {self.top_m}")
        if not self.evict_after_s >= 0:  # also refuses NaN
            raise ConfigError(f"--evict-after must be >= 0 seconds, got {self.evict_after_s}")
        if not 0.0 <= self.copy_below <= 1.0:  # also refuses NaN
            raise ConfigError(f"--copy-below must be in [0, 1] (0 = never copy), got {self.copy_below}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min}, {self.ngram_max}")
        if not 1 <= self.num_draft_tokens <= self.max_draft_tokens:
            raise ConfigError(
                f"need 1 <= --num-draft-tokens <= --max-draft-tokens, got {self.num_draft_tokens}, "
                f"{self.max_draft_tokens}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = parser.add_argument_group("proposer")
    g.add_argument("--proposer", choices=PROPOSERS, default=env("SPECDEC_DRAFT_PROPOSER", "draft-model"))
    g.add_argument("--model", default=env("SPECDEC_DRAFT_MODEL", DEFAULT_DRAFT),
                   help="draft model: registry name or Hugging Face directory (--proposer draft-model; "
                        "default: %(default)s, the default target's)")
    g.add_argument("--tokenizer", default=env("SPECDEC_DRAFT_TOKENIZER"),
                   help="registry name or directory whose tokenizer GetInfo describes (default: the model's; "
                        "for ngram pass the target's)")
    g.add_argument("--top-m", type=int, default=64,
                   help="entries of each draft distribution kept and sent (0 = all)")
    g.add_argument("--copy-below", type=float, default=float(env("SPECDEC_DRAFT_COPY_BELOW", "0.5")),
                   help="where the draft model's probability of its most likely next token is below this, draft "
                        "what followed the same 3 tokens earlier in the session instead (copying from the prompt "
                        "and the answer so far; still lossless); 0 = never")
    g.add_argument("--head-vocab", type=parse_head_vocab, default=env("SPECDEC_DRAFT_HEAD_VOCAB", "auto"),
                   help="score only the draft's N most frequent tokens (its head_vocab.json) and the session's "
                        "own context tokens: a cheaper draft step, still lossless. 'auto' (default): the size the "
                        "checkpoint recommends, on CPU; 'full' or 0: the whole vocabulary")
    g.add_argument("--ngram-max", type=int, default=3, help="longest n-gram to match (--proposer ngram)")
    g.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram to match (--proposer ngram)")
    g.add_argument("--num-draft-tokens", type=int, default=4, help="draft length when a request names none")
    g.add_argument("--max-draft-tokens", type=int, default=16, help="most tokens one Propose may draft")
    g.add_argument("--test-delay-ms", type=int, default=0,
                   help="TEST ONLY: make every Propose this much slower (a slow draft for canary tests)")
    service.add_model_arguments(g, num_slots_help="draft KV cache slots (idle sessions are evicted)")
    g.add_argument("--evict-after", type=float, default=1.0,
                   help="seconds a session keeps its draft KV slot after it last drafted: when more sessions are "
                        "active than --num-slots fit, a new one is refused and decodes without the draft for a "
                        "few cycles (its coordinator's --retry-draft-after) instead of evicting one in the "
                        "middle of a turn, which would re-feed it (0: evict any session not in the batch)")
    service.add_batching_arguments(g, what="Propose calls")
    add_server_arguments(parser, port=DEFAULT_PORT, metrics_port=DEFAULT_METRICS_PORT)


def settings_from_args(args: argparse.Namespace) -> DraftServiceSettings:
    return DraftServiceSettings(
        server=server_settings_from_args(args, service=SERVICE),
        proposer=args.proposer, model=args.model, tokenizer=args.tokenizer, top_m=args.top_m,
        copy_below=args.copy_below, head_vocab=args.head_vocab,
        ngram_max=args.ngram_max, ngram_min=args.ngram_min, num_draft_tokens=args.num_draft_tokens,
        max_draft_tokens=args.max_draft_tokens, test_delay_ms=args.test_delay_ms, evict_after_s=args.evict_after,
        batching=service.batch_settings_from_args(args), **service.model_settings_from_args(args),
    )


def build_engine(settings: DraftServiceSettings):
    """The DraftEngine and the servicer's config for the chosen proposer."""
    from draft_service.servicer import DraftServiceConfig
    from specdec.engine.draft import DraftEngine
    from specdec.models.base import ModelInfo
    from specdec.models.registry import resolve_model

    model_dir = resolve_model(settings.model) if settings.model else None
    tokenizer_dir = resolve_model(settings.tokenizer) if settings.tokenizer else model_dir
    tokenizer = tokenizer_facts(tokenizer_dir)
    if settings.proposer == "ngram":
        from specdec.proposers.ngram import NgramProposer

        proposer = NgramProposer(max_ngram=settings.ngram_max, min_ngram=settings.ngram_min)
        # No logits, no context limit: token ids are not range-checked and vocab_size reads 0.
        info = ModelInfo(name="", architecture="", vocab_size=0, max_context=0, dtype="", device="cpu", backend="")
        top_m = None
    else:
        import torch

        from specdec.models.loader import load_model, on_own_thread
        from specdec.proposers.copy_guess import CopyRule
        from specdec.proposers.draft_model import DraftModelProposer

        log.info("loading draft model %s from %s (%d intra-op threads)", settings.model, model_dir,
                 torch.get_num_threads())
        model = load_model(model_dir, backend=settings.backend, device=settings.device, dtype=settings.dtype,
                           num_slots=settings.num_slots, max_context=settings.max_context, name=settings.model,
                           head_vocab=settings.head_vocab, cuda_graphs=settings.cuda_graphs,
                           compile_layers=settings.compile_layers, graph_warmup_context=settings.graph_warmup_context,
                           fused_decode=True, batch_invariant=settings.batch_invariant,
                           batch_invariant_rows=settings.batch_invariant_rows)
        # On a thread that ends with it, as the model's load (loader.on_own_thread says why).
        proposer = on_own_thread(lambda: DraftModelProposer(model, top_m=settings.top_m,
                                                            copy=CopyRule(settings.copy_below),
                                                            evict_after_s=settings.evict_after_s),
                                 settings.device)
        info, top_m = model.info, settings.top_m
    engine = DraftEngine(proposer, idle_ttl_s=settings.session_ttl_s, max_draft_tokens=settings.max_draft_tokens)
    if settings.test_delay_ms > 0:  # begin_propose: every Propose passes it, batched or not
        engine.begin_propose = service.test_delayed(engine.begin_propose, settings.test_delay_ms / 1000, "Propose")
    config = DraftServiceConfig(info, tokenizer.vocab_fingerprint, tokenizer.eos_token_ids, settings.num_draft_tokens,
                                top_m, info.max_context)
    return engine, config


async def serve_draft(settings: DraftServiceSettings, engine, config, tracer_provider=None) -> None:
    """Serve `engine` until SIGTERM / SIGINT; returns after the graceful shutdown."""
    from draft_service.servicer import DRAFT_SERVICE_NAME, DraftServicer
    from specdec.observability.metrics import DraftMetrics
    from specdec.rpc import draft_pb2_grpc

    def build_servicer(executor, registry) -> DraftServicer:
        return DraftServicer(engine, executor, DraftMetrics(registry), config, settings.batching)

    await service.serve_model_service(
        settings.server, build_servicer, draft_pb2_grpc.add_DraftServiceServicer_to_server, DRAFT_SERVICE_NAME,
        executor_name="draft-model", session_ttl_s=settings.session_ttl_s, ready_file=settings.ready_file,
        tracer_provider=tracer_provider,
    )


def run(settings: DraftServiceSettings) -> int:
    engine, config = build_engine(settings)
    return service.run_traced(settings.server, lambda provider: serve_draft(settings, engine, config, provider))


def build_parser() -> argparse.ArgumentParser:
    return service.build_parser("python -m draft_service", DESCRIPTION, add_arguments)


def run_from_args(args: argparse.Namespace) -> int:
    return service.run_from_args(args, "draft service", settings_from_args, run)


def main(argv: list[str] | None = None) -> int:
    return service.main(build_parser(), run_from_args, argv)
