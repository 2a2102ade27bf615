"""Pick and build a model backend for a local Hugging Face directory.

Names of registry models are turned into directories by specdec.models.registry.resolve_model; this
module only takes directories, so it never touches the network.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from pathlib import Path

from specdec.errors import InvalidArgument
from specdec.models.base import CausalLM
from specdec.models.llama_config import LlamaConfig, UnsupportedModel
from specdec.models.reduced_head import recommended_head_vocab, reduced_head

BACKENDS = ("native", "hf", "auto")
MATMUL_REDUCTIONS = ("default", "full")  # SPECDEC_MATMUL_REDUCTIONS


def apply_matmul_reductions() -> None:
    """SPECDEC_MATMUL_REDUCTIONS=full: bf16 and fp16 matrix products on CUDA sum their split-K partials
    in float32, not in their own precision (PyTorch's default allows the reduced one). An A/B switch
    for a GPU measurement: on one H200 plain rows that shared 16-row padded steps with other
    sessions' verifies parted from batch-1 decoding in bf16 (docs/BENCHMARKS.md, round 41), and
    reductions in the dtype are one way a shape's rounding could differ; not yet measured. A value
    other than MATMUL_REDUCTIONS is refused."""
    setting = os.environ.get("SPECDEC_MATMUL_REDUCTIONS", "default")
    if setting not in MATMUL_REDUCTIONS:
        raise InvalidArgument(f"SPECDEC_MATMUL_REDUCTIONS must be one of {MATMUL_REDUCTIONS}, got {setting!r}")
    if setting == "full":
        import torch

        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def native_support(path: str | Path) -> str | None:
    """None when the native backend runs this model exactly, else the reason it does not."""
    try:
        LlamaConfig.load(path)
    except UnsupportedModel as e:
        return str(e)
    if not any(Path(path).glob("*.safetensors")):
        return "the native backend reads safetensors checkpoints only"
    return None


def load_model(
    path: str | Path,
    backend: str = "native",
    device: str = "cpu",
    dtype: str = "float32",
    num_slots: int = 8,
    max_context: int | None = None,
    kv_budget_bytes: int | None = None,
    name: str | None = None,
    head_vocab: int | str | None = None,
    cuda_graphs: bool | None = None,
    compile_layers: bool = False,
    graph_warmup_context: int = 0,
    fused_decode: bool = False,
    batch_invariant: bool = False,
    batch_invariant_rows: int | None = None,
    step_threads=None,
) -> CausalLM:
    """Load the model in directory `path` with `backend` ("native", "hf", or "auto": native if supported).

    max_context None means the model's limit capped at 2048 tokens per slot. kv_budget_bytes (native
    only) sizes the slot pool from a memory budget instead of num_slots. head_vocab (native only): keep
    the first head_vocab ids of the checkpoint's head_vocab.json as a reduced output head (drafts);
    "auto": the size that file recommends, on CPU only (on a GPU the full head costs next to nothing),
    and the full head for checkpoints without one or on other backends. cuda_graphs (native only):
    decode and verify steps replayed as CUDA graphs (specdec.models.cuda_graphs); None: on for a CUDA
    device; never on elsewhere. compile_layers (native, with CUDA graphs on a CUDA device): the graphs'
    layers torch.compile'd (specdec.models.compiled_layers); each new step shape compiles first.
    graph_warmup_context (native, with CUDA graphs): capture the step shapes of up to this many tokens
    of context at load time instead of on first use (0: on first use).
    fused_decode (native, CPU, float32): forwards of a few tokens as one compiled loop
    (specdec.models.cpu_decode); for drafts only, since its results differ from the PyTorch path's
    in the last bits. Ignored elsewhere.
    batch_invariant (native only): every row of a batched forward computes exactly what it computes
    alone (specdec.models.batch_invariant); batch_invariant_rows: its product chunk (None: the device's default).
    step_threads (native, CPU): a specdec.models.step_threads.StepThreads, intra-op threads by a forward's
    token count; ignored by the HF backend.
    """
    build = functools.partial(_load, path, backend, device, dtype, num_slots, max_context, kv_budget_bytes, name,
                              head_vocab, cuda_graphs, compile_layers, graph_warmup_context, fused_decode,
                              batch_invariant, batch_invariant_rows, step_threads)
    return on_own_thread(build, device)


def on_own_thread(build, device: str):
    """build() on a CPU: on a new thread, which ends when it returns; its result or its exception.
    Elsewhere build() here (CUDA graphs are captured at load, on the thread's current stream).

    A load runs products on several threads (the kernel calibration, a hosted draft's engine), and
    the OpenMP team that starts on the loading thread outlives the load. A service's forwards run on
    another thread (its model thread), whose team then makes more OpenMP threads than cores, and
    libgomp stops spin-waiting between products: at OMP_NUM_THREADS=2 the default target's one-token
    step took 20-21 ms against 14-15.5 ms loaded on the thread that runs it (round 48). A team ends
    with its thread."""
    if not str(device).startswith("cpu"):
        return build()
    # Leaving the block joins the pool's one thread: its team is gone before the caller goes on.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-load") as pool:
        return pool.submit(build).result()


def _load(path, backend, device, dtype, num_slots, max_context, kv_budget_bytes, name, head_vocab, cuda_graphs,
          compile_layers, graph_warmup_context, fused_decode, batch_invariant, batch_invariant_rows, step_threads):
    path = Path(path)
    apply_matmul_reductions()
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend {backend!r} is unknown; choose one of {BACKENDS}")
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{path} is not a Hugging Face model directory (no config.json)")
    if backend == "auto":
        backend = "native" if native_support(path) is None else "hf"
    if head_vocab == "auto":
        head_vocab = recommended_head_vocab(path) if backend == "native" and device == "cpu" else None
    if backend == "native":
        from specdec.models.cuda_graphs import use_cuda_graphs
        from specdec.models.llama import LlamaModel

        return LlamaModel(
            path, device=device, dtype=dtype, num_slots=num_slots, max_context=max_context,
            kv_budget_bytes=kv_budget_bytes, name=name, head_token_ids=reduced_head(path, head_vocab),
            cuda_graphs=use_cuda_graphs(cuda_graphs, device), compile_layers=compile_layers,
            graph_warmup_context=graph_warmup_context, fused_decode=fused_decode, batch_invariant=batch_invariant,
            batch_invariant_rows=batch_invariant_rows, step_threads=step_threads,
        )
    if kv_budget_bytes is not None:
        raise InvalidArgument("kv_budget_bytes is supported by the native backend only; give num_slots")
    if batch_invariant:
        raise InvalidArgument("batch_invariant is supported by the native backend only")
    if head_vocab:
        raise InvalidArgument("a reduced head (head_vocab) is supported by the native backend only")
    from specdec.models.hf_backend import HFModel

    return HFModel(path, device=device, dtype=dtype, num_slots=num_slots, max_context=max_context, name=name)
