"""`python -m specdec.bench.replay_service`: the draft service with the replay proposer (model-scale
benchmarks). Every draft service flag applies (--proposer draft-model --model DIR ...), plus:

    --replay-alpha A             probability that a proposed token is the target's greedy token
    --replay-references FILE     JSON {"references": [[prompt + greedy output ids], ...]}
    --replay-seed S

The draft model does its real forward passes; only the proposed token is replayed
(specdec/proposers/replay.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from draft_service import main as draft_main
    from draft_service.servicer import DraftServiceConfig
    from specdec.engine.draft import DraftEngine
    from specdec.models.loader import load_model
    from specdec.models.registry import resolve_model
    from specdec.observability.tracing import setup_tracing
    from specdec.proposers.replay import ReplayProposer

    parser = draft_main.build_parser()
    parser.prog = "python -m specdec.bench.replay_service"
    parser.add_argument("--replay-alpha", type=float, required=True)
    parser.add_argument("--replay-references", type=Path, required=True)
    parser.add_argument("--replay-seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = draft_main.settings_from_args(args)
    model_dir = resolve_model(settings.model)
    tokenizer_dir = resolve_model(settings.tokenizer) if settings.tokenizer else model_dir
    fingerprint, eos_ids = draft_main.tokenizer_facts(tokenizer_dir)
    model = load_model(model_dir, backend=settings.backend, device=settings.device, dtype=settings.dtype,
                       num_slots=settings.num_slots, max_context=settings.max_context, name=settings.model)
    references = json.loads(args.replay_references.read_text())["references"]
    proposer = ReplayProposer(model, references, args.replay_alpha, args.replay_seed)
    engine = DraftEngine(proposer, idle_ttl_s=settings.session_ttl_s, max_draft_tokens=settings.max_draft_tokens)
    config = DraftServiceConfig(model.info, fingerprint, eos_ids, settings.num_draft_tokens, None,
                                model.info.max_context)
    provider = setup_tracing(settings.server.tracing.service_name, settings.server.tracing.sampling_ratio)
    try:
        asyncio.run(draft_main.serve_draft(settings, engine, config, provider))
    finally:
        provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
