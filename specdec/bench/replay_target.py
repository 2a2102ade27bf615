"""`python -m specdec.bench.replay_target`: the target service hosting a replay draft (model-scale
benchmarks of drafts made inside the target, --draft target:model). Every target service flag
applies (--inner-draft DIR is required), plus:

    --replay-alpha A             probability that a drafted token is the target's greedy token
    --replay-references FILE     JSON {"references": [[prompt + greedy output ids], ...]}
    --replay-seed S

The hosted draft is loaded as usual (target_service.main.load_inner_draft); only its proposer is
swapped for a ReplayProposer around the same loaded model, so the draft's forward passes and their
batching are the real ones (specdec/proposers/replay.py), as in specdec.bench.replay_service.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from specdec.proposers.replay import ReplayProposer
    from target_service import main as target_main

    parser = target_main.build_parser()
    parser.prog = "python -m specdec.bench.replay_target"
    parser.add_argument("--replay-alpha", type=float, required=True)
    parser.add_argument("--replay-references", type=Path, required=True)
    parser.add_argument("--replay-seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = target_main.settings_from_args(args)
    if not settings.inner_draft:
        parser.error("the replay draft runs a hosted draft model's passes: give --inner-draft DIR")
    references = json.loads(args.replay_references.read_text())["references"]

    def replaying(engine):
        engine.proposer = ReplayProposer(engine.proposer.model, references, args.replay_alpha, args.replay_seed)
        return engine

    return target_main.run(settings, adapt_inner_draft=replaying)


if __name__ == "__main__":
    sys.exit(main())
