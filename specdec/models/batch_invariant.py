"""Batch-invariant products: a row's result does not depend on the rows it shares a step with.

In half precision a matrix product's rounding depends on the kernel that computes it, and the kernel
cuBLAS picks depends on the product's shape. A session's decode row computed alone (1 row) and the
same row inside a step with other sessions' verify rows (16 rows of up to 9 tokens: 144) can go
through different kernels and come out different in the last bits; over many positions that drift
can change a greedy token (docs/BENCHMARKS.md, round 41: one request of 2,880 in bf16 parted from
plain decoding beyond the near-tie rule, a request that never drafted). ARCHITECTURE.md: batch-
invariant kernels remove ties entirely.

FixedRowsLinear runs every product on chunks of exactly `rows` rows, the last chunk padded with zero
rows, so every call has one shape whatever the step holds: cuBLAS is deterministic for a given shape,
layout and device, and each output row of a product depends only on its own input row. The price is
the padding (a one-row decode multiplies `rows` rows) and one more read of the weights for each
further chunk of a wide step. Any fixed count is invariant, so the count is a price only: on a GPU a
product of up to a few hundred rows is memory-bound, so a chunk holds 160; on a CPU every row costs
compute, so 8 (--batch-invariant-rows sets another).

On a CPU in float32 the native backend's kernels are not row-invariant either: MKL's product of 4 or
more rows rounds differently from its one-row product, and the one-thread hybrid kernel sends one row
to MKL and more to oneDNN (tests/test_batch_invariant.py). Exact greedy equality there rests on near-
ties being rare; with batch_invariant it holds by construction. The compiled loop kernel (cpu_linear.py,
"auto" at one or two threads) is row-invariant by itself up to cpu_linear.MAX_ROWS rows, so with it the mode
splits wider products into chunks of up to that many rows and pads nothing (pad=False): a decode step
then costs what it costs outside the mode, where padding it to 8 rows cost about 2x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows per product chunk, by device type. On a GPU a step of up to 160 tokens (16 sessions' verifies of 9,
# 32 sessions' of 5) is one chunk; wider steps read the weights once per chunk. Measured on an H200 with the
# 8B model's shapes against chunks of 16-256 (scripts/bench_gpu_step.py, docs/BENCHMARKS.md round 43):
# against 64, a one-row decode costs 11% more, verifies of 16 x 5 / 16 x 9 / 32 x 5 tokens 21-35% less,
# and at 16 sessions the service decoded 8-10% more tokens a second (128 rows: a slower cuBLAS kernel).
ROWS = {"cuda": 160, "cpu": 8}


def rows_for(device: torch.device) -> int:
    return ROWS.get(device.type, ROWS["cuda"])


class FixedRowsLinear:
    """A linear kernel (linear_kernels.py) whose every product has exactly `rows` activation rows."""

    def __init__(self, inner, rows: int, pad: bool = True):
        if rows < 1:
            raise ValueError(f"rows per product must be >= 1, got {rows}")
        self.inner, self.rows, self.pad = inner, rows, pad
        self.name = f"{inner.name}, {rows} rows a product" if pad else f"{inner.name}, up to {rows} rows a product"

    def prepare(self, weight: torch.Tensor):
        return self.inner.prepare(weight)

    def __call__(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        if n == 0:  # no row asked for logits: nothing to make invariant
            return self.inner(x, w, bias)
        x = self._padded(x)
        return _joined([self.inner(x[i:i + self.rows], w, bias) for i in range(0, x.shape[0], self.rows)])[:n]

    def add(self, residual: torch.Tensor, x: torch.Tensor, w) -> torch.Tensor:
        """residual + x @ w.T, chunk by chunk (the residual rides in the product, as inner.add does).
        The residual may hold more rows than x (a stream already padded to whole chunks, LlamaModel.pad_rows):
        x is padded to them, and every residual row comes back."""
        n = residual.shape[0]
        if n == 0:
            return self.inner.add(residual, x, w)
        residual = self._padded(residual)
        x = self._padded(x, residual.shape[0])
        return _joined([self.inner.add(residual[i:i + self.rows], x[i:i + self.rows], w)
                        for i in range(0, x.shape[0], self.rows)])[:n]

    def _padded(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """x with zero rows below, to `rows` (default: the next whole chunk); one kernel, none if already there.
        Unpadded (pad=False, an inner kernel whose rows are invariant up to `rows`): x as it is."""
        if not self.pad:
            return x
        pad = (-x.shape[0] % self.rows) if rows is None else rows - x.shape[0]
        return x if pad == 0 else F.pad(x, (0, 0, 0, pad))


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    # A step of up to `rows` tokens (most of them) is one chunk: no copy.
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
