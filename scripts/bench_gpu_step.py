"""Decode and verify step times of the native backend on a GPU: eager against CUDA graphs, beside the
memory-bandwidth floor (weight bytes / measured device-to-device copy bandwidth).

    python scripts/bench_gpu_step.py --model random:llama3-8b@cuda:0 --model random:llama3.2-1b@cuda:1 \
        --shapes 1x1,1x5,8x1,8x5,32x1,32x5 --context 512 --out steps.json

A shape RxT is R rows (sessions) of T new tokens each (1: a decode step; k + 1: a verify of k drafted
tokens), every row at the same context. Variants, timed interleaved repetition by repetition:
  eager-repeat-kv  the eager forward as it was before CUDA graphs (SDPA's GQA repeats keys/values)
  eager            the eager forward with grouped queries (the CUDA default now)
  graphs           the static-shape forward replayed as a CUDA graph (models/cuda_graphs.py)
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


def run_model(spec: str, args) -> dict:
    name, _, device = spec.partition("@")
    device = device or "cuda:0"
    path = model_dir(name, args.dtype)
    max_rows = max(int(s.split("x")[0]) for s in args.shapes)
    model = LlamaModel(path, device=device, dtype=args.dtype, num_slots=max_rows, max_context=args.max_context,
                       cuda_graphs=True)
    runner = model.graphs
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    slots = [model.allocate() for _ in range(max_rows)]
    for slot in slots:
        model.forward([slot], [torch.randint(0, vocab, (args.context,), generator=gen).tolist()], [1])
    sizes = weight_bytes(model)
    bandwidth = copy_bandwidth(device)
    out = {"model": name, "path": str(path), "device": device, "gpu": torch.cuda.get_device_name(device) if "cuda" in device else "cpu",
           "dtype": args.dtype, "context": args.context, "max_context": args.max_context, **sizes,
           "copy_bandwidth_bytes_per_s": bandwidth, "floor_s": sizes["all_weights"] / bandwidth,
           "floor_read_per_step_s": sizes["read_per_step"] / bandwidth, "shapes": {}}
    variants = {"eager-repeat-kv": (None, False), "eager": (None, True), "graphs": (runner, True)}
    for shape in args.shapes:
        num_rows, width = (int(x) for x in shape.split("x"))
        use = slots[:num_rows]
        starts = [model.length(s) for s in use]
        rows = [torch.randint(0, vocab, (width,), generator=gen).tolist() for _ in use]
        logits = {}
        for label in ("eager", "graphs"):
            model.graphs, model.group_queries = variants[label]
            logits[label] = torch.cat(model.forward(use, rows))
            for slot, start in zip(use, starts):
                model.truncate(slot, start)
        want, got = logits["eager"], logits["graphs"]
        times = {label: [] for label in variants}
        for repeat in range(args.repeats + 3):
            for label, (graphs, grouped) in variants.items():
                model.graphs, model.group_queries = graphs, grouped
                elapsed = timed(model, use, rows, starts)
                if repeat >= 3:
                    times[label].append(elapsed)
        out["shapes"][shape] = {
            **{f"{label}_s": statistics.median(t) for label, t in times.items()},
            **{f"{label}_min_s": min(t) for label, t in times.items()},
            "graphs_vs_eager_max_rel_error": ((got - want).abs().max() / want.abs().max()).item(),
            "greedy_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
        }
        s = out["shapes"][shape]
        print(f"{name:<24} {shape:>5}: eager-repeat-kv {s['eager-repeat-kv_s'] * 1e3:7.2f} ms  eager "
              f"{s['eager_s'] * 1e3:7.2f} ms  graphs {s['graphs_s'] * 1e3:7.2f} ms  floor "
              f"{out['floor_s'] * 1e3:6.2f} ms  graphs/floor {s['graphs_s'] / out['floor_s']:5.2f}  "
              f"rel.err {s['graphs_vs_eager_max_rel_error']:.1e} agree {s['greedy_agreement']:.3f}", flush=True)
    out["graph_stats"] = vars(runner.stats)
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
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = []
    for spec in args.model:
        results.append(run_model(spec, args))
        args.out.write_text(json.dumps({"results": results, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
