"""A draft session's catch-up Propose (its first: the draft prefills the prompt, then drafts) against the
next one, for rows of prompt lengths never seen before and seen again: where a per-shape cost in eager
forwards shows (docs/BENCHMARKS.md, "Round 20": cuDNN's attention planned every new prefill shape).

    python scripts/bench_draft_catch_up.py --model random:llama3.2-1b --device cuda:0 [--sdp no-cudnn]

--sdp no-cudnn / math take cuDNN (and flash / memory-efficient) out of every forward, graphs included,
for comparison with what the model chooses itself (default). Prints one line per wave of sessions.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from specdec.bench.gpu import model_dir
from specdec.engine.draft import DraftEngine
from specdec.engine.draft_batch import ProposeWork, run_propose_batch
from specdec.models.loader import load_model
from specdec.proposers.copy_guess import CopyRule
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.params import SamplingParams

WAVES = [[150], [151], [122, 197], [130, 180], [122, 146, 197, 159] * 2, [120, 140, 190, 150, 125, 141, 199, 155],
         [300, 500], [900, 1100], [1000], [64, 71, 94], [128, 135, 158], [256, 263, 286], [512, 519, 542]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama3.2-1b", help="registry name, directory or random:<preset>")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--sdp", choices=["default", "no-cudnn", "math"], default="default")
    parser.add_argument("--draft-tokens", type=int, default=4)
    args = parser.parse_args()
    if args.sdp != "default":
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.sdp == "math":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    path = model_dir(args.model, args.dtype)
    cuda = args.device.startswith("cuda")
    started = time.perf_counter()
    model = load_model(path, device=args.device, dtype=args.dtype, num_slots=12, max_context=args.max_context,
                       graph_warmup_context=1024 if cuda else 0)
    print(f"load and graph warm-up: {time.perf_counter() - started:.1f} s (sdp: {args.sdp})")
    engine = DraftEngine(DraftModelProposer(model, copy=CopyRule(0.5)), max_draft_tokens=8)
    rng, vocab = random.Random(0), model.info.vocab_size

    def timed(works) -> float:
        if cuda:
            torch.cuda.synchronize()
        begun = time.perf_counter()
        for result in run_propose_batch(engine, works):
            if isinstance(result, Exception):
                raise result
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - begun) * 1e3

    for number, lengths in enumerate(WAVES):
        sessions = [f"w{number}-{i}" for i in range(len(lengths))]
        for session, length in zip(sessions, lengths):
            engine.start_session(session, [rng.randrange(10, vocab) for _ in range(length)], SamplingParams())
        catch_up = timed([ProposeWork(s, n, (), args.draft_tokens) for s, n in zip(sessions, lengths)])
        # The next Propose: one accepted token appended at the committed end, then a fresh block.
        following = timed([ProposeWork(s, n, (5,), args.draft_tokens) for s, n in zip(sessions, lengths)])
        print(f"rows {len(lengths):2d}, lengths {lengths}: catch-up {catch_up:8.1f} ms, next {following:7.1f} ms")
        for session in sessions:
            engine.end_session(session)


if __name__ == "__main__":
    main()
