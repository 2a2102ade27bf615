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
With --weights-nt, the weights are then stored [out, in] (F.linear's own layout, gpt-fast's) instead
of the dense kernel's [in, out], and eager-nt / graphs-nt are timed on the same shapes.
Each forward is timed host to host (synchronize before and after), so launch overhead counts, and
undone with truncate. The script also checks that graphs and eager give the same logits (max
relative error, greedy token agreement) at every shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.bench.gpu import copy_bandwidth, random_model_dir
from specdec.models.llama import LlamaModel
from specdec.models.registry import resolve_model


def model_dir(name: str, dtype: str) -> Path:
    return random_model_dir(name, dtype) if name.startswith("random:") else resolve_model(name)


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


class LinearNT:
    """y = x @ w.T with w as [out, in] (no transposed copy at load): cuBLAS's TN layout."""

    name = "dense-nt"

    def __call__(self, x, w, bias=None):
        return torch.nn.functional.linear(x, w, bias)

    def add(self, residual, x, w):
        return torch.addmm(residual, x, w.t())


def to_nt(model: LlamaModel) -> None:
    """Re-store every prepared [in, out] matrix as [out, in], one at a time (little extra memory)."""
    names = ("wqkv", "wo", "w_gate_up", "w_down")
    for layer in model.weights.layers:
        for name in names:
            setattr(layer, name, getattr(layer, name).t().contiguous())
    model.weights.lm_head = model.weights.lm_head.t().contiguous()
    model.linear = LinearNT()


def time_shapes(model, slots, args, variants, gen, out, check=("eager", "graphs")) -> None:
    vocab = model.config.vocab_size
    for shape in args.shapes:
        num_rows, width = (int(x) for x in shape.split("x"))
        use = slots[:num_rows]
        starts = [model.length(s) for s in use]
        rows = [torch.randint(0, vocab, (width,), generator=gen).tolist() for _ in use]
        logits = {}
        for label in check:
            model.graphs, model.group_queries, model.fuse_norm = variants[label]
            logits[label] = torch.cat(model.forward(use, rows))
            for slot, start in zip(use, starts):
                model.truncate(slot, start)
        want, got = logits[check[0]], logits[check[1]]
        times = {label: [] for label in variants}
        for repeat in range(args.repeats + 3):
            for label, (graphs, grouped, fused) in variants.items():
                model.graphs, model.group_queries, model.fuse_norm = graphs, grouped, fused
                elapsed = timed(model, use, rows, starts)
                if repeat >= 3:
                    times[label].append(elapsed)
        entry = out["shapes"].setdefault(shape, {})
        entry.update({f"{label}_s": statistics.median(t) for label, t in times.items()})
        entry.update({f"{label}_min_s": min(t) for label, t in times.items()})
        entry[f"{check[1]}_vs_{check[0]}_max_rel_error"] = ((got - want).abs().max() / want.abs().max()).item()
        entry[f"{check[1]}_vs_{check[0]}_greedy_agreement"] = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        text = "  ".join(f"{label} {statistics.median(t) * 1e3:7.2f} ms" for label, t in times.items())
        best = min(statistics.median(t) for t in times.values())
        print(f"{out['model']:<22} {shape:>5}: {text}  floor {out['floor_s'] * 1e3:6.2f} ms  best/floor "
              f"{best / out['floor_s']:5.2f}  rel.err {entry[f'{check[1]}_vs_{check[0]}_max_rel_error']:.1e}", flush=True)


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
    for slot in slots:
        model.forward([slot], [torch.randint(0, vocab, (args.context,), generator=gen).tolist()], [1])
    sizes = weight_bytes(model)
    bandwidth = copy_bandwidth(device)
    gpu = torch.cuda.get_device_name(device) if "cuda" in device else "cpu"
    out = {"model": name, "path": str(path), "device": device, "gpu": gpu,
           "dtype": args.dtype, "context": args.context, "max_context": args.max_context, **sizes,
           "copy_bandwidth_bytes_per_s": bandwidth, "floor_s": sizes["all_weights"] / bandwidth,
           "floor_read_per_step_s": sizes["read_per_step"] / bandwidth, "shapes": {}}
    from specdec.models.cuda_graphs import GraphRunner

    # (graphs, grouped queries, fused norm); the cast-norm graphs need their own captures
    cast_runner = GraphRunner(model, capture=model.device.type == "cuda")
    variants = {"eager-repeat-kv": (None, False, False), "eager-cast-norm": (None, True, False),
                "graphs-cast-norm": (cast_runner, True, False), "eager": (None, True, True),
                "graphs": (runner, True, True)}
    time_shapes(model, slots, args, variants, gen, out)
    out["graph_stats_cast_norm"] = vars(cast_runner.stats)
    out["graph_stats"] = vars(runner.stats)
    if args.weights_nt:
        runner.forwards.clear()  # the captured graphs read the old weight addresses
        to_nt(model)
        nt_runner = GraphRunner(model, capture=model.device.type == "cuda")
        time_shapes(model, slots, args, {"eager-nt": (None, True, True), "graphs-nt": (nt_runner, True, True)}, gen, out,
                    check=("eager-nt", "graphs-nt"))
        out["graph_stats_nt"] = vars(nt_runner.stats)
    del model
    torch.cuda.empty_cache()
    return out


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
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = []
    for spec in args.model:
        results.append(run_model(spec, args))
        args.out.write_text(json.dumps({"results": results, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
