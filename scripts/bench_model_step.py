"""Time one decode step and one k-token verify, native backend against transformers, at a fixed context.

    python scripts/bench_model_step.py [--model smollm2-135m-instruct] [--context 300] [--threads 2]

"native-auto-wide": auto built at --threads, its forwards on every usable core, as the target service
runs them (specdec/models/step_threads.py; shown where there are more cores than --threads).

Both backends hold the same prefilled context; each timed forward is undone with truncate, so every
repetition runs at the same position. Backends are timed interleaved, repetition by repetition, so a
neighbour's load on a shared machine hits all of them alike; the median and the minimum are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.models.hf_backend import HFModel
from specdec.models.llama import LlamaModel
from specdec.models.registry import resolve_model
from specdec.models.step_threads import policy_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--verify", type=int, default=5, help="tokens in the verify forward")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    wide = policy_for("cpu", None)
    backends = {
        **{f"native-{kernel}": LlamaModel(path, dtype=args.dtype, num_slots=2, max_context=args.context + 64,
                                          linear_kernel=kernel) for kernel in ("onednn", "dense", "hybrid", "loop", "auto")},
        **({"native-auto-wide": LlamaModel(path, dtype=args.dtype, num_slots=2, max_context=args.context + 64,
                                           step_threads=wide)} if wide else {}),
        "hf-sdpa": HFModel(path, dtype=args.dtype, num_slots=1, attn_implementation="sdpa"),
        "hf-eager": HFModel(path, dtype=args.dtype, num_slots=1, attn_implementation="eager"),
    }
    generator = torch.Generator().manual_seed(0)
    vocab = next(iter(backends.values())).info.vocab_size
    prompt = torch.randint(0, vocab, (args.context,), generator=generator).tolist()
    extra = torch.randint(0, vocab, (args.verify,), generator=generator).tolist()
    slots = {}
    for name, model in backends.items():
        slots[name] = model.allocate()
        model.forward([slots[name]], [prompt], [1])
    for label, tokens, logits in (("decode step (1 token)", extra[:1], 1),
                                  (f"verify ({args.verify} tokens)", extra, args.verify)):
        times = {name: [] for name in backends}
        for _ in range(args.repeats + 3):
            for name, model in backends.items():
                start = time.perf_counter()
                model.forward([slots[name]], [tokens], [logits])
                times[name].append(time.perf_counter() - start)
                model.truncate(slots[name], args.context)
        # The minimum is reported too: on a shared machine it is the least disturbed by neighbours.
        row = ", ".join(f"{n} {statistics.median(t[3:]) * 1e3:.1f} (min {min(t[3:]) * 1e3:.1f}) ms"
                        for n, t in times.items())
        print(f"{label} at context {args.context}, {args.dtype}, {args.threads} threads: {row}")


if __name__ == "__main__":
    main()
