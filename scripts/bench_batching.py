"""Throughput of plain and speculative decoding at several concurrencies, through the services.

    python scripts/bench_batching.py [--target smollm2-135m-instruct] [--draft ngram] \
        [--concurrency 1 4 16] [--seconds 20] [--max-new-tokens 96] [--repeats 3] \
        [--draft-length adaptive] [--target-arg=--max-batch-size=16 ...] [--draft-arg=... ...]

Starts a target service and a draft service as processes (specdec.processes), then runs every cell
(concurrency x mode) once per repetition, interleaved, so that a neighbour's load on a shared
machine hits every cell alike. A cell is a closed loop at constant concurrency: `concurrency`
workers each generate one session after another (prompt, prefill, max_new_tokens tokens) through
the loop the coordinator runs (SpeculativeLoop over the gRPC clients), with the draft service
(speculative) or without it (plain decoding on the target), for --seconds; the tokens emitted in
that window count. Greedy, no EOS stop, so both modes do the same work (greedy speculation is
lossless: the same tokens, which the script checks). Prints per cell the median tokens per second
over the repetitions, speculative over plain at the same concurrency, and each mode over itself at
the first concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

PROMPTS = [
    "Rewrite this function with type hints and a docstring, keeping the body as it is:\n"
    "def area(w, h):\n    if w < 0 or h < 0:\n        raise ValueError('negative')\n    return w * h",
    "Summarise in three sentences: The lighthouse stood on the northern cape for two hundred years. "
    "Its keepers kept a log of every ship that passed, every storm and every repair to the lamp.",
    "List the planets of the solar system in order from the sun, one a line, with one fact each.",
    "Write a short welcome message for new contributors to an open-source project.",
    "Explain step by step how to compute 17 * 23 in your head.",
    "Translate to French: The cat sleeps on the warm windowsill every afternoon.",
    "Write a Python function that returns the n-th Fibonacci number, then explain it line by line.",
    "Give me a packing list for a three-day hiking trip in the mountains.",
    "Describe the water cycle to a ten-year-old.",
    "Repeat the following list, numbering each line: apples, pears, plums, cherries, grapes, figs.",
    "Draft a polite email asking a colleague to review a pull request by Friday.",
    "What are the pros and cons of working from home? Answer with two bulleted lists.",
    "Write a haiku about autumn, then explain its imagery.",
    "Convert this JSON to YAML: {\"name\": \"demo\", \"replicas\": 3, \"ports\": [80, 443]}",
    "Explain the difference between a list and a tuple in Python with examples.",
    "Tell a short story about a robot who learns to paint.",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="ngram", help="'ngram' or a draft model (registry name or directory)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-new-tokens", type=int, default=96, help="per session")
    parser.add_argument("--seconds", type=float, default=20.0, help="the measured window of each cell")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--draft-length", choices=["adaptive", "fixed"], default="adaptive")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of the target (and draft model)")
    parser.add_argument("--target-arg", action="append", default=[], help="extra target service flag")
    parser.add_argument("--draft-arg", action="append", default=[], help="extra draft service flag")
    return parser.parse_args()


def start_services(args: argparse.Namespace):
    from specdec.models.registry import resolve_model
    from specdec.processes import launch, wait_all

    target_dir = resolve_model(args.target)
    slots = str(max(max(args.concurrency), 8))
    env = {"OMP_NUM_THREADS": str(args.threads), "OTEL_TRACES_EXPORTER": "none"}
    target = launch("target_service", ["--model", str(target_dir), "--num-slots", slots, "--max-context", "1024",
                                       "--plaintext", *args.target_arg], env=env)
    if args.draft == "ngram":
        draft_flags = ["--proposer", "ngram", "--tokenizer", str(target_dir)]
    else:
        draft_flags = ["--model", str(resolve_model(args.draft)), "--num-slots", slots, "--max-context", "1024"]
    draft = launch("draft_service", [*draft_flags, "--plaintext", *args.draft_arg], env=env)
    wait_all(target, draft, timeout_s=600)
    return target_dir, target, draft


async def run_cell(args, target_address, draft_address, prompts, concurrency: int, speculative: bool,
                   tag: str) -> dict:
    """`concurrency` workers, each generating one session after another (prompts round robin) for
    args.seconds; the tokens emitted inside that window count (prefills included in the time)."""
    from draft_service.client import connect as connect_draft
    from specdec.generation.loop import SpeculativeLoop, start_generation
    from specdec.generation.session import LoopSettings
    from specdec.generation.stats import SpeculationStats
    from specdec.generation.stopping import StopChecker
    from specdec.sampling.params import SamplingParams
    from specdec.server.settings import ClientSettings
    from target_service.client import connect as connect_target

    client = ClientSettings(plaintext=True, timeout_s=600.0)
    settings = LoopSettings(args.num_draft_tokens, adaptive=args.draft_length == "adaptive")
    emitted, outputs, stats = [0], {}, SpeculationStats()
    async with connect_target(target_address, client) as target, connect_draft(draft_address, client) as draft:
        deadline = time.perf_counter() + args.seconds

        async def emit(tokens):
            if time.perf_counter() < deadline:
                emitted[0] += len(tokens)

        async def worker(w: int):
            n = 0
            while time.perf_counter() < deadline:
                index, session_id = (w + concurrency * n) % len(prompts), f"{tag}-{w}-{n}"
                n += 1
                cursor, first = await start_generation(target, session_id, prompts[index], SamplingParams())
                await emit([first])
                loop = SpeculativeLoop(target, draft if speculative else None, settings)
                result = await loop.run(cursor, StopChecker(args.max_new_tokens - 1), emit)
                outputs.setdefault(index, [first] + result.token_ids)
                stats.merge(result.stats)
                await target.end_session(session_id)
                if speculative:
                    await draft.end_session(session_id)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return {"tokens": emitted[0], "seconds": args.seconds, "tokens_per_s": emitted[0] / args.seconds,
            "stats": {"spec_cycles": stats.cycles, "plain_steps": stats.decode_steps, "drafted": stats.drafted,
                      "accepted": stats.accepted},
            "acceptance": stats.accepted / stats.drafted if stats.drafted else None, "outputs": outputs}


def batch_totals(target) -> tuple[float, float]:
    """(batched steps, rows in them) so far, from the target's batch_size histogram."""
    steps = rows = 0.0
    for line in target.metrics().splitlines():
        if line.startswith("specdec_target_batch_size_count") and 'step="prefill"' not in line:
            steps += float(line.split()[-1])
        elif line.startswith("specdec_target_batch_size_sum") and 'step="prefill"' not in line:
            rows += float(line.split()[-1])
    return steps, rows


def encode_prompts(target_dir) -> list[list[int]]:
    from specdec.models.tokenizer import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    return [encode_prompt(tokenizer, text) for text in PROMPTS]


def report(args, cells: dict) -> None:
    median = {key: statistics.median(r["tokens_per_s"] for r in runs) for key, runs in cells.items()}
    print(f"\nthroughput, generated tokens/s (median of {args.repeats}); draft {args.draft}, "
          f"{args.draft_length} k={args.num_draft_tokens}, {args.max_new_tokens} tokens per session")
    print(f"{'sessions':>8} {'plain':>9} {'spec':>9} {'spec/plain':>10} {'plain/1':>8} {'spec/1':>8}")
    base = args.concurrency[0]
    for c in args.concurrency:
        plain, spec = median[(c, "plain")], median[(c, "spec")]
        print(f"{c:>8} {plain:>9.1f} {spec:>9.1f} {spec / plain:>10.2f} {plain / median[(base, 'plain')]:>8.2f} "
              f"{spec / median[(base, 'spec')]:>8.2f}")
    print(json.dumps({f"{c}-{mode}": round(v, 2) for (c, mode), v in median.items()}))


def main() -> None:
    args = parse_args()
    from specdec.processes import stop_all

    target_dir, target, draft = start_services(args)
    try:
        prompts = encode_prompts(target_dir)
        cells: dict = {}
        for repeat in range(args.repeats):
            for c in args.concurrency:
                for mode in ("plain", "spec"):
                    steps, rows = batch_totals(target)
                    result = asyncio.run(run_cell(args, target.address, draft.address, prompts, c,
                                                  mode == "spec", f"r{repeat}-{c}-{mode}"))
                    steps_after, rows_after = batch_totals(target)
                    result["steps"] = steps_after - steps
                    result["rows_per_step"] = (rows_after - rows) / max(1.0, steps_after - steps)
                    cells.setdefault((c, mode), []).append(result)
                    print(f"repeat {repeat} sessions {c:>2} {mode:>5}: {result['tokens_per_s']:7.1f} tokens/s "
                          f"({result['tokens']} tokens in {result['seconds']:.0f} s; {result['steps']:.0f} "
                          f"target steps of {result['rows_per_step']:.1f} rows; acceptance "
                          f"{result['acceptance'] or 0:.2f})", flush=True)
            for c in args.concurrency:  # lossless under batching: the same greedy tokens either way
                plain, spec = cells[(c, "plain")][-1]["outputs"], cells[(c, "spec")][-1]["outputs"]
                differ = [i for i in plain.keys() & spec.keys() if plain[i] != spec[i]]
                if differ:
                    print(f"WARNING: speculative output differs from plain at {c} sessions, prompts {differ}")
        report(args, cells)
    finally:
        stop_all(target, draft)


if __name__ == "__main__":
    main()
