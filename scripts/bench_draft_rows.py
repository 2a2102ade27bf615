"""What one step of the draft model costs against the rows it drafts (CPU, one thread; or a GPU).

    python scripts/bench_draft_rows.py [--rows 1 4 16] [--repeats 12]    # SPECDEC_CPU_DECODE=eager: PyTorch's operators
    python scripts/bench_draft_rows.py --draft random:llama3.2-1b --device cuda:0 --dtype bfloat16 \
        --rows 1 8 16 --k 1 2 4 --context 600 --replay-alpha 0.8        # the GPU benchmark's hosted draft

A DraftEngine over the native backend as the draft service and the target's hosted draft run it (the
served head, the copy rule, the compiled step where it applies; on a GPU the full head and CUDA
graphs): `rows` greedy sessions of `context` random prompt tokens each append one token and draft k
tokens in one batched Propose (run_propose_batch), as a batched step of the target asks them to.
With --replay-alpha the proposer is the benchmark's replay draft (specdec/proposers/replay.py) over
the same model. Prints the median per pass and per draft step. Warm: nothing else runs between
passes (docs/BENCHMARKS.md, rounds 33 and 39).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.bench.gpu import model_dir
from specdec.engine.draft import DraftEngine
from specdec.engine.draft_batch import ProposeWork, run_propose_batch
from specdec.models.loader import load_model
from specdec.proposers.copy_guess import CopyRule
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.replay import ReplayProposer
from specdec.sampling.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default="smollm2-135m-draft", help="a registry name, directory or random:<preset>")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--context", type=int, default=200, help="prompt tokens a session")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--replay-alpha", type=float, default=None, help="the replay draft over the same model")
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    sync = (lambda: torch.cuda.synchronize(args.device)) if cuda else (lambda: None)
    model = load_model(model_dir(args.draft, args.dtype), backend="native", device=args.device, dtype=args.dtype,
                       num_slots=2 * sum(args.rows), max_context=args.context + 1024, head_vocab="auto",
                       fused_decode=True, graph_warmup_context=args.context + 256 if cuda else 0)
    generator = torch.Generator().manual_seed(0)
    vocab = model.info.vocab_size

    def token() -> int:
        return int(torch.randint(100, min(20000, vocab), (1,), generator=generator))

    # Each session's text: its prompt, then the tokens it appends one a pass (the replay's references).
    texts = {f"rows{rows}-{i}": [token() for _ in range(args.context + len(args.k) * args.repeats)]
             for rows in args.rows for i in range(rows)}
    if args.replay_alpha is None:
        proposer = DraftModelProposer(model, copy=CopyRule(0.5))
    else:
        proposer = ReplayProposer(model, list(texts.values()), args.replay_alpha)
    engine = DraftEngine(proposer)

    for rows in args.rows:
        sessions = [f"rows{rows}-{i}" for i in range(rows)]
        for session_id in sessions:
            engine.start_session(session_id, texts[session_id][:args.context], SamplingParams())
        for k in args.k:
            seconds = []
            for _ in range(args.repeats):
                committed = {s: engine.sessions.peek(s).committed for s in sessions}
                works = [ProposeWork(s, committed[s], (texts[s][committed[s]],), k) for s in sessions]
                sync()
                started = time.perf_counter()
                results = run_propose_batch(engine, works)
                sync()
                seconds.append(time.perf_counter() - started)
                failed = [r for r in results if isinstance(r, Exception)]
                if failed:
                    raise failed[0]
            median = statistics.median(seconds)
            print(f"rows {rows:3d}  k {k}: {median * 1000:6.2f} ms a pass, {median / k * 1000:5.2f} ms a draft step")


if __name__ == "__main__":
    main()
