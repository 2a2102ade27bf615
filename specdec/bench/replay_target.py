"""`python -m specdec.bench.replay_target`: the target service hosting a replay draft (model-scale
benchmarks of drafts made inside the target, --draft target:model). Every target service flag
applies (--inner-draft DIR is required), plus:

    --replay-alpha A             probability that a drafted token is the target's greedy token
    --replay-references FILE     JSON {"references": [[prompt + greedy output ids], ...]}
    --replay-seed S
    --replay-alpha-spread W      each prompt's alpha evenly spaced over A +- W (default 0: A for all)

The hosted draft is loaded as usual (target_service.main.load_inner_draft); only its proposer is
swapped for a ReplayProposer around the same loaded model, so the draft's forward passes and their
batching are the real ones (specdec/proposers/replay.py), as in specdec.bench.replay_service.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from specdec.bench.replay_service import parse_with_replay, replaying
    from target_service import main as target_main

    parser = target_main.build_parser()
    args = parse_with_replay(parser, "python -m specdec.bench.replay_target", argv)
    settings = target_main.settings_from_args(args)
    if not settings.inner_draft:
        parser.error("the replay draft runs a hosted draft model's passes: give --inner-draft DIR")
    return target_main.run(settings, adapt_inner_draft=lambda engine: replaying(engine, args))


if __name__ == "__main__":
    sys.exit(main())
