"""Time one batched step of the native backend with rows of equal and of different lengths (a verify
among decodes), on the CPU, one thread, the default target: what packing ragged rows saves
(docs/BENCHMARKS.md, round 28).

    python scripts/bench_ragged_step.py [--rows 16] [--context 300] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.models.llama import LlamaModel
from specdec.models.registry import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = LlamaModel(resolve_model(args.model), device="cpu", num_slots=args.rows + 1, max_context=1024)
    slots = [model.allocate() for _ in range(args.rows)]
    generator = torch.Generator().manual_seed(0)
    random_row = lambda n: torch.randint(0, 40000, (n,), generator=generator).tolist()  # noqa: E731
    for slot in slots:
        model.forward([slot], [random_row(args.context)], [1])

    def median_ms(widths: list[int]) -> float:
        times = []
        for _ in range(args.repeats):
            rows = [random_row(w) for w in widths]
            started = time.perf_counter()
            model.forward(slots[: len(widths)], rows, widths)  # every token's logits, as a verify asks
            times.append(time.perf_counter() - started)
            for slot, width in zip(slots, widths):
                model.truncate(slot, model.length(slot) - width)
        return 1000 * sorted(times)[len(times) // 2]

    n = args.rows
    for name, widths in ((f"{n} x 1", [1] * n), (f"{n - 1} x 1 + 1 x 5", [1] * (n - 1) + [5]),
                         (f"{n - 1} x 1 + 1 x 2", [1] * (n - 1) + [2]), (f"{n} x 2", [2] * n)):
        print(f"{name:18s} {median_ms(widths):7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
