"""What one step of the draft model costs against the rows it drafts (CPU, one thread).

    python scripts/bench_draft_rows.py [--rows 1 4 16] [--repeats 12]    # SPECDEC_CPU_DECODE=eager: PyTorch's operators

A DraftEngine over the native backend as the draft service and the target's hosted draft run it (the
served head, the copy rule, the compiled step where it applies): `rows` greedy sessions of 200 random
prompt tokens each append one token and draft k = 1 and k = 4 tokens in one batched Propose
(run_propose_batch), as a batched step of the target asks them to. Prints the median per pass and per
draft step. Warm: nothing else runs between passes (docs/BENCHMARKS.md, round 33).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.engine.draft import DraftEngine
from specdec.engine.draft_batch import ProposeWork, run_propose_batch
from specdec.models.loader import load_model
from specdec.models.registry import resolve_model
from specdec.proposers.copy_guess import CopyRule
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default="smollm2-135m-draft")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(resolve_model(args.draft), backend="native", device="cpu", num_slots=2 * sum(args.rows),
                       max_context=2048, head_vocab="auto", fused_decode=True)
    engine = DraftEngine(DraftModelProposer(model, copy=CopyRule(0.5)))
    generator = torch.Generator().manual_seed(0)

    def token() -> int:
        return int(torch.randint(100, 20000, (1,), generator=generator))

    for rows in args.rows:
        sessions = [f"rows{rows}-{i}" for i in range(rows)]
        for session_id in sessions:
            engine.start_session(session_id, [token() for _ in range(200)], SamplingParams())
        for k in (1, 4):
            seconds = []
            for _ in range(args.repeats):
                works = [ProposeWork(s, engine.sessions.peek(s).committed, (token(),), k) for s in sessions]
                started = time.perf_counter()
                results = run_propose_batch(engine, works)
                seconds.append(time.perf_counter() - started)
                failed = [r for r in results if isinstance(r, Exception)]
                if failed:
                    raise failed[0]
            median = statistics.median(seconds)
            print(f"rows {rows:3d}  k {k}: {median * 1000:6.2f} ms a pass, {median / k * 1000:5.2f} ms a draft step")


if __name__ == "__main__":
    main()
