"""Up to how many rows the compiled loop beats oneDNN, measured on a model's own weights when it loads.

Which kernel multiplies a few activation rows fastest has changed with every CPU this project ran on
(docs/BENCHMARKS.md). SmolLM2-135M's 30 layers of products, float32, one thread, ms:

    host                               rows:   1      2      5     12
    family 25 (AVX2)         loop            23-29          36-48  63-84
                             oneDNN packed   33-44          47-57  68-87
    family 26 (AVX-512)      loop             11.4   12.3   23.0   51.3
                             oneDNN packed    14.4   16.8   16.5   22.5

(scripts/bench_linear_products.py). On the first the loop won up to 9-12 rows; on the second up to
two, and a 5-token verify ran 1.4x slower on the loop than on oneDNN. So "auto" times both here, at load, and keeps the loop
for the rows where it wins. The rows are tried in order and the first count where oneDNN is faster
by more than MARGIN ends the loop's range: a row count the loop loses is lost for wider ones too (it
reads each weight once per pair of rows, oneDNN reuses it across all of them), and a near-tie goes
to the loop, whose rows keep their bits whatever shares the product (cpu_linear.py).

The sample is the first layers' weights up to SAMPLE_BYTES, more than this machine's caches hold, so
that both kernels stream weights from memory as a whole forward does; each time is the least of
`repeats` interleaved runs after a warm-up call (oneDNN builds a primitive per row count on first use).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from specdec.models import cpu_linear

log = logging.getLogger(__name__)

MARGIN = 0.05
SAMPLE_BYTES = 64 << 20


def loop_rows(kernel, weights: Sequence, repeats: int = 3) -> int:
    """Rows up to which `kernel` (a LoopLinear) should run the loop, timed on `weights` (its prepared
    _LoopLayouts, in the order a forward uses them)."""
    sample, held = [], 0
    for weight in weights:
        sample.append(weight)
        held += weight.plain.numel() * weight.plain.element_size()
        if held >= SAMPLE_BYTES:
            break
    generator = torch.Generator().manual_seed(0)
    timings = []
    for rows in range(1, cpu_linear.MAX_ROWS + 1):
        inputs = {w.plain.shape[1]: torch.randn(rows, w.plain.shape[1], generator=generator) for w in sample}
        runs = {
            "loop": lambda x=inputs: [cpu_linear.product(x[w.plain.shape[1]], w.plain, kernel.threads) for w in sample],
            "onednn": lambda x=inputs: [kernel.onednn(x[w.plain.shape[1]], w) for w in sample],
        }
        best = _least(runs, repeats, order=list(runs) if rows % 2 else list(runs)[::-1])
        timings.append((rows, best["loop"] * 1e3, best["onednn"] * 1e3))
        if best["onednn"] < best["loop"] * (1 - MARGIN):
            _report(rows - 1, timings, held)
            return rows - 1
    _report(cpu_linear.MAX_ROWS, timings, held)
    return cpu_linear.MAX_ROWS


def _least(runs: dict, repeats: int, order: list[str]) -> dict[str, float]:
    """The least time of each run over `repeats` rounds, the runs alternating within each round so
    that a neighbour's burst of load hits both alike."""
    for name in order:
        runs[name]()  # warm-up: oneDNN builds its primitive for this row count, the loop touches the inputs
    least = dict.fromkeys(order, float("inf"))
    for _ in range(repeats):
        for name in order:
            started = time.perf_counter()
            runs[name]()
            least[name] = min(least[name], time.perf_counter() - started)
    return least


def _report(rows: int, timings: list, held: int) -> None:
    measured = ", ".join(f"{r} rows {loop:.2f} / {onednn:.2f} ms" for r, loop, onednn in timings)
    log.info("linear kernel: the compiled loop up to %d rows, oneDNN above (loop / oneDNN on %.0f MB of "
             "weights: %s)", rows, held / 2**20, measured)
