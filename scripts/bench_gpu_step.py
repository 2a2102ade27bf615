"""Decode and verify step times of the native backend on a GPU: eager against CUDA graphs, beside the
memory-bandwidth floor (weight bytes / measured device-to-device copy bandwidth).

    python scripts/bench_gpu_step.py --model random:llama3-8b@cuda:0 --model random:llama3.2-1b@cuda:1 \
        --shapes 1x1,1x5,8x1,8x5,32x1,32x5 --context 512 --out steps.json

A shape RxT is R rows (sessions) of T new tokens each (1: a decode step; k + 1: a verify of k drafted
tokens), every row at the same context. Variants, timed interleaved repetition by repetition:
  eager-repeat-kv  the eager forward as it was before CUDA graphs (SDPA's GQA repeats keys/values)
  eager-cast-norm  grouped queries, RMSNorm in four kernels (transformers' rounding order)
  graphs-cast-norm the static-shape forward replayed as a CUDA graph (models/cuda_graphs.py), same norm
  eager, graphs    the same with the fused RMSNorm (the CUDA default now)
  graphs-compiled  graphs over the torch.compile'd layer stack (models/compiled_layers.py); its first
                   call per shape (compilation + capture) is reported as graphs-compiled_first_call_s
With --weights-nt, the weights are then stored [out, in] (F.linear's own layout, gpt-fast's: the
"dense-nt" linear kernel) instead of the dense kernel's [in, out], and eager-nt / graphs-nt /
graphs-nt-compiled are timed on the same shapes (experiments: graphs-nt-compiled-cublas, every
product left to cuBLAS; -pdl, with inductor's programmatic dependent launch; --compile-options lays
inductor options over graphs-nt-compiled's). --variants picks a subset; --profile adds a per-kernel
GPU-time table (torch.profiler) of the named variants at --profile-shape.
Each forward is timed host to host (synchronize before and after), so launch overhead counts, and
undone with truncate. The script also checks that graphs and eager give the same logits (max
relative error, greedy token agreement) at every shape; --fp32-reference compares every checked
variant with the eager forward in float32 on the same (upcast) weights, which tells bf16 noise (the
eager bf16 forward's own error) from a wrong result.

    python scripts/bench_gpu_step.py --model random:llama3-8b@cuda:0 --shapes 1x1,1x5,8x1 --weights-nt \
        --variants eager,graphs,eager-nt,graphs-nt,graphs-nt-compiled --profile graphs,graphs-nt-compiled \
        --fp32-reference --repeats 30 --out steps-compiled.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.bench.gpu import copy_bandwidth, model_dir
from specdec.models.compiled_layers import COMPILE_OPTIONS, CompiledLayers
from specdec.models.linear_kernels import DenseNTLinear
from specdec.models.llama import LlamaModel


def weight_bytes(model: LlamaModel) -> dict:
    """The checkpoint's weight bytes (a tied embedding once), and those one step reads: every matrix
    and the output head, the embedding only by row."""
    w = model.weights
    tensors = [w.final_norm, w.lm_head] + [t for layer in w.layers for t in vars(layer).values() if t is not None]
    read = sum(t.numel() * t.element_size() for t in tensors)
    embed = w.embed.numel() * w.embed.element_size()
    return {"all_weights": read + (0 if model.config.tie_word_embeddings else embed), "read_per_step": read}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # a CPU dry run needs none
        torch.cuda.synchronize(device)


def timed(model: LlamaModel, slots, rows, starts) -> float:
    synchronize(model.device)
    started = time.perf_counter()
    model.forward(slots, rows)
    synchronize(model.device)
    elapsed = time.perf_counter() - started
    for slot, start in zip(slots, starts):
        model.truncate(slot, start)
    return elapsed


def to_nt(model: LlamaModel) -> None:
    """Re-store every prepared [in, out] matrix as [out, in], one at a time (little extra memory)."""
    names = ("wqkv", "wo", "w_gate_up", "w_down")
    for layer in model.weights.layers:
        for name in names:
            setattr(layer, name, getattr(layer, name).t().contiguous())
    model.weights.lm_head = model.weights.lm_head.t().contiguous()
    model.linear = DenseNTLinear()


def use(model: LlamaModel, variant) -> None:
    """variant: (graph runner, grouped queries, fused norm[, linear kernel, batch-invariant attention,
    rows the residual stream is padded to]); the short form is the model's own linear, not invariant."""
    model.graphs, model.group_queries, model.fuse_norm = variant[:3]
    own = getattr(model.linear, "inner", model.linear)  # the model's own kernel, under a FixedRowsLinear or not
    model.linear, model.batch_invariant, model.pad_rows = variant[3:] if len(variant) > 3 else (own, False, 0)


def invariant_variants(model: LlamaModel, capture: bool, names) -> dict:
    """--batch-invariant and its parts, each over its own graph captures: inv-R, products on chunks of R
    rows with the residual stream padded once per forward (R = 64: the shipped mode); inv64-per-product,
    each product padding its own input (round 42's code); inv64-linear, the products alone (attention as
    the default graphs run it); inv-attention, the memory-efficient attention alone."""
    from specdec.models.batch_invariant import FixedRowsLinear
    from specdec.models.cuda_graphs import GraphRunner

    base = getattr(model.linear, "inner", model.linear)
    chunks = sorted({64} | {int(n[len("graphs-inv"):]) for n in names if n[len("graphs-inv"):].isdigit()})
    out = {f"graphs-inv{rows}": (GraphRunner(model, capture=capture), True, True, FixedRowsLinear(base, rows), True, rows)
           for rows in chunks}
    out["graphs-inv64-per-product"] = (GraphRunner(model, capture=capture), True, True, FixedRowsLinear(base, 64), True, 0)
    out["graphs-inv64-linear"] = (GraphRunner(model, capture=capture), True, True, FixedRowsLinear(base, 64), False, 64)
    out["graphs-inv-attention"] = (GraphRunner(model, capture=capture), True, True, base, True, 0)
    return out


def time_shapes(model, slots, args, variants, gen, out, check=("eager", "graphs"), records=None) -> None:
    """check: the reference variant, then the variants compared with it. records collects each shape's
    rows and every checked variant's logits (on the host) for the float32 reference."""
    vocab = model.config.vocab_size
    variants = {label: v for label, v in variants.items() if label in args.variants or label in check}
    for shape in args.shapes:
        num_rows, width = (int(x) for x in shape.split("x"))
        use_slots = slots[:num_rows]
        starts = [model.length(s) for s in use_slots]
        rows = [torch.randint(0, vocab, (width,), generator=gen).tolist() for _ in use_slots]
        entry = out["shapes"].setdefault(shape, {})
        logits = {}
        for label in check:  # the first call of a graph variant captures (and compiles) this shape
            use(model, variants[label])
            synchronize(model.device)
            started = time.perf_counter()
            logits[label] = torch.cat(model.forward(use_slots, rows))
            synchronize(model.device)
            entry[f"{label}_first_call_s"] = time.perf_counter() - started
            for slot, start in zip(use_slots, starts):
                model.truncate(slot, start)
        times = {label: [] for label in variants}
        for repeat in range(args.repeats + 3):
            for label, variant in variants.items():
                use(model, variant)
                elapsed = timed(model, use_slots, rows, starts)
                if repeat >= 3:
                    times[label].append(elapsed)
        entry.update({f"{label}_s": statistics.median(t) for label, t in times.items()})
        entry.update({f"{label}_min_s": min(t) for label, t in times.items()})
        if records is not None:
            records.append({"shape": shape, "rows": rows, "logits": {k: v.cpu() for k, v in logits.items()}})
        want = logits[check[0]]
        errors = []
        for label in check[1:]:
            got = logits[label]
            entry[f"{label}_vs_{check[0]}_max_rel_error"] = error = ((got - want).abs().max() / want.abs().max()).item()
            entry[f"{label}_vs_{check[0]}_greedy_agreement"] = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            errors.append(f"{label} {error:.1e}/{entry[f'{label}_vs_{check[0]}_greedy_agreement']:.2f}")
        floor = out["floor_s"]
        text = "  ".join(f"{label} {statistics.median(t) * 1e3:6.2f} ms ({statistics.median(t) / floor:4.2f}x)"
                         for label, t in times.items())
        print(f"{out['model']:<18} {shape:>5}: {text}  floor {floor * 1e3:5.2f} ms  "
              f"rel.err/greedy vs {check[0]}: {', '.join(errors)}", flush=True)
        if shape == args.profile_shape:
            for label in args.profile:
                if label in variants:
                    use(model, variants[label])
                    profile = profile_step(model, use_slots, rows, starts, out)
                    out.setdefault("profiles", {})[f"{label}@{shape}"] = profile


def profile_step(model, slots, rows, starts, out, steps: int = 10) -> dict:
    """GPU time of one forward by kernel (torch.profiler over `steps` forwards, graph replays included):
    matrix-product kernels against everything else, and the products' bandwidth."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            timed(model, slots, rows, starts)
    kernels = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        busy = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        kernels[event.key] = {"us_per_step": busy / steps, "count_per_step": event.count / steps}
    matmul = {k: v for k, v in kernels.items() if is_matmul(k)}
    total_us = sum(v["us_per_step"] for v in kernels.values())
    matmul_us = sum(v["us_per_step"] for v in matmul.values())
    result = {"gpu_busy_us": total_us, "kernels_per_step": sum(v["count_per_step"] for v in kernels.values()),
              "matmul_us": matmul_us, "matmul_kernels_per_step": sum(v["count_per_step"] for v in matmul.values()),
              "matmul_bandwidth_bytes_per_s": out["read_per_step"] / (matmul_us * 1e-6) if matmul_us else None,
              "host_prep_us": host_prep_us(model, slots, rows),
              "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"]))}
    bw = result["matmul_bandwidth_bytes_per_s"] or 0
    print(f"  profile: GPU busy {total_us / 1e3:.2f} ms in {result['kernels_per_step']:.0f} kernels; matrix products "
          f"{matmul_us / 1e3:.2f} ms in {result['matmul_kernels_per_step']:.0f} kernels = {bw / 1e12:.2f} TB/s "
          f"({bw / out['copy_bandwidth_bytes_per_s']:.0%} of copy); the rest {(total_us - matmul_us) / 1e3:.2f} ms",
          flush=True)
    print(f"  host-side index building {result['host_prep_us']:.0f} us per step", flush=True)
    for name, v in list(result["kernels"].items())[:14]:
        print(f"    {v['us_per_step']:8.1f} us  x{v['count_per_step']:5.0f}  {name[:110]}", flush=True)
    return result


def host_prep_us(model, slots, rows, repeats: int = 50) -> float:
    """Host time to build a graph replay's index buffer (no device work): the part of a step that the
    GPU waits for."""
    runner = model.graphs
    if runner is None:
        return 0.0
    starts = [model.length(s) for s in slots]
    lengths = [len(r) for r in rows]
    shape = runner.shape_for(starts, lengths)
    started = time.perf_counter()
    for _ in range(repeats):
        runner._host_inputs(shape, slots, rows, starts, lengths, lengths)
    return (time.perf_counter() - started) / repeats * 1e6


MATMUL_MARKS = ("gemv", "gemm", "nvjet", "xmma", "cutlass", "splitk", "_mm_", "_mm,", "addmm", "fused_mm")


def is_matmul(kernel: str) -> bool:
    name = kernel.lower()
    return any(mark in name for mark in MATMUL_MARKS) or name.endswith("_mm")


def run_model(spec: str, args) -> dict:
    name, _, device = spec.partition("@")
    device = device or "cuda:0"
    path = model_dir(name, args.dtype)
    max_rows = max(int(s.split("x")[0]) for s in args.shapes)
    model = LlamaModel(path, device=device, dtype=args.dtype, num_slots=max_rows, max_context=args.max_context,
                       cuda_graphs=True, linear_kernel=args.linear_kernel)
    runner = model.graphs
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    slots = [model.allocate() for _ in range(max_rows)]
    contexts = [torch.randint(0, vocab, (args.context,), generator=gen).tolist() for _ in slots]
    for slot, context in zip(slots, contexts):
        model.forward([slot], [context], [1])
    sizes = weight_bytes(model)
    bandwidth = copy_bandwidth(device)
    gpu = torch.cuda.get_device_name(device) if "cuda" in device else "cpu"
    out = {"model": name, "path": str(path), "device": device, "gpu": gpu,
           "dtype": args.dtype, "context": args.context, "max_context": args.max_context, **sizes,
           "copy_bandwidth_bytes_per_s": bandwidth, "floor_s": sizes["all_weights"] / bandwidth,
           "floor_read_per_step_s": sizes["read_per_step"] / bandwidth, "shapes": {}}
    from specdec.models.cuda_graphs import GraphRunner

    # (graphs, grouped queries, fused norm); the cast-norm graphs need their own captures
    capture = model.device.type == "cuda"
    cast_runner = GraphRunner(model, capture=capture)
    compiled_runner = GraphRunner(model, capture=capture, compile_layers=True)
    variants = {"eager-repeat-kv": (None, False, False), "eager-cast-norm": (None, True, False),
                "graphs-cast-norm": (cast_runner, True, False), "eager": (None, True, True),
                "graphs": (runner, True, True), "graphs-compiled": (compiled_runner, True, True)}
    if any(v.startswith("graphs-inv") for v in args.variants):
        variants.update(invariant_variants(model, capture, args.variants))
    check = ("eager", "graphs") + tuple(v for v in ("graphs-compiled", "graphs-inv64") if v in args.variants)
    records = []
    time_shapes(model, slots, args, variants, gen, out, check, records)
    out["graph_stats_cast_norm"] = vars(cast_runner.stats)
    out["graph_stats"] = vars(runner.stats)
    out["graph_stats_compiled"] = vars(compiled_runner.stats)
    if args.weights_nt:
        for old in (runner, cast_runner, compiled_runner):
            old.forwards.clear()  # the captured graphs read the old weight addresses
        to_nt(model)
        nt_runner = GraphRunner(model, capture=capture)
        nt_compiled = GraphRunner(model, capture=capture, compile_layers=True)
        if args.compile_options:  # inductor options over COMPILE_OPTIONS, for this variant only
            nt_compiled.layers = CompiledLayers(model, compile=capture, options={**COMPILE_OPTIONS,
                                                                                 **args.compile_options})
        nt_cublas = GraphRunner(model, capture=capture, compile_layers=True)
        # the same pieces, but the products left to cuBLAS (no coordinate-descent decomposition)
        nt_cublas.layers = CompiledLayers(model, compile=capture, options={"triton.cudagraphs": False})
        nt_variants = {"eager-nt": (None, True, True), "graphs-nt": (nt_runner, True, True),
                       "graphs-nt-compiled": (nt_compiled, True, True),
                       "graphs-nt-compiled-cublas": (nt_cublas, True, True)}
        # an experiment: inductor's programmatic dependent launch (not kept: no clear gain, see BENCHMARKS.md)
        nt_pdl = GraphRunner(model, capture=capture, compile_layers=True)
        nt_pdl.layers = CompiledLayers(model, compile=capture, options={**COMPILE_OPTIONS, "triton.enable_pdl": True})
        nt_variants["graphs-nt-compiled-pdl"] = (nt_pdl, True, True)
        nt_check = ("eager-nt", "graphs-nt") + tuple(
            label for label in ("graphs-nt-compiled", "graphs-nt-compiled-cublas", "graphs-nt-compiled-pdl")
            if label in args.variants)
        time_shapes(model, slots, args, nt_variants, gen, out, nt_check, records)
        out["graph_stats_nt"] = vars(nt_runner.stats)
        out["graph_stats_nt_compiled"] = vars(nt_compiled.stats)
        out["graph_stats_nt_compiled_cublas"] = vars(nt_cublas.stats)
    del model, runner, cast_runner, compiled_runner, variants
    if args.weights_nt:
        del nt_runner, nt_compiled, nt_cublas, nt_pdl, nt_variants
    torch.cuda.empty_cache()
    if args.fp32_reference:
        out["fp32_reference"] = fp32_reference(path, device, args, contexts, records)
    return out


def fp32_reference(path, device, args, contexts, records) -> dict:
    """Every checked variant's logits against the same weights run eagerly in float32 (the bf16
    checkpoint upcast): is a variant's error within what bf16 costs the eager forward itself?"""
    model = LlamaModel(path, device=device, dtype="float32", num_slots=len(contexts), max_context=args.max_context,
                       linear_kernel="dense")
    slots = [model.allocate() for _ in contexts]
    for slot, context in zip(slots, contexts):
        model.forward([slot], [context], [1])
    result = {}
    for record in records:
        shape, rows = record["shape"], record["rows"]
        use_slots = slots[: len(rows)]
        want = torch.cat(model.forward(use_slots, rows)).cpu()
        for slot in use_slots:
            model.truncate(slot, len(contexts[0]))
        entry = result.setdefault(shape, {})
        for label, got in record["logits"].items():
            entry[label] = {"max_rel_error": ((got - want).abs().max() / want.abs().max()).item(),
                            "greedy_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}
        print(f"fp32 reference {shape:>5}: " + "  ".join(
            f"{label} {entry[label]['max_rel_error']:.1e}/{entry[label]['greedy_agreement']:.2f}"
            for label in record["logits"]), flush=True)
    del model
    torch.cuda.empty_cache()
    return result


VARIANTS = ("eager-repeat-kv", "eager-cast-norm", "graphs-cast-norm", "eager", "graphs", "graphs-compiled",
            "eager-nt", "graphs-nt", "graphs-nt-compiled", "graphs-nt-compiled-cublas",
            "graphs-nt-compiled-pdl", "graphs-invR (any R)", "graphs-inv64-per-product",
            "graphs-inv64-linear", "graphs-inv-attention")


EXPERIMENTS = ("graphs-nt-compiled-cublas", "graphs-nt-compiled-pdl") + VARIANTS[-4:]  # only when named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="NAME[@DEVICE], repeatable")
    parser.add_argument("--shapes", type=lambda t: t.split(","), default=["1x1", "1x5", "8x1", "8x5", "32x1", "32x5"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--linear-kernel", default="auto", help="dense for a CPU dry run of --weights-nt")
    parser.add_argument("--weights-nt", action="store_true", help="also time [out, in] weights (F.linear)")
    parser.add_argument("--variants", type=lambda t: t.split(","),
                        default=[v for v in VARIANTS if v not in EXPERIMENTS],
                        help="which of " + ",".join(VARIANTS) + " to time (the checked pair always runs)")
    parser.add_argument("--profile", type=lambda t: t.split(","), default=[],
                        help="variants to profile by kernel (torch.profiler) at --profile-shape")
    parser.add_argument("--profile-shape", default="1x1")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="also compare every checked variant with the eager forward in float32")
    parser.add_argument("--compile-options", type=json.loads, default=None,
                        help="JSON of inductor options laid over COMPILE_OPTIONS for graphs-nt-compiled")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = []
    for spec in args.model:
        results.append(run_model(spec, args))
        args.out.write_text(json.dumps({"results": results, "torch": torch.__version__,
                                        "compile_options": args.compile_options}, indent=1))


if __name__ == "__main__":
    main()
