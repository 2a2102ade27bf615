"""How the native backend multiplies activations by weights: the one choice that decides CPU speed.

A small model's forward is almost all matrix products of a few activation rows (1 for a decode step,
k+1 for a verify) by large weights, so it runs at memory bandwidth only if the kernel streams the weight
once whatever the row count. Measured on the project's 2-core AMD EPYC machine (fp32, SmolLM2-135M's
30 layers of weights): torch.mm / F.linear (MKL sgemm) took 26-36 ms for 1 row but 50-70 ms for 5-9
rows, while oneDNN's linear on a weight prepacked once at load took about 15-21 ms for 1 to 9 rows.
So on CPU the weights are prepacked for oneDNN when that operator exists; elsewhere (CUDA, fp16 on CPU,
a torch build without oneDNN) a plain matmul on the transposed weight is used.

With one intra-op thread (how the services run beside each other on a small machine) the picture
splits by row count. Whole SmolLM2-135M forwards, fp32, 1 thread, interleaved: one row 39 ms with MKL
against 51 ms with oneDNN, five rows 92 ms with MKL against 48 ms with oneDNN (2 threads: one row
33 ms with oneDNN, 39 ms with MKL). So at one thread "auto" keeps both layouts (twice the weight
memory) and sends one-row products to MKL, the rest to oneDNN: plain decoding and drafting, which are
one-row steps, would otherwise run 25% slower than they can, and flatter every speedup measured
against them. Reproduce: scripts/bench_model_step.py.

Since round 42 the machine is another host (AVX2, no AVX-512), where oneDNN's few-row products are
slow: a 5-token verify cost 1.7-2.0x a one-token step. There "loop" (cpu_linear.py, a compiled loop
that reads each weight once for all of up to 12 rows; oneDNN above that) is "auto" at one thread
(and, as a parallel build, at two) in float32: the same one-row step as MKL and a 5-token verify about 10% faster than hybrid's, and
a row's bits do not depend on how many rows share the product (round 45). Since round 46 the host is
an AVX-512 one (family 26) where oneDNN wins every product of three or more rows (a 5-token verify 27
ms against the loop's 38, a step 18 ms on the loop against oneDNN's 21), so "auto" measures, once the
weights are loaded, up to how many rows the loop wins on them (kernel_calibration.py) and sends wider
products to oneDNN; a named "loop" still runs the loop up to MAX_ROWS.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from specdec.models import cpu_linear


class DenseLinear:
    """y = x @ w.T with w kept transposed and contiguous ([in, out]); residual adds fuse into addmm."""

    name = "dense"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t().contiguous()  # [out, in] -> [in, out]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)

    def add(self, residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """residual + x @ w.T in one kernel."""
        return torch.addmm(residual, x, w)


class DenseNTLinear:
    """y = x @ w.T with w kept as loaded ([out, in], F.linear's and gpt-fast's layout). On CUDA the
    compiled static layers (compiled_layers.py) turn a one-row product on this layout into a reduction
    along contiguous memory; the eager kernels time the same as DenseLinear's."""

    name = "dense-nt"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, w, bias)

    def add(self, residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.addmm(residual, x, w.t())


class OneDnnLinear:
    """oneDNN linear on weights reordered once into its blocked layout (what torch.compile's CPU
    freezing pass does); the residual add rides along as a fused binary post-op."""

    name = "onednn"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        # The batch-size hint only picks the blocked layout; the packed weight serves any number of rows.
        # A hint of 64 measured best here: as fast as a hint of 1 for one row, and 25-40% faster for
        # the 5-9 rows of a verify (a hint of 1 made a 5-row product slower than a 1-row one).
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if rows in _PADDED_ROWS:
            return torch.ops.mkldnn._linear_pointwise(_pad_rows(x), w, bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")

    def add(self, residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows in _PADDED_ROWS:
            return torch.ops.mkldnn._linear_pointwise.binary(_pad_rows(x), _pad_rows(residual), w, None, "add")[:rows]
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, None, "add")


# oneDNN's packed product is slower for 2 activation rows than for 3 or 4: the 30 layers' matrices of
# SmolLM2-135M at one thread took 11.4 ms for 2 rows against 9.0 ms for 3 and 8.1 ms for 4 (and 9.4 ms
# for 2 rows padded to 4; a k = 1 verify and a decode step of two sessions are 2-row products). Padding
# with zero rows is exact: each output row depends only on its own input row; the pad is sliced off.
_PADDED_ROWS = (2,)


def _pad_rows(x: torch.Tensor, rows: int = 4) -> torch.Tensor:
    return torch.cat((x, x.new_zeros(rows - x.shape[0], *x.shape[1:])))


class _BothLayouts(NamedTuple):
    dense: torch.Tensor  # [in, out]
    packed: torch.Tensor  # oneDNN's blocked layout


class HybridLinear:
    """One activation row: MKL on the plain weight; more rows: oneDNN on the prepacked weight."""

    name = "hybrid"

    def __init__(self) -> None:
        self._dense, self._onednn = DenseLinear(), OneDnnLinear()

    def prepare(self, weight: torch.Tensor) -> _BothLayouts:
        return _BothLayouts(self._dense.prepare(weight), self._onednn.prepare(weight))

    def __call__(self, x: torch.Tensor, w: _BothLayouts, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._dense(x, w.dense, bias)
        return self._onednn(x, w.packed, bias)

    def add(self, residual: torch.Tensor, x: torch.Tensor, w: _BothLayouts) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._dense.add(residual, x, w.dense)
        return self._onednn.add(residual, x, w.packed)


class _LoopLayouts(NamedTuple):
    plain: torch.Tensor  # [out, in], as loaded
    packed: torch.Tensor | None  # oneDNN's blocked layout, for wide products; None without oneDNN


class LoopLinear:
    """Up to `loop_rows` rows (at most cpu_linear.MAX_ROWS): the compiled loop on the weight as loaded;
    more (verifies where oneDNN is faster, prefills, wide batched steps): oneDNN on the prepacked
    weight, or F.linear where oneDNN is missing. float32 on a CPU at one or two threads (cpu_linear.py;
    at two, the loop's parallel build); like hybrid, it keeps two copies of each weight.

    calibrate=True (what "auto" asks for): the model times both kernels on its own weights once they are
    loaded and sets loop_rows to where the loop stops winning (kernel_calibration.loop_rows): which rows each
    kernel does best changed with every host this project ran on. Named "loop", loop_rows stays at
    MAX_ROWS, where a row's bits never depend on how many rows share a product. A forward that runs on more
    intra-op threads than the loop was built for (a wide step, step_threads.py) takes oneDNN for every
    product, which uses them all (two-token forwards: 18.0 ms on oneDNN at two threads against 22.5 on
    the one-thread loop, default target, round 47)."""

    name = "loop"

    def __init__(self, with_onednn: bool, threads: int = 1, calibrate: bool = False) -> None:
        self._onednn = OneDnnLinear() if with_onednn else None
        self.threads = threads
        self.loop_rows = cpu_linear.MAX_ROWS
        self.calibrate = calibrate and with_onednn  # without oneDNN there is nothing to choose between

    def prepare(self, weight: torch.Tensor) -> _LoopLayouts:
        weight = weight.contiguous()
        return _LoopLayouts(weight, self._onednn.prepare(weight) if self._onednn else None)

    def _on_loop(self, x: torch.Tensor, w: _LoopLayouts) -> bool:
        return x.shape[0] <= self.loop_rows and (w.packed is None or torch.get_num_threads() <= self.threads)

    def __call__(self, x: torch.Tensor, w: _LoopLayouts, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._on_loop(x, w):
            out = cpu_linear.product(x, w.plain, self.threads)
            return out if bias is None else out.add_(bias)
        if w.packed is not None:
            return self._onednn(x, w.packed, bias)
        return torch.nn.functional.linear(x, w.plain, bias)

    def add(self, residual: torch.Tensor, x: torch.Tensor, w: _LoopLayouts) -> torch.Tensor:
        if self._on_loop(x, w):
            return cpu_linear.product_add(residual, x, w.plain, self.threads)
        if w.packed is not None:
            return self._onednn.add(residual, x, w.packed)
        return torch.addmm(residual, x, w.plain.t())

    def onednn(self, x: torch.Tensor, w: _LoopLayouts) -> torch.Tensor:
        return self._onednn(x, w.packed)


Linear = DenseLinear | DenseNTLinear | OneDnnLinear | HybridLinear | LoopLinear
KERNELS = ("auto", "dense", "dense-nt", "onednn", "hybrid", "loop")


def choose_linear(device: torch.device, dtype: torch.dtype, prefer: str = "auto") -> Linear:
    """The kernel for this device and dtype ("auto"), or the one named by `prefer` (see KERNELS).
    "auto" on a CPU in float32 at one or two intra-op threads: the compiled loop (cpu_linear.py) when
    numba can run it with that many, for as many rows as it beats oneDNN on the model's weights (measured
    at load, kernel_calibration.py), else hybrid at one thread and oneDNN at more. SPECDEC_LINEAR_KERNEL
    names what "auto" means (an A/B switch for benchmarks, which start the services as processes of
    their own)."""
    if prefer == "auto":
        prefer = os.environ.get("SPECDEC_LINEAR_KERNEL", "auto")
    if prefer not in KERNELS:
        raise ValueError(f"linear kernel {prefer!r} is unknown; choose one of {KERNELS}")
    threads = torch.get_num_threads()
    loop_fits = device.type == "cpu" and dtype == torch.float32 and cpu_linear.available(threads)
    if prefer == "loop" or (prefer == "auto" and loop_fits):
        if not loop_fits:
            raise ValueError(f"the compiled loop linear needs float32 on a CPU with numba and 1 or 2 intra-op "
                             f"threads (2: numba's OpenMP or TBB layer), not {device}, {dtype}, {threads} threads")
        # "auto" measures where the loop beats oneDNN on the model's weights; named, the loop runs up to MAX_ROWS.
        return LoopLinear(with_onednn=_onednn_works(dtype), threads=threads, calibrate=prefer == "auto")
    if prefer == "dense":
        return DenseLinear()
    if prefer == "dense-nt":
        return DenseNTLinear()
    usable = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _onednn_works(dtype)
    if prefer in ("onednn", "hybrid") and not usable:
        raise ValueError(f"the oneDNN linear is not usable here ({device}, {dtype}); use 'dense' or 'auto'")
    if not usable:
        return DenseLinear()
    if prefer == "hybrid" or (prefer == "auto" and torch.get_num_threads() == 1):
        return HybridLinear()
    return OneDnnLinear()


def _onednn_works(dtype: torch.dtype) -> bool:
    # The operators are private to torch; check that they exist and compute the right thing here.
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        with torch.inference_mode():
            weight = torch.arange(12.0).reshape(3, 4).to(dtype)
            x = torch.ones(2, 4, dtype=dtype)
            kernel = OneDnnLinear()
            packed = kernel.prepare(weight)
            ok = torch.equal(kernel(x, packed).float(), (x.float() @ weight.float().t()))
            return ok and torch.equal(kernel.add(x[:, :3], x, packed).float(), 1 + x.float() @ weight.float().t())
    except (RuntimeError, AttributeError):
        return False
