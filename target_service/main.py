"""`python -m target_service` / `specdec serve target`: load the target model and serve TargetService.

main() parses flags into one frozen TargetServiceSettings, loads the model, and serves until SIGTERM
(graceful: NOT_SERVING, in-flight calls finish within --grace-period). Heavy imports (torch, the
model code) happen in run(), so building the parser for `--help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from specdec.models.reduced_head import parse_head_vocab
from specdec.models.step_threads import DEFAULT_WIDE_FROM_TOKENS
from specdec.server import service
from specdec.server.settings import ConfigError, ServerSettings, add_server_arguments, server_settings_from_args
from specdec.server.tokenizer_info import tokenizer_facts

log = logging.getLogger(__name__)

SERVICE = "target"
HELP = "serve a target model (TargetService: StartSession, Verify, Decode, Truncate, ...)"
DESCRIPTION = (
    "Serve the target model over gRPC: session-keyed KV caches, lossless verification of drafted "
    "blocks, plain decoding. Health, reflection and Prometheus /metrics included."
)
DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9102
STEP_PRICINGS = ("auto", "packed", "padded")  # --step-pricing


@dataclass(frozen=True)
class TargetServiceSettings:
    server: ServerSettings
    model: str  # registry name or HF directory
    backend: str = "native"
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool | None = None  # None: on for a CUDA device
    compile_layers: bool = False  # torch.compile the CUDA-graph layers (specdec.models.compiled_layers)
    batch_invariant: bool = False  # every row computes what it computes alone (specdec.models.batch_invariant)
    batch_invariant_rows: int | None = None  # its product chunk; None: the device's default
    graph_warmup_context: int = service.GRAPH_WARMUP_CONTEXT  # CUDA-graph shapes captured at startup
    num_slots: int = 8
    max_context: int | None = None  # None: the model's own limit (capped by the loader)
    session_ttl_s: float = 600.0
    evict_after_s: float = 1.0  # --evict-after: a session used this recently keeps its KV slot (TargetEngine)
    max_draft_tokens: int = 64
    ready_file: Path | None = None
    test_fault: str | None = None  # TEST ONLY: TargetEngine(fault_injection=...), docs/CANARY.md
    test_delay_ms: int = 0  # TEST ONLY: every forward sleeps this long (a large target's flat step cost)
    batching: service.BatchSettings = service.BatchSettings()
    trim_drafts: bool = True  # --draft-trimming goodput or step
    trim_cycles: bool = True  # --draft-trimming goodput: also price a drafted session's cycle wall time
    trim_margin: float = 0.0  # --trim-margin: the goodput gain drafts must bring (DraftTrimmer.margin)
    step_pricing: str = "auto"  # --step-pricing: what a step's cost grows with (DraftTrimmer.packed)
    # A draft model hosted here for DecodeStream's model_draft_tokens (specdec.engine.inner_draft):
    # registry name or HF directory; None: none. Loaded like the target (backend, device, dtype, slots).
    inner_draft: str | None = None
    inner_draft_head_vocab: int | str | None = "auto"  # as the draft service's --head-vocab
    inner_draft_copy_below: float = 0.5  # as the draft service's --copy-below
    # --wide-step-threads / --wide-step-tokens (CPU): forwards of at least wide_step_tokens tokens run on
    # this many intra-op threads (specdec.models.step_threads); None: every usable core; 0: off.
    wide_step_threads: int | None = None
    wide_step_tokens: int = DEFAULT_WIDE_FROM_TOKENS

    def __post_init__(self) -> None:
        service.check_model_settings(self.num_slots, self.max_context, self.session_ttl_s,
                                     self.batch_invariant, self.compile_layers, self.backend,
                                     self.batch_invariant_rows)
        if self.max_draft_tokens < 1:
            raise ConfigError(f"--max-draft-tokens must be >= 1, got {self.max_draft_tokens}")
        if not self.evict_after_s >= 0:
            raise ConfigError(f"--evict-after must be >= 0 seconds, got {self.evict_after_s}")
        if not 0.0 <= self.trim_margin <= 10.0:  # also refuses NaN
            raise ConfigError(f"--trim-margin must be in [0, 10], got {self.trim_margin}")
        if self.step_pricing not in STEP_PRICINGS:
            raise ConfigError(f"--step-pricing must be one of {', '.join(STEP_PRICINGS)}, got {self.step_pricing!r}")
        if self.wide_step_threads is not None and self.wide_step_threads < 0:
            raise ConfigError(f"--wide-step-threads must be 'auto' or >= 0 (0: off), got {self.wide_step_threads}")
        if self.wide_step_tokens < 1:
            raise ConfigError(f"--wide-step-tokens must be >= 1, got {self.wide_step_tokens}")
        if not 0.0 <= self.inner_draft_copy_below <= 1.0:  # also refuses NaN
            raise ConfigError(f"--inner-draft-copy-below must be in [0, 1] (0 = never copy), "
                              f"got {self.inner_draft_copy_below}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = parser.add_argument_group("target model")
    g.add_argument("--model", default=env("SPECDEC_TARGET_MODEL", "smollm2-135m-instruct"),
                   help="registry name or Hugging Face model directory (default: %(default)s)")
    g.add_argument("--max-draft-tokens", type=int, default=64, help="most draft tokens one Verify may carry")
    g.add_argument("--test-fault", choices=["wrong-bonus"], default=None,
                   help="TEST ONLY: corrupt verification (every bonus token) so that the canary's equality "
                        "check has a bug to catch (docs/CANARY.md); never in production")
    g.add_argument("--test-delay-ms", type=int, default=0,
                   help="TEST ONLY: make every forward this much slower, however many tokens it feeds (the "
                        "flat step cost of a large memory-bound target, on tiny test models)")
    service.add_model_arguments(g, num_slots_help="sessions whose KV caches fit at once")
    g.add_argument("--evict-after", type=float, default=1.0,
                   help="seconds a session keeps its KV cache slot after its last call: when more sessions are "
                        "active than --num-slots fit, a new one waits for a slot (its coordinator retries) "
                        "instead of evicting one in the middle of a turn (0: evict any session not in a call)")
    service.add_batching_arguments(g, what="Verify and Decode steps")
    g.add_argument("--draft-trimming", choices=["goodput", "step", "off"], default="goodput",
                   help="goodput: verify only the drafted tokens that raise the batch's expected tokens per "
                        "second (measured step cost and per-session acceptance), and, under load, none of a "
                        "session whose drafts come from a draft service and whose cycles, round trips "
                        "included, commit fewer tokens per second than plain decoding would, so that "
                        "speculation never falls below plain decoding; step: the step's goodput only; "
                        "off: verify every drafted token")
    g.add_argument("--inner-draft", default=env("SPECDEC_INNER_DRAFT") or None, metavar="MODEL",
                   help="also host this draft model (registry name or HF directory) on the target's device and "
                        "model thread, for coordinators started with --draft target:model: each streamed step "
                        "drafts and verifies here, with no draft service and no round trip per cycle")
    g.add_argument("--inner-draft-head-vocab", type=parse_head_vocab, default="auto",
                   help="the hosted draft's output head, as the draft service's --head-vocab")
    g.add_argument("--inner-draft-copy-below", type=float, default=float(env("SPECDEC_INNER_DRAFT_COPY_BELOW", "0.5")),
                   help="the hosted draft copies from the session's text where it is this unsure, as the draft "
                        "service's --copy-below (0 = never)")
    g.add_argument("--wide-step-threads", type=parse_wide_step_threads,
                   default=parse_wide_step_threads(env("SPECDEC_WIDE_STEP_THREADS", "auto")),
                   help="CPU: intra-op threads for the target's forwards (those of at least --wide-step-tokens "
                        "tokens), which the rest of a cycle waits for, while the process keeps its own threads "
                        "(OMP_NUM_THREADS, a share of cores used by other services too) for the rest, a hosted "
                        "draft's forwards; auto (default): every core this process may use (its CPU affinity "
                        "and container quota); 0: off")
    g.add_argument("--wide-step-tokens", type=int, default=int(env("SPECDEC_WIDE_STEP_TOKENS", DEFAULT_WIDE_FROM_TOKENS)),
                   help="the fewest tokens a forward needs to run on --wide-step-threads (default: %(default)s)")
    g.add_argument("--trim-margin", type=float, default=0.0,
                   help="goodput trimming: let drafts through only if they raise the step's expected tokens "
                        "per second by this share over plain decoding (e.g. 0.2 on CPUs, where a drafted "
                        "session's draft round trip, not in the step cost, slows the batch; 0..10)")
    g.add_argument("--step-pricing", choices=STEP_PRICINGS, default="auto",
                   help="how goodput trimming prices a batched step: packed, by the tokens it feeds; padded, by "
                        "its rows times its widest row; auto (default): as the backend runs it (the native "
                        "backend packs ragged rows except in CUDA graphs)")
    add_server_arguments(parser, port=DEFAULT_PORT, metrics_port=DEFAULT_METRICS_PORT)


def settings_from_args(args: argparse.Namespace) -> TargetServiceSettings:
    return TargetServiceSettings(
        server=server_settings_from_args(args, service=SERVICE), model=args.model,
        max_draft_tokens=args.max_draft_tokens, test_fault=args.test_fault, test_delay_ms=args.test_delay_ms,
        evict_after_s=args.evict_after,
        batching=service.batch_settings_from_args(args), trim_drafts=args.draft_trimming != "off",
        trim_cycles=args.draft_trimming == "goodput",
        trim_margin=args.trim_margin, step_pricing=args.step_pricing, inner_draft=args.inner_draft,
        inner_draft_head_vocab=args.inner_draft_head_vocab,
        inner_draft_copy_below=args.inner_draft_copy_below,
        wide_step_threads=args.wide_step_threads, wide_step_tokens=args.wide_step_tokens,
        **service.model_settings_from_args(args),
    )


def parse_wide_step_threads(text: str) -> int | None:
    """--wide-step-threads: 'auto' (None: every usable core) or a count (0: off)."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a thread count (0: off), got {text!r}") from None


async def serve_target(settings: TargetServiceSettings, engine, tokenizer, tracer_provider=None,
                       inner_draft=None) -> None:
    """Serve `engine` until SIGTERM / SIGINT; returns after the graceful shutdown."""
    from specdec.observability.metrics import TargetMetrics
    from specdec.rpc import target_pb2_grpc
    from target_service.servicer import TARGET_SERVICE_NAME, TargetServicer

    def build_servicer(executor, registry) -> TargetServicer:
        return TargetServicer(engine, executor, TargetMetrics(registry), tokenizer, settings.max_draft_tokens,
                              settings.batching, settings.trim_drafts, settings.trim_margin, inner_draft,
                              trim_cycles=settings.trim_cycles, step_pricing=settings.step_pricing)

    await service.serve_model_service(
        settings.server, build_servicer, target_pb2_grpc.add_TargetServiceServicer_to_server, TARGET_SERVICE_NAME,
        executor_name="target-model", session_ttl_s=settings.session_ttl_s, ready_file=settings.ready_file,
        tracer_provider=tracer_provider,
    )


def wide_note(step_threads) -> str:
    if step_threads is None:
        return ""
    if step_threads.wide_from_tokens <= 1:
        return f", its forwards on {step_threads.wide}"
    return f", forwards of {step_threads.wide_from_tokens} tokens or more on {step_threads.wide}"


def invariant_note(batch_invariant: bool, rows: int | None) -> str:
    if not batch_invariant:
        return ""
    return ", batch-invariant" + (f", products of {rows} rows" if rows else "")


def run(settings: TargetServiceSettings, adapt_inner_draft=None) -> int:
    """adapt_inner_draft(engine) -> engine: a benchmark's hook on the hosted draft (bench/replay_target)."""
    import torch

    from specdec.engine.target import TargetEngine
    from specdec.models.loader import load_model, on_own_thread
    from specdec.models.registry import resolve_model
    from specdec.models.step_threads import policy_for

    model_dir = resolve_model(settings.model)
    step_threads = policy_for(settings.device, settings.wide_step_threads, settings.wide_step_tokens,
                              settings.batch_invariant)
    log.info("loading target %s from %s (%s, %s, %s%s; %d intra-op threads%s)", settings.model, model_dir,
             settings.backend, settings.device, settings.dtype,
             invariant_note(settings.batch_invariant, settings.batch_invariant_rows), torch.get_num_threads(),
             wide_note(step_threads))
    model = load_model(model_dir, backend=settings.backend, device=settings.device, dtype=settings.dtype,
                       num_slots=settings.num_slots, max_context=settings.max_context, name=settings.model,
                       cuda_graphs=settings.cuda_graphs, compile_layers=settings.compile_layers,
                       graph_warmup_context=settings.graph_warmup_context, batch_invariant=settings.batch_invariant,
                       batch_invariant_rows=settings.batch_invariant_rows, step_threads=step_threads)
    if settings.test_fault:
        log.warning("TEST ONLY: verification is corrupted on purpose (--test-fault %s)", settings.test_fault)
    if settings.test_delay_ms > 0:
        model.forward = service.test_delayed(model.forward, settings.test_delay_ms / 1000, "target forward")
    engine = TargetEngine(model, idle_ttl_s=settings.session_ttl_s, fault_injection=settings.test_fault,
                          evict_after_s=settings.evict_after_s)
    tokenizer = tokenizer_facts(model_dir)
    # Built on a thread that ends with it (loader.on_own_thread says why): the hosted draft's engine runs
    # products on the process's threads, and a team left on this thread slowed the target's steps by a third.
    inner_draft = on_own_thread(lambda: load_inner_draft(settings, tokenizer), settings.device) \
        if settings.inner_draft else None
    if inner_draft is not None and adapt_inner_draft is not None:
        inner_draft = adapt_inner_draft(inner_draft)
    return service.run_traced(settings.server,
                              lambda provider: serve_target(settings, engine, tokenizer, provider, inner_draft))


def load_inner_draft(settings: TargetServiceSettings, tokenizer):
    """The hosted draft's engine: its vocabulary must be the target's (its tokens are verified as ids)."""
    from specdec.engine.draft import DraftEngine
    from specdec.models.loader import load_model
    from specdec.models.registry import resolve_model
    from specdec.proposers.copy_guess import CopyRule
    from specdec.proposers.draft_model import DraftModelProposer

    draft_dir = resolve_model(settings.inner_draft)
    if tokenizer_facts(draft_dir).vocab_fingerprint != tokenizer.vocab_fingerprint:
        raise ConfigError(f"--inner-draft {settings.inner_draft}: its vocabulary differs from the target's")
    log.info("hosting draft %s from %s for model_draft_tokens", settings.inner_draft, draft_dir)
    model = load_model(draft_dir, backend=settings.backend, device=settings.device, dtype=settings.dtype,
                       num_slots=settings.num_slots, max_context=settings.max_context, name=settings.inner_draft,
                       head_vocab=settings.inner_draft_head_vocab, cuda_graphs=settings.cuda_graphs,
                       graph_warmup_context=settings.graph_warmup_context, fused_decode=True)
    return DraftEngine(DraftModelProposer(model, copy=CopyRule(settings.inner_draft_copy_below)), idle_ttl_s=settings.session_ttl_s,
                       max_draft_tokens=settings.max_draft_tokens)


def build_parser() -> argparse.ArgumentParser:
    return service.build_parser("python -m target_service", DESCRIPTION, add_arguments)


def run_from_args(args: argparse.Namespace) -> int:
    return service.run_from_args(args, "target service", settings_from_args, run)


def main(argv: list[str] | None = None) -> int:
    return service.main(build_parser(), run_from_args, argv)
