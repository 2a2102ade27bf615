"""`specdec bench`: plain decoding, the Hugging Face peers and this system, side by side.

    specdec bench                                   # the default prompt set, every method
    specdec bench --prompts ../shared/data/specbench/dev.jsonl --per-category 2 --concurrency 1,4,16
    specdec bench --netem 0.2ms,1ms                 # the service methods again behind a network delay
    specdec bench --arrival-rate 0.2,0.5            # open loop: requests arriving at a set rate

Writes a JSON report with every number and a PNG, and prints a short table. See specdec/bench/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdec.errors import InvalidArgument


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"concurrency levels are sessions, comma-separated, e.g. 1,4,16; "
                                         f"got {text!r}") from None
    if any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError(f"every concurrency level must be at least 1 session, got {text!r}")
    return levels


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _delays(text: str) -> tuple[float, ...]:
    """"0.2ms,1ms" / "200us" / "1" (milliseconds) -> (0.2, 1.0)."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part.endswith("us"):
            out.append(float(part[:-2]) / 1000)
        else:
            out.append(float(part.removesuffix("ms")))
    return tuple(out)


def add_parser(subparsers) -> None:
    from specdec.bench.methods import CATALOG

    parser = subparsers.add_parser(
        "bench", help="benchmark this system against plain decoding and Hugging Face, interleaved",
        description="Run plain decoding, Hugging Face greedy/assisted/prompt-lookup and this system "
                    "(distributed: real processes, gRPC, Redis) on the same prompts in one interleaved run; "
                    "write a JSON report and a PNG; print a table.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="methods:\n" + "\n".join(f"  {k:<24} {v}" for k, v in CATALOG.items()),
    )
    parser.add_argument("--target", default=None, help="registry name or HF directory (default: the default target)")
    parser.add_argument("--draft", default=None,
                        help="draft model: registry name or HF directory; 'none' for no draft model "
                             "(default: the packaged default draft if present, else none)")
    parser.add_argument("--prompts", help="Spec-Bench-format JSONL (default: the project's own set)")
    parser.add_argument("--categories", default="", help="comma-separated categories (default: all)")
    parser.add_argument("--per-category", type=int, help="first N prompts of each category")
    parser.add_argument("--limit", type=int, help="at most N prompts, taken round-robin over categories")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    parser.add_argument("--k-policy", default="fixed",
                        help="fixed: every request drafts k; server: the coordinator's own draft-length policy "
                             "(request k = 0); fixed,server: both, the latter as methods named ...@server; "
                             "fixed:1,2,3,4,6,8,server: every listed k (methods ...@k<N>, k itself keeps the "
                             "plain name) and the coordinator's policy, in one interleaved run")
    parser.add_argument("--methods", default="", help=f"comma-separated subset of: {', '.join(CATALOG)}")
    parser.add_argument("--runs", type=int, default=1, help="passes over the prompts (batch 1)")
    parser.add_argument("--concurrency", type=_levels, default=(1,),
                        help="concurrent sessions, e.g. 1,4,16 (service methods; 1 is the batch-1 pass)")
    parser.add_argument("--concurrency-prompts", type=int, default=16, help="requests per method and level")
    parser.add_argument("--concurrency-rounds", type=int, default=1)
    parser.add_argument("--arrival-rate", type=_rates, default=(),
                        help="open loop: requests per second, e.g. 0.2,0.5 (service methods; requests arrive as a "
                             "Poisson process, the same instants for every method; off by default)")
    parser.add_argument("--arrival-requests", type=_positive, default=32, help="requests per method, rate and round")
    parser.add_argument("--arrival-rounds", type=_positive, default=1)
    parser.add_argument("--arrival-max-sessions", type=_positive, default=16,
                        help="requests in flight at once; a later arrival waits in the client, and its latency "
                             "counts the wait")
    parser.add_argument("--netem", type=_delays, default=(), help="network delays, e.g. 0.2ms,1ms (off by default)")
    parser.add_argument("--netem-mode", choices=["auto", "netns", "proxy"], default="auto",
                        help="auto: netns + tc netem where it works, else a TCP delay proxy")
    parser.add_argument("--netem-prompts", type=int, default=6, help="prompts per delay level")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads in every process (default: the cores)")
    parser.add_argument("--backend", choices=["native", "hf", "auto"], default="native")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-context", type=int,
                        help="tokens per session in every model (default: the model's limit capped at 2048); "
                             "byte-level random models need more for Spec-Bench's long prompts")
    parser.add_argument("--target-arg", action="append", default=[], metavar="FLAG",
                        help="an extra flag for the target service, repeatable, e.g. --target-arg=--trim-margin=0.2")
    parser.add_argument("--draft-arg", action="append", default=[], metavar="FLAG",
                        help="an extra flag for every draft service, repeatable, e.g. --draft-arg=--compile-layers")
    parser.add_argument("--coordinator-arg", action="append", default=[], metavar="FLAG",
                        help="an extra flag for every coordinator, repeatable, e.g. --coordinator-arg=--pipelining=auto")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default=None,
                        help="native backend on CUDA: replay decode and verify steps as CUDA graphs, in the "
                             "services and in process (default: on for a CUDA device)")
    parser.add_argument("--draft-device", help="the draft's device (default: --device), e.g. cuda:1")
    parser.add_argument("--pld-tokens", type=int, help="prompt_lookup_num_tokens for hf-pld (default: k)")
    scale = parser.add_argument_group("model scale (GPU)")
    scale.add_argument("--replay-alpha", type=lambda t: tuple(float(x) for x in t.split(",") if x), default=(),
                       help="replay proposer acceptance(s), e.g. 0.6,0.8,0.9: one method each (needs --draft)")
    scale.add_argument("--replay-seed", type=int, default=0)
    scale.add_argument("--replay-alpha-spread", type=_spread, default=0.0,
                       help="give each prompt its own alpha, evenly spaced over alpha +- this (a mix of "
                            "predictable and unpredictable prompts; default 0: one alpha for all)")
    scale.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    scale.add_argument("--tie-units", type=_tie_units, default=None,
                       help="bf16 / fp16: a divergence from plain decoding whose re-scored logit gap is within "
                            "this many units in the last place of the logits (at least 0.05) is a numerical "
                            "tie, a wider one unexplained (default: specdec.generation.equality.TIE_ULPS, 4)")
    scale.add_argument("--floor", action="store_true",
                       help="measure the memory-bandwidth floor of a target step (weight bytes / copy bandwidth)")
    parser.add_argument("--timing-repeats", type=int, default=3, help="engine step timings per prompt")
    parser.add_argument("--seed", type=int, default=0, help="shuffles the base order of the methods")
    parser.add_argument("--out", type=Path, default=Path("bench-results/bench.json"),
                        help="the JSON report (gzip-compressed where the name ends in .gz)")
    parser.add_argument("--plot", type=Path, help="the PNG (default: the report's path with .png for .json / .json.gz)")
    parser.add_argument("--log-dir", type=Path, help="service logs (default: a temporary folder)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--replot", type=Path, metavar="JSON",
                        help="recompute a report's numbers from its raw requests (rewrites it), redraw its PNG, "
                             "print its tables; measures nothing")
    parser.set_defaults(func=run)


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"arrival rates are requests per second, comma-separated, e.g. 0.2,0.5; "
                                         f"got {text!r}") from None
    if any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"every arrival rate must be > 0 requests per second, got {text!r}")
    return rates


def _spread(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"the spread must be in [0, 1] (each prompt's alpha is clipped to "
                                         f"[0, 1]), got {text}")
    return value


def _tie_units(text: str) -> float:
    value = float(text)
    if not value >= 0.0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"--tie-units must be >= 0 (0: only the 0.05 floor), got {text}")
    return value


def default_draft() -> str | None:
    from specdec.commands.generate import default_draft as packaged_or_ngram

    draft = packaged_or_ngram()
    return None if draft == "ngram" else draft


def build_config(args: argparse.Namespace):
    from specdec.bench.runner import BenchConfig
    from specdec.models.registry import DEFAULT_TARGET

    draft = args.draft if args.draft is not None else default_draft()
    return BenchConfig(
        target=args.target or DEFAULT_TARGET, draft=None if draft in (None, "none") else draft,
        prompts_file=args.prompts, categories=tuple(c for c in args.categories.split(",") if c),
        per_category=args.per_category, limit=args.limit, max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens, k_policy=args.k_policy,
        methods=tuple(m for m in args.methods.split(",") if m), runs=args.runs,
        concurrency=tuple(args.concurrency) or (1,), concurrency_prompts=args.concurrency_prompts,
        concurrency_rounds=args.concurrency_rounds, arrival_rates=tuple(args.arrival_rate),
        arrival_requests=args.arrival_requests, arrival_rounds=args.arrival_rounds,
        arrival_max_sessions=args.arrival_max_sessions, netem_ms=tuple(args.netem), netem_mode=args.netem_mode,
        netem_prompts=args.netem_prompts, threads=args.threads, backend=args.backend, dtype=args.dtype,
        device=args.device, draft_device=args.draft_device,
        cuda_graphs=None if args.cuda_graphs is None else args.cuda_graphs == "on", pld_tokens=args.pld_tokens,
        max_context=args.max_context,
        timing_repeats=args.timing_repeats, seed=args.seed, log_dir=args.log_dir, replay_alphas=args.replay_alpha,
        replay_seed=args.replay_seed, replay_alpha_spread=args.replay_alpha_spread, ignore_eos=args.ignore_eos,
        **({} if args.tie_units is None else {"tie_units": args.tie_units}),
        floor=args.floor,
        target_args=tuple(args.target_arg), draft_args=tuple(args.draft_arg), coordinator_args=tuple(args.coordinator_arg),
    )


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specdec.bench.output import assemble, recompute, tables
    from specdec.bench.plot import plot_report
    from specdec.bench.report_file import plot_path, read_report, write_report
    from specdec.bench.runner import Bench

    if args.replot:
        report = recompute(read_report(args.replot))
        write_report(args.replot, report)
        plot = plot_report(report, args.plot or plot_path(args.replot))
        print(tables(report))
        print(f"plot:   {plot}", file=sys.stderr)
        return 0
    try:
        bench = Bench(build_config(args))
    except ValueError as exc:  # a value the benchmark refuses (unknown methods, draft lengths): one line
        raise InvalidArgument(str(exc)) from None
    with tqdm(total=bench.total_steps(), disable=args.no_progress, unit="req", file=sys.stderr) as progress:
        bench.progress = progress
        collected = bench.run()
    report = assemble(bench, collected)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_report(args.out, report)
    try:
        plot = plot_report(report, args.plot or plot_path(args.out))
    except ImportError as exc:  # matplotlib is the `bench` extra; redraw later with --replot
        plot = f"not drawn ({exc}); run `specdec bench --replot {args.out}` where matplotlib is installed"
    print(tables(report))
    print(f"\nreport: {args.out}\nplot:   {plot}", file=sys.stderr)
    return 0
