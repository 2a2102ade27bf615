"""`specdec generate`: run the system in one process with the default models and print an answer."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from specdec.models.reduced_head import parse_head_vocab
from specdec.sampling.params import SamplingMode, SamplingParams


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-k", type=int, default=0, help="0 = off")
    group.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--sampling-mode", choices=[m.value for m in SamplingMode], default="rejection",
                       help="rejection: optimal acceptance; gumbel: output identical to plain decoding "
                            "with the same seed")
    group.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed,
                          SamplingMode(args.sampling_mode)).validate()


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate an answer in one process (no services)",
        description="Load target and draft in this process and generate with speculative decoding.",
    )
    parser.add_argument("prompt", help="the user's message (the chat template is applied)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or HF directory")
    parser.add_argument("--draft", default=None,
                        help="'ngram', 'none', a registry name or an HF directory (default: the "
                             "packaged draft if present, else ngram)")
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=4,
                        help="draft length (the starting one with --draft-length adaptive)")
    parser.add_argument("--draft-length", choices=["adaptive", "fixed"], default="adaptive")
    parser.add_argument("--pipelining", choices=["on", "off"], default="off",
                        help="pipelined cycles (in one process the engines take turns: same output, no gain)")
    parser.add_argument("--pipeline-branches", type=int, choices=[1, 2, 3], default=1,
                        help="with --pipelining on: branches per speculative draft (2: + a second bonus guess, "
                             "3: + all but the last token accepted; docs/PIPELINING.md)")
    parser.add_argument("--draft-head-vocab", type=parse_head_vocab, default="auto",
                        help="score only the draft's N most frequent tokens and the session's own context "
                             "tokens ('auto': the draft's recommendation on CPU; 'full' or 0: the whole vocabulary)")
    parser.add_argument("--backend", choices=["native", "hf", "auto"], default="native")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default=None,
                        help="replay decode and verify steps as CUDA graphs (default: on for a CUDA device)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    parser.add_argument("--compare", action="store_true",
                        help="also decode plainly and report the speedup and token-for-token equality")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_sampling_arguments(parser)
    parser.set_defaults(func=run)


def default_draft() -> str:
    try:
        from specdec.models.registry import DEFAULT_DRAFT, resolve_model

        resolve_model(DEFAULT_DRAFT, fetch=False)
        return DEFAULT_DRAFT
    except Exception:
        return "ngram"


def run(args: argparse.Namespace) -> int:
    from specdec.generation.local import LocalSettings, LocalSystem

    params = sampling_params(args)
    draft = args.draft or default_draft()
    system = LocalSystem(LocalSettings(target=args.target, draft=draft, backend=args.backend,
                                       device=args.device, dtype=args.dtype,
                                       cuda_graphs=None if args.cuda_graphs is None else args.cuda_graphs == "on",
                                       num_draft_tokens=args.num_draft_tokens,
                                       adaptive=args.draft_length == "adaptive",
                                       pipelining=args.pipelining == "on",
                                       pipeline_branches=args.pipeline_branches,
                                       draft_head_vocab=args.draft_head_vocab))
    prompt_ids = system.encode(args.prompt, raw=args.raw)
    stream = None if args.json else (lambda text: print(text, end="", flush=True))
    result = asyncio.run(system.generate(prompt_ids, params, args.max_new_tokens, args.stop, stream))
    report = summarize(result, draft)
    if args.compare:
        plain = asyncio.run(system.generate(prompt_ids, params, args.max_new_tokens, args.stop, speculate=False))
        report["plain_seconds"] = round(plain.seconds, 3)
        report["speedup"] = round(plain.seconds / result.seconds, 3)
        report["identical_to_plain"] = plain.generation.token_ids == result.generation.token_ids
    if args.json:
        print(json.dumps({"text": result.text, **report}, indent=2))
    else:
        print("\n", file=sys.stderr)
        for key, value in report.items():
            print(f"{key:>22}: {value}", file=sys.stderr)
    return 0


def summarize(result, draft: str) -> dict:
    stats = result.generation.stats
    n = len(result.generation.token_ids)
    decode_time = result.seconds - result.first_token_seconds
    return {
        "draft": draft,
        "finish_reason": result.generation.finish_reason.value,
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": n,
        "seconds": round(result.seconds, 3),
        "time_to_first_token_s": round(result.first_token_seconds, 3),
        "time_per_output_token_ms": round(1000 * decode_time / max(1, n - 1), 2),
        "tokens_per_second": round(n / result.seconds, 2) if result.seconds else 0.0,
        "cycles": stats.cycles,
        "acceptance_rate": round(stats.acceptance_rate, 3),
        "mean_accepted_length": round(stats.mean_accepted_length, 3),
        "acceptance_by_position": [round(a, 3) for a in stats.acceptance_by_position()],
        "fallbacks": stats.fallbacks,
        "pipeline_hit_rate": None if stats.pipeline_hit_rate is None else round(stats.pipeline_hit_rate, 3),
        "pipeline_hits_second_guess": stats.pipeline_hits_second_guess,
        "pipeline_hits_rejected_last": stats.pipeline_hits_rejected_last,
    }
