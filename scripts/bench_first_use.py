"""What a forward of a width no CUDA graph covers costs on a GPU: eager on its first use, eager again,
and as graphed pieces of up to 9 tokens (specdec.models.llama: LlamaModel._in_pieces).

    python scripts/bench_first_use.py --model random:llama3.2-1b --device cuda:0 --widths 1,5,9,10,16,17,23,31,40,48

Each width is fed to one slot that already holds --context tokens, timed host to host (synchronize
before and after), then undone with truncate. The pieces are fed through the public forward, one
piece at a time, so that the model's own chunking (which covers up to 36 tokens) does not decide.
Numbers: docs/BENCHMARKS.md, "Catch-ups as graphed pieces".
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.bench.gpu import random_model_dir
from specdec.models.cuda_graphs import MAX_TOKENS_PER_ROW
from specdec.models.llama import LlamaModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama3.2-1b", help="a random:<preset> or a model directory")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=200, help="tokens the slot holds before each forward")
    parser.add_argument("--widths", default="1,5,9,10,12,16,17,23,31,40,48")
    parser.add_argument("--max-context", type=int, default=4096)
    args = parser.parse_args()
    path = random_model_dir(args.model, args.dtype) if args.model.startswith("random:") else args.model
    model = LlamaModel(path, device=args.device, dtype=args.dtype, num_slots=2, max_context=args.max_context,
                       cuda_graphs=True,
                       graph_warmup_context=1024)
    slot = model.allocate()
    model.forward([slot], [list(range(5, 5 + args.context))], [1])

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def timed(feed) -> float:
        sync()
        started = time.perf_counter()
        feed()
        sync()
        return (time.perf_counter() - started) * 1000

    def whole(tokens: list[int]) -> None:
        """One forward: graphed up to 9 tokens, eager beyond (the graphs set aside: no pieces)."""
        graphs = model.graphs
        if len(tokens) > MAX_TOKENS_PER_ROW:
            model.graphs = None
        try:
            model.forward([slot], [tokens], [1])
        finally:
            model.graphs = graphs

    for width in (int(w) for w in args.widths.split(",")):
        tokens = list(range(7, 7 + width))
        times = []
        for _ in range(2):  # first use, then again
            times.append(timed(lambda: whole(tokens)))
            model.truncate(slot, args.context)
        pieces = [tokens[i:i + MAX_TOKENS_PER_ROW] for i in range(0, width, MAX_TOKENS_PER_ROW)]
        times.append(timed(lambda: [model.forward([slot], [p], [1 if p is pieces[-1] else 0]) for p in pieces]))
        model.truncate(slot, args.context)
        print(f"width {width:3d}: first {times[0]:7.1f} ms, again {times[1]:6.1f} ms, "
              f"graphed pieces {times[2]:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
