"""`python -m specdec.bench.replay_service`: the draft service with the replay proposer (model-scale
benchmarks). Every draft service flag applies (--proposer draft-model --model DIR ...), plus:

    --replay-alpha A             probability that a proposed token is the target's greedy token
    --replay-references FILE     JSON {"references": [[prompt + greedy output ids], ...]}
    --replay-seed S
    --replay-alpha-spread W      each prompt's alpha evenly spaced over A +- W (default 0: A for all)

The draft service is built as usual (draft_service.main.build_engine); only its proposer is swapped
for a ReplayProposer around the same loaded model, so the forward passes and their batching are the
real draft's (specdec/proposers/replay.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path


def parse_with_replay(parser, prog: str, argv: list[str] | None):
    """A service's own flags plus --replay-alpha / --replay-references / --replay-seed / --replay-alpha-spread;
    logging set up."""
    parser.prog = prog
    parser.add_argument("--replay-alpha", type=float, required=True)
    parser.add_argument("--replay-references", type=Path, required=True)
    parser.add_argument("--replay-seed", type=int, default=0)
    parser.add_argument("--replay-alpha-spread", type=float, default=0.0,
                        help="each prompt's alpha evenly spaced over alpha +- this (proposers/replay.py)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args


def replaying(engine, args):
    """The draft engine with its proposer swapped for a ReplayProposer around the same loaded model."""
    from specdec.proposers.replay import ReplayProposer

    references = json.loads(args.replay_references.read_text())["references"]
    engine.proposer = ReplayProposer(engine.proposer.model, references, args.replay_alpha, args.replay_seed,
                                     args.replay_alpha_spread)
    return engine


def main(argv: list[str] | None = None) -> int:
    from draft_service import main as draft_main
    from specdec.server import service

    parser = draft_main.build_parser()
    args = parse_with_replay(parser, "python -m specdec.bench.replay_service", argv)
    settings = draft_main.settings_from_args(args)
    if settings.proposer != "draft-model":
        parser.error("the replay proposer runs a draft model's passes: use --proposer draft-model --model DIR")
    engine, config = draft_main.build_engine(settings)
    engine = replaying(engine, args)
    config = dataclasses.replace(config, top_m=None)  # point masses: no distributions travel
    return service.run_traced(settings.server,
                              lambda provider: draft_main.serve_draft(settings, engine, config, provider))


if __name__ == "__main__":
    sys.exit(main())
