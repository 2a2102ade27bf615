"""Where a draft model's time per drafted token goes on a GPU (docs/BENCHMARKS.md, round 22).

A DraftEngine over the native backend, as the draft service runs it, one greedy session of 220
tokens: the median time of a Propose of k tokens, of the model's forward alone (one CUDA graph
replay), and the torch profiler's kernels over five Proposes of 8.

    python scripts/profile_draft_step.py --model random:llama3.2-1b --device cuda:1 [--compile-layers]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specdec.bench.gpu import model_dir
from specdec.engine.draft import DraftEngine
from specdec.models.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama3.2-1b", help="a random:<preset>, registry name or directory")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile-layers", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    started = time.perf_counter()
    model = load_model(model_dir(args.model, args.dtype), backend="native", device=args.device, dtype=args.dtype,
                       num_slots=4, max_context=4096, compile_layers=args.compile_layers)
    print(f"loaded in {time.perf_counter() - started:.1f} s", flush=True)
    cuda = torch.device(args.device).type == "cuda"
    sync = (lambda: torch.cuda.synchronize(args.device)) if cuda else (lambda: None)
    engine = DraftEngine(DraftModelProposer(model, top_m=0))
    context = [1000 + (i * 7919) % 30000 for i in range(220)]
    engine.start_session("s", context, SamplingParams())

    def propose(k: int) -> float:
        started = time.perf_counter()
        engine.propose("s", len(context), [], k)  # back to the context, then k tokens
        sync()
        return time.perf_counter() - started

    for k in (1, 2, 4, 8):  # first uses build the graphs (and compile, with --compile-layers)
        print(f"first propose of {k}: {propose(k):.2f} s", flush=True)
    for k in (1, 2, 4, 8):
        median = statistics.median(propose(k) for _ in range(args.repeats))
        print(f"propose k={k}: {median * 1e3:.2f} ms, {median / k * 1e3:.2f} ms a token", flush=True)

    slot = engine.proposer._open["s"].slot
    length = model.length(slot)

    def forward() -> float:
        model.truncate(slot, length)
        started = time.perf_counter()
        model.forward([slot], [[context[-1]]], [1])
        sync()
        return time.perf_counter() - started

    print(f"model forward, one token: {statistics.median(forward() for _ in range(2 * args.repeats)) * 1e3:.2f} ms")
    model.truncate(slot, length)
    if getattr(model, "graphs", None) is not None:
        print("graphs:", vars(model.graphs.stats))
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(5):
            propose(8)
    order = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=order, row_limit=14, max_name_column_width=40))


if __name__ == "__main__":
    main()
