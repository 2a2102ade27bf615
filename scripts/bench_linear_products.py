"""Time one forward's worth of matrix products on the CPU, by row count, for each linear kernel.

    python scripts/bench_linear_products.py [--rows 1,2,5,8,12,16,32,80] [--threads 1]

The weights are random, in the default target's shapes (SmolLM2-135M: 30 layers of q/k/v, o,
gate/up and down); what a product costs does not depend on the values. Kernels: the compiled loop
(specdec/models/cpu_linear.py), oneDNN on prepacked weights, and MKL through F.linear. Each row
count's kernels run interleaved, repetition by repetition; the median and the minimum are printed.
This is what specdec/models/kernel_calibration.py measures at load, on every row count and kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.models import cpu_linear
from specdec.models.linear_kernels import OneDnnLinear

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [out, in]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,5,8,12,16,32,80")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    plain = [[torch.randn(shape, generator=generator) * 0.02 for shape in SHAPES] for _ in range(args.layers)]
    onednn = OneDnnLinear()
    packed = [[onednn.prepare(w) for w in layer] for layer in plain]
    kernels = {
        "loop": lambda x, i, j: cpu_linear.product(x, plain[i][j], args.threads),
        "onednn": lambda x, i, j: onednn(x, packed[i][j]),
        "mkl": lambda x, i, j: torch.nn.functional.linear(x, plain[i][j]),
    }
    print(f"{args.layers} layers of products, float32, {args.threads} threads, ms: median (min)")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {width: torch.randn(rows, width, generator=generator) for width in {s[1] for s in SHAPES}}
        times = {name: [] for name in kernels}
        for repeat in range(args.repeats + 1):
            for name, kernel in kernels.items():
                started = time.perf_counter()
                for i in range(args.layers):
                    for j, shape in enumerate(SHAPES):
                        kernel(inputs[shape[1]], i, j)
                if repeat:  # the first round warms up (oneDNN builds a primitive per row count)
                    times[name].append((time.perf_counter() - started) * 1e3)
        print(f"{rows:3d} rows: " + "  ".join(
            f"{name} {statistics.median(t):.1f} ({min(t):.1f})" for name, t in times.items()))


if __name__ == "__main__":
    main()
