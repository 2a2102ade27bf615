"""Products of a few activation rows by a weight on one or two CPU threads, as a compiled loop (numba).

A decode step multiplies one row, a verify k+1 rows, by every weight of the model; on a CPU that is a
stream of the weights from memory, and the best kernel reads each weight value once for all the rows.
On the AMD EPYC host this workplace's CPU has been since round 42 (AVX2), one thread, SmolLM2-135M's
30 layers of products, float32, in ms (docs/BENCHMARKS.md, round 45; repeated runs vary by ~15%):

    rows              1      5      8     10     12     16     80
    this loop      23-29  36-48  47-63    76   63-84    112    540
    oneDNN packed  33-44  47-57  54-68    77   68-87  86-92    267-293
    MKL (F.linear) 30-40  64-72     66           77     82    314

and the 49,152-row lm_head: 7-9 ms for one row and 9-13 for five (MKL: 12 and 30). The loop and
oneDNN cross between 9 and 12 rows. So up to MAX_ROWS rows this loop runs, and above that oneDNN on
its packed copy of the weight (linear_kernels.LoopLinear), which reuses each weight across many rows.
In a whole forward (scripts/bench_model_step.py) a one-row step costs what MKL's does, and a 5-token
verify about 1.55x a step against oneDNN's 1.85x. Hosts differ: on the AVX-512 one of round 46 oneDNN
wins from three rows on, so "auto" measures the crossover on each machine (kernel_calibration.py).
At two intra-op threads a parallel build splits the weight's rows over the threads (each sum still on
one thread, so the bits are the serial build's): a whole step 40 ms against oneDNN's 50 at two
threads, a 5-token verify 66 against 74 (round 45's host).

Each output is one sum over the input, reassociated for vectorisation (cpu_attention.FASTMATH), in
the same order whichever rows the call holds: rows go in pairs that share each weight load, and the
last odd row alone, by a loop that compiles to the same reduction. tests/test_linear_kernels.py checks
that a row's bits do not depend on how many rows the call holds, on the machine that runs the tests.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from specdec.models import cpu_attention

try:
    from numba import prange
except ImportError:  # no numba: the loop is never compiled, and prange only has to exist
    prange = range

log = logging.getLogger(__name__)

# Above this many rows a blocked GEMM reuses each weight across rows better than this loop does.
MAX_ROWS = 12


def _rows_loop(x, w, out, accumulate):  # pragma: no cover - compiled
    # out[r, o] (+)= x[r] . w[o]; x [R, I] and w [O, I], rows contiguous.
    rows, width = x.shape
    paired = rows - rows % 2
    for o in prange(w.shape[0]):  # the parallel build splits the weight's rows over the threads
        for r in range(0, paired, 2):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            for i in range(width):
                weight = w[o, i]
                a0 += x[r, i] * weight
                a1 += x[r + 1, i] * weight
            if accumulate:
                out[r, o] += a0
                out[r + 1, o] += a1
            else:
                out[r, o] = a0
                out[r + 1, o] = a1
        if paired < rows:
            acc = np.float32(0.0)
            for i in range(width):
                acc += x[paired, i] * w[o, i]
            if accumulate:
                out[paired, o] += acc
            else:
                out[paired, o] = acc


@functools.cache
def _kernel(parallel: bool = False):
    """_rows_loop compiled (or loaded from numba's disk cache), or None without numba. parallel: the
    build that splits the weight's rows over numba's threads, compiled for the serial build's argument
    types but not run here (cpu_attention.parallel_layer_ready says why)."""
    if cpu_attention._kernel() is None:  # numba missing or broken; also sets its cache directory
        return None
    if parallel:
        return cpu_attention.parallel_build(_rows_loop, _kernel(), "the compiled linear loop")
    import numba

    loop = numba.njit(nogil=True, cache=True, fastmath=cpu_attention.FASTMATH, boundscheck=False)(_rows_loop)
    ones = np.ones((1, 4), dtype=np.float32)
    try:
        loop(ones, ones, np.empty((1, 1), np.float32), False)  # compile now, at model load
    except Exception as exc:  # noqa: BLE001 - a broken numba install must not stop a model loading
        log.warning("the compiled linear loop did not compile (%r)", exc)
        return None
    return loop


def available(threads: int = 1) -> bool:
    """Whether the loop can run products here with this many threads (1, or 2 with a parallel build)."""
    return threads in (1, 2) and _kernel(threads > 1) is not None


def _run(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, accumulate: bool, threads: int) -> None:
    parallel = threads > 1 and cpu_attention.parallel_layer_ready()  # else the serial build: the same bits
    if parallel:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # per calling thread
    _kernel(parallel)(x.contiguous().numpy(), w.numpy(), out.numpy(), accumulate)


def product(x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """x @ w.T through the loop; x [R, I] float32, w [O, I] contiguous."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _run(x, w, out, False, threads)
    return out


def product_add(residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """residual + x @ w.T, the residual added in the loop."""
    out = residual.clone(memory_format=torch.contiguous_format)
    _run(x, w, out, True, threads)
    return out
