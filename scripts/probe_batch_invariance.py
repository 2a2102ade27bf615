"""Does a row's result depend on the rows it shares a step with? (half precision, GPU)

Three parts, each comparing bit for bit what one row gets alone with what it gets inside a batch:

1. products: for each weight shape of the model, rows of an M-row product against the same rows
   multiplied alone, for M = 1..288, with the native backend's CUDA kernel (DenseLinear) and with
   FixedRowsLinear (specdec/models/batch_invariant.py) at the given chunk sizes; plus times;
2. attention: one query's output (the grouped-query SDPA of the graphed steps) alone against the same
   query in batches of 16 rows, 5 or 9 tokens per row, and longer key buckets, per SDPA backend;
3. the model (random weights of the preset's shapes, fewer layers), CUDA graphs as served: a
   session's decode logits alone against the same decode inside steps of other sessions' decodes
   and verifies, and a verify's first row against the decode, for each mode (as served, matmul
   reductions in float32, fixed-row products, with an SDPA backend forced); plus step times.

    python scripts/probe_batch_invariance.py --preset llama3-8b --layers 4 --out probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.models.batch_invariant import FixedRowsLinear  # noqa: E402
from specdec.models.linear_kernels import DenseLinear  # noqa: E402

ROW_COUNTS = (1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 24, 32, 33, 40, 48, 64, 65, 72, 80, 96, 128, 129, 144, 160, 256, 288)
DEVICE = "cuda"
BACKENDS = {"default": None, "efficient": [SDPBackend.EFFICIENT_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
            "math": [SDPBackend.MATH]}


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, repeats: int = 20) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats * 1e3


@torch.inference_mode()
def products(cfg: dict, chunk_rows: list[int], dtype: torch.dtype) -> dict:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    shapes = {"qkv": (h, h + 2 * kv), "o": (h, h), "gate_up": (h, 2 * inter), "down": (inter, h), "lm_head": (h, vocab)}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    kernels = {"dense": DenseLinear(), **{f"rows{c}": FixedRowsLinear(DenseLinear(), c) for c in chunk_rows}}
    out = {}
    for name, (fan_in, fan_out) in shapes.items():
        w = (torch.randn(fan_out, fan_in, generator=gen, device=DEVICE) / fan_in ** 0.5).to(dtype)
        x = torch.randn(max(ROW_COUNTS), fan_in, generator=gen, device=DEVICE).to(dtype)
        r = torch.randn(max(ROW_COUNTS), fan_out, generator=gen, device=DEVICE).to(dtype)
        for kname, kernel in kernels.items():
            wp = kernel.prepare(w)
            alone = {i: kernel(x[i:i + 1], wp) for i in range(max(ROW_COUNTS))}
            alone_add = {i: kernel.add(r[i:i + 1], x[i:i + 1], wp) for i in range(max(ROW_COUNTS))}
            rows = {}
            for m in ROW_COUNTS:
                y, ya = kernel(x[:m], wp), kernel.add(r[:m], x[:m], wp)
                worst = max(max(diff(y[i], alone[i][0]), diff(ya[i], alone_add[i][0])) for i in range(m))
                rows[m] = worst
            times = {m: round(timed(lambda m=m: kernel.add(r[:m], x[:m], wp)), 4) for m in (1, 16, 64, 80, 128, 144)}
            out[f"{name}/{kname}"] = {"max_diff_by_rows": rows, "ms_by_rows": times,
                                      "invariant_up_to": max([m for m in ROW_COUNTS
                                                              if all(rows[k] == 0 for k in ROW_COUNTS if k <= m)],
                                                             default=0)}
            print(f"products {name:8s} {kname:7s} invariant up to {out[f'{name}/{kname}']['invariant_up_to']:4d} rows; "
                  f"first differing: {[m for m in ROW_COUNTS if rows[m]][:6]}; ms {times}", flush=True)
    return out


@torch.inference_mode()
def attention(cfg: dict, dtype: torch.dtype) -> dict:
    from specdec.models.slot_attention import grouped_attention

    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    ctx = 200  # the probe row's keys: 0..199 (its query at position 199)
    q0 = torch.randn(H, D, generator=gen, device=DEVICE).to(dtype)
    k0 = torch.randn(KV, 1024, D, generator=gen, device=DEVICE).to(dtype)
    v0 = torch.randn(KV, 1024, D, generator=gen, device=DEVICE).to(dtype)

    def run(B: int, T: int, L: int, backend) -> torch.Tensor:
        g = torch.Generator(device=DEVICE).manual_seed(B * 1000 + T * 10 + L)
        q = torch.randn(B, H, T, D, generator=g, device=DEVICE).to(dtype)
        keys = torch.randn(B, KV, L, D, generator=g, device=DEVICE).to(dtype)
        values = torch.randn(B, KV, L, D, generator=g, device=DEVICE).to(dtype)
        q[0, :, :] = q0[:, None]
        keys[0], values[0] = k0[:, :L], v0[:, :L]
        positions = torch.randint(100, L, (B, 1), generator=g, device=DEVICE) + torch.arange(T, device=DEVICE)
        positions = positions.clamp(max=L - 1)
        positions[0] = ctx - 1
        mask = (torch.arange(L, device=DEVICE) <= positions[:, :, None])[:, None]
        with sdpa_kernel(backend) if backend else contextlib.nullcontext():
            return grouped_attention(q, keys, values, mask)[0, :, 0]

    out = {}
    for bname, backend in BACKENDS.items():
        try:
            ref = run(1, 1, 256, backend)
            cases = {f"{B}x{T} keys {L}": diff(run(B, T, L, backend), ref)
                     for B in (1, 16) for T in (1, 5, 9) for L in (256, 512, 1024)}
        except RuntimeError as e:
            out[bname] = {"error": str(e)[:200]}
            print(f"attention {bname}: {str(e)[:120]}", flush=True)
            continue
        out[bname] = cases
        print(f"attention {bname:9s} differing cases: {sorted(k for k, v in cases.items() if v)}", flush=True)
    return out


def make_model(preset: str, layers: int, dtype: str, num_slots: int, home: Path):
    from specdec.bench.gpu import PRESETS, make_random_model
    from specdec.models.llama import LlamaModel

    name = f"{preset}-l{layers}"
    PRESETS[name] = dict(PRESETS[preset], num_hidden_layers=layers)
    directory = make_random_model(home / name, name, dtype)
    return LlamaModel(directory, device=DEVICE, dtype=dtype, num_slots=num_slots, max_context=2048, cuda_graphs=True)


@torch.inference_mode()
def model_probe(model, modes: dict, probes: int) -> dict:
    from specdec.models.cuda_graphs import GraphRunner

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    # Slot 0 is probed; slots 1-7 are short (the probe's key bucket), 8-31 long (larger buckets).
    lengths = [180] + [120 + 10 * i for i in range(1, 8)] + [300 + 25 * i for i in range(8, model.num_slots)]
    for slot, n in enumerate(lengths):
        assert model.allocate() == slot
        model.forward([slot], [torch.randint(0, vocab, (n,), generator=gen).tolist()], [1])
    base_linear, base_layers = model.linear, model._layers
    out = {}
    for mode, (linear_rows, backend, full_reductions) in modes.items():
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not full_reductions
        model.linear = base_linear if not linear_rows else FixedRowsLinear(base_linear, linear_rows)

        def layers(x, b, backend=backend):
            with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                return base_layers(x, b)
        model._layers = layers
        model.graphs = GraphRunner(model, capture=DEVICE.startswith("cuda"))
        cases: dict[str, list[float]] = {}
        for p in range(probes):
            token = torch.randint(0, vocab, (9,), generator=gen).tolist()
            others = {s: torch.randint(0, vocab, (9,), generator=gen).tolist() for s in range(1, model.num_slots)}

            def step(slots, width, probe_width=1):
                rows = [token[:probe_width]] + [others[s][:width] for s in slots[1:]]
                before = [model.length(s) for s in slots]
                logits = model.forward(slots, rows, [probe_width] + [len(r) for r in rows[1:]])[0]
                for s, n in zip(slots, before):
                    model.truncate(s, n)
                return logits[0]
            ref = step([0], 1)
            for label, slots, width, pw in (("8 decodes, same key bucket", list(range(8)), 1, 1),
                                            ("16 decodes", list(range(16)), 1, 1),
                                            ("16 rows, others verify 5", list(range(16)), 5, 1),
                                            ("16 rows, others verify 9", list(range(16)), 9, 1),
                                            ("32 rows, others verify 5", list(range(32)), 5, 1),
                                            ("its own verify of 5, alone", [0], 1, 5),
                                            ("its own verify of 5 among 15 verifies of 5", list(range(16)), 5, 5)):
                cases.setdefault(label, []).append(diff(step(slots, width, pw), ref))
        times = {}
        for label, slots, width in (("1x1", [0], 1), ("16x1", list(range(16)), 1), ("16x5", list(range(16)), 5),
                                    ("16x9", list(range(16)), 9)):
            rows = [[1] * width for _ in slots]

            def once(slots=slots, rows=rows):
                before = [model.length(s) for s in slots]
                model.forward(slots, rows, [len(r) for r in rows])
                for s, n in zip(slots, before):
                    model.truncate(s, n)
            times[label] = round(timed(once), 3)
        out[mode] = {"max_diff": {k: max(v) for k, v in cases.items()},
                     "differing_probes": {k: sum(1 for d in v if d) for k, v in cases.items()}, "step_ms": times}
        print(f"model {mode:22s} differing probes {out[mode]['differing_probes']} step ms {times}", flush=True)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=4, help="layers of the probed model (its shapes stay the preset's)")
    parser.add_argument("--chunk-rows", default="32,64,128")
    parser.add_argument("--probes", type=int, default=4)
    parser.add_argument("--parts", default="products,attention,model")
    parser.add_argument("--out", type=Path, default=Path("probe.json"))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    parser.add_argument("--max-rows", type=int, default=None, help="cap the product row counts (dry runs)")
    args = parser.parse_args()
    global DEVICE, ROW_COUNTS
    DEVICE = args.device
    if args.max_rows:
        ROW_COUNTS = tuple(m for m in ROW_COUNTS if m <= args.max_rows)
    from specdec.bench.gpu import PRESETS

    cfg, dtype = PRESETS[args.preset], torch.bfloat16
    chunks = [int(c) for c in args.chunk_rows.split(",")]
    report = {"device": torch.cuda.get_device_name() if DEVICE.startswith("cuda") else DEVICE, "torch": torch.__version__, "preset": args.preset}
    parts = args.parts.split(",")
    if "products" in parts:
        report["products"] = products(cfg, chunks, dtype)
    if "attention" in parts:
        report["attention"] = attention(cfg, dtype)
    if "model" in parts:
        with tempfile.TemporaryDirectory() as home:
            model = make_model(args.preset, args.layers, "bfloat16", 32, Path(home))
            modes = {"as served": (0, None, False), "reductions in fp32": (0, None, True)}
            for c in chunks:
                modes[f"rows{c}"] = (c, None, False)
                for bname in ("efficient", "math") if DEVICE.startswith("cuda") else ():
                    modes[f"rows{c} + {bname}"] = (c, BACKENDS[bname], False)
            report["model"] = model_probe(model, modes, args.probes)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
