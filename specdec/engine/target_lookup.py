"""Prompt lookup inside the target: drafts for DecodeStream's lookup_draft_tokens.

A speculative cycle whose proposer runs elsewhere pays a round trip to the target per cycle (two
with a draft service), which is most of its overhead on a CPU and most of its loss under load on a
GPU, where streamed plain decoding pays none (docs/BENCHMARKS.md). An n-gram proposer needs only the
session's committed tokens, which the target holds: here it drafts inside the target's decode
stream, and each step verifies the draft in the same batched forward that decodes the other
sessions. No draft service, no round trip per cycle; the goodput trimmer cuts the drafts that would
slow the batch down, as it does any verify's.

Lossless as any verify: a lookup draft is deterministic, a point mass, so the target accepts a
drafted token with its own probability of it (specdec.proposers.ngram). A draft never holds a stop
token: one can only end a step as its recovered or bonus token, so a stream still ends right after
its stop token, with nothing committed past it.
"""

from __future__ import annotations

from typing import Collection, Sequence

from specdec.proposers.ngram import NgramProposer
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock

LOOKUP_PROPOSER = "ngram-target"  # the proposer's name in stats, metrics and the benchmark


class TargetLookup:
    def __init__(self, proposer: NgramProposer | None = None):
        self.proposer = proposer or NgramProposer()

    def draft(self, token_ids: Sequence[int], max_tokens: int, params: SamplingParams,
              stop_token_ids: Collection[int] = ()) -> DraftBlock:
        """Up to max_tokens tokens continuing token_ids (the committed sequence), cut before the
        first stop token."""
        if max_tokens <= 0:
            return DraftBlock.empty()
        block = self.proposer.propose(None, token_ids, max_tokens, params)
        drafted = block.token_ids.tolist()
        cut = next((i for i, token in enumerate(drafted) if token in stop_token_ids), len(drafted))
        return block if cut == len(drafted) else DraftBlock(block.token_ids[:cut])
